"""The safety stage: the behaviour monitors' verdicts acted on, and the gate and versions in short (§17).

Built from the config and its edges: the monitors every stage reports to, the version history, the policy,
the pauses, the learner's rollback (None with learning off: alarms and halts only) and its promotion (the
gate's counts). Started inside the daemon's task group (the watch, when the monitors are on).
"""
from __future__ import annotations

import asyncio
import collections
from typing import Awaitable, Callable

from clawd.config.schema import Config
from clawd.lifetime import Stage
from clawd.pauses import Pauses
from clawd.safety.monitors import Monitors
from clawd.safety.versions import Versions
from clawd.safety.watch import Watch
from clawd.served import Policy


class Safety(Stage):
    def __init__(self, cfg: Config, *, monitors: Monitors | None, versions: Versions, policy: Policy,
                 pauses: Pauses, rollback: Callable[[int, str], Awaitable[int]] | None, promotion=None):
        """promotion: the learner's (clawd.learning.promotion.Promotion), None without a gate."""
        self.versions, self.policy, self.promotion = versions, policy, promotion
        # The monitors' verdicts on the version serving: alarm, halt learning, or roll back (clawd.safety.watch).
        self.watch = None if monitors is None else Watch(monitors, versions, policy, pauses, cfg.state_dir, rollback,
                                                         interval=cfg.monitors.interval)
        self._task: asyncio.Task | None = None

    async def start(self, tasks: asyncio.TaskGroup) -> None:
        if self.watch is not None:
            self._task = tasks.create_task(self.watch.run(), name="monitors")

    async def drain(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def status(self) -> dict:
        """The gate, the monitors and the versions in short (clawctl versions and /dashboard say more)."""
        serving = self.versions.get(self.policy.version)
        monitors = (serving.monitors or {}) if serving is not None else {}
        return {"safety": {
            "gate": None if self.promotion is None else self.promotion.snapshot(),
            "versions": dict(collections.Counter(v.status for v in self.versions)),
            "monitors": None if self.watch is None else {
                "rollbacks": self.watch.rollbacks, "halts": self.watch.halts, "clean": monitors.get("clean"),
                "alarms": [a["detail"] for a in monitors.get("alarms", [])]}}}
