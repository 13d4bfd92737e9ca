"""clawd.safety.paired: the paired comparison of two versions, exact values."""
from __future__ import annotations

import pytest

from clawd.safety import paired


def test_the_difference_is_the_mean_of_the_pairs_and_the_counts_are_exact():
    before = [True, True, False, False, False, True, False, False]
    after = [True, False, True, True, False, True, True, False]
    r = paired.compare(before, after, resamples=500)
    assert (r["n"], r["before"], r["after"], r["diff"]) == (8, 3 / 8, 5 / 8, 2 / 8)
    assert (r["better"], r["worse"]) == (3, 1)
    assert r["low"] <= r["diff"] <= r["high"] and r["level"] == 0.95
    assert paired.compare(before, after, resamples=500) == r  # seeded: the same inputs, the same interval


def test_identical_outcomes_give_a_zero_width_interval():
    r = paired.compare([1, 0, 1, 1], [1, 0, 1, 1])
    assert (r["diff"], r["low"], r["high"], r["better"], r["worse"]) == (0.0, 0.0, 0.0, 0, 0)
    assert paired.verdict(r) == "no change"


def test_a_consistent_gain_is_up_a_consistent_loss_down_and_noise_no_change():
    n = 40
    assert paired.verdict(paired.compare([0] * n, [1] * 30 + [0] * 10)) == "up"
    assert paired.verdict(paired.compare([1] * n, [0] * 30 + [1] * 10)) == "down"
    # 5 up and 5 down of 40: the interval straddles 0
    noisy = paired.compare([0] * 5 + [1] * 5 + [1] * 30, [1] * 5 + [0] * 5 + [1] * 30)
    assert noisy["diff"] == 0.0 and noisy["low"] < 0 < noisy["high"] and paired.verdict(noisy) == "no change"


def test_pairing_narrows_the_interval_when_prompts_differ_in_difficulty():
    # Half the prompts always fail, half always pass, and one in ten goes up: unpaired, the prompts'
    # spread would swamp the gain; paired, the difference alone varies.
    before = [0] * 20 + [1] * 20 + [0] * 4
    after = [0] * 20 + [1] * 20 + [1] * 4
    r = paired.compare(before, after)
    assert r["low"] > 0 and paired.verdict(r) == "up"


def test_bad_input_and_empty_input():
    with pytest.raises(ValueError, match="not pairs"):
        paired.compare([1, 0], [1])
    with pytest.raises(ValueError):
        paired.compare([1], [1], level=1.0)
    empty = paired.compare([], [])
    assert empty["n"] == 0 and empty["diff"] is None and paired.verdict(empty) == "no change"
    assert paired.describe("correct", empty) == "correct: nothing to compare"


def test_describe_says_it_in_points():
    r = paired.compare([0, 0, 1, 1], [1, 0, 1, 1], resamples=200)
    line = paired.describe("correct", r)
    assert line.startswith("correct 50% -> 75%: +25 pts [") and "(95%, 4 pairs; 1 up, 0 down)" in line


def test_clusters_resample_whole_and_a_cluster_of_agreeing_pairs_counts_once():
    before = [1] * 10 + [0] * 6 + [1] * 24
    after = [0] * 10 + [1] * 6 + [1] * 24  # 10 down, 6 up, 24 the same
    alone = paired.compare(before, after)
    # Every pair its own cluster: the same draws as `compare`, so the same interval.
    own = paired.compare(before, after, clusters=list(range(40)))
    assert (own["n"], own["diff"], own["better"], own["worse"], own["clusters"]) == (40, -4 / 40, 6, 10, 40)
    assert (own["low"], own["high"]) == pytest.approx((alone["low"], alone["high"]), abs=1e-12)
    # Four seeds that agree on every question: 160 pairs, but no more evidence than the 40. Taken as independent,
    # the interval narrows by half; by question, it is the 40's.
    b4, a4, q4 = before * 4, after * 4, list(range(40)) * 4
    naive = paired.compare(b4, a4)
    clustered = paired.compare(b4, a4, clusters=q4)
    assert clustered["diff"] == pytest.approx(alone["diff"]) and clustered["clusters"] == 40
    assert (clustered["low"], clustered["high"]) == pytest.approx((alone["low"], alone["high"]), abs=1e-12)
    assert clustered["high"] - clustered["low"] > 1.5 * (naive["high"] - naive["low"])
    assert paired.compare(b4, a4, clusters=q4) == clustered  # seeded
    with pytest.raises(ValueError, match="cluster names"):
        paired.compare([1, 0], [1, 1], clusters=["a"])
    assert paired.compare([], [], clusters=[]) | {"level": None} == dict.fromkeys(
        ("before", "after", "diff", "low", "high", "better", "worse", "level"), None) | {"n": 0, "clusters": 0}
