"""Paired comparison of two policy versions on the same prompts: the difference and its interval.

When version A and version B answer the same evaluation prompts (the same sampling seed per
prompt), each prompt is a pair of outcomes, and the question is whether B does better than A
on prompts like these. Comparing the two rates as if they were independent samples wastes
the pairing: most of the variation between prompts (some are easy, some hard) is shared by
both sides. The paired bootstrap resamples prompts, keeping each prompt's two outcomes
together, so its interval is that of the difference itself.

A floor module (pure, stdlib only): the demo and the learning bench use it, and a promotion
gate can. Outcomes are booleans (satisfied, correct, styled) or numbers (a score).
"""
from __future__ import annotations

import random
import statistics
from typing import Sequence

RESAMPLES = 2000
LEVEL = 0.95


def compare(before: Sequence[float], after: Sequence[float], *, resamples: int = RESAMPLES,
            level: float = LEVEL, seed: int = 0, clusters: Sequence | None = None) -> dict:
    """before[i] and after[i] are the two versions' outcomes on prompt i (True counts as 1).

    Returns {"n", "before", "after", "diff", "low", "high", "level", "better", "worse"}: the means, the
    mean paired difference after − before with its percentile bootstrap interval at `level`
    (seeded, so the same inputs give the same interval), and the number of prompts that went
    up and down. With n = 0 every figure is None.

    `clusters[i]` names pair i's cluster, for pairs that are not independent: the same question answered in
    several seeds' runs is one cluster (what makes one seed lose it, it being fragile, makes the others
    likelier to). The bootstrap then resamples clusters, each with all its pairs, and takes the mean difference
    over the pairs drawn: wider where a cluster's pairs agree, the same where they are independent. The result
    also says how many "clusters" there were."""
    if len(before) != len(after):
        raise ValueError(f"{len(before)} outcomes before and {len(after)} after: not pairs")
    if clusters is not None and len(clusters) != len(before):
        raise ValueError(f"{len(before)} pairs and {len(clusters)} cluster names")
    if not 0 < level < 1 or resamples < 1:
        raise ValueError("level must be in (0, 1) and resamples at least 1")
    n = len(before)
    named = {} if clusters is None else {"clusters": len(set(clusters))}
    if n == 0:
        return dict.fromkeys(("before", "after", "diff", "low", "high", "better", "worse"), None) | {
            "n": 0, "level": level, **named}
    diffs = [float(a) - float(b) for b, a in zip(before, after)]
    rng = random.Random(seed)
    if clusters is None:
        means = sorted(statistics.fmean(rng.choices(diffs, k=n)) for _ in range(resamples))
    else:
        sums: dict = {}
        for d, c in zip(diffs, clusters):
            total, count = sums.get(c, (0.0, 0))
            sums[c] = (total + d, count + 1)
        groups = list(sums.values())
        means = []
        for _ in range(resamples):
            drawn = rng.choices(groups, k=len(groups))
            means.append(sum(t for t, _ in drawn) / sum(c for _, c in drawn))
        means.sort()
    tail = (1 - level) / 2
    low = means[int(tail * resamples)]
    high = means[min(resamples - 1, int((1 - tail) * resamples))]
    return {"n": n, "before": statistics.fmean(map(float, before)), "after": statistics.fmean(map(float, after)),
            "diff": statistics.fmean(diffs), "low": low, "high": high, "level": level,
            "better": sum(d > 0 for d in diffs), "worse": sum(d < 0 for d in diffs), **named}


def verdict(result: dict) -> str:
    """"up", "down" or "no change" (the interval includes 0, or nothing to compare)."""
    if not result["n"]:
        return "no change"
    if result["low"] > 0:
        return "up"
    if result["high"] < 0:
        return "down"
    return "no change"


def describe(name: str, result: dict) -> str:
    """One line: `correct 41% -> 44%: +3 pts [-6, +12] (95%, 32 pairs; 5 up, 4 down)`."""
    if not result["n"]:
        return f"{name}: nothing to compare"
    return (f"{name} {100 * result['before']:.0f}% -> {100 * result['after']:.0f}%: "
            f"{100 * result['diff']:+.0f} pts [{100 * result['low']:+.0f}, {100 * result['high']:+.0f}] "
            f"({100 * result['level']:.0f}%, {result['n']} pairs; {result['better']} up, {result['worse']} down)")
