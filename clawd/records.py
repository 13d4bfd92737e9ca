"""Turn records: one JSONL line per finished main turn, a file per UTC day.

Records are for people (audit, debugging, datasets), not for durability: the
sample journal owns that. Lines are appended from the event loop and flushed
without fsync. Files older than `retention_days` are deleted at rotation.
Records never hold API keys or headers: a `Turn` has none to give.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import IO

from clawd.turns import FinishedTurn

log = logging.getLogger("clawd.records")


class RecordWriter:
    def __init__(self, directory: Path, *, kind: str = "turns", retention_days: int = 30):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.kind = kind
        self.retention_days = retention_days
        self._day: str | None = None
        self._file: IO[str] | None = None
        self.written = 0

    def path_for(self, day: str) -> Path:
        return self.directory / f"{self.kind}-{day}.jsonl"

    def write(self, record: dict, now: float | None = None) -> None:
        now = time.time() if now is None else now
        day = time.strftime("%Y-%m-%d", time.gmtime(now))
        if day != self._day:
            self._rotate(day, now)
        self._file.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._file.flush()
        self.written += 1

    def write_turn(self, finished: FinishedTurn) -> None:
        self.write(finished.to_record(), finished.finished)

    def _rotate(self, day: str, now: float) -> None:
        if self._file is not None:
            self._file.close()
        self._day = day
        self._file = open(self.path_for(day), "a", encoding="utf-8")
        cutoff = time.strftime("%Y-%m-%d", time.gmtime(now - self.retention_days * 86400))
        for path in self.directory.glob(f"{self.kind}-*.jsonl"):
            if path.stem[len(self.kind) + 1:] < cutoff:
                log.info("deleting %s (older than %d days)", path, self.retention_days)
                path.unlink()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self._day = None
