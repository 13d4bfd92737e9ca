"""Retention that runs: a sweep on a timer, so that old conversations go even when nothing is written.

Each sweep deletes turn and judge records of days past `[records] retention_days`, rejected batches
kept for inspection (state/rejected/) older than the same, exports clawctl staged and never
collected (state/exports/) after a day, the journal's segments that hold nothing
live, and published weights past their use. A published version is past its use when it is older
than the version serving, outside the trainer's newest `keep_versions`, not the weights of a
checkpoint (the restart's and the rollback targets', which `clawctl rollback` publishes again from
the checkpoint itself), and not a version still marked serving. The trainer prunes the same
directory as it publishes; the sweep covers what it leaves when it does not (no steps, a rollback,
an older run); it never touches a directory being written (the trainer's hidden temporaries). Each part's failure is logged and counted; the next sweep tries again.
"""
from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from clawd.records import RecordWriter
from clawd.weights import VERSION_DIR, checkpointed_versions, numbered

log = logging.getLogger("clawd.privacy")

_EXPORT_HOURS = 24  # a staged export clawctl did not collect (it failed to copy) is a copy of someone's data


@dataclass
class RetentionStats:
    sweeps: int = 0
    last: float | None = None             # when the last sweep ended (time.time())
    removed: dict[str, int] = field(default_factory=lambda: {"records": 0, "rejected": 0, "segments": 0,
                                                             "weights": 0, "exports": 0})
    failures: int = 0


class Retention:
    def __init__(self, state_dir: Path, records: tuple[RecordWriter, ...], retention_days: int, *,
                 compact_journal: Callable[[], list] | None, serving: Callable[[], int],
                 keep_versions: int, pinned: Callable[[], set[int]] = set, interval: float = 3600.0):
        self.state_dir = Path(state_dir)
        self.records = records
        self.retention_days = retention_days
        self.compact_journal = compact_journal
        self.serving = serving            # the version serving now
        self.keep_versions = keep_versions
        self.pinned = pinned              # versions the registry still marks serving (a canary, a rollout)
        self.interval = interval
        self.stats = RetentionStats()

    async def run(self) -> None:
        while True:
            self.sweep()
            await asyncio.sleep(self.interval)

    def sweep(self, now: float | None = None) -> dict[str, int]:
        """One pass over every part; returns what it removed."""
        now = time.time() if now is None else now
        removed = {}
        for part, work in (("records", lambda: sum(len(r.prune(now)) for r in self.records)),
                           ("rejected", lambda: self._old_rejected(now)),
                           ("segments", lambda: len(self.compact_journal()) if self.compact_journal else 0),
                           ("weights", self._past_use),
                           ("exports", lambda: self._uncollected(now))):
            try:
                removed[part] = work()
            except OSError as exc:
                self.stats.failures += 1
                log.error("retention: %s: %s (tried again at the next sweep)", part, exc.strerror or exc)
                continue
            self.stats.removed[part] += removed[part]
        self.stats.sweeps += 1
        self.stats.last = time.time()
        if any(removed.values()):
            log.info("retention: removed %s", ", ".join(f"{n} {part}" for part, n in removed.items() if n))
        return removed

    def _old_rejected(self, now: float) -> int:
        directory = self.state_dir / "rejected"
        if not directory.is_dir():
            return 0
        cutoff = now - self.retention_days * 86400
        gone = 0
        for path in directory.glob("*.samples.jsonl"):
            if path.stat().st_mtime < cutoff:
                path.unlink(missing_ok=True)
                gone += 1
        return gone

    def _uncollected(self, now: float) -> int:
        directory = self.state_dir / "exports"
        gone = 0
        for path in (directory.iterdir() if directory.is_dir() else ()):
            if path.is_dir() and path.stat().st_mtime < now - _EXPORT_HOURS * 3600:
                shutil.rmtree(path)
                gone += 1
        return gone

    def _past_use(self) -> int:
        weights = self.state_dir / "weights"
        if not weights.is_dir():
            return 0
        published = numbered(weights, VERSION_DIR)
        keep = {v for v, _ in published[-self.keep_versions:]} if self.keep_versions > 0 else set()
        keep |= set(checkpointed_versions(self.state_dir)) | self.pinned()
        serving = self.serving()
        gone = 0
        for version, path in published:
            if version < serving and version not in keep:
                try:
                    shutil.rmtree(path)
                except FileNotFoundError:  # the trainer pruned it first
                    continue
                gone += 1
        return gone
