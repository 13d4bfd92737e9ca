"""The [monitors] section: behaviour monitors per version over live traffic, and what each drift does."""
from __future__ import annotations

import typing
from dataclasses import dataclass, field

from clawd.checks import check_finite, is_int


ACTIONS = ("off", "alarm", "halt", "rollback")  # what a monitor's drift does (clawd.safety.monitors)


@dataclass(frozen=True)
class MonitorRule:
    """One monitor: what its drift past `threshold` does. The threshold's meaning (a rise in a share, a
    ratio of a mean) is the monitor's own: clawd.safety.monitors.MONITORS says it for each."""
    action: typing.Literal[("default", *ACTIONS)] = "default"  # "default": the monitor's own (DEFAULT_RULES)
    threshold: float = 0.0         # 0: the monitor's own

    def check(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        check_finite(self, "threshold", lambda x: x >= 0, ">= 0 (0 = the monitor's default)", errors)
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
    enabled: bool = True           # watch each version's live traffic and act on drift
    min_replies: int = 24          # a version's replies before its monitors say anything
    baseline_versions: int = 3     # the baseline: the replies of the last N versions that served cleanly
    interval: float = 5.0          # seconds between checks of the version serving
    mean_words: MonitorRule = _rule("mean_words")                          # mean words per reply
    empty_share: MonitorRule = _rule("empty_share")                        # share of replies that are empty
    one_word_share: MonitorRule = _rule("one_word_share")                  # share of replies of 0 or 1 words
    repeated_opening_share: MonitorRule = _rule("repeated_opening_share")  # share of replies whose first 3 words recur
    top_reply_share: MonitorRule = _rule("top_reply_share")                # share of replies that are the commonest one
    distinct_2: MonitorRule = _rule("distinct_2")                          # distinct word pairs / all word pairs
    refusal_share: MonitorRule = _rule("refusal_share")                    # share of replies that open with a refusal
    tool_error_share: MonitorRule = _rule("tool_error_share")              # share of tool turns with an invalid call
    reward_mean: MonitorRule = _rule("reward_mean")                        # the judge's mean reward, in [-1, 1]
    hint_share: MonitorRule = _rule("hint_share")                          # share of judgements that give a hint
    kl: MonitorRule = _rule("kl")                                          # the trainer's KL to the reference, in nats
    entropy: MonitorRule = _rule("entropy")                                # per-token entropy of the policy's samples

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
        check_finite(self, "interval", lambda x: x > 0, "above 0", errors)
        return errors

    def rules(self) -> dict[str, MonitorRule]:
        """Every monitor's rule by name, in the file's order."""
        return {name: value for name, value in vars(self).items() if isinstance(value, MonitorRule)}
