"""clawd's CPU engine served in the test's own process, wired as `python -m clawd.engine.local` wires it."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import torch
from aiohttp import web

from clawd.engine.local.server import build_app


@contextlib.asynccontextmanager
async def running(engine) -> AsyncIterator[str]:
    """`engine` (a loaded-on-entry `clawd.engine.local.scheduler.Engine`) on 127.0.0.1:0; yields its URL.
    One torch thread, as clawd runs it (--threads): 2 threads on 2 busy cores are slower."""
    runner = web.AppRunner(build_app(engine), handler_cancellation=True, access_log=None)
    await runner.setup()
    run, threads = None, torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        engine.load()
        run = asyncio.create_task(engine.run())
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        if run is not None:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        engine.shutdown()
        await runner.cleanup()
        torch.set_num_threads(threads)


@contextlib.asynccontextmanager
async def supervised(url: str, policy, health_interval: float = 0.2, ready_timeout: float = 120.0):
    """An engine supervisor over the engine at `url` (launch "none", as for an engine clawd does not start),
    running and ready; stopped and closed on exit. Yields it."""
    from clawd.config.loading import config_from_dict
    from clawd.engine.client import EngineClient
    from clawd.engine.supervisor import EngineSupervisor

    cfg = config_from_dict({"engine": {"launch": "none", "urls": [url], "health_interval": health_interval}})
    sup = EngineSupervisor(cfg, EngineClient(url), "policy", policy, index=0)
    await sup.client.start()
    task = asyncio.create_task(sup.run())
    try:
        await asyncio.wait_for(sup.ready.wait(), ready_timeout)
        yield sup
    finally:
        await sup.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sup.client.close()
