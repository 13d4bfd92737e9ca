"""One snapshot of the stages for `clawctl status`, `/metrics` and `/debug/process` (docs/ARCHITECTURE.md §8).

`Status` holds references to the long-lived stages and reads them on demand; it
owns nothing but the per-minute rate windows the chat path ticks.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from aiohttp import web

from clawd.config import Config
from clawd.engine.supervisor import EngineSupervisor
from clawd.learning.learner import Learner
from clawd.ops.disk import DiskBudget
from clawd.pauses import Pauses
from clawd.records import RecordWriter
from clawd.served import Policy
from clawd.learning.store import SampleStore
from clawd.scoring.scorer import Scorer
from clawd.serving.completion import ChatService
from clawd.trainer.link import TrainerSupervisor


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


@dataclass
class Status:
    """The one snapshot of the stages: `clawctl status`, `GET /metrics` and `/debug/process` all read it.

    It holds references to the long-lived stages and reads them on demand; it owns nothing but the
    per-minute rate windows the chat path ticks. Values are raw (a step's NaN loss stays NaN, which
    Prometheus carries); JSON outputs pass the snapshot through `finite` first.
    """
    cfg: Config
    policy: Policy
    pauses: Pauses
    chat: ChatService
    store: SampleStore
    scorer: Scorer
    supervisors: Sequence[EngineSupervisor]
    trainer: TrainerSupervisor | None
    learner: Learner | None
    started: float
    requests: Rate = field(default_factory=Rate)  # chat requests admitted, ticked by the API
    turns: Rate = field(default_factory=Rate)     # finished turns, ticked by the handover to scoring
    disk: DiskBudget | None = None
    records: Sequence[RecordWriter] = ()
    versions: Any = None   # clawd.safety.versions.Versions: the version history
    watch: Any = None      # clawd.safety.watch.Watch: the behaviour monitors' verdicts (None: monitors off)
    privacy: Any = None    # clawd.privacy.policy.Privacy: PII found, turns kept out of training
    retention: Any = None  # clawd.privacy.retention.Retention: the sweeps
    handover: Any = None   # clawd.scoring.handover.TurnHandover: turns whose PII scan waits

    def snapshot(self) -> dict:
        cfg, learner, trainer, store = self.cfg, self.learner, self.trainer, self.store
        sc = self.scorer.stats
        return {
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "mode": cfg.scoring.mode,
            "judge": cfg.judge.backend,
            "paused": self.pauses.snapshot(),
            "policy": {"version": self.policy.version, "weight_version": self.policy.weight_version,
                       "published_at": self.policy.published_at, "weights": self.policy.weights_dir,
                       "adapter": self.policy.adapter},
            "queue": {"waiting": store.waiting, "in_flight": store.in_flight,
                      "effective": store.fresh(self.policy.version, cfg.learner.max_staleness),
                      "batch_size": cfg.learner.rollout_batch_size, "journal_live": store.depth,
                      "stale_dropped": store.dropped_stale, "acked": store.acked_total,
                      "collected": store.put_total},  # every sample scoring gave the store
            "sessions": {"live": len(self.chat.sessions), "bytes": self.chat.sessions.retained_bytes,
                         "max_bytes": self.chat.sessions.max_bytes,
                         "evicted_for_bytes": self.chat.sessions.evicted_for_bytes},
            "tokenizer_cache": {"bytes": self.chat.tok.cache_bytes, "max_bytes": self.chat.tok.cache_max_bytes,
                                "entries": self.chat.tok.cache_entries},
            "chat": dataclasses.asdict(self.chat.stats),
            "encoder": None if self.chat.encoder is None else dataclasses.asdict(self.chat.encoder.stats),
            "rates": {"requests_per_min": self.requests.per_minute(), "turns_per_min": self.turns.per_minute()},
            "scoring": {"turns": sc.submitted, "samples": sc.emitted, "pending": sc.pending,
                        "pending_bytes": sc.pending_bytes, "votes": dict(sc.votes),
                        "kinds": dict(sc.kinds), "excluded": dict(sc.excluded), "hints_offered": sc.hints_offered,
                        "hints_accepted": sc.hints_accepted, "reference_failed": sc.reference_failed,
                        "not_learned_while_paused": self.pauses.turns_not_learned},
            "learner": None if learner is None else {**dataclasses.asdict(learner.stats),
                                                     "control": cfg.learner.control,
                                                     "limits": learner.limits.snapshot(),
                                                     "weight_sync": learner.publisher.groups and
                                                     dataclasses.asdict(learner.publisher.groups.stats)},
            "engines": {s.name: {"state": s.state.value, "ready": s.is_ready, "pid": s.pid, "restarts": s.restarts,
                                 "hangs": s.hangs, "hang_reason": s.hang_reason, "url": s.client.url,
                                 "output_dropped": s.output_dropped,
                                 "input_limit": s.input_limit} for s in self.supervisors},
            # The policy replicas as the router sees them (clawd.engine.replicas).
            "replicas": self.chat.replicas.snapshot(self.chat.sessions.homed(len(self.chat.replicas))),
            "sessions_rehomed": self.chat.replicas.rehomed,
            "adapters": None if self.chat.adapters is None else self.chat.adapters.snapshot(),
            "trainer": None if trainer is None else {
                "alive": trainer.alive, "pid": trainer.pid, "restarts": trainer.restarts,
                "world_size": trainer.ready.world_size if trainer.ready else cfg.train.world_size,
                "step": trainer.ready.step if trainer.ready else None, "version": trainer.version,
                "checkpoint_step": (trainer.state or {}).get("checkpoint_step"),
                "owed": (trainer.state or {}).get("owed", []),
                "writing": (trainer.state or {}).get("writing")},  # a version's directory written off the critical path
            "journal": {**store.journal.stats(), "size_bytes": _tree_size(store.journal.directory)},
            "disk": None if self.disk is None else self.disk.snapshot(),
            "records": {w.kind: {"written": w.written, "failed": w.failed} for w in self.records},
            "safety": self._safety(),
            "privacy": self._privacy(),
        }

    def _privacy(self) -> dict | None:
        if self.privacy is None:
            return None
        ps, rs = self.privacy.stats, None if self.retention is None else self.retention.stats
        return {"pii": {"categories": list(self.cfg.privacy.pii_categories), "turns_scanned": ps.scanned,
                        "turns_with_pii": ps.with_pii, "found": dict(ps.found),
                        "redacted_records": ps.redacted_records, "phones_unread": ps.phones_unread,
                        "scans": None if self.handover is None else {
                            "waiting": self.handover.waiting, "deferred": self.handover.stats.deferred,
                            "failed": self.handover.stats.failed}},
                "not_trained": dict(ps.excluded), "unrecorded_turns": ps.unrecorded,
                "retention": None if rs is None else {"days": self.cfg.records.retention_days, "sweeps": rs.sweeps,
                                                      "last": rs.last, "removed": dict(rs.removed),
                                                      "failures": rs.failures}}

    def _safety(self) -> dict:
        """The gate, the monitors and the versions in short (clawctl versions and /dashboard say more)."""
        promotion = getattr(self.learner, "promotion", None)
        serving = self.versions.get(self.policy.version) if self.versions is not None else None
        monitors = (serving.monitors or {}) if serving is not None else {}
        return {"gate": None if promotion is None else promotion.snapshot(),
                "versions": {} if self.versions is None else dict(collections.Counter(v.status for v in self.versions)),
                "monitors": None if self.watch is None else {
                    "rollbacks": self.watch.rollbacks, "halts": self.watch.halts, "clean": monitors.get("clean"),
                    "alarms": [a["detail"] for a in monitors.get("alarms", [])]}}

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
