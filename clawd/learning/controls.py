"""Negative controls: a batch whose reward carries no information about the replies.

Learning from users is only shown to be real when the same loop, fed a signal with
no information in it, does not move the same metrics. `[learner] control` makes the
learner train on such a signal (docs/ARCHITECTURE.md §12):

- `shuffle_rewards`: the batch's rewards, permuted across its samples. The reward
  distribution (how many +1, -1, 0) is what the judge gave; which reply got which is
  the seeded generator's draw over the batch in a canonical order, so the same batch
  gets the same permutation whatever order its samples arrived in.
- `zero_rewards`: every reward 0.

Either way the teacher signal is dropped too (`has_hint = False`, which makes the OPD
term exactly zero): a control arm is an rl (or combine) arm with its reward cut off from
the replies; in opd mode, where the reward is not used, it trains on nothing. Records and the journal keep the judge's real scores; only the batch handed
to the trainer changes. Pure functions: the caller owns the random generator.
"""
from __future__ import annotations

import dataclasses
import random

from clawd.samples import Sample

CONTROLS = ("none", "shuffle_rewards", "zero_rewards")


def apply(control: str, batch: list[Sample], rng: random.Random) -> list[Sample]:
    """The batch to train on under `control` (the same list for "none")."""
    if control == "none":
        return batch
    if control == "shuffle_rewards":
        # Dealt in a canonical order (by tokens, then id), not the order samples reached the batch: that
        # order is a race between concurrent scorings, and which reply got which reward would follow it.
        order = sorted(range(len(batch)), key=lambda i: (batch[i].tokens, batch[i].sample_id))
        dealt = [(batch[i].reward, batch[i].advantage) for i in order]
        rng.shuffle(dealt)
        scores: list[tuple[float, float | None]] = [(0.0, None)] * len(batch)
        for i, score in zip(order, dealt):
            scores[i] = score
    elif control == "zero_rewards":
        scores = [(0.0, None if s.advantage is None else 0.0) for s in batch]
    else:
        raise ValueError(f"control {control!r} is not one of {CONTROLS}")
    return [_scored(s, reward, advantage) for s, (reward, advantage) in zip(batch, scores)]


def _scored(sample: Sample, reward: float, advantage: float | None) -> Sample:
    """`sample` with a control's score and no teacher signal. A live turn dealt a rollout's score (or the other
    way round) keeps its own kind: the live one takes the advantage as its reward's sign, a rollout a reward of 0
    and the live reward as its advantage."""
    if sample.advantage is None and advantage is not None:
        reward, advantage = float((advantage > 0) - (advantage < 0)), None
    elif sample.advantage is not None and advantage is None:
        reward, advantage = 0.0, reward
    # The whole teacher signal goes: its top-k rows too (they exist only on a hinted sample).
    return dataclasses.replace(sample, reward=reward, advantage=advantage, has_hint=False, teacher_logprobs=None,
                               top_ids=None, teacher_top_logprobs=None)
