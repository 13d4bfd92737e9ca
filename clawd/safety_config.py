"""The [gate], [monitors] and [versions] sections: what keeps live learning safe to leave on
(docs/ARCHITECTURE.md §17).

Their own module, as [train] has one, so that `clawd.config` stays one readable file under its size
cap. Loaded and checked as every other section is (`clawd.config`).
"""
from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field

from clawd.checks import is_int, is_number

ACTIONS = ("off", "alarm", "halt", "rollback")  # what a monitor's drift does (clawd.safety.monitors)


def _check_finite(section, name: str, ok, want: str, errors: dict) -> None:
    value = getattr(section, name)
    if not (is_number(value) and math.isfinite(value) and ok(value)):
        errors[name] = f"must be a finite number {want}"


@dataclass(frozen=True)
class GateConfig:
    """Each new version is scored on an evaluation set before it serves everyone (clawd.safety.gate)."""
    enabled: bool = True
    set: str = ""                  # JSONL evaluation set; "" = the one that ships with clawd
    prompts: int = 0               # the set's first N prompts only (0: all): each costs k answers a version
    samples_per_prompt: int = 2    # k seeded samples per prompt, the same seeds for every version
    max_tokens: int = 64
    temperature: float = 0.7
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
        _check_finite(self, "temperature", lambda x: x >= 0, ">= 0", errors)
        _check_finite(self, "margin", lambda x: 0 <= x < 1, "in [0, 1)", errors)
        _check_finite(self, "level", lambda x: 0.5 <= x < 1, "in [0.5, 1)", errors)
        _check_finite(self, "timeout", lambda x: x > 0, "above 0", errors)
        return errors


@dataclass(frozen=True)
class MonitorRule:
    """One monitor: what its drift past `threshold` does. The threshold's meaning (a rise in a share, a
    ratio of a mean) is the monitor's own: clawd.safety.monitors.MONITORS says it for each."""
    action: typing.Literal[("default", *ACTIONS)] = "default"  # "default": the monitor's own (DEFAULT_RULES)
    threshold: float = 0.0         # 0: the monitor's own

    def check(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        _check_finite(self, "threshold", lambda x: x >= 0, ">= 0 (0 = the monitor's default)", errors)
        return errors


# Each monitor's default rule. Shares rise by more than the threshold (absolute); mean_words moves by
# more than threshold x the baseline's (relative, either way); distinct_2 and entropy fall under
# (1 - threshold) x the baseline's; reward_mean falls by more (the judge's reward is in [-1, 1]); kl rises
# by more (nats, the trainer's sampled KL to the reference). Why these: clawd.safety.monitors.
DEFAULT_RULES = {
    "mean_words": ("alarm", 0.5),          # learning to be brief is legitimate: say it, do not stop it
    "empty_share": ("rollback", 0.10),
    "one_word_share": ("rollback", 0.20),
    "repeated_opening_share": ("rollback", 0.30),
    "top_reply_share": ("rollback", 0.20),
    "distinct_2": ("rollback", 0.5),
    "refusal_share": ("halt", 0.10),
    "tool_error_share": ("halt", 0.10),
    "reward_mean": ("alarm", 0.5),
    "hint_share": ("alarm", 0.30),
    "kl": ("halt", 1.0),
    "entropy": ("alarm", 0.5),
}


def _rule(name: str):
    return field(default_factory=lambda: MonitorRule(*DEFAULT_RULES[name]))


@dataclass(frozen=True)
class MonitorsConfig:
    """Behaviour monitors per version over live traffic (clawd.safety.monitors). A [monitors.NAME] table
    that gives only `action` keeps the monitor's default threshold, and the other way round."""
    enabled: bool = True
    min_replies: int = 24          # a version's replies before its monitors say anything
    baseline_versions: int = 3     # the baseline: the replies of the last N versions that served cleanly
    interval: float = 5.0          # seconds between checks of the version serving
    mean_words: MonitorRule = _rule("mean_words")
    empty_share: MonitorRule = _rule("empty_share")
    one_word_share: MonitorRule = _rule("one_word_share")
    repeated_opening_share: MonitorRule = _rule("repeated_opening_share")
    top_reply_share: MonitorRule = _rule("top_reply_share")
    distinct_2: MonitorRule = _rule("distinct_2")
    refusal_share: MonitorRule = _rule("refusal_share")
    tool_error_share: MonitorRule = _rule("tool_error_share")
    reward_mean: MonitorRule = _rule("reward_mean")
    hint_share: MonitorRule = _rule("hint_share")
    kl: MonitorRule = _rule("kl")
    entropy: MonitorRule = _rule("entropy")

    def __post_init__(self) -> None:
        for name, rule in self.rules().items():  # what a [monitors.NAME] table left out: the monitor's own
            action, threshold = DEFAULT_RULES[name]
            object.__setattr__(self, name, MonitorRule(action if rule.action == "default" else rule.action,
                                                       rule.threshold or threshold))

    def check(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        for name in ("min_replies", "baseline_versions"):
            if not (is_int(getattr(self, name)) and getattr(self, name) >= 1):
                errors[name] = "must be an integer, at least 1"
        _check_finite(self, "interval", lambda x: x > 0, "above 0", errors)
        return errors

    def rules(self) -> dict[str, MonitorRule]:
        """Every monitor's rule by name, in the file's order."""
        return {name: value for name, value in vars(self).items() if isinstance(value, MonitorRule)}


@dataclass(frozen=True)
class VersionsConfig:
    """The version history (state/versions.jsonl) and what rollback keeps (clawd.safety.versions)."""
    rollback_depth: int = 3        # versions that served whose checkpoints are kept as rollback targets; 0 = none

    def check(self) -> dict[str, str]:
        if not (is_int(self.rollback_depth) and 0 <= self.rollback_depth <= 100):
            return {"rollback_depth": "must be an integer in 0..100"}
        return {}
