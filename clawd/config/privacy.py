"""The [privacy] section: what clawd keeps about the people whose conversations it serves and trains on."""
from __future__ import annotations

import math
import typing
from dataclasses import dataclass

from clawd.checks import is_group_name, is_number


PII_CATEGORIES = ("email", "phone", "card", "iban", "ip", "secret")  # clawd.privacy.pii detects these


@dataclass(frozen=True)
class PrivacyConfig:
    # PII detection (clawd.privacy.pii) and what a finding does at each place a turn goes.
    pii_categories: tuple[str, ...] = PII_CATEGORIES  # () turns detection off
    redact_records: bool = True          # turn and judge records: PII replaced by [EMAIL] etc., token ids dropped
    redact_judge: bool = True            # prompts sent to an external ("openai") judge: PII replaced the same way
    # Training: "exclude" keeps a turn with PII in its prompt or reply out of training (reason "pii");
    # "keep" trains it as it was served (its tokens are never rewritten: the exact-token contract).
    pii_training: typing.Literal["exclude", "keep"] = "exclude"
    # Turns never trained (no_train, or an API key with train = false) are recorded without the words
    # of their messages and reply unless this is true: sizes, version and timing stay.
    untrained_content: bool = False
    # Retention (clawd.privacy.retention): a sweep every this many seconds applies [records] retention_days
    # and cleans journal segments and published weights past their use, even when nothing is written.
    retention_interval: float = 3600.0
    # A group given read access to the published weights directory alone (launch = "none": an engine run
    # as another user reads them on a shared filesystem). "" = none: the state directory is clawd's only.
    weights_group: str = ""

    def check(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        unknown = [c for c in self.pii_categories if c not in PII_CATEGORIES]
        if unknown:
            errors["pii_categories"] = f"unknown {', '.join(unknown)}; known: {', '.join(PII_CATEGORIES)}"
        value = self.retention_interval
        if not (is_number(value) and math.isfinite(value) and value >= 1):
            errors["retention_interval"] = "must be a finite number of seconds, at least 1"
        if self.weights_group and not is_group_name(self.weights_group):
            errors["weights_group"] = "must be a group name"
        return errors
