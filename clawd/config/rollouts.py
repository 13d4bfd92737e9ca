"""The [rollouts] section: active rollouts beside live chat (docs/ARCHITECTURE.md §19)."""
from __future__ import annotations

import typing
from dataclasses import dataclass

from clawd.checks import check_finite, is_import_path, is_int

SCALES = ("mean", "std")  # a group's advantages (clawd.rollouts.groups)


@dataclass(frozen=True)
class RolloutsConfig:
    enabled: bool = False                # draw groups from the set and the environments below while serving
    set: str = ""                        # a prompt set (JSON Lines, clawd/rollouts/tasks.py's format); "" = none
    environments: tuple[str, ...] = ()   # "module:Class" environments, e.g. "clawd.rollouts.envs.calculator:Calculator"
    prompts_per_batch: int = 4           # B: groups drawn before the source looks at the learner's backlog again
    samples_per_prompt: int = 4          # N: answers (episodes) to one prompt (seed): one group
    scale: typing.Literal[SCALES] = "mean"  # a group's advantages: r - mean, or divided by its std as well
    discount: float = 1.0                # an episode's reward over its turns: turn t gets discount^(turns after t)
    temperature: float = 1.0             # the rollouts' sampling temperature
    max_new_tokens: int = 256            # tokens one model turn may write
    max_turns: int = 6                   # model turns in one episode
    max_context: int = 4096              # prompt and reply of any turn, in tokens
    checker_timeout: float = 10.0        # seconds one deployment call (a checker, an environment step) may take
    concurrency: int = 2                 # rollout requests in flight at most
    live_headroom: int = 0               # rollouts wait while more live requests than this are in flight
    backlog: int = 64                    # rollout samples waiting in the store at most: never outrun the learner

    def check(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        if self.enabled and not (self.set or self.environments):
            errors["enabled"] = "needs a set or at least one environment"
        bad = [e for e in self.environments if not is_import_path(e)]
        if bad:
            errors["environments"] = f"each must name a class as \"package.module:Class\", not {bad[0]!r}"
        for name in ("prompts_per_batch", "max_new_tokens", "max_turns", "max_context", "concurrency", "backlog"):
            if not (is_int(getattr(self, name)) and getattr(self, name) >= 1):
                errors[name] = "must be an integer, at least 1"
        if not (is_int(self.samples_per_prompt) and self.samples_per_prompt >= 2):
            errors["samples_per_prompt"] = "must be an integer, at least 2 (a group compares its answers)"
        if not (is_int(self.live_headroom) and self.live_headroom >= 0):
            errors["live_headroom"] = "must be an integer, 0 or more"
        check_finite(self, "discount", lambda x: 0 < x <= 1, "in (0, 1]", errors)
        check_finite(self, "temperature", lambda x: 0 < x <= 2, "in (0, 2]", errors)
        check_finite(self, "checker_timeout", lambda x: x > 0, "above 0", errors)
        return errors
