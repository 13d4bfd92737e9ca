"""The HTTP face of clawd: OpenAI-compatible routes on aiohttp.

Handlers stay thin: authenticate, enforce the concurrency limit, parse, and
hand over to `ChatService`. One middleware turns every error, aiohttp's own
(404, 405, 413) included, into OpenAI's error shape, so a client never sees a
body it cannot parse.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import sys
import time
from typing import Awaitable, Callable, Sequence

from aiohttp import web

from clawd.serving.completion import ChatService
from clawd.serving.request import Limits, parse_chat_request
from clawd.config import Config
from clawd.engine.supervisor import EngineSupervisor
from clawd.serving.errors import ApiError
from clawd.learning.learner import Learner
from clawd.ops.metrics import Metrics
from clawd.ops.pause import PauseState
from clawd.learning.store import SampleStore
from clawd.scoring.scorer import Scorer
from clawd.ops.status import Status, finite

log = logging.getLogger("clawd.api")

CONFIG = web.AppKey("config", Config)
CHAT = web.AppKey("chat", ChatService)
STARTED = web.AppKey("started", float)
SERVING = web.AppKey("serving", dict)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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


class Authenticator:
    """Bearer keys, compared in constant time against every configured key."""

    def __init__(self, cfg: Config):
        self.set_keys(cfg.auth.keys)

    def set_keys(self, keys) -> None:
        """At start and on SIGHUP: the next request is checked against these."""
        self.keys = [(k.name, k.key.encode()) for k in keys]

    @property
    def open(self) -> bool:
        return not self.keys

    def principal(self, request: web.Request) -> str | None:
        """The key's name; None when keys are off (the caller picks a principal)."""
        if self.open:
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "Missing bearer token: send 'Authorization: Bearer <key>'", code="missing_api_key")
        given = token.strip().encode("utf-8", "surrogateescape")  # header bytes as sent
        found = None
        for name, key in self.keys:  # no early exit: timing does not reveal which key matched
            if hmac.compare_digest(given, key):
                found = name
        if found is None:
            raise ApiError(401, "Invalid API key", code="invalid_api_key")
        return found


def make_app(cfg: Config, chat: ChatService, *, scorer: Scorer | None = None, store: SampleStore | None = None,
             supervisors: Sequence[EngineSupervisor] = (), learner: Learner | None = None,
             pause: PauseState | None = None, status: Status | None = None, auth: Authenticator | None = None,
             metrics: Metrics | None = None) -> web.Application:
    # Metrics outermost: it counts the final status, the error middleware's answers and 404s included.
    middlewares = [openai_errors] if metrics is None else [metrics.middleware, openai_errors]
    app = web.Application(middlewares=middlewares, client_max_size=cfg.server.max_body_bytes)
    app[CONFIG] = cfg
    app[CHAT] = chat
    app[STARTED] = time.time()
    app[SERVING] = {"in_flight": 0, "accepting": True}
    auth = auth or Authenticator(cfg)
    if auth.open:
        log.warning("no API keys configured: the chat API is open to anyone who can reach %s:%d",
                    cfg.server.host, cfg.server.port)
    limits = Limits(max_messages=cfg.server.max_messages, max_message_chars=cfg.server.max_message_chars)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        key_name = auth.principal(request)
        state = app[SERVING]
        if not state["accepting"]:
            raise ApiError(503, "clawd is shutting down", code="shutting_down", retry_after=5)
        if pause is not None and pause.serving:
            raise ApiError(503, "clawd is paused by its operator (clawctl resume)", code="paused", retry_after=30)
        if status is not None:
            status.requests.tick()
        if state["in_flight"] >= cfg.server.max_concurrent_requests:
            raise ApiError(429, f"More than {cfg.server.max_concurrent_requests} requests in flight; retry shortly",
                           code="too_many_requests", retry_after=1)
        state["in_flight"] += 1
        try:
            try:
                body = await request.read()
            except web.RequestPayloadError:  # a body its Content-Encoding does not decode
                raise ApiError(400, "The request body could not be decoded; check its Content-Encoding",
                               code="invalid_body") from None
            req = parse_chat_request(body, request.headers, limits)
            principal = key_name if key_name is not None else (req.user or "anonymous")
            return await chat.complete(req, principal, request)
        finally:
            state["in_flight"] -= 1

    async def models(request: web.Request) -> web.Response:
        auth.principal(request)
        card = {"id": chat.model_name, "object": "model", "created": int(app[STARTED]), "owned_by": "clawd",
                "root": chat.model_name, "parent": None, "max_model_len": chat.context_length}
        return web.json_response({"object": "list", "data": [card]}, dumps=json.dumps)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(request: web.Request) -> web.Response:
        # Chat needs the policy engine only; a reference engine that is down costs samples, not replies.
        engine = chat.supervisor.state.value
        ok = chat.supervisor.is_ready and app[SERVING]["accepting"]
        body = {"ready": ok, "engine": engine, "policy_version": chat.policy.version,
                "engines": {s.role: s.state.value for s in supervisors}}
        headers = None if ok else {"Retry-After": "2"}
        return web.json_response(body, status=200 if ok else 503, headers=headers)

    async def metrics_page(request: web.Request) -> web.Response:
        return metrics.render()

    async def debug_process(request: web.Request) -> web.Response:
        # For tests and operators: the daemon's process shape (DESIGN §1).
        # threading is already loaded by asyncio; reading it here adds no threads.
        threads = sys.modules["threading"].active_count()
        return web.json_response(finite({"pid": os.getpid(), "threads": threads,
                                  "torch_imported": "torch" in sys.modules, "engine_url": chat.engine.url, "engine_pid": chat.supervisor.pid,
                                  "engine_restarts": chat.supervisor.restarts,
                                  "transformers_imported": "transformers" in sys.modules,
                                  "stats": chat.stats.__dict__, "sessions": len(chat.sessions),
                                  "engines": {s.role: {"state": s.state.value, "url": s.client.url, "pid": s.pid,
                                                       "restarts": s.restarts} for s in supervisors},
                                  "scoring": scorer.stats.__dict__ if scorer else None,
                                  "samples": {"waiting": store.waiting, "depth": store.depth} if store else None,
                                  "learner": ({**learner.stats.__dict__, "paused": learner.paused,
                                               "pause_reason": learner.pause_reason,
                                               "policy_version": chat.policy.version} if learner else None),
                                  "trainer": ({"pid": learner.trainer.pid, "alive": learner.trainer.alive,
                                               "restarts": learner.trainer.restarts} if learner else None)}))

    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    if metrics is not None:
        # No auth, like /health: operators scrape it from localhost (server.host is 127.0.0.1 by default).
        app.router.add_get("/metrics", metrics_page)
    if cfg.server.debug_routes:
        app.router.add_get("/debug/process", debug_process)
    return app

