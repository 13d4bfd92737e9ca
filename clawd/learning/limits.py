"""What one training step is given: within what the trainer's memory holds, in an order of its own
(docs/ARCHITECTURE.md §13).

`split` and `cut` are pure; `BatchLimits` keeps the caps and the counts and moves samples in the store.

- A sample longer than `max_sample_tokens` is never trained: it is excluded (reason "too_long"), its
  journal entry acked as a stale one is, and counted. One long agent transcript would otherwise train
  alone at any size (a micro-batch takes a sample longer than its budget whole).
- A step that ran out of memory is a bad batch, not a broken trainer: every sample of the batch gets a
  cap, half the batch's size, on the batches it may be in, and goes back to the front of the line; the
  next batch holding one is cut to the smallest cap among its samples (capped samples first). A batch of
  one that runs out of memory is excluded (reason "oom"). Caps only shrink, so a batch can fail at most
  about 2n - 1 times for n samples: never a loop. Caps live in memory: after a restart a batch may run out
  of memory once more, and is split again.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Sequence

from clawd.learning.store import SampleStore
from clawd.samples import Sample

log = logging.getLogger("clawd.learner")

TOO_LONG, OOM = "too_long", "oom"


def canonical(batch: list[Sample]) -> list[Sample]:
    """The batch in an order of its own (by tokens, then id), as the trainer is given it. The order samples
    reached the store is a race between concurrent scorings; the trainer's packing (ties by position) and
    its float sums would follow it, and the same samples would give a step that differs in the last bits."""
    return sorted(batch, key=lambda s: (s.tokens, s.sample_id))


def cut(batch: Sequence[Sample], caps: dict[str, int], max_tokens: int) -> tuple[list, list, list]:
    """(to train now, to put back in line, too long to ever train): the batch without samples over
    `max_tokens`, cut to the smallest cap among its samples, capped samples first. Pure."""
    long = [s for s in batch if len(s.tokens) > max_tokens]
    fits = [s for s in batch if len(s.tokens) <= max_tokens]
    limit = min((caps[s.sample_id] for s in fits if s.sample_id in caps), default=len(fits))
    ordered = [s for s in fits if s.sample_id in caps] + [s for s in fits if s.sample_id not in caps]
    return ordered[:limit], ordered[limit:], long


def split(batch: Sequence[Sample], caps: dict[str, int]) -> tuple[dict[str, int], list[Sample]]:
    """After `batch` ran out of memory: (the new caps, the samples to exclude). A batch of one is excluded;
    otherwise each of its samples is capped at half its size (a cap never grows). Pure."""
    if len(batch) == 1:
        return {k: v for k, v in caps.items() if k != batch[0].sample_id}, list(batch)
    half = len(batch) // 2
    return {**caps, **{s.sample_id: min(caps.get(s.sample_id, half), half) for s in batch}}, []


class BatchLimits:
    """The learner's gate between the store and the trainer: what a step may be given."""

    def __init__(self, store: SampleStore, max_sample_tokens: int):
        self.store = store
        self.max_sample_tokens = max_sample_tokens
        self.excluded: Counter[str] = Counter()  # samples never trained, by reason
        self.oom_steps = 0                        # steps that ran out of memory
        self._caps: dict[str, int] = {}           # sample id -> most samples a batch holding it may have

    @property
    def capped(self) -> int:
        """Samples in line under a cap: split off a batch that ran out of memory, not trained yet. Caps of samples
        that left the line otherwise (dropped as stale, forgotten) go."""
        if self._caps:
            waiting = self.store.waiting_ids()
            self._caps = {k: v for k, v in self._caps.items() if k in waiting}
        return len(self._caps)

    def admit(self, batch: Sequence[Sample]) -> list[Sample]:
        """The part of a batch the store handed out that a step may take; the rest goes back in line first,
        and samples too long to train are excluded."""
        now, rest, long = cut(batch, self._caps, self.max_sample_tokens)
        self.store.requeue(rest)
        self._exclude(long, TOO_LONG, f"longer than {self.max_sample_tokens} tokens")
        return now

    def out_of_memory(self, batch: Sequence[Sample], why: BaseException) -> None:
        """The step on `batch` ran out of memory: back in line under caps, or excluded when alone."""
        self.oom_steps += 1
        self._caps, too_big = split(batch, self._caps)
        log.warning("training step ran out of memory on %d sample(s); %s: %s", len(batch),
                    "the sample is excluded" if too_big else "they go again in smaller batches", why)
        self._exclude(too_big, OOM, "too big for the trainer's memory alone")
        self.store.requeue([s for s in batch if s not in too_big])

    def trained(self, batch: Sequence[Sample]) -> None:
        for s in batch:
            self._caps.pop(s.sample_id, None)

    def _exclude(self, samples: list[Sample], reason: str, why: str) -> None:
        if samples:
            self.excluded[reason] += len(samples)
            self.store.exclude(samples)
            log.warning("excluded %d sample(s) from training, %s: %s", len(samples), why,
                        ", ".join(s.sample_id for s in samples[:8]))

    def snapshot(self) -> dict:
        return {"max_sample_tokens": self.max_sample_tokens, "excluded": dict(self.excluded),
                "oom_steps": self.oom_steps, "capped": self.capped}
