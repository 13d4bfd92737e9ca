"""The learner: wait for a batch → train → gate → publish → acknowledge → repeat, while serving goes on.

One long-lived task (owned by `daemon.run`). Batches come from the sample store (stale samples dropped,
fairness applied); the trainer subprocess trains and writes the new weights; with a gate (clawd.safety.gate)
the new version is scored before it serves everyone, and a rejected one is rolled back; the publisher swaps
the policy engine onto it; only then does the policy version move (history: clawd.safety.versions). Samples
are acknowledged once the trainer has checkpointed the step that consumed them: a crash replays, never loses.

The engine serves the trainer's state: a failed publish is retried before the next step; a (re)started
trainer holds its checkpoint's weights, so samples trained after it wait again, and those weights are
published when the engine serves others (a new number when their directory is gone; through the gate when
they never passed it: a restart serves the newest version that did meanwhile). Version numbers only go up.

A step is trained once. When the trainer's write of its weights or of its checkpoint fails, the step
stays in the trainer (`owed` in its state) and only that write is retried before the next step: with
backoff after an I/O error, after a pause (reason "disk", clawd.pauses) when the disk is full or short of
`[state] min_free_bytes`, the end of the pause retrying it first. Only a trainer that died or whose step
itself raised (it exits) loses the step; it restarts from its checkpoint and the unacknowledged samples
are trained again.
"""
from __future__ import annotations

import asyncio
import collections
import errno
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from clawd.config.learner import LearnerConfig
from clawd.engine.client import EngineError
from clawd.served import Policy
from clawd.learning import controls
from clawd.learning.journal import JournalWriteError
from clawd.learning.collect import collect
from clawd.learning.limits import BatchLimits, canonical
from clawd.learning.promotion import Promotion
from clawd.learning.publisher import NotWritten, Publisher
from clawd.learning.recovery import Held, Next, Recovery, held_needs
from clawd.learning.rollback import keep_for_inspection, sort_unacked
from clawd.learning.store import SampleStore
from clawd.pauses import DISK, GATE, NON_FINITE, Pauses, describe
from clawd.safety.gate import PromotionGate
from clawd.safety.versions import CANDIDATE, GOOD, REJECTED, ROLLED_BACK, SERVING, Version, Versions
from clawd.samples import Sample
from clawd.trainer.catalogue import Trained
from clawd.trainer.errors import HandlerError, TrainerError
from clawd.trainer.link import TrainerSupervisor
from clawd.weights import (checkpointed_samples, checkpointed_versions, is_published, ledger_path, read_ledger,
                           version_dir)

log = logging.getLogger("clawd.learner")

_RETRY_INITIAL = 1.0  # seconds before a failed step or publish is tried again; doubles up to _RETRY_MAX
_RETRY_MAX = 30.0


@dataclass
class LearnerStats:
    steps: int = 0
    skipped_steps: int = 0
    no_signal_steps: int = 0  # of those, batches whose every advantage was 0: no optimizer step, nothing to publish
    failed_steps: int = 0
    publishes: int = 0
    failed_publishes: int = 0
    samples_trained: int = 0
    stale_dropped: int = 0
    last_metrics: dict = field(default_factory=dict)
    last_publish_seconds: float = 0.0
    last_intake_held_seconds: float = 0.0  # engine paused: new requests wait, running ones are parked
    waiting_since: float | None = None
    requeued_after_restart: int = 0
    failed_writes: int = 0  # the trainer's weights or checkpoint writes that failed; retried alone, never retrained
    disk_pauses: int = 0    # of those, the ones that paused learning for disk space
    rollbacks: int = 0
    dropped_after_rollback: int = 0  # samples of rejected or rolled-back versions, never trained


class Learner:
    def __init__(self, cfg: LearnerConfig, store: SampleStore, trainer: TrainerSupervisor, publisher: Publisher,
                 policy: Policy, state_dir, *, control_seed: int = 0, pauses: Pauses | None = None,
                 versions: Versions | None = None, gate: PromotionGate | None = None, lora: bool = False,
                 max_sample_tokens: int = 8192, on_step: Callable[[int, Trained, list[Sample]], None] | None = None,
                 on_publish: Callable[[float, float], None] | None = None,
                 reserve: Callable[[int], int] = lambda version: version):
        """reserve: takes the number this learner would give its next version and returns the one it gets
        (adapters per principal: learners of several histories allot numbers at once, and one allotter keeps
        every number given once, clawd.learning.lineages)."""
        self.cfg = cfg
        self.limits = BatchLimits(store, max_sample_tokens)  # what one step may hold: the trainer's memory
        self._control_rng = random.Random(control_seed)  # `[learner] control = "shuffle_rewards"` only
        self.store = store
        self.trainer = trainer
        self.publisher = publisher
        self.policy = policy
        self.state_dir = state_dir
        self.stats = LearnerStats()
        # Learning's one pause state (the daemon's, shared with clawctl and the disk budget): no new step
        # starts while a reason holds; the learner itself adds "disk" and "non_finite".
        self.pauses = pauses if pauses is not None else Pauses(Path(state_dir) / "pause.json")
        self._stopping = False
        self._idle = asyncio.Event()  # no step in progress
        self._rollback_waiting = 0  # rollbacks asked for and not yet begun: no new version is delivered
        self._idle.set()
        self.recovery = Recovery()  # what is owed before the next step (clawd.learning.recovery)
        self._retry_delay = _RETRY_INITIAL
        self.on_publish = on_publish  # (seconds, intake held): metrics
        self.on_step = on_step  # (trained from, reply, batch): the monitors and the learning view
        # Versions (clawd.safety): the history, and the gate a new version passes before it serves everyone.
        self.versions = versions if versions is not None else Versions(Path(state_dir) / "versions.jsonl")
        if self.versions.get(policy.version) is None:
            self.versions.add(Version(policy.version, None, time.time(), "serving", detail="served at start"))
        self.promotion = None if gate is None else Promotion(gate, self.versions, publisher, policy, lora=lora)
        self._work = asyncio.Lock()  # a step, a promotion or a rollback: one at a time
        self._reserve = reserve

    @property
    def paused(self) -> bool:
        return self._stopping or self.pauses.learning

    @property
    def busy(self) -> bool:
        """A step, promotion or rollback is in progress (a pause lets it finish)."""
        return not self._idle.is_set()

    @property
    def pause_reason(self) -> str | None:
        if self._stopping:
            return "stopping"
        return "; ".join(map(describe, self.pauses.held.values())) or None

    async def run(self) -> None:
        while not self._stopping:
            await self.pauses.until_running()
            if self._stopping:
                return
            if not await self._busy(self._serve_trainer_state()):
                continue
            batch = await collect(self.cfg, self.store, self.limits, self.policy, self.stats)
            if self.paused:  # paused while waiting: the batch goes back untouched
                self.store.requeue(batch)
                continue
            await self._busy(self._step(batch))

    async def _busy(self, work):
        """Runs `work` as the step in progress that `stop` lets finish."""
        try:
            async with self._work:
                self._idle.clear()
                try:
                    return await work
                finally:
                    self._idle.set()
        finally:
            work.close()  # cancelled while waiting for the lock (a rollback held it): never started

    async def stop(self, timeout: float) -> None:
        """Let a step in progress finish (within timeout) and checkpoint what was trained, so its
        samples are acknowledged now rather than trained again after the restart. The caller then
        cancels `run`; a step cut short is replayed from the journal on the next start."""
        self._stopping = True
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
                if self.recovery.unacked and self.trainer.alive:
                    await self.trainer.checkpoint(timeout)
                    await self._ack()
        except (TimeoutError, TrainerError) as exc:
            log.warning("stopping without a final checkpoint (%s); %d trained sample(s) replay at the next start",
                        exc or "timed out", len(self.recovery.unacked))

    async def _serve_trainer_state(self) -> bool:
        """Before a step, make the engine serve what the trainer holds. False: not yet, try again."""
        try:
            ready = await self.trainer.ready_info()
        except TrainerError as exc:  # no live trainer for a long while: say so, keep waiting
            log.error("learner waiting for the trainer: %s", exc)
            await self._backoff()
            return False
        rec = self.recovery
        if ready.pid != rec.trainer_pid:
            self._trainer_restarted(ready.pid)
            rec.unpublished = None
            if (lost := rec.lost(lambda path: is_published(Path(path)))) is not None:
                self._lost(lost)
            record = self.versions.get(ready.weights_version)
            path = version_dir(self.state_dir, ready.weights_version)
            need = held_needs(ready.weights_version, record and record.status, self.policy.version,
                              is_published(path), self.promotion is not None)
            if need is Held.GATE:
                rec.candidate = (str(path), ready.weights_version)  # unchecked: its gate first
            elif need is Held.SERVE:
                rec.unpublished = (str(path), ready.weights_version)
            elif need is Held.RENUMBER:  # older (checkpoint_every > 1) or rotated out: the same weights, a new number
                version = self._next_version()
                try:
                    weights = await self.trainer.publish(version, timeout=self.cfg.publish_timeout)
                except TrainerError as exc:
                    log.error("could not write the trainer's weights as v%d: %s", version, exc)
                    rec.trainer_pid = None  # try the whole thing again
                    return await self._write_failed("publish", exc)
                rec.unpublished = (weights, version)
        if not rec.recovered:
            await self._recover(ready.weights_version)
        if not await self._write_owed():
            return False
        self._retry_delay = _RETRY_INITIAL
        return True

    def _lost(self, version: int) -> None:
        """A candidate whose directory the trainer child died writing (a deferred write): its weights died with
        it. Replicas that took them over their group go back onto the policy's; its samples train again."""
        self.versions.update(version, status=ROLLED_BACK, detail="lost: the trainer died before its directory "
                             "was written")
        self.publisher.abandon(version)
        log.error("v%d is lost: the trainer died before its directory was written", version)

    async def _recover(self, held_version: int) -> None:
        """At start: the trainer left on a rejected or rolled-back version (`held_version`) is rolled back again."""
        self.recovery.recovered = True
        record = self.versions.get(held_version)
        if record is not None and record.status in (REJECTED, ROLLED_BACK):
            log.warning("v%d was %s before the last stop: rolling back again", record.version, record.status)
            await self._rollback(self._target(exclude={record.version}), f"at start: v{record.version} was "
                                 f"{record.status}")

    async def _write_owed(self) -> bool:
        """The writes the trainer's last step still owes (its state's `owed`), each retried alone, and the
        engine moved onto the newest written version. False: not yet (paused or backed off)."""
        rec = self.recovery
        while (step := rec.next((self.trainer.state or {}).get("owed", []))) is not None:
            if step is Next.DELIVER:  # its gate or its publish failed: again
                if not await self._deliver():
                    await self._backoff()
                    return False
            elif step is Next.PUBLISH:
                version = self._next_version()
                try:
                    rec.unpublished = (await self.trainer.publish(version, timeout=self.cfg.publish_timeout), version)
                except TrainerError as exc:
                    return await self._write_failed("publish", exc)
            elif step is Next.SERVE:
                if not await self._publish(*rec.unpublished):
                    await self._backoff()
                    return False
                rec.unpublished = None
            else:  # Next.CHECKPOINT
                try:
                    await self.trainer.checkpoint(self.cfg.publish_timeout)
                except TrainerError as exc:
                    return await self._write_failed("checkpoint", exc)
                await self._ack()
        return True

    async def _write_failed(self, op: str, exc: TrainerError | dict) -> bool:
        """A trainer write failed: pause for disk space, else back off. Always False (not written yet)."""
        kind = exc.get("kind") if isinstance(exc, dict) else getattr(exc, "kind", None)
        message = exc.get("message") if isinstance(exc, dict) else str(exc)
        self.stats.failed_writes += 1
        if kind == "disk":
            self.stats.disk_pauses += 1
            self.pauses.hold(DISK, f"the trainer's {op} failed: {message}")
            log.error("learning paused: the trainer's %s failed for disk space; the trained step is kept and "
                      "the %s is retried first when the pause lifts: %s", op, op, message)
        else:
            log.error("the trainer's %s failed, retrying it (the step is kept): %s", op, message)
            await self._backoff()
        return False

    def _next_version(self) -> int:
        return self._reserve(max(self.policy.version, self.trainer.version, self.versions.newest) + 1)

    async def _ack(self) -> None:
        """A checkpoint holds every step trained so far: their samples leave the journal. A journal write that
        fails keeps them for the next ack (until then a restart would train them again: at least once)."""
        done = self.recovery.acknowledged()
        if not done:
            return
        try:
            await self.store.ack([s.sample_id for s in done])
        except JournalWriteError as exc:
            self.recovery.unacknowledged(done)
            log.error("acknowledging %d trained sample(s) failed, retried with the next checkpoint: %s",
                      len(done), exc)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self.pauses.hold(DISK, f"a journal acknowledgement failed: {exc.strerror or exc}")

    def _trainer_restarted(self, pid: int) -> None:
        """A new child resumed from the newest checkpoint: samples trained since are not in it and wait to be
        trained again; those it holds (a child that died after its checkpoint, before its reply) stay to be
        acknowledged, never trained twice."""
        again = self.recovery.restarted(pid, lambda: checkpointed_samples(self.state_dir))
        if again:
            log.warning("trainer restarted from its checkpoint: %d trained sample(s) wait to be trained again",
                        len(again))
            self.stats.requeued_after_restart += len(again)
            self.store.requeue(again)

    async def _backoff(self) -> None:
        await asyncio.sleep(self._retry_delay)
        self._retry_delay = min(self._retry_delay * 2, _RETRY_MAX)

    async def _step(self, batch: list[Sample]) -> None:
        version = self._next_version()
        batch_id = uuid.uuid4().hex
        try:
            trained = await self.trainer.train(batch_id, version, controls.apply(self.cfg.control, canonical(batch),
                                                                                  self._control_rng),
                                               timeout=self.cfg.train_timeout,
                                               # with groups, the directory is written off the critical path
                                               deferred=self.publisher.groups is not None, renumber=self._reserve)
        except TrainerError as exc:  # no step was kept for the batch (a fatal one restarts the trainer)
            self.stats.failed_steps += 1
            if isinstance(exc, HandlerError) and exc.kind == "oom":  # a bad batch: split, never sent whole again
                return self.limits.out_of_memory(batch, exc)
            log.error("training step failed, its %d samples wait for the next try: %s", len(batch), exc)
            self.store.requeue(batch)
            if not (isinstance(exc, HandlerError) and exc.fatal):
                await self._backoff()
            return
        ready = self.trainer.ready
        if ready is not None and ready.pid != self.recovery.trainer_pid:  # restarted during the step, which it retried
            self._trainer_restarted(ready.pid)
            self._catch_up(trained)
        self.stats.steps += 1
        self.stats.samples_trained += len(batch)
        self.limits.trained(batch)
        self.stats.last_metrics = trained.metrics
        if self.on_step is not None:  # the monitors and the learning view: what the step measured, and of which policy
            self.on_step(self.policy.version, trained, batch)
        written = None if trained.weights_dir is None else (trained.weights_dir, trained.version)
        self.recovery.stepped(batch, written, (trained.state or {}).get("writing"))
        if trained.weights_dir is None and trained.failed is None:  # nothing to publish: not a failed publish
            self.stats.skipped_steps += 1
            self.stats.no_signal_steps += bool(trained.metrics.get("no_signal"))
            log.log(logging.INFO if trained.metrics.get("no_signal") else logging.WARNING, "step %s skipped: %s",
                    batch_id, trained.metrics.get("skip_reason"))
            if trained.metrics.get("paused"):  # non-finite steps in a row: stop, say so, keep serving
                self.pauses.hold(NON_FINITE, str(trained.metrics.get("pause_reason")))
        elif trained.weights_dir is not None:
            self.versions.add(Version(trained.version, self.policy.version, time.time(), CANDIDATE,
                                      steps=((trained.state or {}).get("step", 0),), samples=len(batch),
                                      principals=dict(collections.Counter(s.principal for s in batch))))
            await self._deliver()  # a failure is retried before the next step
        if trained.checkpointed:
            await self._ack()
        if trained.failed is not None:  # the step is kept; only the write is retried, before the next step
            await self._write_failed(trained.failed["op"], trained.failed)

    def _catch_up(self, trained: Trained) -> None:
        """A retried step the restarted trainer found already in its checkpoint publishes nothing new: the
        engine must still move onto that checkpoint's weights, which the lost reply never named."""
        version = (trained.state or {}).get("weights_version")
        if trained.weights_dir is None and version is not None and version > self.policy.version:
            path = version_dir(self.state_dir, version)
            if is_published(path):
                self.recovery.unpublished = (str(path), version)

    async def _deliver(self) -> bool:
        """The candidate onto the engine, through the gate when there is one: promoted, or rejected and the
        trainer rolled back. False: not yet (an engine or the evaluation failed; tried again)."""
        weights, version = self.recovery.candidate
        if self._rollback_waiting:  # asked while this version trained: it is doomed, and never serves
            log.warning("v%d is not delivered: a rollback is waiting", version)
            self.recovery.decided()
            return True
        if self.promotion is None:
            if not await self._publish(weights, version):
                return False
        else:
            verdict = await self.promotion.deliver(weights, version, self._publish)
            if verdict is None:
                return False
            if not verdict["passed"]:
                self.recovery.decided()
                await self._rollback(self._target(exclude={version}), f"gate: {verdict['detail']}", rejected=version)
                self.pauses.hold(GATE, f"v{version} rejected: {verdict['detail']}")
                return True
        self.recovery.decided()
        return True

    def _target(self, exclude: set[int] = frozenset()) -> int:
        """The newest version that served cleanly and has a checkpoint: where a rollback returns."""
        kept = checkpointed_versions(self.state_dir)
        good = [v.version for v in self.versions.good() if v.version in kept and v.version not in exclude]
        if not good:
            raise TrainerError("no checkpoint of a version that served cleanly: nothing to roll back to")
        return max(good)

    async def rollback(self, target: int | None = None, *, reason: str, pause: str | None = None) -> int:
        """Return to `target` (default: the newest clean version before the one serving): the trainer restores
        its checkpoint, weights and optimizer, and its weights serve again as a new version (numbers never
        repeat). The versions after it are marked rolled back and their samples dropped. The version serving."""
        self._check_target(target)  # before waiting: a refused rollback must not hold back the step in progress
        self._rollback_waiting += 1  # the step in progress, if any, promotes nothing more (`_deliver`)
        try:
            async with self._work:
                served = await self._rollback(self._check_target(target), reason)
        finally:
            self._rollback_waiting -= 1
        if pause is not None:
            self.pauses.hold(pause, reason)
        return served

    def _check_target(self, target: int | None) -> int:
        if target is None:
            target = self._target(exclude={self.policy.version})
        record = self.versions.get(target)
        if record is None or record.status not in GOOD or target not in checkpointed_versions(self.state_dir):
            raise ValueError(f"v{target} cannot be rolled back to: only a version that served cleanly and has "
                             f"a checkpoint (now: {sorted(checkpointed_versions(self.state_dir))})")
        if target == self.policy.version:
            raise ValueError(f"v{target} is the version serving")
        return target

    async def checkpoint(self) -> dict:
        """`clawctl checkpoint`: a checkpoint of the weights serving now (a rollback target from here on)."""
        async with self._work:
            if not await self._write_owed():
                raise TrainerError("the trainer still owes a write; see the log")
            done = await self.trainer.checkpoint(self.cfg.publish_timeout)
            await self._ack()
            return {"path": done.path, "step": done.step, "version": self.policy.version}

    async def _rollback(self, target: int, reason: str, rejected: int | None = None) -> int:
        current = (self.trainer.state or {}).get("step", 0)  # the abandoned branch's last step
        step = await self.trainer.restore(target, timeout=self.cfg.publish_timeout)
        doomed = {v.version for v in self.versions if v.version > target and v.status in (CANDIDATE, "serving")}
        doomed |= {v for v in self.versions.lineage(self.policy.version) if v > target}
        ledger = read_ledger(ledger_path(self.state_dir))
        kept, dropped, again = sort_unacked(self.recovery.unacked, ledger, current, step, doomed)
        self.recovery.rolled_back(kept, dropped)  # acknowledged with the owed checkpoint: never trained again
        self.store.requeue(again)
        keep_for_inspection(self.state_dir, [s for s in dropped if not self.store.is_forgotten(s.sample_id)],
                            sorted(doomed))  # a forgotten person's samples are not written back to disk
        for version in sorted(doomed):  # a version rejected before keeps saying so
            was = self.versions.get(version)
            rejects = rejected == version or (was is not None and was.status == REJECTED)
            self.versions.update(version, status=REJECTED if rejects else ROLLED_BACK,
                                 detail=f"{reason}; back to v{target}")
        self.stats.dropped_after_rollback += self.store.drop_versions(doomed)
        self.stats.rollbacks += 1
        if target != self.policy.version:  # the engine serves a doomed version: the target's weights, renumbered
            version = self._next_version()
            weights = await self.trainer.publish(version, timeout=self.cfg.publish_timeout)
            self.versions.add(Version(version, target, time.time(), CANDIDATE, restored_from=target,
                                      detail=f"v{target} again ({reason})"))
            if not await self._publish(weights, version):
                self.recovery.unpublished = (weights, version)
        elif self.versions.get(target).status != SERVING:  # a restart already serves it: it is the serving one again
            self.versions.promote(target, f"serving again ({reason})")
        log.warning("rolled back to v%d (%s): %d sample(s) of %s dropped, %d to train again; serving v%d", target,
                    reason, len(dropped), ", ".join(f"v{v}" for v in sorted(doomed)), len(again), self.policy.version)
        await self._write_owed()
        return self.policy.version

    async def _publish(self, weights_dir: str, version: int, promote: bool = True) -> bool:
        started = time.monotonic()
        try:
            held = await self.publisher.publish(weights_dir, version)
        except EngineError as exc:
            self.stats.failed_publishes += 1
            log.error("publishing v%d failed, still serving v%d (retrying): %s", version, self.policy.version, exc)
            if isinstance(exc, NotWritten) and getattr(exc.error, "kind", None) == "disk":
                self.stats.disk_pauses += 1
                self.pauses.hold(DISK, f"the trainer's write of v{version} failed: {exc.error}")
            return False
        self.stats.publishes += 1
        self.stats.last_publish_seconds = time.monotonic() - started
        self.stats.last_intake_held_seconds = held
        if self.on_publish is not None:
            self.on_publish(self.stats.last_publish_seconds, held)
        retired = self.policy.adapter
        self.policy.version = version
        self.policy.weight_version = str(version)
        self.policy.weights_dir = weights_dir
        self.policy.adapter = self.publisher.adapter_of(version)
        self.policy.published_at = time.time()
        self.publisher.retire(retired)  # unloaded once the requests that carry it are done
        if promote:
            self.versions.promote(version)
        log.info("published v%d in %.2fs, intake held %.3fs (%s)", version, self.stats.last_publish_seconds, held,
                 weights_dir)
        return True
