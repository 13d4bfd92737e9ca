"""The [scoring] section: how a turn becomes a sample (rl, opd or both) and how many wait for their judge."""
from __future__ import annotations

import typing
from dataclasses import dataclass

from clawd.checks import below


@dataclass(frozen=True)
class ScoringConfig:
    # "rl": judge votes; "opd": hindsight hints for the teacher; "combine": both
    mode: typing.Literal["rl", "opd", "combine"] = "combine"
    prm_m: int = 1                       # judge votes per turn, run in parallel; majority wins, ties give 0 (1..16)
    at_least_one: bool = False           # rl only: a session's first score-0 turn is kept while it has no sample
    max_pending: int = 10_000            # turns waiting for their judge beyond this many are excluded
    max_pending_bytes: int = 256 * 1024 * 1024  # turns waiting for their judge, by their messages' size
    fair_share: float = 0.25             # most of a training batch one user principal may fill, in (0, 1]

    def check(self) -> dict[str, str]:
        errors = below(self, 1, "max_pending", "max_pending_bytes")
        if not 1 <= self.prm_m <= 16:
            errors["prm_m"] = "must be in 1..16"
        if self.at_least_one and self.mode != "rl":
            errors["at_least_one"] = "applies to mode \"rl\" only"
        if not 0 < self.fair_share <= 1:
            errors["fair_share"] = "must be in (0, 1]"
        return errors
