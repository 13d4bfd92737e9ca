"""The local engine's compute thread, and the progress its steps make.

The scheduler's event loop owns every request's state; each model step (a prefill, a decode step) runs
on the one compute thread while the loop awaits it, so the HTTP side answers liveness, aborts and
arrivals during the step (torch releases the GIL in its kernels). A long prefill on a loaded machine is
then busy, not hung. What hung means is no progress: `Progress` counts the decoder layers the model
runs, so a step that advances can be told from one that is stuck, as SGLang's /health_generate tells a
scheduler that puts out tokens from one that puts out nothing.
"""
from __future__ import annotations

import asyncio
import os
import queue
import threading

import torch

HEALTH_TIMEOUT_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"  # SGLang's name and default: how long /health_generate waits
HEALTH_TIMEOUT = 20.0
HEALTH_POLL = 0.05  # how often a health check looks at the count the compute thread moves


class Compute:
    """One daemon thread that runs the model's steps in order, one at a time.

    A daemon thread, so a step stuck for good (the hang this engine's supervisor must find) does not keep
    the process from exiting; concurrent.futures' pools are joined at exit."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._work, name="engine-compute", daemon=True).start()

    async def run(self, fn, *args):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._jobs.put((loop, fut, fn, args))
        return await fut

    def _work(self) -> None:
        while True:
            loop, fut, fn, args = self._jobs.get()
            try:
                outcome = (fn(*args), None)
            except BaseException as exc:  # handed to the awaiting task, which re-raises it
                outcome = (None, exc)
            try:
                loop.call_soon_threadsafe(_settle, fut, *outcome)
            except RuntimeError:  # the loop closed: the engine is exiting, nobody awaits the step
                return


def _settle(fut: asyncio.Future, result, exc: BaseException | None) -> None:
    if fut.done():  # its task was cancelled (shutdown)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class Progress:
    """Decoder layers run so far (moved on the compute thread, read on the loop: an int under the GIL)."""

    def __init__(self):
        self.count = 0

    def watch(self, model) -> None:
        """Count each decoder layer that finishes (each whole step, for a model whose layers are not at
        model.model.layers), so a long prefill reads as advancing, not stuck. Again for each new model."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        for module in layers if isinstance(layers, torch.nn.ModuleList) else [model]:
            module.register_forward_hook(self._advance)

    def _advance(self, *_) -> None:
        self.count += 1

    async def moving(self) -> bool:
        """Whether the count moves within SGLANG_HEALTH_CHECK_TIMEOUT (default 20 s)."""
        timeout = float(os.environ.get(HEALTH_TIMEOUT_ENV) or HEALTH_TIMEOUT)
        start, loop = self.count, asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:  # a poll: the count moves on the compute thread, up to 30 times a step
            await asyncio.sleep(HEALTH_POLL)
            if self.count != start:
                return True
        return False
