"""One chat completion, from a validated request to an OpenAI response and a captured turn.
(One file, over 500 lines: the request path and `_Output`, the reply it builds, change together.)

The path (docs/ARCHITECTURE.md §2): render the prompt ids with the chat template → resolve
the session → engine `/generate` token-in with explicit sampling params and
log-probs → decode and parse the output ids ourselves → answer (streamed token
by token, or whole) → hand the finished turn to the session table. The ids
and log-probs kept for training are exactly the engine's.

With several policy replicas the router (clawd.engine.replicas) picks one per request: the session's
home, else the least loaded. A call that fails before any byte reached the client, on a broken replica,
is tried once on another (`Attempt.run`). A reply names the weight version of the replica that produced
it (`system_fingerprint`, the turn's versions).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from clawd.turns import LOGPROB_MISMATCH, NO_TRAIN, SAMPLING_PARAMS, FinishedTurn, Turn
from clawd.encoding import Encoder, encode_prompt
from clawd.serving.request import ChatRequest
from clawd.config import Config
from clawd.serving.connections import note_hangup
from clawd.serving.detokenize import IncrementalDetokenizer
from clawd.engine.client import NEUTRAL_SAMPLING, Chunk, EngineError, EngineUnavailable, top_ids
from clawd.engine.lora import AdapterUse
from clawd.engine.replicas import Attempt, Replicas
from clawd.serving.errors import ApiError, bad_request
from clawd.serving.parsers import Content, Reasoning, ToolCall, make_parser
from clawd.served import Policy
from clawd.serving.sessions import SessionTable
from clawd.tokenizer import ChatTokenizer, TemplateError

log = logging.getLogger("clawd.chat")


@dataclass
class ChatStats:
    requests: int = 0
    main_turns: int = 0
    side_turns: int = 0
    excluded: dict[str, int] = field(default_factory=dict)
    aborted: int = 0
    engine_errors: int = 0
    retries: int = 0            # calls tried again on another replica after failing before any byte was sent
    prompt_tokens: int = 0      # of answered requests, main and side
    completion_tokens: int = 0


class _SessionLocks:
    """Requests of one explicit session are handled in arrival order."""

    def __init__(self):
        self._locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}

    async def acquire(self, key: tuple[str, str]) -> None:
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            await lock.acquire()
        except asyncio.CancelledError:  # the client left while queued: give up its place
            self._leave(key)
            raise

    def release(self, key: tuple[str, str]) -> None:
        self._locks[key][0].release()
        self._leave(key)

    def _leave(self, key: tuple[str, str]) -> None:
        lock, users = self._locks[key]
        if users == 1:
            del self._locks[key]
        else:
            self._locks[key] = (lock, users - 1)


class ChatService:
    def __init__(self, cfg: Config, tokenizer: ChatTokenizer, replicas: Replicas, sessions: SessionTable,
                 on_finished: Callable[[FinishedTurn], None], policy: Policy,
                 spawn: Callable[[Any], Any], adapters: AdapterUse | None = None, encoder: Encoder | None = None):
        """encoder: the worker long prompts are encoded in (None: in the daemon, yielding between pieces)."""
        self.cfg = cfg
        # Top-K distillation asks the engine for each reply token's top-k ids (0: not asked).
        self.top_k = cfg.train.opd_top_k if cfg.scoring.mode != "rl" else 0
        self.adapters = adapters  # LoRA mode: the policy's adapter, named in each request and counted while used
        self.tok = tokenizer
        self.encoder = encoder
        self.replicas = replicas
        self.sessions = sessions
        self.on_finished = on_finished
        self.policy = policy
        self.spawn = spawn  # starts a task owned by the daemon (aborts outlive their request)
        self.stats = ChatStats()
        self.context_length = cfg.model.context_length or tokenizer.info.context_length
        # A prompt has at most context - 1 tokens; longer text than they can stand for is refused unencoded.
        per_token = tokenizer.max_chars_per_token
        self.max_prompt_chars = (self.context_length - 1) * per_token if per_token else None
        self.model_name = cfg.server.served_model_name or cfg.model_path.name
        self._locks = _SessionLocks()
        # Streamed replies: called with the seconds from `complete` to the first token written (metrics).
        self.on_first_token: Callable[[float], None] | None = None

    # ---- request → engine payload -------------------------------------------------

    async def _prompt_ids(self, req: ChatRequest) -> tuple[list[int], dict]:
        """The prompt's ids and its pieces new to the tokenizer's cache, kept only once the request passes
        the context checks; text that cannot fit the context is refused before it is encoded."""
        try:
            text = self.tok.render(req.render_messages, req.tools, **req.chat_template_kwargs)
        except TemplateError as exc:
            raise bad_request(str(exc), "messages", "invalid_messages") from None
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise ApiError(400, f"The prompt is {len(text)} characters, more than the model's context of "
                           f"{self.context_length} tokens can hold (a token stands for at most "
                           f"{self.tok.max_chars_per_token} characters)", param="messages",
                           code="context_length_exceeded")
        return await encode_prompt(self.tok, text, self.encoder)

    def _sampling(self, req: ChatRequest, prompt_len: int, main: bool) -> tuple[dict, float, str | None]:
        s, cfg = req.sampling, self.cfg.sampling
        room = self.context_length - prompt_len
        if room < 1:
            raise ApiError(400, f"The prompt is {prompt_len} tokens, which leaves no room in the model's "
                           f"context of {self.context_length} tokens", param="messages",
                           code="context_length_exceeded")
        limit = self.replicas.input_limit  # the engine's own, a few tokens under the context (SGLang)
        if limit is not None and prompt_len >= limit:
            raise ApiError(400, f"The prompt is {prompt_len} tokens; the model engine accepts prompts of fewer "
                           f"than {limit}", param="messages", code="context_length_exceeded")
        if s.max_tokens is not None and s.max_tokens > room:
            raise ApiError(400, f"max_tokens is {s.max_tokens}, but the prompt ({prompt_len} tokens) leaves "
                           f"{room} of the model's {self.context_length}", param="max_tokens",
                           code="context_length_exceeded")
        max_new = s.max_tokens or min(self.cfg.model.max_tokens_cap, room)
        params: dict[str, Any] = {"max_new_tokens": max_new, "stop_token_ids": list(self.tok.info.eos_ids),
                                  "no_stop_trim": True, "skip_special_tokens": False}
        if s.stop:
            params["stop"] = list(s.stop)
        excluded = None
        if main and cfg.override_sampling:
            temperature = cfg.train_temperature
            params.update(temperature=temperature, top_p=1.0, top_k=-1)
        else:
            temperature = cfg.default_temperature if s.temperature is None else s.temperature
            params.update(temperature=temperature, top_p=1.0 if s.top_p is None else s.top_p,
                          top_k=s.top_k or -1)
            for key in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
                if getattr(s, key) is not None:
                    params[key] = getattr(s, key)
            if s.logit_bias:
                params["logit_bias"] = dict(s.logit_bias)
            if s.seed is not None:
                params["sampling_seed"] = s.seed
            if not s.full_distribution() or not cfg.min_train_temperature <= temperature <= 2.0:
                excluded = SAMPLING_PARAMS
        if main and excluded is None:
            # A trainable turn names every field that shapes the distribution, at its neutral value: an
            # engine's --preferred-sampling-params fill only the fields a request leaves out.
            params = {**NEUTRAL_SAMPLING, **params}
        return params, temperature, excluded

    # ---- the request ----------------------------------------------------------------

    async def complete(self, req: ChatRequest, principal: str, request: web.Request,
                       release: Callable[[], None] = lambda: None) -> web.StreamResponse:
        """`release` gives back the request's slot (idempotent) once the engine's part is over."""
        self.stats.requests += 1
        started = time.monotonic()
        prompt_ids, new_pieces = await self._prompt_ids(req)
        turn_type = req.turn_type or self.cfg.sessions.default_turn_type
        main = turn_type == "main"
        params, temperature, excluded = self._sampling(req, len(prompt_ids), main)
        self.tok.keep(new_pieces)  # within the context: worth caching
        if req.no_train:
            excluded = NO_TRAIN
        if not self.replicas.any_usable:
            raise ApiError(503, "The model engine is not ready; retry shortly", code="engine_unavailable",
                           retry_after=2)
        rid = uuid.uuid4().hex
        payload = {"input_ids": prompt_ids, "rid": rid, "sampling_params": params, "return_logprob": True}
        if main and self.top_k:  # each token's top-k ids, for top-K distillation
            payload["top_logprobs_num"] = self.top_k
        # LoRA: the adapter is fixed here, so the reply's version is known whichever replica serves it.
        served_as = self.policy.weight_version
        adapter = self.adapters.begin() if self.adapters is not None else None
        if adapter is not None:
            payload["lora_path"] = adapter
        try:
            if not main:
                self.stats.side_turns += 1
                return await self._serve(req, request, payload, rid, prompt_ids, None, started, release,
                                         served_as if adapter else None)
            return await self._main_turn(req, request, payload, rid, prompt_ids, principal, temperature, excluded,
                                         started, release, served_as if adapter else None)
        finally:
            if self.adapters is not None:
                self.adapters.end(adapter)

    async def _main_turn(self, req: ChatRequest, request: web.Request, payload: dict, rid: str,
                         prompt_ids: list[int], principal: str, temperature: float, excluded: str | None,
                         started: float, release: Callable[[], None], served_as: str | None) -> web.StreamResponse:
        lock_key = (principal, req.session_id) if req.session_id is not None else None
        if lock_key:
            await self._locks.acquire(lock_key)
        try:
            admission = self.sessions.begin(principal, req.session_id, req.render_messages, time.time())
            self._finish(admission.finished)
            capture = _Capture(admission=admission, principal=principal, temperature=temperature,
                               excluded=excluded, version=self.policy.version, req=req)
            return await self._serve(req, request, payload, rid, prompt_ids, capture, started, release, served_as)
        finally:
            if lock_key:
                self._locks.release(lock_key)

    async def _serve(self, req: ChatRequest, request: web.Request, payload: dict, rid: str,
                     prompt_ids: list[int], capture: "_Capture | None", started: float,
                     release: Callable[[], None], served_as: str | None = None) -> web.StreamResponse:
        out = _Output(self, req, rid)
        out.served_as = served_as
        route = Attempt(self.replicas, sessions=self.sessions.homed(len(self.replicas)))
        if capture:
            route.home = self.sessions.replica_of(capture.admission)
            route.rehome = lambda i: self.sessions.set_replica(capture.admission, i)
        out.replicas, out.route = self.replicas, route
        try:
            if req.stream:
                resp = await self._stream(req, request, payload, out, started, release, route)
            else:  # a whole reply is written by aiohttp after the handler returns: after the slot is released
                resp = await self._whole(payload, out, route)
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away (aiohttp cancels the handler, or a write finds the
            # socket closed): stop the engine's work too. Counted (clawd_aborted_requests_total) and
            # logged quietly: a client that leaves is routine, a line per hang-up would let one fill the log.
            self.stats.aborted += 1
            note_hangup(f"rid={rid} stream={req.stream}")
            if route.replica is not None:
                self.spawn(self._abort(rid, route.replica))
            if capture:
                self.sessions.cancel(capture.admission, time.time())
            raise
        except BaseException:
            if capture:
                self.sessions.cancel(capture.admission, time.time())
            raise
        finally:
            route.end()
        self.stats.prompt_tokens += len(prompt_ids)
        self.stats.completion_tokens += len(out.ids)
        if capture and out.failed:  # the client got an error event: no turn to learn from
            self.sessions.cancel(capture.admission, time.time())
        elif capture:
            self._capture(capture, rid, prompt_ids, out)
        # One structured line per completion: enough to follow a turn from client to records.
        log.info("chat id=%s rid=%s session=%s turn=%s version=%d replica=%s home=%s served=%s type=%s stream=%s "
                 "prompt=%d completion=%d finish=%s", out.completion_id, rid,
                 capture.admission.session_id if capture else "-", capture.admission.turn_index if capture else "-",
                 self.policy.version, route.replica, "-" if route.home is None else route.home, out.weight_version, "main" if capture else "side", req.stream, len(prompt_ids), len(out.ids),
                 out.finish_reason)
        return resp

    async def _abort(self, rid: str, replica: int) -> None:
        try:
            await self.replicas.client(replica).abort(rid)
        except EngineError as exc:
            log.warning("could not abort rid %s: %s", rid, exc)

    async def _whole(self, payload: dict, out: "_Output", route: Attempt) -> web.Response:
        result = await self._on_replica(route, lambda engine: engine.generate(payload))
        meta = result.get("meta_info") or {}
        lps = meta.get("output_token_logprobs") or []
        out.add(Chunk(ids=list(result.get("output_ids") or []), logprobs=[e[0] for e in lps],
                      logprob_ids=[e[1] for e in lps], finish=meta.get("finish_reason"), meta=meta,
                      top_ids=top_ids(meta.get("output_top_logprobs"))))
        if out.engine_finish == "abort":  # the engine dropped it (paused, overloaded): not an answer
            self.stats.engine_errors += 1
            raise ApiError(503, "The model engine aborted the request; retry it", code="engine_aborted",
                           retry_after=1)
        out.close()
        return web.json_response(out.completion(), dumps=json.dumps)

    async def _on_replica(self, route: Attempt, call):
        """`call(engine client)` on the request's replica, tried once more elsewhere where that is safe."""
        try:
            return await route.run(call)
        except EngineError as exc:
            raise self._engine_failed(exc) from None
        finally:
            self.stats.retries += int(route.attempts > 1)

    def _engine_failed(self, exc: EngineError) -> ApiError:
        """The engine failure as the client's error (OpenAI's shape; 503s with Retry-After)."""
        self.stats.engine_errors += 1
        if isinstance(exc, EngineUnavailable):
            return ApiError(503, f"The model engine is unavailable: {exc}", code="engine_unavailable",
                            retry_after=exc.retry_after or 2)
        if exc.status == 400:
            return ApiError(400, f"The model engine rejected the request: {exc}", code="engine_rejected")
        if exc.status == 503:
            return ApiError(503, f"The model engine is busy: {exc}", code="engine_unavailable",
                            retry_after=exc.retry_after or 2)
        return ApiError(502, f"The model engine failed: {exc}", code="engine_error", retry_after=exc.retry_after or 1)

    async def _first_chunk(self, engine, payload: dict, box: list):
        """Opens a stream on `engine` and reads its first chunk; the stream goes into `box` either way, so
        the caller can close it."""
        chunks = engine.stream(payload)
        box[:] = [chunks]
        try:
            return await anext(chunks, None)
        except BaseException:
            await chunks.aclose()
            raise

    async def _stream(self, req: ChatRequest, request: web.Request, payload: dict, out: "_Output",
                      started: float, release: Callable[[], None], route: Attempt) -> web.StreamResponse:
        # Wait for the engine's first chunk before sending headers, so an engine
        # failure at the start is still a proper 502/503 rather than a broken stream (or a retry elsewhere).
        box: list = []
        first = await self._on_replica(route, lambda engine: self._first_chunk(engine, payload, box))
        chunks = box[0]
        if first is not None and first.meta:
            out.meta = first.meta
        finish = (first.finish or {}) if first is not None else {}
        if finish.get("type") == "abort" and not first.ids:
            # SGLang refuses some requests inside a started stream (HTTP 200, an abort carrying a status):
            # nothing was sent yet, so the client still gets a proper status.
            await chunks.aclose()
            self.stats.engine_errors += 1
            if finish.get("status_code") == 400:
                raise ApiError(400, f"The model engine rejected the request: {finish.get('message')}",
                               code="engine_rejected")
            raise ApiError(503, "The model engine aborted the request; retry it", code="engine_aborted",
                           retry_after=1)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        # This handler reads the engine into `outbox`, (bytes, carries a token) parts then None; the writer
        # task, which it alone owns, writes them. A client that stops reading stalls only the writer: the
        # engine's stream is read to its end, the slot released, the rest written under write_timeout. The
        # outbox holds at most one reply: max_new_tokens (at most the context) events of a few hundred bytes
        # (~1 kB with log-probs), one per token, plus the role, finish, usage and [DONE] events.
        outbox: asyncio.Queue[tuple[bytes, bool] | None] = asyncio.Queue()
        outbox.put_nowait((out.sse({"role": "assistant", "content": ""}), False))
        first_token = self.on_first_token
        writer = asyncio.create_task(_deliver(
            resp, outbox, None if first_token is None else lambda: first_token(time.monotonic() - started)))
        try:
            try:
                await self._pump(req, first, chunks, out, outbox, writer)
            finally:
                await chunks.aclose()
            outbox.put_nowait(None)
            release()
            await writer  # a failed write (the client left) raises here: the abort path in _serve
        finally:
            if not writer.done():  # this request is ending another way (cancelled): the writer goes with it
                writer.cancel()
                await asyncio.wait([writer])
            if writer.done() and not writer.cancelled():
                # Read, so asyncio does not log it as never retrieved: a write that failed as the client left,
                # while this request is already ending by its own exception (which says so).
                writer.exception()
        return resp

    async def _pump(self, req: ChatRequest, first: Chunk | None, chunks, out: "_Output", outbox: asyncio.Queue,
                    writer: asyncio.Task) -> None:
        """The engine's chunks, from `first` to the end, as SSE events into `outbox`."""
        try:
            chunk = first
            while chunk is not None:
                deltas, logprobs = out.add(chunk)
                if logprobs and not deltas:
                    deltas = [{}]  # log-probs of tokens whose text is still held back
                if deltas:  # one write per engine chunk, however many events it makes
                    outbox.put_nowait((b"".join(out.sse(d, logprobs=logprobs if i == len(deltas) - 1 else None)
                                                for i, d in enumerate(deltas)), True))
                if writer.done():  # it ends early only when a write failed: the client left
                    writer.result()
                chunk = await anext(chunks, None)
            if out.engine_finish == "abort":
                raise EngineError("the engine aborted the request")
            tail = [out.sse(piece) for piece in out.close()]
        except EngineError as exc:
            self.stats.engine_errors += 1
            out.failed = True
            err = ApiError(502, f"The model engine failed mid-stream: {exc}", code="engine_error").body()
            outbox.put_nowait((b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n", False))
            return
        tail.append(out.sse({}, finish=out.finish_reason))
        if req.include_usage:
            tail.append(b"data: " + json.dumps(out.usage_chunk()).encode() + b"\n\n")
        tail.append(b"data: [DONE]\n\n")
        # Tokens the detokenizer held back to the end arrive in the tail: their first one is written there.
        outbox.put_nowait((b"".join(tail), bool(out.ids)))

    # ---- the captured turn ---------------------------------------------------------

    def _capture(self, cap: "_Capture", rid: str, prompt_ids: list[int], out: "_Output") -> None:
        now = time.time()
        excluded = cap.excluded
        if out.logprob_ids != out.ids or any(lp is None for lp in out.logprobs):
            log.error("rid %s: engine log-prob ids disagree with output ids; turn excluded", rid)
            excluded = LOGPROB_MISMATCH
        turn = Turn(
            session_id=cap.admission.session_id, turn_index=cap.admission.turn_index, principal=cap.principal,
            request_id=out.completion_id, rid=rid, prompt_ids=prompt_ids, response_ids=out.ids,
            response_logprobs=[float(lp) if lp is not None else float("nan") for lp in out.logprobs],
            response_top_ids=self._top_ids(out),
            temperature=cap.temperature, messages=cap.req.render_messages, tools=cap.req.tools,
            reply=out.reply_message(), finish_reason=out.finish_reason, policy_version=out.version(cap.version),
            weight_version=out.weight_version or self.policy.weight_version, created=now,
            excluded=excluded)
        self.stats.main_turns += 1
        if excluded:
            self.stats.excluded[excluded] = self.stats.excluded.get(excluded, 0) + 1
        self._finish(self.sessions.complete(cap.admission, turn, cap.req.session_done, now))

    def _top_ids(self, out: "_Output") -> list[list[int]] | None:
        """The reply's top-k ids at each token (top-K distillation), or None: not asked for, or not k a token
        (an engine that leaves them out: the teacher then scores the sampled tokens only)."""
        k = self.top_k
        if not k or len(out.top_ids) != len(out.ids) or any(len(row) != k for row in out.top_ids):
            return None
        return out.top_ids

    def _finish(self, finished: list[FinishedTurn]) -> None:
        for ft in finished:
            self.on_finished(ft)


async def _deliver(resp: web.StreamResponse, outbox: asyncio.Queue, on_token: Callable[[], None] | None) -> None:
    """A streamed reply's writer: each part as it comes, until None; then the end of the response."""
    while (part := await outbox.get()) is not None:
        await resp.write(part[0])
        if part[1] and on_token is not None:  # once: the client has its first token
            on_token()
            on_token = None
    await resp.write_eof()


@dataclass
class _Capture:
    admission: Any
    principal: str
    temperature: float
    excluded: str | None
    version: int
    req: ChatRequest


class _Output:
    """Accumulates engine chunks into ids, log-probs and OpenAI deltas for one response."""

    def __init__(self, svc: ChatService, req: ChatRequest, rid: str):
        self.req = req
        self.tok = svc.tok
        self.model = svc.model_name
        self.policy = svc.policy
        self.replicas = svc.replicas
        self.route: Attempt | None = None  # which replica serves it
        self.completion_id = f"chatcmpl-{rid}"
        self.created = int(time.time())
        self.detok = IncrementalDetokenizer(svc.tok.tokenizer, svc.tok.special_ids)
        self.parser = make_parser(svc.cfg.model.tool_parser, svc.cfg.model.reasoning_parser,
                                  stop=list(req.sampling.stop), tools_enabled=req.tool_choice != "none",
                                  call_id=lambda: f"call_{uuid.uuid4().hex[:24]}")
        self.ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.logprob_ids: list[int] = []
        self.top_ids: list[list[int]] = []
        self.meta: dict = {}
        self.engine_finish: str | None = None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []
        self.failed = False
        self.served_as: str | None = None  # LoRA: the version of the adapter the request carried

    @property
    def weight_version(self) -> str | None:
        """The weight version of the replica that produced the reply: its own word when it gave one (SGLang's
        meta_info.weight_version, the last token's), else what that replica last reported. In LoRA mode the
        adapter's version, which the request named (the engine's own stays the base's)."""
        if self.served_as is not None:
            return self.served_as
        served = self.meta.get("weight_version")
        if served is None and self.route is not None and self.route.replica is not None:
            served = self.replicas.version(self.route.replica)
        return None if served is None else str(served)

    def version(self, default: int) -> int:
        """The policy version number of the weights that produced the reply (staleness counts from it)."""
        try:
            return int(self.weight_version)  # type: ignore[arg-type]
        except (TypeError, ValueError):  # no number (a remote engine's base model: "default")
            return default

    @property
    def fingerprint(self) -> str:
        # OpenAI's "backend configuration" field: here, which policy version served the reply.
        return f"clawd-v{self.version(self.policy.version)}"

    def add(self, chunk: Chunk) -> tuple[list[dict], list[dict]]:
        self.ids += chunk.ids
        self.logprobs += chunk.logprobs
        self.logprob_ids += chunk.logprob_ids
        self.top_ids += chunk.top_ids
        if chunk.meta:
            self.meta = chunk.meta
        if chunk.finish is not None:
            self.engine_finish = chunk.finish.get("type")
        logprobs = self._token_logprobs(chunk.ids, chunk.logprobs) if self.req.logprobs else []
        return self._deltas(self.parser.feed(self.detok.push(chunk.ids))), logprobs

    def close(self) -> list[dict]:
        return self._deltas(self.parser.feed(self.detok.flush()) + self.parser.finish())

    def _token_logprobs(self, ids: list[int], logprobs: list[float | None]) -> list[dict]:
        out = []
        for tid, lp in zip(ids, logprobs):
            text = self.tok.tokenizer.decode([tid], skip_special_tokens=False)
            out.append({"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")), "top_logprobs": []})
        return out

    def _deltas(self, events) -> list[dict]:
        deltas = []
        for ev in events:
            if isinstance(ev, Content):
                self.content.append(ev.text)
                deltas.append({"content": ev.text})
            elif isinstance(ev, Reasoning):
                self.reasoning.append(ev.text)
                deltas.append({"reasoning_content": ev.text})
            elif isinstance(ev, ToolCall):
                self.calls.append(ev)
                deltas.append({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                               "function": {"name": ev.name, "arguments": ev.arguments}}]})
        return deltas

    @property
    def finish_reason(self) -> str:
        if self.engine_finish == "length":
            return "length"
        return "tool_calls" if self.calls else "stop"

    def reply_message(self) -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or (None if self.calls else "")}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls]
        return msg

    def usage(self) -> dict:
        prompt = int(self.meta.get("prompt_tokens") or 0)
        return {"prompt_tokens": prompt, "completion_tokens": len(self.ids), "total_tokens": prompt + len(self.ids)}

    def completion(self) -> dict:
        choice: dict[str, Any] = {"index": 0, "message": self.reply_message(), "logprobs": None,
                                  "finish_reason": self.finish_reason}
        if self.req.logprobs:
            choice["logprobs"] = {"content": self._token_logprobs(self.ids, self.logprobs)}
        return {"id": self.completion_id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint, "choices": [choice],
                "usage": self.usage()}

    def sse(self, delta: dict, *, finish: str | None = None, logprobs: list[dict] | None = None) -> bytes:
        chunk = {"id": self.completion_id, "object": "chat.completion.chunk", "created": self.created,
                 "model": self.model, "system_fingerprint": self.fingerprint,
                 "choices": [{"index": 0, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                              "finish_reason": finish}]}
        if self.req.include_usage:
            chunk["usage"] = None
        return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"

    def usage_chunk(self) -> dict:
        return {"id": self.completion_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint, "choices": [], "usage": self.usage()}
