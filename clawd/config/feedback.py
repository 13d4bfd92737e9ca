"""The [feedback] section: explicit ratings of replies (POST /v1/feedback) beside the judge, and the judge's
calibration against them."""
from __future__ import annotations

import typing
from dataclasses import dataclass

from clawd.checks import below


@dataclass(frozen=True)
class FeedbackConfig:
    enabled: bool = True                 # POST /v1/feedback is served (off: 404, as any unknown route)
    # a rating "replace"s the judge's vote, or "join"s its votes as one more (majority; a tie gives 0)
    ratings: typing.Literal["replace", "join"] = "replace"
    max_replies: int = 100_000           # the newest main replies a rating can name (about 300 bytes each)
    max_text_chars: int = 4000           # the longest text a rating may carry
    min_pairs: int = 20                  # judge ±1 verdicts rated in a scope before its agreement can alarm
    alarm_below: float = 0.6             # alarm when a scope's agreement interval lies wholly below this

    def check(self) -> dict[str, str]:
        errors = below(self, 1, "max_replies", "max_text_chars", "min_pairs")
        if not 0 < self.alarm_below <= 1:
            errors["alarm_below"] = "must be in (0, 1]"
        return errors
