"""Group advantages for active rollouts (docs/ARCHITECTURE.md §19): N answers to one prompt are one group, and
each answer is judged against its siblings, not against the whole batch. Pure functions.

GRPO's rule: A_i = r_i − mean(r) over the group, optionally divided by the group's standard deviation
("std", as GRPO does; "mean" alone as Dr. GRPO argues, which leaves easy and hard prompts their own
scale). A group whose rewards all agree says nothing about which answer was better: it is dropped
(and counted), never trained with a zero advantage, which would only move the weights through AdamW's
momentum. An episode of several model turns (an agent in an environment) earns one reward at its end:
each turn gets it discounted by the turns that follow it (γ = 1: every turn the same).
"""
from __future__ import annotations

import math
from typing import Sequence

SCALES = ("mean", "std")
STD_EPS = 1e-6  # keeps a group of near-equal rewards from dividing by almost zero


def agree(rewards: Sequence[float], tolerance: float = 1e-9) -> bool:
    """Every reward of the group the same (within `tolerance`): no answer was better than another."""
    return max(rewards) - min(rewards) <= tolerance


def group_advantages(rewards: Sequence[float], scale: str = "mean") -> list[float] | None:
    """Each answer's advantage within its group: r − mean(r), divided by the population standard deviation
    (+ STD_EPS) with scale "std". None when the rewards agree (the group is dropped) or the group has fewer
    than two answers."""
    if scale not in SCALES:
        raise ValueError(f"scale {scale!r} is not one of {SCALES}")
    if len(rewards) < 2 or not all(math.isfinite(r) for r in rewards):
        return None
    if agree(rewards):
        return None
    mean = math.fsum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if scale == "mean":
        return centred
    std = math.sqrt(math.fsum(c * c for c in centred) / len(centred))
    return [c / (std + STD_EPS) for c in centred]


def turn_returns(reward: float, turns: int, discount: float = 1.0) -> list[float]:
    """An episode's end reward spread over its `turns` model turns: turn t (from 0) gets
    reward · discount^(turns − 1 − t), so the last turn gets it whole and earlier turns less (γ < 1)."""
    if turns < 1:
        raise ValueError("an episode has at least one model turn")
    if not 0 < discount <= 1:
        raise ValueError("discount must be in (0, 1]")
    return [reward * discount ** (turns - 1 - t) for t in range(turns)]
