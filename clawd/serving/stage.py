"""The serving stage: chat requests → the policy engine; each finished turn handed over to scoring (§2).

Built from the config and its edges: the engines (replicas, adapters), the policy, the pauses, the turn
handover and the encoder of the scoring stage, the API keys, and what ops adds to the web server (the metrics'
middleware and instruments, and `mount` for its own routes). Its parts: the session table, the chat service,
the aiohttp app behind a `TrackedSite`. Started by listening (and the session sweeper); drained by closing
admission, letting in-flight requests finish, then handing every open session's last turn to scoring.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import secrets
from typing import Callable

from aiohttp import web

from clawd.config.schema import Config
from clawd.encoding import Encoder
from clawd.engine.stage import Engines
from clawd.lifetime import Stage
from clawd.pauses import Pauses
from clawd.scoring.handover import TurnHandover
from clawd.served import Policy
from clawd.serving.api import CONNECTIONS, AdmissionGate, make_app
from clawd.serving.auth import Authenticator
from clawd.serving.completion import ChatService
from clawd.serving.connections import TrackedSite
from clawd.serving.feedback import FeedbackDesk
from clawd.serving.sessions import SessionTable
from clawd.tokenizer import ChatTokenizer
from clawd.turns import SHUTDOWN

log = logging.getLogger("clawd")


class Serving(Stage):
    def __init__(self, cfg: Config, *, tokenizer: ChatTokenizer, engines: Engines, policy: Policy, pauses: Pauses,
                 handover: TurnHandover, encoder: Encoder, auth: Authenticator, metrics,
                 mount: Callable[[web.Application], None], on_request: Callable[[], None], max_connections: int,
                 spawn: Callable[..., asyncio.Task], feedback: FeedbackDesk | None = None):
        """metrics: clawd.ops.metrics.Metrics (its middleware, first-token and connection instruments and access
        logger); mount: adds ops' routes (/metrics, the learning view, /debug) to the app; feedback: where users'
        ratings of replies go (None: no /v1/feedback)."""
        self.cfg, self.handover = cfg, handover
        self.sessions = SessionTable(idle_timeout=cfg.sessions.session_idle_timeout,
                                     max_turns=cfg.sessions.session_max_turns, max_sessions=cfg.sessions.max_sessions,
                                     new_id=lambda: secrets.token_hex(16), max_bytes=cfg.sessions.max_bytes)
        self.chat = ChatService(cfg, tokenizer, engines.replicas, self.sessions, handover, policy, spawn=spawn,
                                adapters=engines.adapters, encoder=encoder, on_first_token=metrics.observe_first_token,
                                ratings=feedback and feedback.ratings)
        self.admission = AdmissionGate()
        self.app = make_app(cfg, self.chat, auth=auth, admission=self.admission, engines=engines.supervisors,
                            serving_paused=lambda: pauses.serving, on_request=on_request,
                            outer_middlewares=[metrics.middleware], feedback=feedback)
        mount(self.app)
        connections = self.app[CONNECTIONS]  # deadlines for headers and bodies, the connection cap
        connections.cap = max_connections
        connections.on_close = metrics.watch_connections(lambda: connections.open)
        self.runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=cfg.server.drain_timeout,
                                    **metrics.runner_options(), **connections.runner_options())
        self.url: str | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self, tasks: asyncio.TaskGroup) -> None:
        self._sweeper = tasks.create_task(self._expire_sessions(), name="session-sweeper")
        await self.runner.setup()
        site = TrackedSite(self.runner, self.app[CONNECTIONS], self.cfg.server.host, self.cfg.server.port,
                           backlog=1024)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        log.info("listening on %s (model %s, engine %s, mode %s, judge %s)", self.url, self.cfg.model.path,
                 self.cfg.engine.launch, self.cfg.scoring.mode, self.cfg.judge.backend)

    def stopping(self) -> None:
        self.admission.close()

    async def drain(self) -> None:
        log.info("stopping: draining requests for up to %.0fs", self.cfg.server.drain_timeout)
        await self.runner.cleanup()  # stops listening, waits for in-flight handlers
        for finished in self.sessions.close_all(time.time(), SHUTDOWN):
            self.handover(finished)
        if self._sweeper is not None:
            self._sweeper.cancel()

    def cut_connections(self) -> None:
        """Requests still waiting on a client that does not read its reply: their connections cut (aiohttp ends
        their handlers as for a hang-up; cancelling its shutdown then would log an InvalidStateError)."""
        if self.runner.server is not None:
            for connection in self.runner.server.connections:
                connection.force_close()

    async def _expire_sessions(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sessions.sweep_interval)
            for finished in self.sessions.expire(time.time()):
                self.handover(finished)

    def status(self) -> dict:
        chat, sessions = self.chat, self.sessions
        return {"sessions": {"live": len(sessions), "bytes": sessions.retained_bytes, "max_bytes": sessions.max_bytes,
                             "evicted_for_bytes": sessions.evicted_for_bytes},
                "tokenizer_cache": {"bytes": chat.tok.cache_bytes, "max_bytes": chat.tok.cache_max_bytes,
                                    "entries": chat.tok.cache_entries},
                "chat": dataclasses.asdict(chat.stats),
                # The policy replicas as the router sees them (clawd.engine.replicas).
                "replicas": chat.replicas.snapshot(sessions.homed(len(chat.replicas))),
                "sessions_rehomed": chat.replicas.rehomed}
