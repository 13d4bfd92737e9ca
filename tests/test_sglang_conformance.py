"""What clawd relies on SGLang for, checked against the fake and the local engine alike.

Each test is one behaviour of SGLang 0.5.23 that clawd depends on. Its docstring
names where it was read: the released wheel (`sglang==0.5.23`), paths under
`sglang/srt/`, the files of the §10 table of sglang-http-api.md. Every test runs
twice, on `tests/fake_sglang.py` and on clawd's CPU engine (`clawd.engine.local`,
on the tiny model), both in this process on 127.0.0.1:0. The two share no code,
so each checks the other: a behaviour both show is the contract clawd codes to.

The local engine is wired as `python -m clawd.engine.local` wires it (parse_args,
Engine, build_app), its keys coming from a `--config` file as clawd passes them.

LoRA at run time (§8 below; SGLang 0.5.23, read from entrypoints/http_server.py,
managers/io_struct.py, managers/tokenizer_manager.py, lora/lora_registry.py,
lora/lora_manager.py, utils/auth.py, arg_groups/lora_hook.py):

| behaviour                                                                 | where                          |
|---------------------------------------------------------------------------|--------------------------------|
| `--enable-lora` without `--lora-paths` needs `--max-lora-rank` and          | arg_groups/lora_hook.py        |
| `--lora-target-modules` (`all` = every linear layer); `--max-loras-per-batch` |                             |
| 8 kinds of rows per batch, the base counting as one                       |                                |
| `/load_lora_adapter {lora_name, lora_path, pinned?}` → 200 `{rid: null,     | managers/io_struct.py          |
| http_worker_ipc: null, success, error_message, loaded_adapters}`; 400 with |  (LoadLoRAAdapterReqOutput)    |
| success false on failure; loaded_adapters null when LoRA is off           |                                |
| a name already loaded: "Failed to load LoRA adapter X because it is already | lora/lora_manager.py         |
| loaded"; rank over the limit or modules outside the targets: "LoRA adapter |                                |
| X with rank R is incompatible with the current LoRA memory pool ..."       |                                |
| `/unload_lora_adapter {lora_name}`: same shape; unregisters at once, frees | managers/tokenizer_manager.py |
| after the requests in flight on it end; unknown: "LoRA with name X does not | lora/lora_registry.py        |
| exist. Loaded LoRAs: ..."                                                  |                                |
| `/generate` `lora_path`: an adapter name, or a list with one per item (null | managers/io_struct.py        |
| = base); without --enable-lora, 400 "LoRA is not enabled. Please set        | managers/tokenizer_manager.py |
| `--enable-lora` to enable LoRA."; unknown name, 400 "The following         | lora/lora_registry.py          |
| requested LoRA adapters are not loaded: X\nLoaded adapters: ..."           |                                |
| both control routes are ADMIN_OPTIONAL: the admin key, never the API key  | utils/auth.py                  |
| `/v1/models`: the base card, then one per adapter with parent = the base   | entrypoints/openai/serving_models |
| loading or unloading leaves `/model_info`'s weight_version alone           | managers/tokenizer_manager.py |

Not reproduced: `--lora-paths` at launch, `--max-loaded-loras` eviction, pinning (accepted,
ignored), and SGLang's tokenizer re-loading an unloaded name from its old path.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from dataclasses import dataclass

import aiohttp
import pytest

from clawd.engine.local.scheduler import WAITING_TIMEOUT_ENV
from clawd.engine.local.scheduler import Engine as LocalEngine
from clawd.engine.local.server import parse_args
from tests.fake_sglang import FakeSGLang, lora_incompatible, lora_offset
from tests.local_engine import running
from tests.test_engine_lora import build_adapter

CONTEXT = 1024  # both servers' context length
LIMIT = CONTEXT - 6  # max_req_input_len, SGLang's arithmetic (see test_server_info_reports_the_input_limit)
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
TIMED_OUT = {"type": "abort", "status_code": 503, "message": "Request waiting timeout reached."}
PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}
KEY, ADMIN_KEY = "k-ordinary-0123456789", "k-admin-9876543210"
LORA_RANK, LORA_TARGETS = 8, ["q_proj", "v_proj"]
LORA_OFF = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


@dataclass
class Server:
    kind: str  # "fake" | "local"
    url: str
    model_path: str
    fake: FakeSGLang | None = None  # the fake itself, for what it records


@pytest.fixture(params=["fake", "local"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def serve(kind, tiny_model, tmp_path):
    """serve(**options) -> async context manager of a Server of this test's kind.

    Options: incremental (--incremental-streaming-output), api_key / admin_api_key,
    max_running (max running requests), waiting_timeout (SGLANG_REQ_WAITING_TIMEOUT) and
    lora (--enable-lora --max-lora-rank 8 --lora-target-modules q_proj v_proj).
    """
    @contextlib.asynccontextmanager
    async def start(incremental=False, api_key=None, admin_api_key=None, max_running=None,
                    waiting_timeout=None, lora=False):
        if kind == "fake":
            # 1 ms a token, so a long request is still running when a control call arrives
            fake = FakeSGLang(tokens=32, token_delay=0.001, context_length=CONTEXT,
                              incremental_streaming_output=incremental, api_key=api_key,
                              admin_api_key=admin_api_key, max_running_requests=max_running,
                              waiting_timeout=waiting_timeout, enable_lora=lora,
                              max_lora_rank=LORA_RANK if lora else None,
                              lora_target_modules=LORA_TARGETS if lora else None)
            async with fake:
                yield Server("fake", fake.url, fake.model_path, fake)
            return
        argv = ["--model", str(tiny_model), "--context-length", str(CONTEXT), "--threads", "1",
                "--max-batch-size", str(max_running or 8)]
        if incremental:
            argv.append("--incremental-streaming-output")
        if lora:
            argv += ["--enable-lora", "--max-lora-rank", str(LORA_RANK), "--lora-target-modules", *LORA_TARGETS]
        if api_key or admin_api_key:
            config = tmp_path / "engine.yaml"
            keys = {"api-key": api_key, "admin-api-key": admin_api_key}
            config.write_text(json.dumps({k: v for k, v in keys.items() if v}))
            argv += ["--config", str(config)]
        args = parse_args(argv)
        saved = os.environ.pop(WAITING_TIMEOUT_ENV, None)
        if waiting_timeout:
            os.environ[WAITING_TIMEOUT_ENV] = str(waiting_timeout)
        try:
            engine = LocalEngine(args)
        finally:
            os.environ.pop(WAITING_TIMEOUT_ENV, None)
            if saved is not None:
                os.environ[WAITING_TIMEOUT_ENV] = saved
        async with running(engine) as url:
            yield Server("local", url, str(tiny_model))
    return start


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def call(http, server: Server, path: str, body=None, key: str | None = None, headers=None):
    """(status, JSON body or text) of a POST (with a body) or GET (without)."""
    headers = dict(headers or {})
    if key:
        headers["Authorization"] = f"Bearer {key}"
    method = "GET" if body is None else "POST"
    async with http.request(method, server.url + path, json=body, headers=headers) as resp:
        raw = await resp.read()
        if resp.content_type == "application/json":
            return resp.status, json.loads(raw)
        return resp.status, raw.decode()


async def sse(http, server: Server, body: dict, key: str | None = None) -> list[dict]:
    """A streamed /generate: its chunks, after checking the framing (data events, [DONE] last)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.post(server.url + "/generate", json={**body, "stream": True}, headers=headers) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        raw = (await resp.read()).decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], raw[-300:]
    assert all(e.startswith("data: ") for e in events[:-1])
    return [json.loads(e[len("data: "):]) for e in events[:-2]]


class Stream:
    """A streamed /generate read chunk by chunk, to act while it runs."""

    def __init__(self, http, server: Server, body: dict, key: str | None = None):
        self.ctx = http.post(server.url + "/generate", json={**body, "stream": True},
                             headers={"Authorization": f"Bearer {key}"} if key else {})
        self.chunks: list[dict] = []

    async def __aenter__(self) -> Stream:
        self.resp = await self.ctx.__aenter__()
        assert self.resp.status == 200
        return self

    async def __aexit__(self, *exc) -> None:
        await self.ctx.__aexit__(*exc)

    async def next(self) -> dict:
        event = await self.resp.content.readuntil(b"\n\n")
        assert event.startswith(b"data: ") and event != b"data: [DONE]\n\n"
        self.chunks.append(json.loads(event[len(b"data: "):]))
        return self.chunks[-1]

    async def rest(self) -> list[dict]:
        events = (await self.resp.read()).decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        self.chunks += [json.loads(e[len("data: "):]) for e in events[:-2]]
        return self.chunks


def long_body(rid: str | None = None, tokens: int = 1000) -> dict:
    """A request that runs for about a second on either server unless stopped."""
    body = {"input_ids": [11, 12, 13, 14], "return_logprob": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}}
    return body if rid is None else {**body, "rid": rid}


def short_body(**params) -> dict:
    return {"input_ids": [21, 22, 23], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0, **params}}


async def until_registered(http, server: Server, rid: str) -> None:
    """Wait until `rid` is in flight. The probe reuses the rid with a prompt at the input limit:
    refused as a duplicate once the rid is taken, refused by the input limit before that, so
    it never runs and never takes the rid itself."""
    probe = {"input_ids": [7] * LIMIT, "rid": rid}
    for _ in range(2000):
        status, err = await call(http, server, "/generate", probe)
        assert status == 400
        if "Duplicate request ID" in err["error"]["message"]:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{rid} never showed up")


def ids_and_logprobs(out: dict) -> tuple[list, list]:
    return out["output_ids"], out["meta_info"]["output_token_logprobs"]


# --------------------------------------------------------------------------
# 1. /server_info

async def test_server_info_reports_the_input_limit(serve, http):
    """`/server_info` answers the scheduler's limits and the version; `/get_server_info` is its
    deprecated alias; `/model_info` (and `/get_model_info`) unchanged. SGLang 0.5.23:
    entrypoints/http_server.py (the routes), managers/tp_worker.py (max_req_len = min(context
    - 1, KV pool - 1); max_req_input_len = max_req_len - 5: a reserve of 6 under the context,
    so a prompt at the limit still leaves a few tokens to generate). The servers here report
    the context in force as `context_length` (SGLang echoes its --context-length flag, null when
    not given): clawd derives the prompt limit from `max_req_input_len`, which is always there."""
    async with serve() as server:
        status, info = await call(http, server, "/server_info")
        alias = await call(http, server, "/get_server_info")
        model = await call(http, server, "/model_info")
        model_alias = await call(http, server, "/get_model_info")
    assert status == 200 and alias == (200, info)
    assert info["max_req_input_len"] == LIMIT and type(info["max_req_input_len"]) is int
    assert info["context_length"] == CONTEXT and info["version"] == "0.5.23"
    assert info["max_total_num_tokens"] >= CONTEXT and info["internal_states"]
    assert not {"api_key", "admin_api_key"} & set(info)
    assert model[0] == 200 and model_alias == model
    assert {"model_path", "served_model_name", "tokenizer_path", "is_generation", "weight_version",
            "preferred_sampling_params", "model_type", "architectures"} <= set(model[1])


# --------------------------------------------------------------------------
# 2. The input limit

async def test_input_limit_refuses_long_prompts_and_trims_max_new_tokens(serve, http):
    """A prompt of `max_req_input_len` tokens or more is refused: HTTP 400 {"error": {"message"}}
    when not streamed; streamed, an abort chunk carrying status_code 400, then [DONE] (the
    scheduler aborts it; only a non-streamed abort with status 400 becomes HTTP 400).
    `max_new_tokens`, given or the default 128, is cut to the room left, max_req_len -
    len(prompt) - 1; a given one that with the prompt exceeds the context is refused (400).
    SGLang 0.5.23: managers/tp_worker.py (the limit), managers/scheduler.py
    (validate_input_length, the trim), managers/tokenizer_manager.py (_validate_one_request,
    _handle_abort_finish_reason), entrypoints/http_server.py."""
    message = (f"Input length ({LIMIT} tokens) exceeds the maximum allowed length ({LIMIT} tokens). "
               f"Use a shorter input or enable --allow-auto-truncate.")
    at_limit = {"input_ids": [9] * LIMIT, "sampling_params": {"max_new_tokens": 1}}
    below = [9] * (LIMIT - 1)  # room: CONTEXT - 2 - (LIMIT - 1) = 5 tokens
    async with serve() as server:
        refused = await call(http, server, "/generate", at_limit)
        chunks = await sse(http, server, at_limit)
        default = await call(http, server, "/generate", {"input_ids": below, "sampling_params": {
            "ignore_eos": True, "temperature": 0}})
        fitting = await call(http, server, "/generate", {"input_ids": below, "sampling_params": {
            "max_new_tokens": CONTEXT - len(below), "ignore_eos": True, "temperature": 0}})
        over = await call(http, server, "/generate", {"input_ids": below, "sampling_params": {
            "max_new_tokens": CONTEXT - len(below) + 1}})
        whole = await call(http, server, "/generate", {"input_ids": [9] * CONTEXT})
    assert refused == (400, {"error": {"message": message}})
    assert len(chunks) == 1 and chunks[0]["output_ids"] == []
    assert chunks[0]["meta_info"]["finish_reason"] == {
        "type": "abort", "message": message, "status_code": 400, "err_type": "BadRequestError"}
    for status, out in (default, fitting):
        assert status == 200 and len(out["output_ids"]) == 5
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert over[0] == 400 and over[1]["error"]["message"].startswith(
        f"Requested token count exceeds the model's maximum context length of {CONTEXT} tokens.")
    assert whole == (400, {"error": {"message": f"The input ({CONTEXT} tokens) is longer than the "
                                                 f"model's context length ({CONTEXT} tokens)."}})


# --------------------------------------------------------------------------
# 3. Aborts

async def test_abort_request_ends_requests_with_abort_and_http_200(serve, http):
    """`/abort_request {"rid"}` and `{"abort_all": true}` answer 200 with an empty body; the
    aborted request answers HTTP 200 with its partial output and finish_reason.type "abort"
    (a plain abort carries no status_code); an unknown rid is a no-op. SGLang 0.5.23:
    entrypoints/http_server.py, managers/tokenizer_manager.py (abort_request), managers/io_struct.py
    (AbortReq: over HTTP only rid and abort_all count)."""
    async with serve() as server:
        async with Stream(http, server, long_body("conf-stream-1")) as stream:
            await stream.next()
            assert await call(http, server, "/abort_request", {"rid": "conf-stream-1"}) == (200, "")
            chunks = await stream.rest()
        last = chunks[-1]
        assert last["meta_info"]["finish_reason"] == ABORTED
        assert 0 < last["meta_info"]["completion_tokens"] < 1000

        one = asyncio.create_task(call(http, server, "/generate", long_body("conf-plain-1")))
        await until_registered(http, server, "conf-plain-1")
        assert await call(http, server, "/abort_request", {"rid": "conf-plain-1"}) == (200, "")
        status, out = await one
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["finish_reason"]["status_code"] is None
        assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] < 1000

        tasks = [asyncio.create_task(call(http, server, "/generate", long_body(f"conf-all-{i}")))
                 for i in range(2)]
        for i in range(2):
            await until_registered(http, server, f"conf-all-{i}")
        assert await call(http, server, "/abort_request", {"rid": "no-such-rid"}) == (200, "")
        assert await call(http, server, "/abort_request", {"abort_all": True}) == (200, "")
        for status, out in await asyncio.gather(*tasks):
            assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"


async def test_aborts_carrying_a_status_are_http_errors(serve, http):
    """An abort the scheduler gives a status code (not /abort_request's, which never has one)
    comes back, when not streamed, as that HTTP error: 400 as {"error": {"message"}} (the input
    limit, previous test), 500 and 503 as {"object": "error", "message", "type": "<code>",
    "param": null, "code": <code>}; streamed, as the last chunk's finish_reason, HTTP 200.
    The reference's two sentences agree once read with the source: §10's "come back as HTTP
    400" is the 400 case, §1's 503 body the other. Here the 503 is SGLang's waiting timeout
    (SGLANG_REQ_WAITING_TIMEOUT): a request waiting for room in a full batch that long.
    SGLang 0.5.23: managers/tokenizer_manager.py (_handle_abort_finish_reason),
    managers/scheduler.py (_abort_on_waiting_timeout), entrypoints/http_server.py."""
    async with serve(max_running=1, waiting_timeout=0.2) as server:
        async with Stream(http, server, long_body("conf-busy")) as busy:
            await busy.next()  # running: the only place in the batch is taken
            status, body = await call(http, server, "/generate", short_body())
            chunks = await sse(http, server, short_body())
            await call(http, server, "/abort_request", {"rid": "conf-busy"})
            await busy.rest()
    assert (status, body) == (503, {"object": "error", "message": "Request waiting timeout reached.",
                                    "type": "503", "param": None, "code": 503})
    assert len(chunks) == 1 and chunks[0]["output_ids"] == []
    assert chunks[0]["meta_info"]["finish_reason"] == TIMED_OUT
    assert "prompt_tokens" not in chunks[0]["meta_info"]  # aborted in the waiting queue


# --------------------------------------------------------------------------
# 4. Pausing

@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_paused_requests_wait_and_updates_go_through(serve, http, mode):
    """After `/pause_generation {"mode"}` a new /generate waits (is not refused) until
    `/continue_generation`; `/ready` answers 503 meanwhile; `/update_weights_from_disk` is
    accepted while paused (in_place with flush_cache false: its KV stays, so a flush would fail).
    abort ends the running request (finish "abort"); retract parks it and it finishes after
    continue, `num_retractions` 1 and its `weight_versions` spanning both versions; in_place
    freezes it and it finishes after continue. SGLang 0.5.23: managers/io_struct.py
    (PauseGenerationReqInput), managers/scheduler.py, managers/tokenizer_manager.py (is_pause_cond,
    the writer lock skipped while paused), entrypoints/http_server.py."""
    async with serve() as server:
        async with Stream(http, server, long_body("conf-run", tokens=60)) as running:
            await running.next()
            assert await call(http, server, "/pause_generation", {"mode": mode}) == (200, PAUSED)
            waiting = asyncio.create_task(call(http, server, "/generate", short_body()))
            assert (await call(http, server, "/ready"))[0] == 503
            status, res = await call(http, server, "/update_weights_from_disk", {
                "model_path": server.model_path, "weight_version": "v2", "flush_cache": mode != "in_place"})
            assert (status, res["success"]) == (200, True)
            await asyncio.sleep(0.1)
            assert not waiting.done()
            assert await call(http, server, "/continue_generation", {}) == (200, CONTINUED)
            chunks = await running.rest()
        status, out = await waiting
    assert status == 200 and out["meta_info"]["weight_version"] == "v2"
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    meta = chunks[-1]["meta_info"]
    if mode == "abort":
        assert meta["finish_reason"] == ABORTED
        return
    assert meta["finish_reason"] == {"type": "length", "length": 60}
    assert meta["num_retractions"] == (1 if mode == "retract" else 0)
    old, new = meta["weight_versions"]
    assert (old["version"], old["start"], new["version"], new["end"]) == ("0", 0, "v2", 60)
    assert old["end"] == new["start"]


async def test_continue_when_not_paused_changes_nothing(serve, http):
    """`/continue_generation` when not paused answers 200 and disturbs nothing: clawd sends it
    whenever an engine becomes ready. SGLang 0.5.23: managers/tokenizer_manager.py
    (continue_generation), entrypoints/http_server.py."""
    async with serve() as server:
        assert await call(http, server, "/continue_generation", {}) == (200, CONTINUED)
        async with Stream(http, server, long_body("conf-steady", tokens=20)) as running:
            await running.next()
            assert await call(http, server, "/continue_generation", {}) == (200, CONTINUED)
            chunks = await running.rest()
        ready = await call(http, server, "/ready")
        status, out = await call(http, server, "/generate", short_body())
    meta = chunks[-1]["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 20} and meta["num_retractions"] == 0
    assert ready[0] == 200 and status == 200 and len(out["output_ids"]) == 4


# --------------------------------------------------------------------------
# 5. Keys

async def test_admin_key_guards_control_endpoints_and_refuses_the_api_key(serve, http, caplog):
    """With `--api-key K` and `--admin-api-key A`: /health*, /ready* stay open; /generate,
    /model_info, /server_info take K (not A); control endpoints take A and refuse K; a missing
    or wrong key is 401 {"error": "Unauthorized"}; `x-api-key` works as well as Bearer. The
    local engine reads both keys from its --config file and logs neither. SGLang 0.5.23:
    utils/auth.py (decide_request_auth; ADMIN_OPTIONAL routes), server_args_config_parser.py."""
    unauthorized = (401, {"error": "Unauthorized"})
    caplog.set_level(logging.DEBUG)
    async with serve(api_key=KEY, admin_api_key=ADMIN_KEY) as server:
        for path in ("/health", "/ready"):
            assert (await call(http, server, path))[0] == 200
        for path, body in (("/generate", short_body()), ("/model_info", None), ("/server_info", None)):
            assert await call(http, server, path, body) == unauthorized
            assert await call(http, server, path, body, key=ADMIN_KEY) == unauthorized
            assert (await call(http, server, path, body, key=KEY))[0] == 200
        assert (await call(http, server, "/model_info", headers={"x-api-key": KEY}))[0] == 200
        assert await call(http, server, "/model_info", key=KEY + "x") == unauthorized
        control = [("/abort_request", {"rid": "nobody"}), ("/pause_generation", {"mode": "abort"}),
                   ("/continue_generation", {}), ("/flush_cache", {}),
                   ("/update_weights_from_disk", {"model_path": server.model_path, "weight_version": "1"})]
        for path, body in control:
            assert await call(http, server, path, body) == unauthorized
            assert await call(http, server, path, body, key=KEY) == unauthorized
        for path, body in control:
            assert (await call(http, server, path, body, key=ADMIN_KEY))[0] == 200, path
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert KEY not in logged and ADMIN_KEY not in logged


async def test_api_key_alone_guards_everything_but_health(serve, http):
    """With only `--api-key K`, every endpoint but /health*, /ready*, /metrics* needs K, the
    control endpoints included. SGLang 0.5.23: utils/auth.py."""
    async with serve(api_key=KEY) as server:
        assert (await call(http, server, "/health"))[0] == 200
        for path, body in (("/generate", short_body()), ("/pause_generation", {}), ("/continue_generation", {})):
            assert await call(http, server, path, body) == (401, {"error": "Unauthorized"})
            assert (await call(http, server, path, body, key=KEY))[0] == 200


# --------------------------------------------------------------------------
# 6. Streams

@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_stream_reassembles_to_the_plain_answer(serve, http, incremental):
    """Streamed chunks are cumulative by default (each holds the whole output so far, log-probs
    likewise) and deltas with `--incremental-streaming-output`; either way the reassembled ids
    and log-probs equal the non-streamed answer's, and only the last chunk has a finish_reason.
    SGLang 0.5.23: managers/tokenizer_manager.py (_slice_streaming_output_meta_info)."""
    body = {**short_body(max_new_tokens=6), "rid": "conf-stream"}
    async with serve(incremental=incremental) as server:
        status, whole = await call(http, server, "/generate", body)
        chunks = await sse(http, server, body)
    assert status == 200 and len(whole["output_ids"]) == 6
    assert [c["meta_info"]["finish_reason"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    for c in chunks:
        assert len(c["output_ids"]) == len(c["meta_info"]["output_token_logprobs"])
    if incremental:
        ids = sum((c["output_ids"] for c in chunks), [])
        lps = sum((c["meta_info"]["output_token_logprobs"] for c in chunks), [])
        assert all(c["output_ids"] for c in chunks)
    else:
        for before, after in zip(chunks, chunks[1:]):
            assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
            assert after["meta_info"]["output_token_logprobs"][:len(before["output_ids"])] == \
                before["meta_info"]["output_token_logprobs"]
        ids, lps = ids_and_logprobs(chunks[-1])
    assert (ids, lps) == ids_and_logprobs(whole)
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


# --------------------------------------------------------------------------
# 7. The sampling_params contract

async def test_sampling_params_contract_and_neutral_values(serve, http):
    """Unknown keys inside `sampling_params` are refused, 400 {"error": "<text>"}; unknown
    top-level keys are ignored; `top_k: 0` is refused, 400 {"error": {"message"}}; the neutral
    values clawd sends on trainable turns are accepted and change nothing. SGLang 0.5.23:
    api/v1/api_types.py (the contract), sampling/sampling_params.py (verify)."""
    neutral = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
               "repetition_penalty": 1.0, "min_new_tokens": 0}
    base = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
    async with serve() as server:
        unknown = await call(http, server, "/generate", short_body(max_tokens=3))
        top_k = await call(http, server, "/generate", short_body(top_k=0))
        extra = await call(http, server, "/generate", {**short_body(), "clawd_turn": {"x": 1}})
        plain = await call(http, server, "/generate", {**short_body(), "sampling_params": base})
        spelled = await call(http, server, "/generate", {**short_body(), "sampling_params": {**base, **neutral}})
    assert unknown[0] == 400 and isinstance(unknown[1]["error"], str)
    assert unknown[1]["error"].startswith("unknown field `max_tokens`, expected one of ")
    assert top_k[0] == 400 and "top_k" in top_k[1]["error"]["message"]
    assert extra[0] == 200 and len(extra[1]["output_ids"]) == 4
    assert plain[0] == spelled[0] == 200
    assert ids_and_logprobs(plain[1]) == ids_and_logprobs(spelled[1])


# --------------------------------------------------------------------------
# 8. LoRA adapters at run time

@pytest.fixture(scope="module")
def lora_dirs(tiny_model, tmp_path_factory):
    """PEFT adapter directories on the tiny model: two that fit the servers' limits, one of rank 16
    (over --max-lora-rank 8), one on down_proj (outside --lora-target-modules)."""
    root = tmp_path_factory.mktemp("conformance-lora")
    return {"a": build_adapter(tiny_model, root / "a", 1, LORA_TARGETS),
            "b": build_adapter(tiny_model, root / "b", 2, ["v_proj"]),
            "wide": build_adapter(tiny_model, root / "wide", 3, LORA_TARGETS, r=16),
            "mlp": build_adapter(tiny_model, root / "mlp", 4, ["down_proj"])}


def lora_answer(adapters: dict | None, error: str | None = None) -> dict:
    return {"rid": None, "http_worker_ipc": None, "success": error is None, "error_message": error,
            "loaded_adapters": adapters}


def scoring(lora=None, prompts=(31, 32, 33, 34, 35)) -> dict:
    """Prefill-only scoring of the prompt(s), input log-probs from position 0, on adapter(s) `lora`."""
    body = {"input_ids": list(prompts), "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0}}
    return body if lora is None else {**body, "lora_path": lora}


def input_lps(out: dict) -> list[float]:
    return [e[0] for e in out["meta_info"]["input_token_logprobs"]][1:]


async def test_lora_load_unload_and_v1_models(serve, http, lora_dirs):
    """`/load_lora_adapter` answers {rid, http_worker_ipc, success, error_message, loaded_adapters}:
    200 on success, 400 with success false when the name is loaded already, the rank is over
    --max-lora-rank, the modules are outside --lora-target-modules or the directory holds no
    adapter. `/v1/models` lists the base, then each adapter with the base as parent.
    `/unload_lora_adapter` answers the same shape; an unknown name is a 400. Neither touches
    /model_info's weight_version. SGLang 0.5.23: entrypoints/http_server.py, managers/io_struct.py,
    lora/lora_manager.py, lora/lora_registry.py, entrypoints/openai/serving_models.py."""
    a, b = str(lora_dirs["a"]), str(lora_dirs["b"])
    async with serve(lora=True) as server:
        before = await call(http, server, "/model_info")
        models0 = await call(http, server, "/v1/models")
        load = lambda name, path: call(http, server, "/load_lora_adapter", {"lora_name": name, "lora_path": path})
        first = await load("policy-1", a)
        second = await load("policy-2", b)
        again = await load("policy-1", b)
        wide = await load("wide", str(lora_dirs["wide"]))
        mlp = await load("mlp", str(lora_dirs["mlp"]))
        missing = await load("gone", str(lora_dirs["a"]) + "-missing")
        models1 = await call(http, server, "/v1/models")
        after = await call(http, server, "/model_info")
        unload = await call(http, server, "/unload_lora_adapter", {"lora_name": "policy-1"})
        unload_again = await call(http, server, "/unload_lora_adapter", {"lora_name": "policy-1"})
        models2 = await call(http, server, "/v1/models")
    both = {"policy-1": a, "policy-2": b}
    assert first == (200, lora_answer({"policy-1": a}))
    assert second == (200, lora_answer(both))
    assert again == (400, lora_answer(both, "Failed to load LoRA adapter policy-1 because it is already loaded"))
    assert wide == (400, lora_answer(both, lora_incompatible("wide", 16)))
    assert mlp == (400, lora_answer(both, lora_incompatible("mlp", 4)))
    assert missing[0] == 400 and missing[1]["success"] is False
    assert missing[1]["error_message"].startswith("Failed to load LoRA adapter gone from ")
    base = server.model_path
    assert models0[0] == 200 and models0[1]["object"] == "list"
    assert [(c["id"], c["root"], c["parent"]) for c in models0[1]["data"]] == [(base, base, None)]
    card = models0[1]["data"][0]
    assert (card["object"], card["owned_by"], card["max_model_len"]) == ("model", "sglang", CONTEXT)
    assert isinstance(card["created"], int)
    assert [(c["id"], c["root"], c["parent"]) for c in models1[1]["data"]] == [
        (base, base, None), ("policy-1", a, base), ("policy-2", b, base)]
    assert all(set(c) == set(card) and c["object"] == "model" for c in models1[1]["data"])
    assert before[1]["weight_version"] == after[1]["weight_version"] == "0"
    assert unload == (200, lora_answer({"policy-2": b}))
    assert unload_again[0] == 400 and unload_again[1]["success"] is False
    assert unload_again[1]["error_message"].startswith("LoRA with name policy-1 does not exist. Loaded LoRAs: ")
    assert [c["id"] for c in models2[1]["data"]] == [base, "policy-2"]


async def test_lora_path_routes_each_row_to_its_adapter(serve, http, lora_dirs):
    """`lora_path` names a loaded adapter, for a single request or per item of a batch (null: the
    base); a batch may mix base rows and adapter rows, each scored by its own model. An unknown
    name is a 400 in the ValueError shape. SGLang 0.5.23: managers/io_struct.py (GenerateReqInput.
    lora_path), managers/tokenizer_manager.py, lora/lora_registry.py (acquire)."""
    async with serve(lora=True) as server:
        await call(http, server, "/load_lora_adapter", {"lora_name": "policy-1", "lora_path": str(lora_dirs["a"])})
        base = await call(http, server, "/generate", scoring())
        single = await call(http, server, "/generate", scoring("policy-1"))
        batch = await call(http, server, "/generate", {**scoring([None, "policy-1"], [[31, 32, 33, 34, 35]] * 2),
                                                       "rid": ["row-base", "row-lora"]})
        sampled = await call(http, server, "/generate", {**short_body(), "lora_path": "policy-1"})
        unknown = await call(http, server, "/generate", scoring("nope"))
        unknown_row = await call(http, server, "/generate", scoring([None, "nope"], [[31, 32]] * 2))
    assert base[0] == single[0] == batch[0] == sampled[0] == 200
    near = lambda x, y: len(x) == len(y) and all(abs(p - q) <= 1e-4 for p, q in zip(x, y))
    assert near(input_lps(batch[1][0]), input_lps(base[1]))
    assert near(input_lps(batch[1][1]), input_lps(single[1]))
    assert max(abs(p - q) for p, q in zip(input_lps(single[1]), input_lps(base[1]))) > 1e-4
    assert len(sampled[1]["output_ids"]) == 4
    message = "The following requested LoRA adapters are not loaded: nope\n"
    for status, err in (unknown, unknown_row):
        assert status == 400 and err["error"]["message"].startswith(message)
    if server.fake is not None:  # what the fake records: the adapter of every item, and its offset
        assert ("row-base", None) in server.fake.lora_used and ("row-lora", "policy-1") in server.fake.lora_used
        offset = lora_offset("policy-1")
        assert near([x - offset for x in input_lps(single[1])], input_lps(base[1]))


async def test_lora_needs_enable_lora(serve, http, lora_dirs):
    """Without --enable-lora a /generate naming an adapter is a 400 {"error": {"message"}} and
    loading one a 400 with success false and loaded_adapters null. SGLang 0.5.23:
    managers/tokenizer_manager.py (load_lora_adapter, the request check)."""
    async with serve() as server:
        refused = await call(http, server, "/generate", scoring("policy-1"))
        load = await call(http, server, "/load_lora_adapter", {"lora_name": "p", "lora_path": str(lora_dirs["a"])})
        plain = await call(http, server, "/generate", scoring())
        models = await call(http, server, "/v1/models")
    assert refused == (400, {"error": {"message": LORA_OFF}})
    assert load == (400, lora_answer(None, LORA_OFF))
    assert plain[0] == 200 and [c["id"] for c in models[1]["data"]] == [server.model_path]


async def test_lora_control_routes_take_the_admin_key(serve, http, lora_dirs):
    """With an admin key set, /load_lora_adapter and /unload_lora_adapter need it and refuse the API
    key; /v1/models takes the API key. SGLang 0.5.23: utils/auth.py (ADMIN_OPTIONAL)."""
    unauthorized = (401, {"error": "Unauthorized"})
    load = {"lora_name": "policy-1", "lora_path": str(lora_dirs["a"])}
    async with serve(api_key=KEY, admin_api_key=ADMIN_KEY, lora=True) as server:
        for path, body in (("/load_lora_adapter", load), ("/unload_lora_adapter", {"lora_name": "policy-1"})):
            assert await call(http, server, path, body) == unauthorized
            assert await call(http, server, path, body, key=KEY) == unauthorized
            status, out = await call(http, server, path, body, key=ADMIN_KEY)
            assert (status, out["success"]) == (200, True), out
        assert await call(http, server, "/v1/models", key=ADMIN_KEY) == unauthorized
        assert (await call(http, server, "/v1/models", key=KEY))[0] == 200


async def test_lora_unload_waits_for_requests_in_flight(serve, http, lora_dirs):
    """An unload refuses new requests naming the adapter at once but answers only after the request
    in flight on it has ended (here by an abort). SGLang 0.5.23: managers/tokenizer_manager.py
    (_unload_lora_adapter_locked: unregister, wait_for_unload, then free)."""
    async with serve(lora=True) as server:
        await call(http, server, "/load_lora_adapter", {"lora_name": "policy-1", "lora_path": str(lora_dirs["a"])})
        async with Stream(http, server, {**long_body("conf-on-lora"), "lora_path": "policy-1"}) as running:
            await running.next()
            unload = asyncio.create_task(call(http, server, "/unload_lora_adapter", {"lora_name": "policy-1"}))
            for _ in range(2000):
                status, err = await call(http, server, "/generate", scoring("policy-1"))
                if status == 400:
                    break
                await asyncio.sleep(0.001)
            assert err["error"]["message"].startswith("The following requested LoRA adapters are not loaded")
            assert not unload.done()
            await call(http, server, "/abort_request", {"rid": "conf-on-lora"})
            chunks = await running.rest()
        status, out = await unload
    assert chunks[-1]["meta_info"]["finish_reason"] == ABORTED
    assert (status, out) == (200, lora_answer({}))


# --------------------------------------------------------------------------
# 9. Top-k and id log-probs (`top_logprobs_num`, `token_ids_logprob`)

VOCAB = 4096  # the fake's and the tiny model's
ROW_KEYS = ("input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs", "output_token_ids_logprobs")
PROMPT = [21, 22, 23, 24, 25, 26]


def rows_body(max_new: int = 4, start: int = 2, k: int = 3, ids=(9, 4, 9)) -> dict:
    """`ids`: token_ids_logprob as sent (a tuple is sent as a list)."""
    return {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": k,
            "token_ids_logprob": list(ids) if isinstance(ids, tuple) else ids,
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}}


def check_row(row, k: int | None = None, ids=None) -> None:
    """One position's triples: top-k exactly k, highest first; chosen ids in the request's order."""
    assert all(isinstance(lp, float) and type(t) is int for lp, t, _ in row)
    if k is not None:
        assert len(row) == k and [e[0] for e in row] == sorted((e[0] for e in row), reverse=True)
    if ids is not None:
        assert [e[1] for e in row] == list(ids)
        assert len({e[0] for e, t in zip(row, ids) if t == ids[0]}) == 1  # a duplicate reads the same value


async def test_top_logprobs_and_token_ids_logprob_shapes(serve, http):
    """Only with `return_logprob` (ignored without, <= 0 and [] off): `input_top_logprobs` and
    `input_token_ids_logprobs` line up with `input_token_logprobs` (len − s entries, entry 0 null;
    s = len gives []); one output row per output token, from the tensor `output_token_logprobs`
    reads; a prefill-only request still gets one output row. Rows are [logprob, id, text|null]
    triples: top-k exactly K, highest first; id rows in the request's order, duplicates kept. A list
    of lists on a single request, an id outside the vocabulary (checked even without return_logprob)
    and (clawd's refusal where SGLang crashes) K > V are 400 {"error": {"message"}}; a scalar breaks
    the contract. SGLang 0.5.23:
    managers/tokenizer_manager.py (add_logprob_to_meta_info, _validate_token_ids_logprob),
    managers/io_struct.py, layers/logprob_processor.py, api/v1/api_types.py."""
    async with serve() as server:
        gen = (await call(http, server, "/generate", rows_body()))[1]
        prefill = (await call(http, server, "/generate", rows_body(max_new=0, start=5)))[1]
        whole = (await call(http, server, "/generate", rows_body(start=len(PROMPT))))[1]
        no_start = (await call(http, server, "/generate", rows_body(start=-1)))[1]
        ignored = (await call(http, server, "/generate", {**rows_body(), "return_logprob": False}))[1]
        off = (await call(http, server, "/generate", rows_body(k=-1, ids=())))[1]
        batch = (await call(http, server, "/generate", {**rows_body(), "input_ids": [PROMPT, PROMPT[:4]],
                                                        "token_ids_logprob": [[7, 7], [3]]}))[1]
        refused = [await call(http, server, "/generate", body) for body in (
            rows_body(ids=[[1, 2]]), rows_body(ids=(5, VOCAB)), rows_body(k=VOCAB + 1),
            {**rows_body(k=VOCAB + 1), "return_logprob": False}, rows_body(ids=0), rows_body(ids=[1.5]),
            {**rows_body(ids=(VOCAB,)), "return_logprob": False})]
    meta, out_ids = gen["meta_info"], gen["output_ids"]
    assert [k for k in meta if k in ROW_KEYS] == list(ROW_KEYS)
    for key in ("input_top_logprobs", "input_token_ids_logprobs"):
        assert len(meta[key]) == len(meta["input_token_logprobs"]) == len(PROMPT) - 2 and meta[key][0] is None
    for key in ("output_top_logprobs", "output_token_ids_logprobs"):
        assert len(meta[key]) == len(out_ids) == 4
    for row in meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]:
        check_row(row, k=3)
    for row in meta["input_token_ids_logprobs"][1:] + meta["output_token_ids_logprobs"]:
        check_row(row, ids=[9, 4, 9])
    # greedy: each output top row starts with the sampled token, at the value output_token_logprobs reports
    assert [row[0] for row in meta["output_top_logprobs"]] == meta["output_token_logprobs"]
    assert all(e[2] is None for row in meta["output_top_logprobs"] for e in row)

    pmeta = prefill["meta_info"]
    assert (prefill["output_ids"], pmeta["output_token_logprobs"]) == ([], [])
    assert len(pmeta["output_top_logprobs"]) == len(pmeta["output_token_ids_logprobs"]) == 1
    check_row(pmeta["output_top_logprobs"][0], k=3)
    check_row(pmeta["output_token_ids_logprobs"][0], ids=[9, 4, 9])
    assert pmeta["input_top_logprobs"] == pmeta["input_token_ids_logprobs"] == [None]
    for out in (whole, no_start):
        assert [out["meta_info"][k] for k in ROW_KEYS[::2]] == [[], []]
        assert len(out["meta_info"]["output_top_logprobs"]) == 4
    assert not [k for k in ignored["meta_info"] if "logprob" in k]
    assert not [k for k in off["meta_info"] if k in ROW_KEYS]
    first, second = batch
    check_row(first["meta_info"]["output_token_ids_logprobs"][0], ids=[7, 7])
    check_row(second["meta_info"]["input_token_ids_logprobs"][1], ids=[3])
    assert len(second["meta_info"]["input_top_logprobs"]) == 2

    flat, oov, too_many, too_many_ignored, scalar, floats, oov_ignored = refused
    assert flat == (400, {"error": {"message": "token_ids_logprob must be a flat list of integers."}})
    assert oov == oov_ignored == (400, {"error": {"message": f"token_ids_logprob contains out-of-vocabulary "
                                                             f"token id {VOCAB}; valid range is [0, {VOCAB})."}})
    assert too_many == (400, {"error": {"message": f"top_logprobs_num ({VOCAB + 1}) exceeds the vocabulary "
                                                   f"size ({VOCAB})."}})
    assert too_many_ignored[0] == 200
    for status, err in (scalar, floats):
        assert status == 400 and isinstance(err["error"], str)  # the contract's shape: {"error": "<text>"}


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_logprob_rows_in_streams(serve, http, incremental):
    """Streamed, every chunk carries the whole `input_*` lists; the `output_*` rows follow the output
    ids: all so far (cumulative) or only the new ones (--incremental-streaming-output), reassembling
    to the non-streamed answer; `return_text_in_logprobs` fills every triple's text, input entry 0
    included. SGLang 0.5.23: managers/tokenizer_manager.py (_INCREMENTAL_STREAMING_META_INFO_KEYS,
    _slice_streaming_output_meta_info)."""
    body = {**rows_body(max_new=5), "return_text_in_logprobs": True}
    async with serve(incremental=incremental) as server:
        whole = (await call(http, server, "/generate", body))[1]["meta_info"]
        chunks = await sse(http, server, body)
    assert all(isinstance(e[2], str) for row in whole["input_top_logprobs"][1:] for e in row)
    assert isinstance(whole["input_token_logprobs"][0][2], str)
    for c in chunks:
        meta = c["meta_info"]
        for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
            assert meta[key] == whole[key]
        assert len(meta["output_top_logprobs"]) == len(meta["output_token_ids_logprobs"]) == len(c["output_ids"])
    for key in ("output_top_logprobs", "output_token_ids_logprobs"):
        rows = sum((c["meta_info"][key] for c in chunks), []) if incremental else chunks[-1]["meta_info"][key]
        assert rows == whole[key]
