"""The [records] section: how long turn and judge records are kept."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RecordsConfig:
    retention_days: int = 30             # turn and judge records older than this many days are deleted

    def check(self) -> dict[str, str]:
        return {"retention_days": "must be at least 1"} if self.retention_days < 1 else {}
