"""The [state] section: the state directory and the free space learning keeps on it."""
from __future__ import annotations

from dataclasses import dataclass

from clawd.checks import below


@dataclass(frozen=True)
class StateConfig:
    dir: str = "state"                   # where clawd keeps records, journal, weights and checkpoints
    # Learning pauses (reason "disk") before a journal, weights or checkpoint write would leave less than
    # this free on the state directory's filesystem; serving goes on. 0: only a failed write pauses it.
    min_free_bytes: int = 1024 * 1024 * 1024

    def check(self) -> dict[str, str]:
        return ({} if self.dir else {"dir": "must not be empty"}) | below(self, 0, "min_free_bytes")
