"""One chat completion, from a validated request to an OpenAI response and a captured turn (the reply
itself is built by clawd.serving.reply).

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
import logging
import time
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from clawd.turns import LOGPROB_MISMATCH, NO_TRAIN, FinishedTurn
from clawd.encoding import Encoder, encode_prompt
from clawd.serving.request import ChatRequest
from clawd.config.schema import Config
from clawd.serving.connections import note_hangup
from clawd.engine.chunks import Chunk, top_ids
from clawd.engine.client import EngineError, EngineUnavailable
from clawd.engine.lora import AdapterUse
from clawd.engine.replicas import Attempt, Replicas
from clawd.serving.errors import ApiError, bad_request
from clawd.scoring.feedback import Ratings
from clawd.serving.capture import Capture, captured_turn
from clawd.serving.payload import engine_sampling
from clawd.serving.reply import ReplyBuilder
from clawd.serving.stream import Sender, pump
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


@dataclass
class Exchange:
    """One chat request on its way through `ChatService`: what the engine is sent, and what the steps that
    serve it need (built by `complete`; a main turn adds what its captured turn needs)."""
    req: ChatRequest
    request: web.Request
    rid: str
    prompt_ids: list[int]
    payload: dict                   # the engine's /generate body (clawd.serving.payload)
    started: float                  # monotonic, when the request arrived: the first token's latency
    release: Callable[[], None]     # gives back the request's slot once the engine's part is over
    served_as: str | None = None    # LoRA: the version whose adapter the request carries
    capture: Capture | None = None  # a main turn's


class ChatService:
    def __init__(self, cfg: Config, tokenizer: ChatTokenizer, replicas: Replicas, sessions: SessionTable,
                 on_finished: Callable[[FinishedTurn], None], policy: Policy,
                 spawn: Callable[[Any], Any], adapters: AdapterUse | None = None, encoder: Encoder | None = None,
                 on_first_token: Callable[[float], None] | None = None, ratings: Ratings | None = None):
        """encoder: the worker long prompts are encoded in (None: in the daemon, yielding between pieces);
        on_first_token: called with the seconds from `complete` to a streamed reply's first token (metrics);
        ratings: where each main turn served is registered, for its user's ratings (None: feedback is off)."""
        self.cfg = cfg
        # Top-K distillation asks the engine for each reply token's top-k ids (0: not asked).
        self.top_k = cfg.train.loss.opd_top_k if cfg.scoring.mode != "rl" else 0
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
        self.on_first_token = on_first_token
        self.ratings = ratings

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

    # ---- the request ----------------------------------------------------------------

    async def complete(self, req: ChatRequest, principal: str, request: web.Request,
                       release: Callable[[], None] = lambda: None) -> web.StreamResponse:
        """`release` gives back the request's slot (idempotent) once the engine's part is over."""
        self.stats.requests += 1
        started = time.monotonic()
        prompt_ids, new_pieces = await self._prompt_ids(req)
        turn_type = req.turn_type or self.cfg.sessions.default_turn_type
        main = turn_type == "main"
        params, temperature, excluded = engine_sampling(
            req.sampling, self.cfg.sampling, prompt_len=len(prompt_ids), context_length=self.context_length,
            input_limit=self.replicas.input_limit, max_tokens_cap=self.cfg.model.max_tokens_cap,
            eos_ids=self.tok.info.eos_ids, main=main)
        self.tok.keep(new_pieces)  # within the context: worth caching
        if req.no_train:
            excluded = NO_TRAIN
        if not self.replicas.any_usable:
            raise ApiError(503, "The model engine is not ready; retry shortly", code="engine_unavailable",
                           retry_after=2)
        rid = secrets.token_hex(16)  # 128 random bits, as a uuid4 (122) gives, at a third of its cost
        payload = {"input_ids": prompt_ids, "rid": rid, "sampling_params": params, "return_logprob": True}
        if main and self.top_k:  # each token's top-k ids, for top-K distillation
            payload["top_logprobs_num"] = self.top_k
        # LoRA: the adapter is fixed here, so the reply's version is known whichever replica serves it: the
        # principal's own adapter's when they have one (adapters per principal), else the policy's.
        served_as = self.policy.of(principal).weight_version
        adapter = self.adapters.begin(principal) if self.adapters is not None else None
        if adapter is not None:
            payload["lora_path"] = adapter
        ex = Exchange(req, request, rid, prompt_ids, payload, started, release, served_as if adapter else None)
        try:
            if not main:
                self.stats.side_turns += 1
                return await self._serve(ex)
            return await self._main_turn(ex, principal, temperature, excluded)
        finally:
            if self.adapters is not None:
                self.adapters.end(adapter)

    async def _main_turn(self, ex: Exchange, principal: str, temperature: float,
                         excluded: str | None) -> web.StreamResponse:
        req = ex.req
        lock_key = (principal, req.session_id) if req.session_id is not None else None
        if lock_key:
            await self._locks.acquire(lock_key)
        try:
            admission = self.sessions.begin(principal, req.session_id, req.render_messages, time.time())
            self._finish(admission.finished)
            ex.capture = Capture(admission=admission, principal=principal, temperature=temperature,
                                 excluded=excluded, version=self.policy.of(principal).version, req=req)
            return await self._serve(ex)
        finally:
            if lock_key:
                self._locks.release(lock_key)

    async def _serve(self, ex: Exchange) -> web.StreamResponse:
        req, capture, rid = ex.req, ex.capture, ex.rid
        route = Attempt(self.replicas, sessions=self.sessions.homed(len(self.replicas)),
                        home=None if capture is None else self.sessions.replica_of(capture.admission),
                        rehome=None if capture is None else lambda i: self.sessions.set_replica(capture.admission, i))
        out = ReplyBuilder(req, rid, tok=self.tok, model=self.model_name, policy=self.policy, replicas=self.replicas,
                           tool_parser=self.cfg.model.tool_parser, reasoning_parser=self.cfg.model.reasoning_parser,
                           route=route, served_as=ex.served_as)
        try:
            if req.stream:
                resp = await self._stream(ex, out, route)
            else:  # a whole reply is written by aiohttp after the handler returns: after the slot is released
                resp = await self._whole(ex, out, route)
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
        self.stats.prompt_tokens += len(ex.prompt_ids)
        self.stats.completion_tokens += len(out.ids)
        if capture and out.failed:  # the client got an error event: no turn to learn from
            self.sessions.cancel(capture.admission, time.time())
        elif capture:
            self._capture(capture, rid, ex.prompt_ids, out)
        # One structured line per completion: enough to follow a turn from client to records.
        log.info("chat id=%s rid=%s session=%s turn=%s version=%d replica=%s home=%s served=%s type=%s stream=%s "
                 "prompt=%d completion=%d finish=%s", out.completion_id, rid,
                 capture.admission.session_id if capture else "-", capture.admission.turn_index if capture else "-",
                 self.policy.version, route.replica, "-" if route.home is None else route.home, out.weight_version,
                 "main" if capture else "side", req.stream, len(ex.prompt_ids), len(out.ids), out.finish_reason)
        return resp

    async def _abort(self, rid: str, replica: int) -> None:
        try:
            await self.replicas.client(replica).abort(rid)
        except EngineError as exc:
            log.warning("could not abort rid %s: %s", rid, exc)

    async def _whole(self, ex: Exchange, out: ReplyBuilder, route: Attempt) -> web.Response:
        result = await self._on_replica(route, "generate", ex.payload)
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
        return web.Response(body=out.completion_body(), content_type="application/json", charset="utf-8")

    async def _on_replica(self, route: Attempt, method: str, payload: dict):
        """The engine client's `method` on the request's replica, tried once more elsewhere where that is safe;
        an engine's failure as the client's error."""
        try:
            return await route.run(method, payload)
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

    async def _stream(self, ex: Exchange, out: ReplyBuilder, route: Attempt) -> web.StreamResponse:
        # Wait for the engine's first chunk before sending headers, so an engine
        # failure at the start is still a proper 502/503 rather than a broken stream (or a retry elsewhere).
        chunks, first = await self._on_replica(route, "open_stream", ex.payload)
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
        await resp.prepare(ex.request)
        # This handler reads the engine and hands each event to the sender, which writes it at once while the
        # client keeps up, else through a writer task that it alone owns (clawd.serving.stream). A client that
        # stops reading stalls only that writer: the engine's stream is read to its end, the slot released, the
        # rest written under write_timeout. Its queue holds at most one reply: max_new_tokens (at most the
        # context) events of a few hundred bytes (~1 kB with log-probs), one per token, plus the role, finish,
        # usage and [DONE] events.
        first_token = self.on_first_token
        sender = Sender(resp, ex.request.transport,
                        None if first_token is None else lambda: first_token(time.monotonic() - ex.started))
        try:
            try:
                await sender.send(out.sse({"role": "assistant", "content": ""}), False)
                last, token = await pump(first, chunks, out, sender, include_usage=ex.req.include_usage)
                if out.failed:
                    self.stats.engine_errors += 1
            finally:
                await chunks.aclose()
            ex.release()
            await sender.end(last, token)  # a failed write (the client left) raises here: the abort path in _serve
        finally:
            writer = sender.cancel()  # this request ending another way (cancelled): the writer goes with it
            if writer is not None:
                await asyncio.wait([writer])
                if not writer.cancelled():
                    # Read, so asyncio does not log it as never retrieved: a write that failed as the client left,
                    # while this request is already ending by its own exception (which says so).
                    writer.exception()
        return resp

    # ---- the captured turn ---------------------------------------------------------

    def _capture(self, cap: Capture, rid: str, prompt_ids: list[int], out: ReplyBuilder) -> None:
        now = time.time()
        turn = captured_turn(cap, rid, prompt_ids, out, top_k=self.top_k, weight_version=self.policy.weight_version,
                             now=now)
        if turn.excluded == LOGPROB_MISMATCH:
            log.error("rid %s: engine log-prob ids disagree with output ids; turn excluded", rid)
        self.stats.main_turns += 1
        if self.ratings is not None:
            self.ratings.served(turn.request_id, principal=turn.principal, version=turn.policy_version,
                                session_id=turn.session_id, turn_index=turn.turn_index, excluded=turn.excluded)
        if turn.excluded:
            self.stats.excluded[turn.excluded] = self.stats.excluded.get(turn.excluded, 0) + 1
        self._finish(self.sessions.complete(cap.admission, turn, cap.req.session_done, now))

    def _finish(self, finished: list[FinishedTurn]) -> None:
        for ft in finished:
            self.on_finished(ft)
