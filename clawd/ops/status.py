"""One snapshot of the stages for `clawctl status`, `/metrics` and `/debug/process` (docs/ARCHITECTURE.md §8).

`Status` reads each stage's part on demand (`home`: the shared state no one stage owns); `Rate` is the
per-minute window the chat path ticks.
"""
from __future__ import annotations

import collections
import math
import os
import sys
import time
from typing import Callable, Iterable

from aiohttp import web

from clawd.config.schema import Config
from clawd.learning.store import SampleStore
from clawd.ops.disk import DiskBudget
from clawd.pauses import Pauses
from clawd.records import RecordWriter
from clawd.served import Policy


class Rate:
    """Events over the last `window` seconds, in one-second buckets: O(window) memory, O(1) ticks."""

    def __init__(self, window: float = 60.0, clock=time.monotonic):
        self.window = window
        self.clock = clock
        self._buckets: collections.deque[list] = collections.deque()  # [second, count], oldest first

    def tick(self, n: int = 1) -> None:
        now = int(self.clock())
        if self._buckets and self._buckets[-1][0] == now:
            self._buckets[-1][1] += n
        else:
            self._buckets.append([now, n])
        self._trim(now)

    def per_minute(self) -> float:
        now = int(self.clock())
        self._trim(now)
        return sum(n for _, n in self._buckets) * 60.0 / self.window

    def _trim(self, now: int) -> None:
        while self._buckets and self._buckets[0][0] <= now - self.window:
            self._buckets.popleft()


def finite(value):
    """`value` as strict JSON can carry it: non-finite floats (a step with no loss tokens reports NaN)
    become None; Python's json would write `NaN`, which jq and JavaScript reject."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


class Status:
    """The one snapshot of the stages: `clawctl status`, `GET /metrics` and `/debug/process` all read it.

    Each stage gives its part (its `status()`, read on demand); the daemon's shared state (the policy, the
    pauses, the queue and journal, the disk, the records, the rates) is `home`. Values are raw (a step's NaN
    loss stays NaN, which Prometheus carries); JSON outputs pass the snapshot through `finite` first.
    """

    def __init__(self, home: Callable[[], dict], stages: Iterable, started: float):
        """stages: the daemon's stages in the order they were built (a list it may still be adding to)."""
        self.home, self.stages, self.started = home, stages, started

    def snapshot(self) -> dict:
        out = {"pid": os.getpid(), "uptime_s": round(time.time() - self.started, 1),
               "learner": None, "trainer": None, "adapters": None, "lineages": None,  # None: that part is off
               **self.home()}
        for stage in self.stages:
            out.update(stage.status())
        return out

    async def handle_debug_process(self, request: web.Request) -> web.Response:
        """`GET /debug/process` (server.debug_routes): the snapshot plus the daemon's process shape, for tests
        and operators. threading is already loaded by asyncio; reading it here adds no threads. `os_threads` is
        the kernel's count, which also sees threads a native library starts (a DNS resolver's, say)."""
        process = {"threads": sys.modules["threading"].active_count(), "os_threads": len(os.listdir("/proc/self/task")),
                   "torch_imported": "torch" in sys.modules, "transformers_imported": "transformers" in sys.modules}
        return web.json_response(finite({**self.snapshot(), **process}))


def _tree_size(path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # compacted while we walked
                pass
    return total


def shared(cfg: Config, policy: Policy, pauses: Pauses, store: SampleStore, disk: DiskBudget,
           records: tuple[RecordWriter, ...], requests: Rate, turns: Rate) -> dict:
    """The shared state's part of the snapshot: what no one stage owns."""
    return {"mode": cfg.scoring.mode, "judge": cfg.judge.backend, "paused": pauses.snapshot(),
            "policy": {"version": policy.version, "weight_version": policy.weight_version,
                       "published_at": policy.published_at, "weights": policy.weights_dir,
                       "adapter": policy.adapter},
            "queue": {"waiting": store.waiting, "in_flight": store.in_flight,
                      "effective": store.fresh(policy.version, cfg.learner.max_staleness),
                      "batch_size": cfg.learner.rollout_batch_size, "journal_live": store.depth,
                      "stale_dropped": store.dropped_stale, "acked": store.acked_total,
                      "collected": store.put_total},  # every sample scoring gave the store
            "rates": {"requests_per_min": requests.per_minute(), "turns_per_min": turns.per_minute()},
            "journal": {**store.journal.stats(), "size_bytes": _tree_size(store.journal.directory)},
            "disk": disk.snapshot(),
            "records": {w.kind: {"written": w.written, "failed": w.failed} for w in records}}
