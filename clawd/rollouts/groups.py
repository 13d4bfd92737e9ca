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
from dataclasses import dataclass, field
from typing import Sequence

from clawd.config.rollouts import SCALES
from clawd.samples import Sample

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


@dataclass(frozen=True)
class Member:
    """One answer of a group: its model turns, (prompt_ids, output_ids, logprobs) each, and its reward;
    `said` is what the record keeps of it (its last reply, how its episode ended)."""
    turns: tuple[tuple[list[int], list[int], list[float]], ...]
    reward: float
    said: dict = field(default_factory=dict, compare=False)


def group_samples(group_id: str, members: Sequence[Member], *, source: str, principal: str, policy_version: int,
                  temperature: float, scale: str = "mean", discount: float = 1.0, created: float = 0.0,
                  scored: float = 0.0) -> tuple[list[Sample], list[float] | None]:
    """(the samples of one group, each member's advantage). A group is N answers to one prompt, or N episodes
    from one seed; each model turn a sample whose advantage is its answer's, discounted over the turns after it.
    ([], None) when the rewards agree or fewer than two answered (dropped: the caller counts it). Sample ids:
    "<group_id>-<member>-<turn>"."""
    advantages = group_advantages([m.reward for m in members], scale)
    if advantages is None:
        return [], None
    out = []
    for i, (member, advantage) in enumerate(zip(members, advantages)):
        if not member.turns:
            continue
        for t, ((prompt, output, logprobs), a) in enumerate(zip(member.turns,
                                                               turn_returns(advantage, len(member.turns), discount))):
            out.append(Sample(sample_id=f"{group_id}-{i}-{t}", mode="rl", session_id=group_id, turn_index=t,
                              principal=principal, tokens=[*prompt, *output], response_length=len(output),
                              loss_mask=[1] * len(output), rollout_logprobs=list(logprobs), temperature=temperature,
                              reward=member.reward, teacher_logprobs=None, has_hint=False,
                              policy_version=policy_version, created=created, scored=scored, source=source,
                              advantage=a))
    return out, advantages
