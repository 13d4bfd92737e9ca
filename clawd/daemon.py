"""The daemon: one process, one event loop, no threads (DESIGN §1).

`run()` is the architecture in one place: it builds each stage, owns every
long-lived task in one TaskGroup, serves until SIGTERM/SIGINT, and shuts the
stages down in reverse order.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid

from aiohttp import web

from .api import SERVING, make_app
from .chat import ChatService, Policy
from .config import Config
from .engine.client import EngineClient
from .engine.supervisor import EngineSupervisor
from .records import RecordWriter
from .sessions import SessionTable
from .tokenizer import ChatTokenizer
from .turns import SHUTDOWN, FinishedTurn

log = logging.getLogger("clawd")


async def run(cfg: Config) -> int:
    state_dir = cfg.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)

    # Stages, upstream to downstream: model → engine → sessions → records → chat API.
    tokenizer = ChatTokenizer(cfg.model_path)
    engine = EngineClient(cfg.engine.url, api_key=cfg.engine.api_key,
                          connect_timeout=cfg.engine.connect_timeout,
                          request_timeout=cfg.engine.request_timeout,
                          incremental_stream=cfg.engine.streams_deltas)
    supervisor = EngineSupervisor(cfg, engine)
    sessions = SessionTable(idle_timeout=cfg.sessions.session_idle_timeout,
                            max_turns=cfg.sessions.session_max_turns,
                            max_sessions=cfg.sessions.max_sessions,
                            new_id=lambda: uuid.uuid4().hex)
    turn_records = RecordWriter(state_dir / "records", kind="turns",
                                retention_days=cfg.records.retention_days)

    def on_finished(finished: FinishedTurn) -> None:
        # Scoring (judge, teacher) will consume finished turns here; today they are recorded.
        turn_records.write_turn(finished)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    await engine.start()
    try:
        async with asyncio.TaskGroup() as tasks:
            chat = ChatService(cfg, tokenizer, engine, supervisor, sessions, on_finished, Policy(),
                               spawn=tasks.create_task)
            engine_task = tasks.create_task(supervisor.run(), name="engine-supervisor")
            sweeper = tasks.create_task(_expire_sessions(sessions, on_finished, cfg.sessions.sweep_interval),
                                        name="session-sweeper")
            app = make_app(cfg, chat)
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                   shutdown_timeout=cfg.server.drain_timeout)
            await runner.setup()
            site = web.TCPSite(runner, cfg.server.host, cfg.server.port, backlog=1024)
            await site.start()
            host, port = runner.addresses[0][:2]
            log.info("listening on http://%s:%d (model %s, engine %s)", host, port, cfg.model.path,
                     cfg.engine.launch)

            await stop.wait()
            log.info("stopping: draining requests for up to %.0fs", cfg.server.drain_timeout)
            app[SERVING]["accepting"] = False
            await runner.cleanup()  # stops listening, waits for in-flight handlers
            for finished in sessions.close_all(time.time(), SHUTDOWN):
                on_finished(finished)
            sweeper.cancel()
            await supervisor.stop()
            engine_task.cancel()
    finally:
        await engine.close()
        turn_records.close()
    log.info("stopped")
    return 0


async def _expire_sessions(sessions: SessionTable, on_finished, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        for finished in sessions.expire(time.time()):
            on_finished(finished)
