"""Moving the policy engine onto a published version (docs/ARCHITECTURE.md §6).

Full weights: each replica in turn pauses its intake (retract), takes the weights over its weight-update
group with the trainer (clawd.learning.weight_groups) or else loads the directory from disk, and
continues; the engine's own word on the weight_version it serves confirms it. LoRA mode: each replica
loads the adapter beside the base, nothing paused. The learner moves the policy only once every replica
in rotation has confirmed and the version's directory is on disk: with groups the trainer writes it off
the critical path (clawd.trainer.worker.publishing), and whatever reads it from disk waits for it (`_on_disk`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Callable

from clawd.engine.client import EngineClient, EngineError, EngineUnavailable
from clawd.engine.lora import AdapterUse, adapter_name
from clawd.engine.replicas import Replicas
from clawd.learning.weight_groups import WeightGroups
from clawd.trainer.errors import TrainerError
from clawd.weights import is_published

log = logging.getLogger("clawd.learner")


class NotWritten(EngineUnavailable):
    """A version's directory that the trainer's deferred write did not put on disk: nothing loads it and the
    policy does not move onto it; the publish is retried. `error`: the trainer's (its kind says "disk")."""

    def __init__(self, message: str, error: TrainerError | None = None):
        super().__init__(message)
        self.error = error


class Publisher:
    """Moves the policy engine onto a published directory (docs/ARCHITECTURE.md §6).

    Given `Replicas`, a rolling publish: each replica in rotation is swapped in turn (new work goes to the
    others meanwhile), so serving never stops. `publish` returns once every replica in rotation confirmed
    the version (the learner then moves the policy); a replica whose swap failed is marked `needs_realign`,
    out of rotation until its supervisor has moved it onto the policy's weights, provided another replica
    confirmed. If none did, the publish fails as a whole and is retried, as with one engine."""

    def __init__(self, engine: EngineClient | Replicas, timeout: float, ready: asyncio.Event | None = None,
                 adapters: AdapterUse | None = None, base_dir: str | None = None, groups: WeightGroups | None = None,
                 before_load: Callable[[str], None] | None = None):
        self.replicas = engine if isinstance(engine, Replicas) else None
        self.engine = None if isinstance(engine, Replicas) else engine
        self.timeout = timeout
        self.ready = ready  # the engine supervisor's: set while the engine is up and on the published weights
        self.adapters = adapters  # LoRA mode: a publish loads an adapter beside the base (clawd.engine.lora)
        self.canary: int | None = None  # the replica holding a candidate apart (`hold_apart`)
        self.base_dir = base_dir  # the base model's directory: what v0 is, for a canary going back to it
        # Called with a version's directory before any engine is asked to read it: [privacy] weights_group
        # opens it to an engine run as another user (clawd.privacy.files.share).
        self.before_load = before_load
        # Full weights over torch.distributed (clawd.learning.weight_groups); None: from disk. With groups the
        # trainer writes a version's directory off the critical path, while it is pushed: whatever reads it
        # from disk waits for it first (`_on_disk`), and so does `publish`'s return.
        self.groups = groups

    def adapter_of(self, version: int) -> str | None:
        """The adapter name version's requests carry; None for full weights, and for v0 (the base itself)."""
        return None if self.adapters is None or version == 0 else adapter_name(version)

    def retire(self, adapter: str | None) -> None:
        if self.adapters is not None:
            self.adapters.retire(adapter, range(len(self.replicas) if self.replicas is not None else 1))

    def abandon(self, version: int) -> None:
        """Replicas that took `version` over their group, which must not keep it (its directory was lost with
        the trainer child): their supervisors move them back onto the policy's weights."""
        for sup in self.replicas.supervisors if self.replicas is not None else ():
            if sup.info.get("weight_version") == str(version):
                sup.needs_realign = True

    async def stage(self, weights_dir: str, version: int) -> None:
        """LoRA: load a candidate's adapter on every ready replica, where no chat request carries it: the gate
        asks it by name. `publish` then finds it loaded; `unstage` unloads it once the gate rejected it."""
        engines = [self.engine] if self.replicas is None else [
            s.client for s in self.replicas.supervisors if s.is_ready and not s.needs_realign]
        if not engines:
            raise EngineUnavailable("no policy replica is ready to hold the candidate")
        await self._on_disk(weights_dir, version)
        for engine in engines:
            if adapter_name(version) not in await engine.loaded_adapters():
                await engine.load_adapter(adapter_name(version), weights_dir, self.timeout)

    def unstage(self, version: int) -> None:
        self.retire(adapter_name(version))

    async def hold_apart(self, weights_dir: str, version: int) -> EngineClient | None:
        """Full weights on several replicas: one leaves rotation (once its running requests end) and takes
        the candidate, and the gate asks it alone: no chat request reaches it. None with fewer than two
        replicas in rotation (one engine holds one set of weights: the candidate must serve to be checked)."""
        replicas = self.replicas
        if replicas is None or self.adapters is not None:
            return None
        usable = [i for i in range(len(replicas)) if replicas.usable(i)]
        if len(usable) < 2:
            return None
        i = usable[-1]
        sup, counts = replicas.supervisors[i], replicas.counts[i]
        counts.canary = True
        try:
            async with asyncio.timeout(self.timeout):
                while counts.in_flight:  # a request on the old weights would resume on the candidate's
                    await asyncio.sleep(0.05)
            async with sup.swap_lock:
                await self._swap(sup.client, weights_dir, version, group=sup.name)
                sup.info = {**sup.info, "weight_version": str(version)}
        except (EngineError, TimeoutError) as exc:
            counts.canary = False
            sup.needs_realign = True  # whatever it holds now, its supervisor moves it back onto the policy
            raise EngineUnavailable(f"the canary {sup.name} could not take v{version}: {exc}") from None
        self.canary = i
        log.info("v%d held apart on %s for its gate", version, sup.name)
        return sup.client

    async def release(self, back_to: tuple[str, str] | None) -> None:
        """The canary rejoins rotation: promoted (`publish` found it on the version already), or rejected and
        moved back onto `back_to` (weights directory, weight_version); a failed move is its supervisor's."""
        if self.canary is None:
            return
        i, self.canary = self.canary, None
        sup = self.replicas.supervisors[i]
        if back_to is not None:
            try:
                async with sup.swap_lock:
                    await self._swap(sup.client, back_to[0], int(back_to[1]))
                    sup.info = {**sup.info, "weight_version": back_to[1]}
            except EngineError as exc:
                log.error("the canary %s could not go back to v%s (its supervisor realigns it): %s", sup.name,
                          back_to[1], exc)
                sup.needs_realign = True
        self.replicas.counts[i].canary = False

    async def publish(self, weights_dir: str, version: int) -> float:
        """Returns the seconds the engine's intake was held (pause to continue; the longest of the replicas')."""
        if self.replicas is None:
            await self._until_ready(lambda: self.ready is None or self.ready.is_set(), self.ready)
            return await self._swap(self.engine, weights_dir, version)
        replicas = self.replicas
        await self._until_ready(lambda: any(s.is_ready for s in replicas.supervisors), None)
        done: set[int] = set()
        failed: dict[int, EngineError] = {}
        held = 0.0
        # A second pass takes a replica that became ready during the first (on the old weights).
        for _ in range(2):
            todo = [i for i, s in enumerate(replicas.supervisors)
                    if i not in done and i not in failed and s.is_ready and not s.needs_realign]
            for i in todo:
                if i == self.canary and replicas.version(i) == str(version):  # it passed its gate on them
                    done.add(i)
                    continue
                sup = replicas.supervisors[i]
                async with sup.swap_lock:
                    replicas.counts[i].draining = True
                    try:
                        took = await self._swap(sup.client, weights_dir, version, group=sup.name)
                        held = max(held, took)
                        log.info("publishing v%d: %s swapped, intake held %.3fs", version, sup.name, took)
                    except EngineError as exc:
                        failed[i] = exc
                        replicas.counts[i].swap_failures += 1
                        log.error("publishing v%d: replica %s failed its swap: %s", version, sup.name, exc)
                        continue
                    finally:
                        replicas.counts[i].draining = False
                    if self.adapters is not None:
                        sup.adapter_version = str(version)
                    else:
                        sup.info = {**sup.info, "weight_version": str(version)}
                    done.add(i)
        if not done:
            raise next(iter(failed.values()), None) or EngineUnavailable("no policy replica is ready")
        # Before the policy moves onto it: restarts, realignment, canaries and rollbacks load the directory. Only
        # pushes skipped `_on_disk` (a swap from disk already ran it).
        if self.groups is not None:
            await self._on_disk(weights_dir, version)
        for i in failed:  # realigned by its supervisor once the policy has moved (right after this returns)
            replicas.supervisors[i].needs_realign = True
        return held

    async def _until_ready(self, ready: Callable[[], bool], event: asyncio.Event | None) -> None:
        """A starting engine's socket already accepts (the daemon owns it): calls sent now would be served,
        out of order with the supervisor's own checks, once it is up. Wait for it instead."""
        try:
            async with asyncio.timeout(self.timeout):
                while not ready():
                    if event is not None:
                        await event.wait()
                    else:
                        await asyncio.sleep(0.1)
        except TimeoutError:
            raise EngineUnavailable(f"the engine is not ready after {self.timeout:.0f}s") from None

    async def _swap(self, engine: EngineClient, weights_dir: str, version: int, group: str | None = None) -> float:
        """One engine onto `weights_dir` (over its weight-update group `group` when one applies); the seconds
        its intake was held."""
        if self.adapters is not None:  # beside the old adapter: nothing paused, running requests keep theirs
            await self._on_disk(weights_dir, version)
            if adapter_name(version) not in await engine.loaded_adapters():  # the gate may have staged it
                await engine.load_adapter(adapter_name(version), weights_dir, self.timeout)
            return 0.0
        # Retract parks running requests (they resume on the new weights); nothing is refused. Continue is
        # sent whatever happened, a failed pause included: a pause that failed on our side may have
        # happened on the engine's, and a paused engine holds every chat. (The supervisor also sends it
        # whenever an engine becomes ready, for a clawd that died between the two.)
        grouped = (self.groups is not None and group is not None and self.groups.applies(group, version)
                   and await self.groups.form(group, engine))  # before the pause: forming waits for both ends
        if not grouped:
            await self._on_disk(weights_dir, version)  # before the pause too: a deferred write may still be going
        held = time.monotonic()
        try:
            await engine.control("/pause_generation", {"mode": "retract"}, self.timeout)
            if not (grouped and await self._push(engine, group, version)):
                if grouped:  # the push failed: a deferred write is waited for inside the pause (rare)
                    await self._on_disk(weights_dir, version)
                await engine.control("/update_weights_from_disk",
                                     {"model_path": weights_dir, "weight_version": str(version)}, self.timeout)
        finally:
            await engine.control("/continue_generation", {}, self.timeout)
            held = time.monotonic() - held
        # The engine's own word on what it serves beats the HTTP status of the update. It is busy
        # re-running the requests the swap parked: give it the publish timeout, not the short one.
        served = (await engine.model_info(timeout=self.timeout)).get("weight_version")
        if served != str(version):
            raise EngineError(f"engine serves weight_version {served!r} after publishing {version}")
        return held

    async def _on_disk(self, weights_dir: str, version: int) -> None:
        """Before an engine reads `weights_dir`, or the policy moves onto it: on disk (a deferred write waited
        for: the trainer's `written`), and opened to the engines' user (`before_load`)."""
        if self.groups is not None and not is_published(Path(weights_dir)):
            try:
                await self.groups.trainer.written(version, self.timeout)
            except TrainerError as exc:
                raise NotWritten(f"v{version}'s directory could not be written: {exc}", exc) from None
            if not is_published(Path(weights_dir)):
                raise NotWritten(f"v{version}'s directory was never written (its trainer child died first)")
        if self.before_load is not None:
            self.before_load(weights_dir)

    async def _push(self, engine: EngineClient, group: str, version: int) -> bool:
        """The weights over the replica's group; False when the push failed (the groups counted and logged it):
        the caller loads the directory, which also overwrites a partial update."""
        try:
            await self.groups.push(group, engine, version)
        except Exception:  # any end of it (trainer, engine, the group itself): the directory is the fallback
            return False
        return True
