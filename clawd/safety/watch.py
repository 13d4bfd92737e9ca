"""Carrying out the monitors' verdicts on the version serving (docs/ARCHITECTURE.md §17).

A long-lived task the daemon owns: every `interval` seconds it checks the serving version's monitors
(clawd.safety.monitors) against the baseline of the versions that served cleanly, writes what it found
into the version's record (clawd.safety.versions: `monitors` = {summary, alarms, clean, checked}) and acts
on the strongest alarm: "alarm" is logged; "halt" pauses learning (reason "monitor"); "rollback" pauses
learning and serves again the newest clean version that has a checkpoint.

A version is *clean* once it has served `min_replies` replies with no alarm. The baseline is the first
`baseline_versions` clean versions (the anchor: how the policy behaved before learning moved it), so that
a drift spread over many small steps is measured in full, not step by step; after a restart, before the
anchor's replies are heard again, its summary kept in versions.jsonl stands in. Rollbacks return to the
newest clean version that has a checkpoint: a version replaced before it was heard enough is neither.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from clawd.pauses import MONITOR, Pauses
from clawd.safety.monitors import Alarm, Monitors, drift, worst
from clawd.safety.versions import CANDIDATE, GOOD, SERVING, Versions
from clawd.served import Policy
from clawd.weights import checkpointed_versions

log = logging.getLogger("clawd.monitors")

SUMMARY_KEYS = ("replies", "judgements", "steps", "tool_turns", "kl_steps", "entropy_steps", "mean_words",
                "empty_share", "one_word_share", "repeated_opening_share", "top_reply_share", "distinct_2",
                "refusal_share", "tool_error_share", "reward_mean", "hint_share", "kl", "entropy", "top_openings",
                "top_replies")
RECORD_EVERY = 60.0  # seconds between writes of an unchanged verdict into versions.jsonl


class Watch:
    def __init__(self, monitors: Monitors, versions: Versions, policy: Policy, pauses: Pauses, state_dir,
                 rollback: Callable[[int, str], Awaitable[int]] | None, *, interval: float = 5.0):
        self.monitors, self.versions, self.policy, self.pauses = monitors, versions, policy, pauses
        self.state_dir = state_dir
        self.rollback = rollback  # (target, reason) -> the version serving after; None when learning is off
        self.interval = interval
        self.acted: dict[int, str] = {}  # version -> the strongest action already carried out on it
        self.rollbacks = 0
        self.halts = 0
        self._recorded: dict[int, tuple] = {}  # version -> (verdict, when) last written

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check()

    def clean(self) -> list[int]:
        """Versions that served cleanly, oldest first: the baseline and the rollback targets."""
        return [v.version for v in self.versions if v.status in GOOD and (v.monitors or {}).get("clean")]

    async def check(self) -> list[Alarm]:
        version = self.policy.version
        record = self.versions.get(version)
        if record is None or record.status not in (SERVING, CANDIDATE):
            return []
        cfg = self.monitors.cfg
        summary = self.monitors.snapshot_of(version)
        # A version is never its own baseline: v0, clean on its first replies, would otherwise be judged against
        # its own earlier summary, and a change in the traffic it serves (probes, then users) read as drift.
        anchor = [v for v in self.clean() if v != version][:cfg.baseline_versions]
        baseline = self.monitors.baseline(version, anchor).summary()
        if (baseline.get("replies") or 0) < cfg.min_replies and anchor:  # not heard since a restart
            baseline = (self.versions.get(anchor[0]).monitors or {}).get("summary") or baseline
        alarms = drift(summary, baseline, cfg.rules(), cfg.min_replies) if cfg.enabled and summary else []
        clean = not alarms and (summary.get("replies") or 0) >= cfg.min_replies
        self._record(version, summary, alarms, clean)
        action = worst(alarms)
        if action is None or _rank(action) <= _rank(self.acted.get(version)):
            return alarms
        self.acted[version] = action
        detail = "; ".join(a.detail for a in alarms if a.action == action)
        log.warning("v%d monitors: %s -> %s", version, "; ".join(a.detail for a in alarms), action)
        if action == "halt":
            self.halts += 1
            self.pauses.hold(MONITOR, f"v{version}: {detail}")
        elif action == "rollback":
            await self._roll_back(version, detail)
        return alarms

    async def _roll_back(self, version: int, detail: str) -> None:
        kept = checkpointed_versions(self.state_dir)
        targets = [v for v in self.clean() if v in kept and v != version]
        self.pauses.hold(MONITOR, f"v{version}: {detail}")
        if self.rollback is None or not targets:
            log.error("v%d should be rolled back (%s) but %s; learning is halted", version, detail,
                      "learning is off" if self.rollback is None else "no clean version has a checkpoint")
            return
        try:
            serving = await self.rollback(max(targets), f"monitor: {detail}")
        except Exception as exc:  # the trainer or the engine failed: learning stays halted, the operator decides
            log.error("rolling v%d back to v%d failed, learning stays halted: %s", version, max(targets), exc)
            return
        self.rollbacks += 1
        log.warning("monitors rolled v%d back to v%d, serving as v%d", version, max(targets), serving)

    def _record(self, version: int, summary: dict, alarms: list[Alarm], clean: bool) -> None:
        verdict = (clean, tuple(a.monitor for a in alarms))
        last = self._recorded.get(version)
        if last is not None and last[0] == verdict and time.monotonic() - last[1] < RECORD_EVERY:
            return
        self._recorded[version] = (verdict, time.monotonic())
        self.versions.update(version, monitors={"summary": {k: summary.get(k) for k in SUMMARY_KEYS},
                                                "alarms": [a.to_json() for a in alarms], "clean": clean,
                                                "checked": time.time()})


def _rank(action: str | None) -> int:
    return {None: 0, "alarm": 1, "halt": 2, "rollback": 3}[action]
