"""The disk budget: learning pauses before the state directory's filesystem fills, and resumes by itself.

Learning writes the journal (every sample, every acknowledgement), a weights directory per version and a
checkpoint every few; serving writes only its records, which it can lose without harm. So a disk running
low pauses learning (reason "disk", clawd.pauses) and serving goes on:

- `poll()` (every `INTERVAL` seconds) holds the pause while free space is under `state.min_free_bytes`,
  and lifts it once free space is back above that by a margin (so it does not flap on the line);
- `failed(exc)`: a write site that met ENOSPC (records, the journal) holds the pause at once, whatever
  the last poll said, as the learner does when the trainer's write failed or would not fit; a later
  poll lifts it if the space is really there.

The trainer checks the same floor before each weights or checkpoint write, with the write's own size,
so the floor may be met while a checkpoint still does not fit: a disk pause that comes back within a
minute of its lift is lifted later each time (5 s, doubling to 5 min), so a retry does not flap.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import shutil
import time
from pathlib import Path
from typing import Callable

from clawd.pauses import DISK, Pauses

log = logging.getLogger("clawd.disk")

INTERVAL = 5.0                      # seconds between polls
MARGIN = 64 * 1024 * 1024           # free space above the floor before a disk pause lifts
RELAPSE = 60.0                      # seconds: a disk pause held again this soon after its lift is a relapse
MAX_WAIT = 300.0                    # the longest a relapsing pause waits before its next lift


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


class DiskBudget:
    def __init__(self, path: Path, min_free_bytes: int, pauses: Pauses,
                 free: Callable[[Path], int] = lambda p: shutil.disk_usage(p).free,
                 clock: Callable[[], float] = time.monotonic):
        self.path = Path(path)
        self.min_free_bytes = min_free_bytes
        self.pauses = pauses
        self._free = free
        self._clock = clock
        self.free_bytes: int | None = None   # at the last poll
        self.full_writes = 0                 # writes that failed for want of space
        self._held_since: float | None = None  # when the disk pause now held was first seen
        self._lifted_at: float | None = None
        self._wait = 0.0                      # how long the pause now held waits before a lift

    def poll(self) -> None:
        now = self._clock()
        try:
            self.free_bytes = free = self._free(self.path)
        except OSError as exc:  # the directory went away or the filesystem errs: say so, decide nothing
            log.error("cannot read the free space of %s: %s", self.path, exc)
            return
        if free < self.min_free_bytes:
            self.pauses.hold(DISK, f"{mib(free)} free on {self.path}, state.min_free_bytes is "
                                   f"{mib(self.min_free_bytes)}")
        held = DISK in self.pauses.held
        if held and self._held_since is None:  # a new disk pause, whoever held it
            relapse = self._lifted_at is not None and now - self._lifted_at < RELAPSE
            self._wait = min(max(self._wait * 2, INTERVAL), MAX_WAIT) if relapse else 0.0
            self._held_since = now
        if held and free >= self.min_free_bytes + MARGIN and now - self._held_since >= self._wait:
            log.warning("disk: %s free on %s again", mib(free), self.path)
            self.pauses.lift(DISK)
            self._lifted_at, held = now, False
        if not held:
            self._held_since = None

    def failed(self, exc: OSError) -> None:
        """A write site's OSError: a full disk (ENOSPC, or EDQUOT: a quota) pauses learning."""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self.full_writes += 1
            self.pauses.hold(DISK, f"a write failed: {exc.strerror or exc}")

    def snapshot(self) -> dict:
        return {"free_bytes": self.free_bytes, "min_free_bytes": self.min_free_bytes,
                "full_writes": self.full_writes}

    async def run(self, interval: float = INTERVAL) -> None:
        while True:
            self.poll()
            await asyncio.sleep(interval)
