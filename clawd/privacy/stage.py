"""The privacy stage: the retention sweeps, and what the privacy policy did, in short (docs/OPERATING.md).

The policy itself (`clawd.privacy.policy.Privacy`: PII, consent) is built before the stages that ask it;
this stage owns the sweeps that run even when nothing is written (old records, journal segments, weights past
use) and gives the privacy part of the status. Its edges: the records, the journal's compaction, the policy
version serving and those pinned, and the handover whose PII scans it reports.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from clawd.config.schema import Config
from clawd.lifetime import Stage
from clawd.privacy.policy import Privacy
from clawd.privacy.retention import Retention
from clawd.records import RecordWriter


class PrivacyStage(Stage):
    def __init__(self, cfg: Config, *, privacy: Privacy, records: tuple[RecordWriter, ...],
                 compact_journal: Callable[[], list], serving: Callable[[], int], pinned: Callable[[], set[int]],
                 scans=None):
        """scans: the turn handover (clawd.scoring.handover.TurnHandover) whose PII scans wait, or None."""
        self.cfg, self.privacy, self.scans = cfg, privacy, scans
        self.retention = Retention(cfg.state_dir, records, cfg.records.retention_days, compact_journal=compact_journal,
                                   serving=serving, keep_versions=cfg.train.keep_versions,
                                   interval=cfg.privacy.retention_interval, pinned=pinned)
        self._task: asyncio.Task | None = None

    async def start(self, tasks: asyncio.TaskGroup) -> None:
        self._task = tasks.create_task(self.retention.run(), name="retention")

    async def drain(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def status(self) -> dict:
        ps, rs = self.privacy.stats, self.retention.stats
        return {"privacy": {
            "pii": {"categories": list(self.cfg.privacy.pii_categories), "turns_scanned": ps.scanned,
                    "turns_with_pii": ps.with_pii, "found": dict(ps.found), "redacted_records": ps.redacted_records,
                    "phones_unread": ps.phones_unread,
                    "scans": None if self.scans is None else {
                        "waiting": self.scans.waiting, "deferred": self.scans.stats.deferred,
                        "failed": self.scans.stats.failed}},
            "not_trained": dict(ps.excluded), "unrecorded_turns": ps.unrecorded,
            "retention": {"days": self.cfg.records.retention_days, "sweeps": rs.sweeps, "last": rs.last,
                          "removed": dict(rs.removed), "failures": rs.failures}}}
