"""The [learner] section: when a batch goes to the trainer, and how long each trainer call may take."""
from __future__ import annotations

import typing
from dataclasses import dataclass

from clawd.checks import below, not_positive


@dataclass(frozen=True)
class LearnerConfig:
    enabled: bool = True                 # train on the scored samples and publish the new weights to the policy engine
    rollout_batch_size: int = 16         # samples per training step (excluded turns take no slot)
    backlog_batches: int = 4  # a backlog's step takes up to this many batches' worth of fresh samples
    min_batch_size: int = 4              # the fewest samples a batch past rollout_timeout trains on
    rollout_timeout: float = 0.0         # seconds a batch waits before training on what it has; 0 = until it is full
    stall_warn_interval: float = 30.0    # seconds between "waiting for samples" log lines
    max_staleness: int = 2               # samples from a policy more than this many versions old are dropped
    train_timeout: float = 1800.0        # seconds a training step may take
    trainer_ready_timeout: float = 600.0  # seconds the trainer process has to start
    publish_timeout: float = 600.0       # seconds a weight swap may take
    control: typing.Literal["none", "shuffle_rewards", "zero_rewards"] = "none"  # clawd.learning.controls
    max_sample_tokens: int = 0  # longer samples are never trained (clawd.learning.limits); 0: micro_batch_tokens

    def check(self) -> dict[str, str]:
        errors = not_positive(self, "stall_warn_interval", "train_timeout", "trainer_ready_timeout",
                               "publish_timeout", "backlog_batches") | below(self, 0, "rollout_timeout",
                                                                             "max_staleness",
                                                                            "max_sample_tokens")
        if self.rollout_batch_size < 1:
            errors["rollout_batch_size"] = "must be at least 1"
        if not 1 <= self.min_batch_size <= self.rollout_batch_size:
            errors["min_batch_size"] = "must be in 1..rollout_batch_size"
        return errors
