"""Waiting for the learner's next batch (docs/ARCHITECTURE.md §6): enough fresh samples, or a timeout.

A batch goes once `rollout_batch_size` samples within `max_staleness` versions of the policy are in the
store, or after `rollout_timeout` with at least `min_batch_size`, or at once for samples split off a batch
that ran out of memory (clawd.learning.limits). A backlog goes whole, up to `backlog_batches` batches:
taken in batches of n it would age out. Stale samples are dropped (and counted) as the batch is taken.
"""
from __future__ import annotations

import asyncio
import logging
import time

from clawd.config.learner import LearnerConfig
from clawd.learning.limits import BatchLimits
from clawd.learning.store import SampleStore
from clawd.samples import Sample
from clawd.served import Policy

log = logging.getLogger("clawd.learner")


async def collect(cfg: LearnerConfig, store: SampleStore, limits: BatchLimits, policy: Policy, stats) -> list[Sample]:
    """The next batch, within what the trainer's memory holds; `stats` (LearnerStats) counts what was dropped
    stale and says since when the learner waits."""
    n = cfg.rollout_batch_size
    started = time.monotonic()
    stats.waiting_since = time.time()
    while True:
        version = policy.version  # read again at each pass: a rollback may move it meanwhile
        fresh = store.fresh(version, cfg.max_staleness)
        waited = time.monotonic() - started
        timed_out = cfg.rollout_timeout > 0 and waited >= cfg.rollout_timeout
        if fresh >= n or (timed_out and fresh >= cfg.min_batch_size) or (fresh and limits.capped):
            take = min(max(fresh, n), cfg.backlog_batches * n)
            batch, stale = store.take_batch(take, current_version=version, max_staleness=cfg.max_staleness)
            stats.stale_dropped += len(stale)
            if stale:  # acked with the next checkpoint: they will never be trained
                log.info("dropped %d stale sample(s): more than %d versions behind v%d", len(stale),
                         cfg.max_staleness, version)
            batch = limits.admit(batch)
            if batch:
                stats.waiting_since = None
                return batch
        wait = cfg.stall_warn_interval
        if cfg.rollout_timeout > 0:
            wait = min(wait, max(cfg.rollout_timeout - waited, 0.05))
        try:
            await asyncio.wait_for(store.wait_for(n, current_version=version, max_staleness=cfg.max_staleness), wait)
        except asyncio.TimeoutError:
            if time.monotonic() - started >= cfg.stall_warn_interval:
                log.info("waiting for samples: %d/%d effective (policy v%d, %.0fs)", fresh, n, version, waited)
