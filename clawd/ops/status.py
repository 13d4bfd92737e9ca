"""What `clawctl status` shows: one JSON-able snapshot read from the stages (DESIGN §8).

`Status` holds references to the long-lived stages and reads them on demand; it
owns nothing but the per-minute rate windows the chat path ticks.
"""
from __future__ import annotations

import collections
import math
import os
import time
from dataclasses import dataclass
from typing import Sequence

from clawd.config import Config
from clawd.engine.supervisor import EngineSupervisor
from clawd.learning.journal import Journal
from clawd.learning.learner import Learner
from clawd.ops.pause import PauseState
from clawd.served import Policy
from clawd.learning.store import SampleStore
from clawd.scoring.scorer import Scorer
from clawd.serving.sessions import SessionTable
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
    cfg: Config
    policy: Policy
    pause: PauseState
    sessions: SessionTable
    store: SampleStore
    journal: Journal
    scorer: Scorer
    supervisors: Sequence[EngineSupervisor]
    trainer: TrainerSupervisor | None
    learner: Learner | None
    started: float

    def __post_init__(self):
        self.requests = Rate()
        self.turns = Rate()

    def snapshot(self) -> dict:
        cfg, learner, trainer = self.cfg, self.learner, self.trainer
        paused = self.pause.current
        learning_reason = learner.pause_reason if learner is not None and learner.paused else None
        sc = self.scorer.stats
        return finite({
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "mode": cfg.scoring.mode,
            "judge": cfg.judge.backend,
            "paused": {"learning": paused.learning or learning_reason is not None, "serving": paused.serving,
                       "since": paused.since, "reason": paused.reason or learning_reason},
            "policy": {"version": self.policy.version, "weight_version": self.policy.weight_version,
                       "published_at": self.policy.published_at, "weights": self.policy.weights_dir},
            "queue": {"waiting": self.store.waiting, "in_flight": self.store.in_flight,
                      "effective": self.store.fresh(self.policy.version, cfg.learner.max_staleness),
                      "batch_size": cfg.learner.rollout_batch_size, "journal_live": self.store.depth},
            "sessions": {"live": len(self.sessions)},
            "rates": {"requests_per_min": self.requests.per_minute(), "turns_per_min": self.turns.per_minute()},
            "scoring": {"turns": sc.submitted, "samples": sc.emitted, "pending": sc.pending, "votes": dict(sc.votes),
                        "excluded": dict(sc.excluded), "hints_offered": sc.hints_offered,
                        "hints_accepted": sc.hints_accepted, "not_learned_while_paused": self.pause.turns_not_learned},
            "learner": None if learner is None else {
                "steps": learner.stats.steps, "skipped_steps": learner.stats.skipped_steps,
                "failed_steps": learner.stats.failed_steps, "publishes": learner.stats.publishes,
                "failed_publishes": learner.stats.failed_publishes, "stale_dropped": learner.stats.stale_dropped,
                "samples_trained": learner.stats.samples_trained,
                "last_publish_seconds": learner.stats.last_publish_seconds,
                "last_intake_held_seconds": learner.stats.last_intake_held_seconds,
                "waiting_since": learner.stats.waiting_since, "last_metrics": learner.stats.last_metrics},
            "engines": {s.role: {"state": s.state.value, "pid": s.pid, "restarts": s.restarts, "url": s.client.url}
                        for s in self.supervisors},
            "trainer": None if trainer is None else {
                "alive": trainer.alive, "pid": trainer.pid, "restarts": trainer.restarts,
                "step": trainer.ready.step if trainer.ready else None, "version": trainer.version},
            "journal": {**self.journal.stats(), "size_bytes": _tree_size(self.journal.directory)},
        })


def _tree_size(path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # compacted while we walked
                pass
    return total
