"""The [versions] section: the version history and what rollback keeps."""
from __future__ import annotations

from dataclasses import dataclass

from clawd.checks import is_int


@dataclass(frozen=True)
class VersionsConfig:
    """The version history (state/versions.jsonl) and what rollback keeps (clawd.safety.versions)."""
    rollback_depth: int = 3        # versions that served whose checkpoints are kept as rollback targets; 0 = none

    def check(self) -> dict[str, str]:
        if not (is_int(self.rollback_depth) and 0 <= self.rollback_depth <= 100):
            return {"rollback_depth": "must be an integer in 0..100"}
        return {}
