"""A fake SGLang server: SGLang 0.5.23's native HTTP API shapes, no model.

It deliberately shares no code with clawd/engine/local, so the two can be
checked against each other.

It "generates" token ids from a script (`responder(input_ids, sampling_params)`)
and answers with the exact JSON of /generate (single, batch, n>1, SSE stream,
prefill scoring with input log-probs), /abort_request, /pause_generation,
/continue_generation, /update_weights_from_disk, /flush_cache, /model_info,
/server_info /health and, with `enable_lora=True`, /load_lora_adapter, /unload_lora_adapter, /v1/models
and /generate's `lora_path` (SGLang 0.5.23's shapes, read from its source:
docs/ARCHITECTURE.md §10), with its context limits, its API keys (`api_key=`,
`admin_api_key=`) and, with `max_running_requests`, its waiting queue and
`waiting_timeout` (SGLANG_REQ_WAITING_TIMEOUT). Faults can be
injected at run time: an HTTP error, a dropped connection, a request that hangs
until aborted, and a hung engine (`stick()`: its scheduler stops, streams included
mid-way, and optionally its HTTP front end stops answering /model_info and
/server_info; `unstick()` lets it go on). Everything it received is recorded for
tests to assert on.

In-process:  async with FakeSGLang(responder=...) as fake: ... fake.url
Standalone:  python tests/fake_sglang.py --port 0 --tokens 32 --token-delay 0
             (prints "PORT <n>" first, then serves until SIGTERM)

Log-prob values are pure functions of (position, id) so tests can compute them:
input_logprob(pos, tok) for prompt scoring, output_logprob(tok) for sampled
tokens, deliberately different (prefill log-probs are T=1, decode ones are not).
Each position's whole distribution (`top_logprobs_num`, `token_ids_logprob`) is
row_logprob(lp, tok, x): it falls 0.5 per id after the scored or sampled `tok`,
whose log-prob is lp. A prefill-only request's one output row is centred on the
first scripted token with input_logprob(len(prompt), tok).
A LoRA adapter shifts every log-prob of the items it serves by lora_offset(name),
so a test can tell which adapter served a row; `lora_used` records (rid, adapter)
of every /generate item (None: the base model).
"""
from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import secrets
import signal
import time
import uuid
import zlib
from collections import OrderedDict, deque
from typing import Any, Awaitable, Callable

from aiohttp import web

Responder = Callable[[list[int], dict], "list[int] | Awaitable[list[int]]"]

# The keys SGLang's /generate contract accepts inside sampling_params (§2.2).
SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
    "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "min_new_tokens", "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "custom_params",
    "stream_interval", "logit_bias", "sampling_seed", "beam_width", "watermark", "choice",
)
_NUMBER_KEYS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                "repetition_penalty")
_INT_KEYS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "stream_interval",
             "sampling_seed", "beam_width")
_BOOL_KEYS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")

ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue", "status_code": None,
                   "err_type": None}
TIMED_OUT = {"type": "abort", "status_code": 503, "message": "Request waiting timeout reached."}
VERSION = "0.5.23"
# utils/auth.py: always open by path prefix; the control routes that take the admin key.
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
ADMIN_ROUTES = frozenset({"/abort_request", "/pause_generation", "/continue_generation",
                          "/load_lora_adapter", "/unload_lora_adapter",
                          "/update_weights_from_disk", "/flush_cache"})
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
           "or waiting requests, the operation will not be performed.)\n")
_SSE = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def input_logprob(pos: int, tok: int) -> float:
    """Prefill log-prob of `tok` at prompt position `pos` (never for position s: that is null)."""
    return round(-0.01 * ((tok + pos) % 97) - 0.001, 6)


def output_logprob(tok: int) -> float:
    """Decode log-prob of a sampled token."""
    return round(-0.01 * (tok % 89) - 0.002, 6)


def lora_offset(name: str | None) -> float:
    """What adapter `name` adds to every log-prob it serves: 0 for the base, -0.001 .. -0.05 otherwise."""
    if name is None:
        return 0.0
    return -0.001 * (1 + zlib.crc32(name.encode()) % 50)


def shifted(lp: float, lora: str | None) -> float:
    return round(lp + lora_offset(lora), 6)


# SGLang's messages (lora/lora_registry.py, lora/lora_manager.py, managers/tokenizer_manager.py).
LORA_NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
LORA_ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_incompatible(name: str, rank) -> str:
    return (f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool "
            f"configuration. Please ensure that the LoRA adapter's rank is within the configured "
            f"`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")


def row_logprob(lp: float, tok: int, x: int, vocab_size: int) -> float:
    """Log-prob of id x in the row of a position whose own token `tok` has log-prob lp."""
    return round(lp - 0.5 * ((x - tok) % vocab_size), 6)


def top_logprobs(lp: float, tok: int, k: int, vocab_size: int) -> list[list]:
    """k alternatives: the token itself first, then its neighbours, each 0.5 nats lower."""
    return [[row_logprob(lp, tok, (tok + j) % vocab_size, vocab_size), (tok + j) % vocab_size, None]
            for j in range(k)]


def ids_logprobs(lp: float, tok: int, ids: list[int], vocab_size: int) -> list[list]:
    """The same row read at `ids`, in the request's order, duplicates kept."""
    return [[row_logprob(lp, tok, x, vocab_size), x, None] for x in ids]


def token_text(tok: int) -> str:
    """The fake detokenizer: concatenating pieces gives the text of a sequence."""
    return f"<{tok}>"


def default_script(input_ids: list[int], tokens: int, eos_id: int) -> list[int]:
    """`tokens` ids that depend on the prompt, the last one EOS, none of the others EOS."""
    if tokens < 1:
        return []
    h = sum(input_ids) % 997
    ids = [100 + (h + 13 * i) % 900 for i in range(tokens - 1)]
    return [t + 1 if t == eos_id else t for t in ids] + [eos_id]


def abort_matches(body: dict, rid: str) -> bool:
    """Whether an /abort_request body targets rid (SGLang matches rids by prefix)."""
    if body.get("abort_all") is True:
        return True
    prefix = body.get("rid")
    return isinstance(prefix, str) and prefix != "" and rid.startswith(prefix)


class ContractError(Exception):
    """A /generate body the API contract rejects: 400 {"error": "<string>"}."""


class _Item:
    """One sequence being generated. Mutable state, so a plain slotted class."""
    __slots__ = ("rid", "index", "ids", "sp", "max_new", "min_new", "stops", "no_trim",
                 "logprob", "start", "topk", "script", "out", "lps", "tops", "spans", "finish",
                 "abort", "started", "retractions", "t0", "gen", "lora", "lp_ids", "chosen", "with_text")

    def __init__(self, rid, index, ids, sp, logprob, start, topk, eos_id):
        self.rid, self.index, self.ids, self.sp = rid, index, ids, sp
        self.max_new = _get(sp, "max_new_tokens", 128)
        self.min_new = _get(sp, "min_new_tokens", 0)
        # ignore_eos turns off every token-based stop, stop_token_ids included.
        self.stops = (set() if _get(sp, "ignore_eos", False)
                      else {eos_id, *(_get(sp, "stop_token_ids", None) or ())})
        self.no_trim = _get(sp, "no_stop_trim", False)
        self.logprob, self.start, self.topk = logprob, start, topk
        self.script: list[int] = []
        self.out: list[int] = []
        self.lps: list[list] = []
        self.tops: list[list] = []
        self.lp_ids: list[int] | None = None  # token_ids_logprob, only with return_logprob
        self.chosen: list[list] = []  # one token_ids_logprob row per output position
        self.with_text = False  # return_text_in_logprobs
        self.spans: list[dict] = []
        self.finish: dict | None = None
        self.abort: str | None = None  # the cause, once aborted
        self.started = False  # left the waiting queue
        self.retractions = 0
        self.t0 = time.monotonic()
        self.gen: _Gen | None = None
        self.lora: str | None = None  # the adapter serving it


class _Gen:
    """One /generate call in flight: its items and the event that wakes it."""
    __slots__ = ("items", "wake", "hang", "batch")

    def __init__(self, items: list[_Item], hang: bool, batch: bool):
        self.items, self.hang, self.batch = items, hang, batch
        self.wake = asyncio.Event()
        for it in items:
            it.gen = self


def _get(sp: dict, key: str, default):
    v = sp.get(key)
    return default if v is None else v


def _per_item(value, i: int, count: int, name: str):
    if not isinstance(value, list):
        return value
    if len(value) != count:
        raise ValueError(f"The length of {name} ({len(value)}) must match the batch size "
                         f"({count}).")
    return value[i]


def check_sampling_params(sp: Any) -> None:
    """Validate like SGLang: contract errors raise ContractError, value errors ValueError."""
    if not isinstance(sp, dict):
        raise ContractError("invalid type: expected struct SamplingParams for `sampling_params`")
    for key, v in sp.items():
        if key not in SAMPLING_KEYS:
            raise ContractError(f"unknown field `{key}`, expected one of "
                                + ", ".join(f"`{k}`" for k in SAMPLING_KEYS))
        if v is None:
            continue
        if key in _NUMBER_KEYS and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ContractError(f"invalid type: {v!r}, expected a number for `{key}`")
        if key in _INT_KEYS and (isinstance(v, bool) or not isinstance(v, int)):
            raise ContractError(f"invalid type: {v!r}, expected an integer for `{key}`")
        if key in _BOOL_KEYS and not isinstance(v, bool):
            raise ContractError(f"invalid type: {v!r}, expected a boolean for `{key}`")
        if key == "stop_token_ids" and not (isinstance(v, list) and all(_is_int(t) for t in v)):
            raise ContractError(f"invalid type: {v!r}, expected a list of integers for `{key}`")
    t = _get(sp, "temperature", 1.0)
    if not math.isfinite(t) or t < 0:
        raise ValueError(f"temperature must be non-negative, got {t}.")
    top_p = _get(sp, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    top_k = _get(sp, "top_k", -1)
    if top_k < 1 and top_k != -1:
        raise ValueError(f"top_k must be -1 (disable) or a positive integer, got {top_k}.")
    min_p = _get(sp, "min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}.")
    for key in ("frequency_penalty", "presence_penalty"):
        if not -2 <= _get(sp, key, 0.0) <= 2:
            raise ValueError(f"{key} must be in [-2, 2], got {sp[key]}.")
    if not 0 < _get(sp, "repetition_penalty", 1.0) <= 2:
        raise ValueError(f"repetition_penalty must be in (0, 2], got {sp['repetition_penalty']}.")
    max_new = _get(sp, "max_new_tokens", 128)
    if max_new < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {max_new}.")
    min_new = _get(sp, "min_new_tokens", 0)
    if not 0 <= min_new <= max_new:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {min_new}.")
    if _get(sp, "n", 1) < 1:
        raise ValueError(f"n must be at least 1, got {sp['n']}.")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _texts(entries: list[list], on: bool) -> list[list]:
    """return_text_in_logprobs: each triple's text is its id decoded alone."""
    return [[lp, tok, token_text(tok)] for lp, tok, _ in entries] if on else entries


def _row_texts(rows: list, on: bool) -> list:
    return [None if r is None else _texts(r, on) for r in rows] if on else rows


def _bad_request(message: str) -> web.Response:
    """The shape of a body that fails validation on a control route (FastAPI 422 made 400)."""
    return web.Response(status=400, content_type="application/json", body=dumps(
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}))


def _json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=dumps(obj), content_type="application/json")


def _abort_error(finish: dict | None) -> web.Response | None:
    """tokenizer_manager.py, _handle_abort_finish_reason: a non-streamed request aborted with
    status 400 raises ValueError (400 {"error": {"message"}}), with 500 or 503 HTTPException
    (that status, {"object": "error", ...}); any other abort is an ordinary 200 answer. A
    streamed request gets the abort as its last chunk either way."""
    if not finish or finish.get("type") != "abort":
        return None
    code = finish.get("status_code")
    if code == 400:
        return _json_response({"error": {"message": finish["message"]}}, 400)
    if code in (500, 503):
        return _json_response({"object": "error", "message": finish["message"], "type": str(code),
                               "param": None, "code": code}, code)
    return None


class FakeSGLang:
    def __init__(self, responder: Responder | None = None, *, tokens: int = 32, eos_id: int = 2,
                 token_delay: float = 0.0, incremental_streaming_output: bool = False,
                 weight_version: str = "0", model_path: str = "fake/model",
                 vocab_size: int = 4096, context_length: int = 32768,
                 max_total_num_tokens: int | None = None, max_running_requests: int | None = None,
                 waiting_timeout: float | None = None, api_key: str | None = None,
                 admin_api_key: str | None = None, enable_lora: bool = False,
                 max_lora_rank: int | None = None, lora_target_modules: list[str] | None = None,
                 host: str = "127.0.0.1", port: int = 0):
        self.responder = responder or (lambda ids, sp: default_script(ids, tokens, eos_id))
        self.eos_id = eos_id
        self.token_delay = token_delay
        self.incremental = incremental_streaming_output
        self.weight_version = weight_version
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.context_length = context_length
        # tp_worker.py: max_req_len = min(context - 1, pool - 1); prompts need 5 tokens of room more.
        pool = context_length * 8 if max_total_num_tokens is None else max_total_num_tokens
        self.max_total_num_tokens = pool
        self.max_req_len = min(context_length - 1, pool - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.max_running_requests = max_running_requests
        self.waiting_timeout = waiting_timeout
        self._keys = (api_key, admin_api_key)
        self.enable_lora = enable_lora
        if enable_lora and (max_lora_rank is None or not lora_target_modules):
            raise ValueError("enable_lora needs max_lora_rank and lora_target_modules (no --lora-paths)")
        self.max_lora_rank = max_lora_rank
        targets = lora_target_modules or ()
        self.lora_targets = set(LORA_ALL_TARGETS if "all" in targets else targets)
        self.lora_adapters: dict[str, str] = {}  # name -> path, in load order
        self.lora_used: list[tuple[str, str | None]] = []  # (rid, adapter) of every /generate item
        self.host, self.port = host, port
        # What tests assert on.
        self.requests: list[dict] = []  # /generate bodies, in arrival order
        self.abort_requests: list[dict] = []  # /abort_request bodies
        self.weight_updates: list[dict] = []  # /update_weights_from_disk bodies
        self.calls: list[tuple[str, dict]] = []  # every control call: (path, body)
        # (rid, cause) of every aborted item; cause: abort_request|pause|update|disconnect
        self.aborted: list[tuple[str, str]] = []
        self._inflight: dict[str, _Item] = {}
        self._gens: set[_Gen] = set()
        self._faults: dict[str, deque] = {}
        self._paused = False
        self._pause_mode = "abort"
        self._updating = 0  # updates holding the writer lock
        self._abort_seen = asyncio.Event()
        self._stuck = False  # the scheduler makes no progress: calls are held before and between steps
        self.health_check_timeout = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT: /health_generate's own wait
        self._front_stuck: asyncio.Event | None = None  # set: /model_info and /server_info answer again
        self._runner: web.AppRunner | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    @property
    def paused(self) -> bool:
        return self._paused

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._auth])
        r = app.router
        r.add_post("/generate", self._generate)
        r.add_put("/generate", self._generate)
        r.add_post("/abort_request", self._faulty(self._abort_request))
        r.add_post("/pause_generation", self._faulty(self._pause))
        r.add_post("/continue_generation", self._faulty(self._continue))
        r.add_post("/update_weights_from_disk", self._faulty(self._update_weights))
        r.add_route("*", "/flush_cache", self._faulty(self._flush_cache))
        r.add_post("/load_lora_adapter", self._faulty(self._load_lora))
        r.add_post("/unload_lora_adapter", self._faulty(self._unload_lora))
        r.add_get("/v1/models", self._faulty(self._models))
        r.add_get("/health", self._faulty(self._health))
        r.add_get("/health_generate", self._faulty(self._health))
        r.add_get("/ready", self._faulty(self._ready))
        r.add_get("/model_info", self._faulty(self._model_info))
        r.add_get("/get_model_info", self._faulty(self._model_info))  # deprecated alias
        r.add_get("/server_info", self._faulty(self._server_info))
        r.add_get("/get_server_info", self._faulty(self._server_info))  # deprecated alias
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        """utils/auth.py: /health*, /ready*, /metrics* are open; control routes need the admin
        key when one is set (the API key is refused there), the API key otherwise; every other
        route needs the API key when one is set. Bearer or x-api-key; 401 when missing or wrong."""
        api_key, admin_key = self._keys
        path = request.path
        if request.method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
            return await handler(request)
        expected = (admin_key or api_key) if path in ADMIN_ROUTES else api_key
        if expected is not None:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            offered = [token] if scheme.lower() == "bearer" else []
            offered.append(request.headers.get("x-api-key", ""))
            if not any(t and secrets.compare_digest(t.encode(), expected.encode()) for t in offered):
                return _json_response({"error": "Unauthorized"}, 401)
        return await handler(request)

    async def start(self) -> FakeSGLang:
        # handler_cancellation: a client that hangs up cancels its handler, which is
        # how a disconnect during a non-streamed generation is noticed.
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeSGLang:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- failure injection -----------------------------------------------------------------

    def fail_next(self, status: int, body: dict | str, count: int = 1, path: str = "/generate"):
        """The next `count` requests to `path` answer `status` with `body` (JSON or text)."""
        self._faults.setdefault(path, deque()).extend([("fail", status, body)] * count)

    def drop_next(self, count: int = 1, path: str = "/generate"):
        """The next `count` requests to `path` get part of a response, then the socket closes."""
        self._faults.setdefault(path, deque()).extend([("drop",)] * count)

    def hang_next(self, count: int = 1):
        """The next `count` /generate requests never answer until aborted (or disconnected)."""
        self._faults.setdefault("/generate", deque()).extend([("hang",)] * count)

    def stick(self, front_end: bool = False) -> None:
        """A hung engine: its scheduler stops (new calls get a stream's headers or nothing, running streams stop
        between chunks); with `front_end`, /model_info and /server_info stop answering too."""
        self._stuck = True
        if front_end and self._front_stuck is None:
            self._front_stuck = asyncio.Event()

    def unstick(self) -> None:
        """The hang ends: held calls and status calls go on."""
        self._stuck = False
        if self._front_stuck is not None:
            self._front_stuck.set()
            self._front_stuck = None
        self._wake_all()

    async def _front_end(self) -> None:
        """Wait while the HTTP front end is hung."""
        if self._front_stuck is not None:
            await self._front_stuck.wait()

    def _take_fault(self, path: str) -> tuple | None:
        q = self._faults.get(path)
        return q.popleft() if q else None

    async def _apply_fault(self, request: web.Request, fault: tuple, stream: bool):
        if fault[0] == "fail":
            _, status, body = fault
            if isinstance(body, str):
                return web.Response(status=status, text=body)
            return _json_response(body, status)
        # drop: promise more than is sent, send a little, then close the socket.
        resp = web.StreamResponse(headers=_SSE if stream else None)
        if not stream:
            resp.content_type = "application/json"
            resp.content_length = 4096
        await resp.prepare(request)
        await resp.write(b'data: {"text":"' if stream else b'{"text":"')
        request.transport.close()
        raise asyncio.CancelledError  # aiohttp drops a cancelled handler's connection quietly

    def _faulty(self, handler):
        async def wrapped(request: web.Request):
            fault = self._take_fault(request.path)
            if fault is not None:
                return await self._apply_fault(request, fault, stream=False)
            return await handler(request)
        return wrapped

    # ---- /generate -------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError as e:
            return _bad_request(f"invalid JSON body: {e}")
        if not isinstance(body, dict):
            return _bad_request("the body must be a JSON object")
        self.requests.append(body)
        stream = body.get("stream") is True
        fault = self._take_fault("/generate")
        if fault is not None and fault[0] != "hang":
            return await self._apply_fault(request, fault, stream)
        try:
            items, batch = self._parse(body)
            self._register(items)
        except ContractError as e:
            return _json_response({"error": str(e)}, 400)
        except ValueError as e:  # SGLang's ValueErrors: a 400, or an error chunk in a stream
            if not stream:
                return _json_response({"error": {"message": str(e)}}, 400)
            resp = web.StreamResponse(headers=_SSE)
            await resp.prepare(request)
            await resp.write(b"data: " + dumps({"error": {
                "message": str(e), "type": "invalid_request_error", "code": 400,
                "retryable": False}}) + b"\n\n" + _DONE)
            return resp
        gen = _Gen(items, hang=fault is not None, batch=batch)
        self._gens.add(gen)
        try:
            if stream:
                return await self._stream(request, gen)
            await self._run(gen)
            for it in items:
                error = _abort_error(it.finish)
                if error is not None:
                    return error
            out = [self._chunk(it, 0) for it in items]
            return _json_response(out if batch else out[0])
        except asyncio.CancelledError:
            self._lose(gen)
            raise
        finally:
            self._gens.discard(gen)
            for it in items:  # only ever left behind by an exception
                if self._inflight.get(it.rid) is it:
                    del self._inflight[it.rid]

    def _parse(self, body: dict) -> tuple[list[_Item], bool]:
        ids = body.get("input_ids")
        if ids is None:
            raise ValueError("The fake SGLang server needs input_ids (it has no tokenizer).")
        if not isinstance(ids, list) or not ids:
            raise ValueError("input_ids must be a non-empty list.")
        batch = isinstance(ids[0], list)
        prompts = ids if batch else [ids]
        for p in prompts:
            if not isinstance(p, list) or not all(type(t) is int for t in p):
                raise ContractError("invalid type: expected a list of integers for `input_ids`")
            if not p:
                raise ValueError("input_ids must not be empty.")
        count = len(prompts)
        sps = body.get("sampling_params")
        sps = [{}] * count if sps is None else sps
        if isinstance(sps, list):
            if len(sps) != count:
                raise ValueError(f"The length of sampling_params ({len(sps)}) must match the "
                                 f"batch size ({count}).")
        else:
            sps = [sps] * count
        for sp in sps:
            check_sampling_params(sp)
        n = _get(sps[0], "n", 1)
        per_item = ("return_logprob", "logprob_start_len", "top_logprobs_num")
        if n > 1 and any(isinstance(body.get(k), list) for k in per_item):
            raise ValueError("Per-request lists of log-prob options are not allowed with n > 1.")
        lp_ids = self._token_ids_logprob(body.get("token_ids_logprob"), count, batch, n)
        with_text = body.get("return_text_in_logprobs") is True
        rid = body.get("rid")
        if not (rid is None or isinstance(rid, str)
                or isinstance(rid, list) and all(isinstance(r, str) for r in rid)):
            raise ContractError("invalid type: expected a string or a list of strings for `rid`")
        if isinstance(rid, list) and len(rid) != count:
            raise ValueError(f"The rid list length ({len(rid)}) must match the batch size "
                             f"({count}).")
        lora = body.get("lora_path")
        if not (lora is None or isinstance(lora, str) or isinstance(lora, list)
                and all(x is None or isinstance(x, str) for x in lora)):
            raise ContractError("invalid type: expected a string or a list of strings for `lora_path`")
        items = []
        for b, (prompt, sp) in enumerate(zip(prompts, sps)):
            adapter = _per_item(lora, b, count, "lora_path")
            self._check_lora(adapter)
            logprob = bool(_per_item(body.get("return_logprob", False), b, count, "return_logprob"))
            start = _per_item(body.get("logprob_start_len", -1), b, count, "logprob_start_len")
            if start is None:
                start = -1
            topk = _per_item(body.get("top_logprobs_num"), b, count, "top_logprobs_num") or 0
            if not (_is_int(start) and _is_int(topk)):
                raise ContractError("invalid type: expected an integer for `logprob_start_len` "
                                    "and `top_logprobs_num`")
            topk = max(topk, 0) if logprob else 0  # <= 0 is off; all of it needs return_logprob
            if topk > self.vocab_size:  # SGLang's scheduler crashes here; clawd's engine refuses it too
                raise ValueError(f"top_logprobs_num ({topk}) exceeds the vocabulary size "
                                 f"({self.vocab_size}).")
            if start > len(prompt):
                raise ValueError(f"logprob_start_len ({start}) is larger than the input length "
                                 f"({len(prompt)}).")
            refused = self._check_length(prompt, sp)
            for j in range(n):
                if n > 1 or rid is None:
                    r = uuid.uuid4().hex  # SGLang regenerates rids for n > 1
                elif isinstance(rid, list):
                    r = rid[b]
                else:
                    r = f"{rid}_{b}" if batch else rid
                item = _Item(r, len(items), prompt, sp, logprob, start, topk, self.eos_id)
                item.lora = adapter
                item.lp_ids = lp_ids[b] if logprob else None
                item.with_text = with_text
                # scheduler.py: max_new_tokens, given or not, is cut to the room left
                item.max_new = min(item.max_new, self.max_req_len - len(prompt) - 1)
                if refused is not None:
                    item.finish, item.started = dict(refused), True
                items.append(item)
        return items, batch or n > 1

    def _token_ids_logprob(self, value, count: int, batch: bool, n: int) -> list[list[int] | None]:
        """One id list (or None) per prompt. api/v1/api_types.py: [] or a list starting with a
        number is one flat list (every prompt shares it), other lists one list per prompt;
        tokenizer_manager.py (_validate_token_ids_logprob) checks every id against the vocabulary,
        with or without return_logprob."""
        if value is None or value == []:
            return [None] * count
        if not isinstance(value, list):
            raise ContractError(f"invalid type: {value!r}, expected a value or an array of values "
                                f"for TokenIdsOrList")
        flat = isinstance(value[0], (int, float)) and not isinstance(value[0], bool)
        lists = [value] if flat else value
        if not all(isinstance(ids, list) and all(map(_is_int, ids)) for ids in lists):
            raise ContractError("invalid type: expected i64 for `token_ids_logprob`")
        if not flat and n > 1:
            raise ValueError("Cannot use list token_ids_logprob with parallel_sample_num > 1")
        if not flat and not batch:
            raise ValueError("token_ids_logprob must be a flat list of integers.")
        per = [value] * count if flat else [_per_item(value, b, count, "token_ids_logprob")
                                            for b in range(count)]
        for ids in per:
            bad = [x for x in ids if not 0 <= x < self.vocab_size]
            if bad:
                raise ValueError(f"token_ids_logprob contains out-of-vocabulary token id {bad[0]}; "
                                 f"valid range is [0, {self.vocab_size}).")
        return [ids or None for ids in per]

    def _check_length(self, prompt: list[int], sp: dict) -> dict | None:
        """The context limits, in SGLang's order. The tokenizer (_validate_one_request) refuses
        with ValueError a prompt of the whole context or more, and a given max_new_tokens that
        with the prompt exceeds the context; the scheduler (validate_input_length) then aborts
        with status 400 a prompt of max_req_input_len tokens or more: returned here."""
        n, context = len(prompt), self.context_length
        if n >= context:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context length "
                             f"({context} tokens).")
        max_new = sp.get("max_new_tokens")
        if max_new is not None and n + max_new > context:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {context} "
                f"tokens. You requested a total of {n + max_new} tokens: {n} tokens from the input "
                f"messages and {max_new} tokens for the completion. Please reduce the number of "
                f"tokens in the input messages or the completion to fit within the limit.")
        if n >= self.max_req_input_len:
            return {"type": "abort", "message": f"Input length ({n} tokens) exceeds the maximum "
                    f"allowed length ({self.max_req_input_len} tokens). Use a shorter input or "
                    f"enable --allow-auto-truncate.", "status_code": 400,
                    "err_type": "BadRequestError"}
        return None

    def _register(self, items: list[_Item]) -> None:
        rids = [it.rid for it in items]
        if len(set(rids)) != len(rids) or any(r in self._inflight for r in rids):
            raise ValueError("Duplicate request ID detected")
        self.lora_used += [(it.rid, it.lora) for it in items]
        for it in items:
            if it.finish is None:  # not refused by the scheduler
                self._inflight[it.rid] = it

    async def _stream(self, request: web.Request, gen: _Gen) -> web.StreamResponse:
        resp = web.StreamResponse(headers=_SSE)
        await resp.prepare(request)

        events: list[bytes] = []

        def emit(it: _Item, lo: int) -> None:
            chunk = self._chunk(it, lo if self.incremental else 0)
            if gen.batch:
                chunk["index"] = it.index
            events.append(b"data: " + dumps(chunk) + b"\n\n")

        async def flush(now: bool) -> None:
            # Without a token delay, chunks go out a few per write: far fewer syscalls.
            if events and (now or len(events) >= 16):
                data = b"".join(events)
                events.clear()
                await resp.write(data)

        try:
            await self._run(gen, emit, flush)
            events.append(_DONE)
            await flush(True)
        except ConnectionResetError:  # the client went away mid-stream
            self._lose(gen)
        return resp

    def _lose(self, gen: _Gen) -> None:
        """The client hung up: every unfinished item of its call counts as aborted."""
        for it in gen.items:
            if it.finish is None:
                it.abort = "disconnect"
                it.finish = ABORTED
                self._finished(it)

    async def _hold(self, gen: _Gen, blocked: Callable[[], bool],
                    deadline: float | None = None) -> bool:
        """Wait while blocked() holds, unless every item of the call gets aborted; False when
        the deadline (time.monotonic()) passed first."""
        while blocked() and any(it.abort is None for it in gen.items):
            gen.wake.clear()
            if deadline is None:
                await gen.wake.wait()
                continue
            try:
                await asyncio.wait_for(gen.wake.wait(), deadline - time.monotonic())
            except TimeoutError:
                return not blocked()
        return True

    def _no_room(self, gen: _Gen) -> Callable[[], bool]:
        """Whether the call must wait for room: max_running_requests items already run."""
        def full() -> bool:
            running = sum(1 for it in self._inflight.values() if it.started and it.finish is None)
            wanted = sum(1 for it in gen.items if it.finish is None)
            return running > 0 and wanted > 0 and running + wanted > self.max_running_requests
        return full

    async def _run(self, gen: _Gen, emit=None, flush=None) -> None:
        """Generate every item of a call one token at a time: emit(item, lo) after each step,
        then flush(now), now=True when the client must see the chunks before a wait."""
        items = gen.items
        if gen.hang:
            for it in items:
                it.started = True
            await self._hold(gen, lambda: True)
        else:  # held before the scheduler while paused or while an update holds the writer lock
            await self._hold(gen, lambda: self._paused or self._updating > 0 or self._stuck)
            if self.max_running_requests is not None:  # the scheduler's waiting queue
                timeout = self.waiting_timeout
                deadline = time.monotonic() + timeout if timeout and timeout > 0 else None
                if not await self._hold(gen, self._no_room(gen), deadline):
                    for it in items:
                        if it.finish is None and it.abort is None:
                            it.finish = dict(TIMED_OUT)
                            self._finished(it)
        for it in items:
            if it.finish is None and it.abort is None and not it.started:
                it.started = True
                script = self.responder(it.ids, it.sp)
                it.script = list(await script if inspect.isawaitable(script) else script)
                if it.max_new == 0:  # prefill only: scoring
                    self._next_token_row(it)
                    it.finish = {"type": "length", "length": 0}
                    self._finished(it)
        live = items
        while True:
            for it in live:
                lo = len(it.out)
                if it.finish is None:
                    if it.abort is not None:
                        it.finish = ABORTED if it.started else ABORTED_WAITING
                        self._finished(it)
                    else:
                        self._step(it)
                if emit is not None:
                    emit(it, lo)
            live = [it for it in live if it.finish is None]
            if not live:
                return  # the caller flushes the last chunks
            if flush is not None:
                await flush(self.token_delay > 0 or self._paused)
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            await self._hold(gen, lambda: self._paused or self._stuck)

    def _step(self, it: _Item) -> None:
        i = len(it.out)
        tok = it.script[i] if i < len(it.script) else self.eos_id  # past the script: EOS forever
        it.out.append(tok)
        if it.logprob:
            lp = shifted(output_logprob(tok), it.lora)
            it.lps.append([lp, tok, None])
            self._keep_row(it, lp, tok)
        if it.spans and it.spans[-1]["version"] == self.weight_version:
            it.spans[-1]["end"] = i + 1
        else:
            it.spans.append({"version": self.weight_version, "start": i, "end": i + 1})
        if tok in it.stops and i + 1 >= it.min_new:
            it.finish = {"type": "stop", "matched": tok}
        elif i + 1 >= it.max_new:
            it.finish = {"type": "length", "length": it.max_new}
        if it.finish is not None:
            self._finished(it)

    def _keep_row(self, it: _Item, lp: float, tok: int) -> None:
        """The output position's rows, centred on `tok` with log-prob lp."""
        if it.topk > 0:
            it.tops.append(top_logprobs(lp, tok, it.topk, self.vocab_size))
        if it.lp_ids:
            it.chosen.append(ids_logprobs(lp, tok, it.lp_ids, self.vocab_size))

    def _next_token_row(self, it: _Item) -> None:
        """SGLang reports one output row for a prefill-only request: the (T = 1) next-token
        distribution after the prompt, here centred on the first scripted token."""
        if it.logprob:
            tok = it.script[0] if it.script else self.eos_id
            self._keep_row(it, shifted(input_logprob(len(it.ids), tok), it.lora), tok)

    def _finished(self, it: _Item) -> None:
        if self._inflight.get(it.rid) is it:
            del self._inflight[it.rid]
        if it.abort is not None:
            self.aborted.append((it.rid, it.abort))
        if self.max_running_requests is not None:
            self._wake_all()  # room in the batch for a waiting call

    def _chunk(self, it: _Item, lo: int) -> dict:
        """The response dict for an item, holding output tokens [lo:] (lo > 0: a delta chunk)."""
        out = it.out
        trim = (it.finish is not None and it.finish["type"] == "stop" and not it.no_trim)
        shown = out[lo:len(out) - 1] if trim else out[lo:]
        meta: dict[str, Any] = {"id": it.rid, "finish_reason": it.finish}
        waiting = not it.started
        if not waiting:  # SGLang leaves these out for a request aborted in the waiting queue
            meta["prompt_tokens"] = len(it.ids)
        meta["weight_version"] = self.weight_version
        meta["num_retractions"] = it.retractions
        if it.logprob:
            text = it.with_text
            meta["input_token_logprobs"] = _texts(self._input_logprobs(it), text)
            meta["output_token_logprobs"] = _texts(it.lps[lo:], text)
            meta["output_token_logprobs_length"] = len(it.lps) - lo
            if it.topk > 0:
                meta["input_top_logprobs"] = _row_texts(self._input_rows(it, top_logprobs, it.topk), text)
                meta["output_top_logprobs"] = _row_texts(it.tops[lo:], text)
            if it.lp_ids:
                meta["input_token_ids_logprobs"] = _row_texts(self._input_rows(it, ids_logprobs, it.lp_ids),
                                                              text)
                meta["output_token_ids_logprobs"] = _row_texts(it.chosen[lo:], text)
        if not waiting:
            meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = len(out)
        if not waiting:
            meta["cached_tokens"] = 0
        meta["weight_versions"] = it.spans
        meta["e2e_latency"] = time.monotonic() - it.t0
        meta["response_sent_to_client_ts"] = time.time()
        return {"text": "".join(map(token_text, shown)), "output_ids": out[lo:], "meta_info": meta}

    def _input_logprobs(self, it: _Item) -> list[list]:
        if it.start < 0:
            return []
        ids, s = it.ids, it.start
        return [[None if p == s else shifted(input_logprob(p, ids[p]), it.lora), ids[p], None]
                for p in range(s, len(ids))]

    def _input_rows(self, it: _Item, row: Callable, arg) -> list:
        """Input rows beside input_token_logprobs: null at position s, then row(lp, tok, arg, V)."""
        if it.start < 0:
            return []
        ids, s = it.ids, it.start
        return [None if p == s else row(shifted(input_logprob(p, ids[p]), it.lora), ids[p], arg, self.vocab_size)
                for p in range(s, len(ids))]

    # ---- control routes --------------------------------------------------------------------

    async def _control_body(self, request: web.Request) -> dict | web.Response:
        """Control routes need a JSON object body; unknown keys are ignored (§1)."""
        try:
            body = json.loads(await request.read())
        except ValueError as e:
            return _bad_request(f"invalid JSON body: {e}")
        if not isinstance(body, dict):
            return _bad_request("the body must be a JSON object")
        self.calls.append((request.path, body))
        return body

    def _abort(self, match: Callable[[_Item], bool], cause: str) -> list[_Item]:
        hit = [it for it in self._inflight.values() if it.abort is None and match(it)]
        for it in hit:
            it.abort = cause
            it.gen.wake.set()
        return hit

    def _wake_all(self) -> None:
        for gen in self._gens:
            gen.wake.set()

    async def _settled(self, items: list[_Item]) -> None:
        """Wait until these aborted items have finished (a control call, so polling is fine)."""
        while any(it.finish is None for it in items):
            await asyncio.sleep(0.001)

    def _busy(self) -> bool:
        """Whether a cache flush would be refused: requests running on the scheduler."""
        if self._paused and self._pause_mode != "in_place":
            return False  # aborted, or retracted to the waiting queue, which a flush ignores
        return self._running()

    def _running(self) -> bool:
        return any(it.started and it.finish is None for it in self._inflight.values())

    async def _abort_request(self, request: web.Request) -> web.Response:
        body = await self._control_body(request)
        if isinstance(body, web.Response):
            return body
        self.abort_requests.append(body)
        self._abort(lambda it: abort_matches(body, it.rid), "abort_request")
        seen, self._abort_seen = self._abort_seen, asyncio.Event()
        seen.set()
        return web.Response(status=200)

    async def wait_for_abort(self, rid: str, timeout: float = 5.0) -> dict:
        """The first /abort_request body that targets rid, waiting for it if need be."""
        async with asyncio.timeout(timeout):
            while True:
                seen = self._abort_seen
                for body in self.abort_requests:
                    if abort_matches(body, rid):
                        return body
                await seen.wait()

    async def _pause(self, request: web.Request) -> web.Response:
        body = await self._control_body(request)
        if isinstance(body, web.Response):
            return body
        mode = body.get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            return _bad_request(f"mode must be one of abort, retract, in_place; got {mode!r}")
        self._paused, self._pause_mode = True, mode
        if mode == "abort":
            await self._settled(self._abort(lambda it: True, "pause"))
        elif mode == "retract":
            for it in self._inflight.values():
                if it.started and it.finish is None:
                    it.retractions += 1
        return _json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        body = await self._control_body(request)
        if isinstance(body, web.Response):
            return body
        self._paused = False
        self._wake_all()
        return _json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _update_weights(self, request: web.Request) -> web.Response:
        body = await self._control_body(request)
        if isinstance(body, web.Response):
            return body
        if not isinstance(body.get("model_path"), str):
            return _bad_request("model_path: Field required")
        self.weight_updates.append(body)
        if body.get("abort_all_requests") is True:
            await self._settled(self._abort(lambda it: True, "update"))
        locked = not self._paused  # the writer lock: wait for running requests, hold new ones
        if locked:
            self._updating += 1
        try:
            while locked and self._running():
                await asyncio.sleep(0.001)
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
            self.model_path = body["model_path"]
        finally:
            if locked:
                self._updating -= 1
                self._wake_all()
        if body.get("flush_cache", True) and self._busy():
            return _json_response({
                "success": False, "num_paused_requests": 0,
                "message": "Weights were updated, but the cache was not flushed because requests "
                           "are still running or queued. Flush the cache when the engine is idle."},
                400)
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {self.weight_version}."
        return _json_response({"success": True, "message": message, "num_paused_requests": 0})

    # ---- LoRA (SGLang 0.5.23: entrypoints/http_server.py, lora/lora_registry.py, lora/lora_manager.py)

    def _check_lora(self, name: str | None) -> None:
        """A /generate item may name a loaded adapter, only with LoRA enabled (ValueError: 400)."""
        if name is None:
            return
        if not self.enable_lora:
            raise ValueError(LORA_NOT_ENABLED)
        if name not in self.lora_adapters:
            raise ValueError(f"The following requested LoRA adapters are not loaded: {name}\n"
                             f"Loaded adapters: {OrderedDict(self.lora_adapters).keys()}.")

    def _lora_answer(self, error: str | None = None) -> web.Response:
        return _json_response({"rid": None, "http_worker_ipc": None, "success": error is None,
                               "error_message": error,
                               "loaded_adapters": dict(self.lora_adapters) if self.enable_lora else None},
                              200 if error is None else 400)

    def _lora_problem(self, name: str, path: str) -> str | None:
        """Why an adapter directory cannot be loaded, read from its adapter_config.json; None if it can."""
        if name in self.lora_adapters:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        try:
            with open(f"{path}/adapter_config.json", encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            return f"Failed to load LoRA adapter {name} from {path}: no readable adapter_config.json ({e})"
        rank, modules = config.get("r"), config.get("target_modules")
        if not (isinstance(rank, int) and 0 < rank <= self.max_lora_rank and isinstance(modules, list)
                and set(modules) <= self.lora_targets):
            return lora_incompatible(name, rank)
        return None

    async def _load_lora(self, request: web.Request) -> web.Response:
        body = await self._control_body(request)
        if isinstance(body, web.Response):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            return _bad_request("lora_name and lora_path: Field required")
        if not self.enable_lora:
            return self._lora_answer(LORA_NOT_ENABLED)
        problem = self._lora_problem(name, path)
        if problem is not None:
            return self._lora_answer(problem)
        self.lora_adapters[name] = path
        return self._lora_answer()

    async def _unload_lora(self, request: web.Request) -> web.Response:
        """Unregister at once (new requests naming it get 400), answer once the items in flight on it end."""
        body = await self._control_body(request)
        if isinstance(body, web.Response):
            return body
        name = body.get("lora_name")
        if not (isinstance(name, str) and name):
            return _bad_request("lora_name: Field required")
        if not self.enable_lora:
            return self._lora_answer(LORA_NOT_ENABLED)
        if name not in self.lora_adapters:
            return self._lora_answer(f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                     f"{OrderedDict(self.lora_adapters).keys()}")
        del self.lora_adapters[name]
        await self._settled([it for it in self._inflight.values() if it.lora == name])
        return self._lora_answer()

    async def _models(self, request: web.Request) -> web.Response:
        """The base's card, then one per loaded adapter with the base as parent."""
        created = int(time.time())
        cards = [{"id": self.model_path, "object": "model", "created": created, "owned_by": "sglang",
                  "root": self.model_path, "parent": None, "max_model_len": self.context_length}]
        cards += [{"id": name, "object": "model", "created": created, "owned_by": "sglang", "root": path,
                   "parent": self.model_path, "max_model_len": None}
                  for name, path in self.lora_adapters.items()]
        return _json_response({"object": "list", "data": cards})

    async def _flush_cache(self, request: web.Request) -> web.Response:
        self.calls.append((request.path, {}))
        if self._busy():
            return web.Response(status=400, text="Cache not flushed: requests are running or "
                                                  "queued. Retry when the engine is idle.\n")
        return web.Response(text=FLUSHED)

    async def _health(self, request: web.Request) -> web.Response:
        """/health and /health_generate (one handler in 0.5.23): 200 as soon as the scheduler puts anything
        out; a stuck one puts out nothing, so 503 after the wait (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s; here
        `health_check_timeout`). A front end stuck too answers nothing."""
        await self._front_end()
        if not self._stuck:
            return web.Response(status=200)
        await asyncio.sleep(self.health_check_timeout)
        return web.Response(status=503 if self._stuck else 200)

    async def _ready(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self._paused else 200)

    async def _server_info(self, request: web.Request) -> web.Response:
        """Server arguments, the scheduler's limits and the version (never a key)."""
        await self._front_end()
        return _json_response({
            "model_path": self.model_path, "tokenizer_path": self.model_path,
            "served_model_name": self.model_path, "context_length": self.context_length,
            "max_running_requests": self.max_running_requests,
            "incremental_streaming_output": self.incremental,
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_input_len": self.max_req_input_len, "internal_states": [{}],
            "version": VERSION, "enable_lora": self.enable_lora, "max_lora_rank": self.max_lora_rank,
            "lora_target_modules": sorted(self.lora_targets) or None, "max_loras_per_batch": 8})

    async def _model_info(self, request: web.Request) -> web.Response:
        await self._front_end()
        return _json_response({
            "model_path": self.model_path, "served_model_name": self.model_path,
            "tokenizer_path": self.model_path, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": self.weight_version,
            "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
            "disaggregation_mode": "null", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"]})


async def _serve(args: argparse.Namespace) -> None:
    fake = FakeSGLang(tokens=args.tokens, eos_id=args.eos_id, token_delay=args.token_delay,
                      incremental_streaming_output=args.incremental_streaming_output,
                      weight_version=args.weight_version, context_length=args.context_length,
                      enable_lora=args.enable_lora, max_lora_rank=args.max_lora_rank,
                      lora_target_modules=args.lora_target_modules, host=args.host, port=args.port)
    await fake.start()
    print(f"PORT {fake.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await fake.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="A fake SGLang server (native API shapes, no model).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tokens", type=int, default=32, help="tokens per reply, EOS included")
    p.add_argument("--eos-id", type=int, default=2)
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds between tokens")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--incremental-streaming-output", action="store_true")
    p.add_argument("--context-length", type=int, default=32768)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="+", default=None)
    asyncio.run(_serve(p.parse_args(argv)))


if __name__ == "__main__":
    main()
