"""The [sampling] section: the temperatures clawd serves and trains at."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingConfig:
    default_temperature: float = 1.0     # temperature when a request sets none, in [0, 2]
    min_train_temperature: float = 0.05  # main turns sampled below this temperature are not trained
    override_sampling: bool = False      # true: main turns sample at train_temperature from the full distribution
    train_temperature: float = 1.0       # override_sampling's temperature, in [min_train_temperature, 2]

    def check(self) -> dict[str, str]:
        errors = {}
        if not 0 <= self.default_temperature <= 2:
            errors["default_temperature"] = "must be in [0, 2]"
        if not 0 < self.min_train_temperature <= 2:
            errors["min_train_temperature"] = "must be in (0, 2]"
        if not self.min_train_temperature <= self.train_temperature <= 2:
            errors["train_temperature"] = "must be in [min_train_temperature, 2]"
        return errors
