"""The HTTP face of clawd: OpenAI-compatible routes on aiohttp.

Handlers stay thin: authenticate, read the body (under `body_timeout`, before
taking a request slot, so a stalled upload holds a connection and never a
slot), enforce the concurrency limit (a slot is held while the engine works on
the request, not while a slow client reads its reply), parse, and hand over to
`ChatService`. One middleware turns every error, aiohttp's own (404, 405,
413) included, into OpenAI's error shape, so a client never sees a body it
cannot parse.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Awaitable, Callable, Sequence

from aiohttp import web
from aiohttp.typedefs import Handler

from clawd.serving.completion import ChatService
from clawd.serving.request import Limits, parse_chat_request
from clawd.config.schema import Config
from clawd.engine.supervisor import EngineSupervisor
from clawd.serving.auth import Authenticator
from clawd.serving.connections import Connections
from clawd.serving import origins
from clawd.serving.errors import ApiError
from clawd.serving.feedback import FeedbackDesk, parse_feedback

log = logging.getLogger("clawd.api")

Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {404: f"Unknown route {request.method} {request.path}",
                   405: f"Method {request.method} is not allowed on {request.path}",
                   413: "Request body is too large"}.get(exc.status, exc.reason)
        err = ApiError(exc.status, message, code=exc.reason.lower().replace(" ", "_"))
        resp = err.response()
        if exc.status == 405 and "Allow" in exc.headers:
            resp.headers["Allow"] = exc.headers["Allow"]
        return resp


class AdmissionGate:
    """Who may come in (the admission gate, not the promotion gate of clawd.safety): closed when the drain
    starts; counts the chat requests holding a slot."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.held: dict[str, int] = {}  # slots by API key (see `principal_share`)
        self._closed = asyncio.Event()

    @property
    def accepting(self) -> bool:
        return not self._closed.is_set()

    def close(self) -> None:
        self._closed.set()

    async def closed(self) -> None:
        await self._closed.wait()


class Slot:
    """One of the `max_concurrent_requests` slots: they bound the engine's work, so a request gives its
    slot back once the engine's part is over, while a reply a slow client reads may still be written."""

    def __init__(self, gate: AdmissionGate, key: str | None = None):
        self.gate, self.key, self.held = gate, key, True
        gate.in_flight += 1
        if key is not None:
            gate.held[key] = gate.held.get(key, 0) + 1

    def release(self) -> None:
        """Idempotent: the chat service calls it when the engine is done, the handler when it ends."""
        if self.held:
            self.held = False
            self.gate.in_flight -= 1
            if self.key is not None:
                left = self.gate.held[self.key] - 1
                if left:
                    self.gate.held[self.key] = left
                else:
                    del self.gate.held[self.key]


def over_share(gate: AdmissionGate, key: str | None, slots: int, share: float, keys: int) -> bool:
    """Whether an API key must wait: with two keys or more, the last `share` of the slots are kept for keys
    holding fewer than that many, so one busy key cannot take them all (alone it still gets the rest). Pure."""
    if key is None or keys < 2 or share >= 1:
        return False
    reserve = max(1, int(slots * share))
    return gate.held.get(key, 0) >= reserve and slots - gate.in_flight <= reserve


CONFIG = web.AppKey("config", Config)
CHAT = web.AppKey("chat", ChatService)
AUTH = web.AppKey("auth", Authenticator)
ADMISSION = web.AppKey("admission", AdmissionGate)
LIMITS = web.AppKey("limits", Limits)
ENGINES = web.AppKey("engines", tuple)          # the engine supervisors, policy first (readiness by role)
SERVING_PAUSED = web.AppKey("serving_paused", Callable[[], bool])  # the operator's `clawctl pause --serving`
ON_REQUEST = web.AppKey("on_request", Callable[[], None])          # a chat request admitted (the status rate)
STARTED = web.AppKey("started", float)
CONNECTIONS = web.AppKey("connections", Connections)  # the listener's connections (TrackedSite serves them)
FEEDBACK = web.AppKey("feedback", FeedbackDesk)        # users' ratings of replies (absent: no such route)


def make_app(cfg: Config, chat: ChatService, *, auth: Authenticator | None = None,
             admission: AdmissionGate | None = None, engines: Sequence[EngineSupervisor] = (),
             serving_paused: Callable[[], bool] = lambda: False, on_request: Callable[[], None] = lambda: None,
             outer_middlewares: Sequence[Middleware] = (), feedback: FeedbackDesk | None = None) -> web.Application:
    """The chat API. `outer_middlewares` wrap the error middleware (metrics: it counts the final status,
    the error middleware's answers and 404s included); other routes (/metrics) are the caller's to add.
    app[CONNECTIONS] tracks the connections of a `TrackedSite` serving this app; its middleware is the
    outermost, the first to see a request reach clawd."""
    connections = Connections(cfg.server)
    srv = cfg.server
    hosts, allowed = origins.allowed_hosts(srv.allowed_hosts, srv.host, srv.loopback), frozenset(srv.allowed_origins)
    app = web.Application(middlewares=[connections.middleware, *outer_middlewares, openai_errors,
                                       origins.guard(hosts, allowed)],  # before any handler: what web pages send
                          client_max_size=cfg.server.max_body_bytes)
    app.on_response_prepare.append(origins.cors_headers(allowed))
    app[CONNECTIONS] = connections
    app[CONFIG] = cfg
    app[CHAT] = chat
    app[AUTH] = auth or Authenticator(cfg)
    app[ADMISSION] = admission or AdmissionGate()
    app[LIMITS] = Limits(max_messages=cfg.server.max_messages, max_message_chars=cfg.server.max_message_chars)
    app[ENGINES] = tuple(engines)
    app[SERVING_PAUSED] = serving_paused
    app[ON_REQUEST] = on_request
    app[STARTED] = time.time()
    if app[AUTH].open:
        log.warning("no API keys configured: the chat API is open to anyone who can reach %s:%d",
                    cfg.server.host, cfg.server.port)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    if feedback is not None:
        app[FEEDBACK] = feedback
        app.router.add_post("/v1/feedback", rate_reply)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    return app


async def chat_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    cfg, gate = app[CONFIG], app[ADMISSION]
    key_name = app[AUTH].principal(request)
    if problem := origins.not_json(request.headers):  # what a web page can POST without asking first
        raise problem
    if not gate.accepting:
        raise ApiError(503, "clawd is shutting down", code="shutting_down", retry_after=5)
    if app[SERVING_PAUSED]():
        raise ApiError(503, "clawd is paused by its operator (clawctl resume)", code="paused", retry_after=30)
    # The whole body before a slot: a client that stalls mid-upload must not hold one of the slots.
    body = await _body_or_answer(request, gate, cfg.server.body_timeout)
    if isinstance(body, web.Response):
        return body
    app[ON_REQUEST]()
    if gate.in_flight >= cfg.server.max_concurrent_requests:
        raise ApiError(429, f"More than {cfg.server.max_concurrent_requests} requests in flight; retry shortly",
                       code="too_many_requests", retry_after=1)
    auth = app[AUTH]
    if over_share(gate, key_name, cfg.server.max_concurrent_requests, cfg.server.principal_request_share,
                  len(auth.keys)):
        raise ApiError(429, f"This API key holds {gate.held.get(key_name, 0)} of the "
                       f"{cfg.server.max_concurrent_requests} request slots; the rest are kept for other keys. "
                       "Retry shortly", code="key_share_exceeded", retry_after=1)
    slot = Slot(gate, key_name)
    try:
        req = parse_chat_request(body, request.headers, app[LIMITS])
        return await app[CHAT].complete(req, app[AUTH].principal_for(key_name, req.user), request,
                                        release=slot.release)
    finally:
        # A whole (non-streamed) reply is written by aiohttp after this returns: after the release, too.
        slot.release()


async def rate_reply(request: web.Request) -> web.Response:
    """A user's rating of a reply (clawd.serving.feedback). No request slot: nothing reaches an engine."""
    app = request.app
    cfg, gate = app[CONFIG], app[ADMISSION]
    key_name = app[AUTH].principal(request)
    if problem := origins.not_json(request.headers):
        raise problem
    if not gate.accepting:
        raise ApiError(503, "clawd is shutting down", code="shutting_down", retry_after=5)
    body = await _body_or_answer(request, gate, cfg.server.body_timeout)
    if isinstance(body, web.Response):
        return body
    req = parse_feedback(body, cfg.feedback.max_text_chars)
    answer = app[FEEDBACK].rate(app[AUTH].principal_for(key_name, req.user), req, time.time())
    return web.json_response(answer, dumps=json.dumps)


async def _body_or_answer(request: web.Request, gate: AdmissionGate, timeout: float) -> bytes | web.Response:
    """The whole request body, or the answer to a body that did not come whole (its connection closed once the
    answer is written: the rest of that body is not worth waiting for)."""
    try:
        return await _body(request, gate, timeout)
    except TimeoutError:
        resp = ApiError(408, f"The request body did not arrive within {timeout:g}s", code="request_timeout").response()
    except _Draining:
        resp = ApiError(503, "clawd is shutting down", code="shutting_down", retry_after=5).response()
    except web.RequestPayloadError:  # a body its Content-Encoding does not decode
        # Closed once the 400 is written (the protocol's own force_close would drop it unsent). aiohttp's
        # lingering read of the broken rest meets the decode error again: the quiet log counts it.
        resp = ApiError(400, "The request body could not be decoded; check its Content-Encoding",
                        code="invalid_body").response()
    resp.force_close()
    return resp


class _Draining(Exception):
    """The drain began while a request body was still arriving."""


async def _body(request: web.Request, gate: AdmissionGate, timeout: float) -> bytes:
    """The request body within `timeout` (else TimeoutError), or _Draining if the drain begins first: aiohttp
    stops reading every connection once its shutdown starts, so the rest of that body would never arrive and
    the client would wait out the timeout for a 408 instead of being told to come back."""
    if request.content.is_eof():  # the whole body is already here (nearly every request)
        return await request.read()
    read = asyncio.ensure_future(request.read())
    closing = asyncio.ensure_future(gate.closed())
    try:
        await asyncio.wait([read, closing], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        closing.cancel()
        if not read.done():
            read.cancel()
        elif not read.cancelled():
            read.exception()  # seen: a client that left as this handler was cancelled is no traceback in the log
    if read.done() and not read.cancelled():
        return read.result()
    if closing.done() and not closing.cancelled():
        raise _Draining
    raise TimeoutError


async def models(request: web.Request) -> web.Response:
    request.app[AUTH].principal(request)
    chat = request.app[CHAT]
    card = {"id": chat.model_name, "object": "model", "created": int(request.app[STARTED]), "owned_by": "clawd",
            "root": chat.model_name, "parent": None, "max_model_len": chat.context_length}
    return web.json_response({"object": "list", "data": [card]}, dumps=json.dumps)


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    # Chat needs the policy engine only; a reference engine that is down costs samples, not replies.
    chat = request.app[CHAT]
    # With several policy replicas, one in rotation is enough.
    replicas = chat.replicas
    serving = replicas.any_usable
    ok = serving and request.app[ADMISSION].accepting
    engine = "ready" if serving else replicas.supervisors[0].state.value
    body = {"ready": ok, "engine": engine, "policy_version": chat.policy.version,
            "engines": {s.name: s.state.value for s in request.app[ENGINES]}}
    headers = None if ok else {"Retry-After": "2"}
    return web.json_response(body, status=200 if ok else 503, headers=headers)
