"""The engine client's deadlines (clawd.engine.client's docstring: no call waits forever), and the record they
keep for the hang detector: each wait on the engine is registered in the client's `_waits` while it waits, so
`quiet_for` knows when calls wait with no byte from any, and `abandon` can end them all at once. (`client` is
that EngineClient: not imported, as it imports this module.)

A wait of its own (`Deadline`) is asyncio's timeout around one await. A stream reads one chunk per token when
the engine paces them, so its reads share one lazily armed timer (`StreamDeadline`) instead of a timer each.
"""
from __future__ import annotations

import asyncio
from typing import Any

from clawd.engine.errors import EngineTimeout


class Call:
    """One generation call: the epochs it began in, to tell whether it was abandoned or overlapped a publish."""
    __slots__ = ("abandon_epoch", "control_epoch")

    def __init__(self, abandon_epoch: int, control_epoch: int):
        self.abandon_epoch, self.control_epoch = abandon_epoch, control_epoch


def _not_abandoned(client: Any, call: Call) -> None:
    """EngineTimeout at once for a call the client abandoned (its engine was found hung) since it began."""
    if call.abandon_epoch != client._abandon_epoch:
        raise EngineTimeout(f"engine call abandoned: {client._abandoned}")


def _waiting(client: Any, wait: Any) -> None:
    """`wait` (its `expired` and `reschedule` are what `abandon` calls) joins the client's waits on the engine."""
    if not client._waits:  # the engine owes nothing until now: the quiet starts here
        client._progress_at = asyncio.get_running_loop().time()
    client._waits.add(wait)


def _timed_out(client: Any, call: Call, what: str, ours: bool) -> EngineTimeout:
    """A wait's expiry: the call abandoned, its own deadline (`ours`: the engine sent `what`), or aiohttp's total."""
    if call.abandon_epoch != client._abandon_epoch:
        return EngineTimeout(f"engine call abandoned: {client._abandoned}")
    return EngineTimeout(f"engine sent {what}" if ours else
                         f"engine call ran past request_timeout ({client._request_timeout:g}s)")


class Deadline:
    """`EngineClient._deadline`: asyncio's timeout around one wait on the engine (a call's first byte, a whole
    answer), registered among the client's waits, its expiry an EngineTimeout saying `what`."""
    __slots__ = ("client", "call", "when", "what", "timeout")

    def __init__(self, client: Any, call: Call, when: float, what: str):
        self.client, self.call, self.when, self.what = client, call, when, what

    async def __aenter__(self) -> None:
        _not_abandoned(self.client, self.call)
        self.timeout = asyncio.timeout_at(self.when)
        await self.timeout.__aenter__()
        _waiting(self.client, self.timeout)

    async def __aexit__(self, kind, exc, tb) -> None:
        self.client._waits.discard(self.timeout)
        try:
            await self.timeout.__aexit__(kind, exc, tb)  # our expiry: the task's cancellation as TimeoutError
        except TimeoutError:
            raise _timed_out(self.client, self.call, self.what, self.timeout.expired()) from None
        if kind is not None and issubclass(kind, TimeoutError):  # aiohttp's total (request_timeout)
            raise _timed_out(self.client, self.call, self.what, self.timeout.expired()) from None


class StreamDeadline:
    """The deadlines of one stream's reads (the first byte's, then each later byte's idle one) on one timer. A read
    notes when its wait must end and registers itself among the client's waits; the timer, armed once, fires when
    the earliest wait could run out and, finding a read then under way past its end, cancels its task (as asyncio's
    timeout does: the cancellation comes back as EngineTimeout); else it is armed again for that read's end, or
    left off until the next read. A paced stream's chunk then costs no timer of its own. Only the waits are timed,
    never the consumer between chunks. `expired` and `reschedule` are what `abandon` calls on a wait."""
    __slots__ = ("client", "call", "loop", "task", "when", "what", "handle", "reading", "fired", "cancelling")

    def __init__(self, client: Any, call: Call):
        self.client, self.call = client, call
        self.loop = asyncio.get_running_loop()
        self.task: asyncio.Task | None = None
        self.when, self.what = 0.0, ""
        self.handle: asyncio.TimerHandle | None = None
        self.reading = self.fired = False
        self.cancelling = 0

    async def read(self, content, when: float, what: str) -> bytes:
        """`content.readany()`, ended by loop time `when` (EngineTimeout saying `what`), or at once when the call
        is abandoned."""
        _not_abandoned(self.client, self.call)
        self.when, self.what = when, what
        if self.handle is None or when < self.handle.when():
            self._arm(when)
        _waiting(self.client, self)
        self.task = asyncio.current_task()
        self.cancelling = self.task.cancelling()
        self.reading = True
        try:
            return await content.readany()
        except asyncio.CancelledError:
            if self.fired and self.task.uncancel() <= self.cancelling:
                raise _timed_out(self.client, self.call, self.what, ours=True) from None
            raise
        except TimeoutError:  # aiohttp's total (request_timeout)
            raise _timed_out(self.client, self.call, self.what, ours=False) from None
        finally:
            self.reading = False
            self.client._waits.discard(self)

    def expired(self) -> bool:
        return self.fired

    def reschedule(self, when: float) -> None:
        """The wait under way ends at `when` (abandon: now)."""
        self.when = when
        self._arm(when)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _arm(self, when: float) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.handle = self.loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self.handle = None
        if not self.reading:  # between reads: the next one arms the timer again
            return
        if self.loop.time() < self.when:  # a later read than the one it was armed for: not yet
            self.handle = self.loop.call_at(self.when, self._fire)
            return
        self.fired = True
        self.task.cancel()
