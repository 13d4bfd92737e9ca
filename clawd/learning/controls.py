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
        dealt = [batch[i].reward for i in order]
        rng.shuffle(dealt)
        rewards = [0.0] * len(batch)
        for i, r in zip(order, dealt):
            rewards[i] = r
    elif control == "zero_rewards":
        rewards = [0.0] * len(batch)
    else:
        raise ValueError(f"control {control!r} is not one of {CONTROLS}")
    # The whole teacher signal goes: its top-k rows too (they exist only on a hinted sample).
    return [dataclasses.replace(s, reward=r, has_hint=False, teacher_logprobs=None, top_ids=None,
                                teacher_top_logprobs=None) for s, r in zip(batch, rewards)]
