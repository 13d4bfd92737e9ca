"""The status snapshot's pure parts: per-minute rates and strict-JSON values."""
from __future__ import annotations

import json
import math

from clawd.ops.status import Rate, finite


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_rate_counts_the_last_window_in_whole_seconds():
    clock = Clock()
    rate = Rate(window=60.0, clock=clock)
    assert rate.per_minute() == 0.0
    rate.tick()
    rate.tick(2)  # same second: one bucket
    clock.t += 30.5
    rate.tick()
    assert rate.per_minute() == 4.0
    clock.t = 1059.9  # second 1059: the first bucket (second 1000) is 59 s old, still in
    assert rate.per_minute() == 4.0
    clock.t = 1060.0  # 60 s old: out
    assert rate.per_minute() == 1.0
    clock.t = 1200.0
    assert rate.per_minute() == 0.0 and not rate._buckets


def test_rate_scales_a_shorter_window_to_a_minute():
    clock = Clock()
    rate = Rate(window=10.0, clock=clock)
    rate.tick(5)
    assert rate.per_minute() == 30.0


def test_finite_turns_non_finite_floats_into_null_and_keeps_the_rest():
    snapshot = {"loss": math.nan, "kl": math.inf, "entropy": -math.inf, "lr": 1e-5, "step": 3, "ok": True,
                "name": "nan", "parts": [1.5, math.nan, {"x": math.nan}], "pair": (math.inf, 2), "none": None}
    assert finite(snapshot) == {"loss": None, "kl": None, "entropy": None, "lr": 1e-5, "step": 3, "ok": True,
                                "name": "nan", "parts": [1.5, None, {"x": None}], "pair": [None, 2], "none": None}
    json.dumps(finite(snapshot), allow_nan=False)  # strict JSON: would raise on NaN
