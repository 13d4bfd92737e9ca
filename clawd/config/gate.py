"""The [gate] section: each new version is scored on an evaluation set before it serves everyone."""
from __future__ import annotations

from dataclasses import dataclass

from clawd.checks import check_finite, is_int


@dataclass(frozen=True)
class GateConfig:
    """Each new version is scored on an evaluation set before it serves everyone (clawd.safety.gate)."""
    enabled: bool = True           # score each new version on the evaluation set before it serves everyone
    set: str = ""                  # JSONL evaluation set; "" = the one that ships with clawd
    prompts: int = 0               # the set's first N prompts only (0: all): each costs k answers a version
    samples_per_prompt: int = 2    # k seeded samples per prompt, the same seeds for every version
    max_tokens: int = 64           # tokens each evaluation answer may take
    temperature: float = 0.7       # the evaluation answers' sampling temperature
    margin: float = 0.05           # rejected: worse than the incumbent (or the baseline) by more, confidently
    level: float = 0.95            # of the paired bootstrap interval
    baseline: bool = True          # also compared with the first version scored: no slow drift below it
    concurrency: int = 8           # evaluation requests in flight at once
    timeout: float = 900.0         # seconds for one version's evaluation; over it, the version is not promoted

    def check(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        if not (is_int(self.prompts) and self.prompts >= 0):
            errors["prompts"] = "must be an integer, 0 (all) or more"
        for name in ("samples_per_prompt", "max_tokens", "concurrency"):
            if not (is_int(getattr(self, name)) and getattr(self, name) >= 1):
                errors[name] = "must be an integer, at least 1"
        check_finite(self, "temperature", lambda x: x >= 0, ">= 0", errors)
        check_finite(self, "margin", lambda x: 0 <= x < 1, "in [0, 1)", errors)
        check_finite(self, "level", lambda x: 0.5 <= x < 1, "in [0.5, 1)", errors)
        check_finite(self, "timeout", lambda x: x > 0, "above 0", errors)
        return errors
