"""The local engine's priority scheduling: SGLang's flags and order, and the CPU's form of preemption.

As in SGLang 0.5.x with --enable-priority-scheduling, a request's `priority` (one int for the whole
request) orders the waiting queue, larger first (smaller first with
--schedule-low-priority-values-first), ties by arrival; a request without one ranks last. Off, a
priority is accepted and ignored. Preemption differs with what a row costs. On a GPU a decode step
costs about the same for 1 row as for 64, so SGLang preempts (retracts) lower rows only when its
batch is full. On a CPU every row is paid for in every step, so here a running row yields at the next
step boundary to any live request ranked more than --priority-scheduling-preemption-threshold above
it (SGLang's flag and default): it waits with its KV cache kept (recomputed where the cache cannot be
re-padded, as SGLang's retraction is), counts in `num_retractions` as SGLang's preempted requests do,
and rejoins when no such request is left. What clawd sends: docs/ARCHITECTURE.md §19.
"""
from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass

LAST = -math.inf  # the rank of a request that names no priority while scheduling by priority


def add_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--enable-priority-scheduling", action="store_true",
                    help="order requests by their `priority` (larger first) and let higher ones preempt lower")
    ap.add_argument("--schedule-low-priority-values-first", action="store_true",
                    help="with --enable-priority-scheduling: smaller priority values first")
    ap.add_argument("--priority-scheduling-preemption-threshold", type=int, default=10,
                    help="how much higher a request's priority must be to preempt a running one")


@dataclass(frozen=True)
class Priorities:
    enabled: bool = False
    low_first: bool = False
    threshold: int = 10

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Priorities:
        return cls(args.enable_priority_scheduling, args.schedule_low_priority_values_first,
                   args.priority_scheduling_preemption_threshold)

    def rank(self, priority: int | None) -> float:
        """A request's rank: higher is served first; every request ranks 0 while scheduling ignores priority."""
        if not self.enabled:
            return 0
        if priority is None:
            return LAST
        return -priority if self.low_first else priority

    def outranks(self, rank: float, other: float) -> bool:
        """Whether a request of `rank` preempts one of `other` (by more than the threshold, as SGLang)."""
        return rank - other > self.threshold  # two LAST ranks: nan, which is not above it

    def yielding(self, ranks: list[float], best: float) -> list[int]:
        """The indices of `ranks` (running rows) that yield while a request of rank `best` is live."""
        return [i for i, r in enumerate(ranks) if self.outranks(best, r)]

    def eligible(self, ranks: list[float], best: float) -> int:
        """How many of `ranks` (the waiting queue, best first) may start while a request of rank `best` is live:
        the leading ones it does not outrank."""
        return sum(1 for _ in itertools.takewhile(lambda r: not self.outranks(best, r), ranks))
