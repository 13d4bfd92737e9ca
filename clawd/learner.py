"""The learner: wait for a batch → train → publish → acknowledge → repeat, while serving goes on.

One long-lived task (owned by `daemon.run`). Batches come from the sample
store (stale samples dropped, fairness applied); the trainer subprocess trains
and writes the new weights as a Hugging Face directory; the publisher swaps the
policy engine onto them; only then does the policy version move. Samples are
acknowledged in the journal once the trainer has checkpointed the step that
consumed them, so a crash anywhere replays them rather than losing them.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

from .chat import Policy
from .config import LearnerConfig
from .engine.client import EngineClient, EngineError
from .sample_store import SampleStore
from .samples import Sample
from .trainer_link import TrainerError, TrainerSupervisor

log = logging.getLogger("clawd.learner")


@dataclass
class LearnerStats:
    steps: int = 0
    skipped_steps: int = 0
    failed_steps: int = 0
    publishes: int = 0
    failed_publishes: int = 0
    samples_trained: int = 0
    stale_dropped: int = 0
    last_metrics: dict = field(default_factory=dict)
    last_publish_seconds: float = 0.0
    waiting_since: float | None = None


class Publisher:
    """Moves the policy engine onto a published directory (DESIGN §14 'Versions and the swap')."""

    def __init__(self, engine: EngineClient, timeout: float):
        self.engine = engine
        self.timeout = timeout

    async def publish(self, weights_dir: str, version: int) -> None:
        # Retract parks running requests (they resume on the new weights); nothing is refused.
        await self.engine.control("/pause_generation", {"mode": "retract"}, self.timeout)
        try:
            await self.engine.control("/update_weights_from_disk",
                                      {"model_path": weights_dir, "weight_version": str(version)}, self.timeout)
        finally:
            await self.engine.control("/continue_generation", {}, self.timeout)
        # The engine's own word on what it serves beats the HTTP status of the update.
        served = (await self.engine.model_info()).get("weight_version")
        if served != str(version):
            raise EngineError(f"engine serves weight_version {served!r} after publishing {version}")


class Learner:
    def __init__(self, cfg: LearnerConfig, store: SampleStore, trainer: TrainerSupervisor, publisher: Publisher,
                 policy: Policy):
        self.cfg = cfg
        self.store = store
        self.trainer = trainer
        self.publisher = publisher
        self.policy = policy
        self.stats = LearnerStats()
        self._running = asyncio.Event()
        self._running.set()
        self._unacked: list[str] = []  # trained, not yet covered by a checkpoint
        self.pause_reason: str | None = None

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    def pause(self, reason: str | None = None) -> None:
        """No new step starts; the current one finishes."""
        self.pause_reason = reason or self.pause_reason or "paused by the operator"
        self._running.clear()

    def resume(self) -> None:
        self.pause_reason = None
        self._running.set()

    async def run(self) -> None:
        while True:
            await self._running.wait()
            batch = await self._collect()
            if self.paused:  # paused while waiting: the batch goes back untouched
                self.store.requeue(batch)
                continue
            await self._step(batch)

    async def _collect(self) -> list[Sample]:
        cfg, n = self.cfg, self.cfg.rollout_batch_size
        started = time.monotonic()
        self.stats.waiting_since = time.time()
        while True:
            version = self.policy.version
            fresh = self.store.fresh(version, cfg.max_staleness)
            waited = time.monotonic() - started
            timed_out = cfg.rollout_timeout > 0 and waited >= cfg.rollout_timeout
            if fresh >= n or (timed_out and fresh >= cfg.min_batch_size):
                batch, stale = self.store.take_batch(n, current_version=version, max_staleness=cfg.max_staleness)
                self.stats.stale_dropped += len(stale)
                if batch:
                    self.stats.waiting_since = None
                    return batch
            wait = cfg.stall_warn_interval
            if cfg.rollout_timeout > 0:
                wait = min(wait, max(cfg.rollout_timeout - waited, 0.05))
            try:
                await asyncio.wait_for(self.store.wait_for(n, current_version=version,
                                                           max_staleness=cfg.max_staleness), wait)
            except asyncio.TimeoutError:
                if time.monotonic() - started >= cfg.stall_warn_interval:
                    log.info("waiting for samples: %d/%d effective (policy v%d, %.0fs)", fresh, n, version, waited)

    async def _step(self, batch: list[Sample]) -> None:
        version = max(self.policy.version, self.trainer.version) + 1
        batch_id = uuid.uuid4().hex
        try:
            trained = await self.trainer.train(batch_id, version, batch, timeout=self.cfg.train_timeout)
        except TrainerError as exc:
            self.stats.failed_steps += 1
            log.error("training step failed, its %d samples wait for the next try: %s", len(batch), exc)
            self.store.requeue(batch)
            await asyncio.sleep(1.0)
            return
        self.stats.steps += 1
        self.stats.samples_trained += len(batch)
        self.stats.last_metrics = trained.metrics
        self._unacked += [s.sample_id for s in batch]
        if trained.weights_dir is None:
            self.stats.skipped_steps += 1
            log.warning("step %s skipped: %s", batch_id, trained.metrics.get("skip_reason"))
            if trained.metrics.get("paused"):  # non-finite steps in a row: stop, say so, keep serving
                self.pause_reason = f"trainer paused: {trained.metrics.get('pause_reason')}"
                log.error("learning paused: %s", self.pause_reason)
                self.pause(self.pause_reason)
        else:
            await self._publish(trained.weights_dir, version)
        if trained.checkpointed:
            await self.store.ack(self._unacked)
            self._unacked = []

    async def _publish(self, weights_dir: str, version: int) -> None:
        started = time.monotonic()
        try:
            await self.publisher.publish(weights_dir, version)
        except EngineError as exc:
            # The engine keeps serving the previous version; the next step publishes newer weights.
            self.stats.failed_publishes += 1
            log.error("publishing v%d failed, still serving v%d: %s", version, self.policy.version, exc)
            return
        self.stats.publishes += 1
        self.stats.last_publish_seconds = time.monotonic() - started
        self.policy.version = version
        self.policy.weight_version = str(version)
        self.policy.published_at = time.time()
        log.info("published v%d in %.2fs (%s)", version, self.stats.last_publish_seconds, weights_dir)
