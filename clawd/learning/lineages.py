"""Adapters per principal, the daemon's side (docs/ARCHITECTURE.md §15): who has an adapter of their own, and a
learner for each.

With `[train] adapters = "per_principal"` (LoRA), a principal whose samples reach `adapter_min_samples` (those
the shared adapter trained on, and those waiting) gets an adapter of their own, for at most `max_adapters`
principals; active rollouts never get one. Their *lineage* is everything that adapter owns, under
state/lineages/<pseudonym>/ (the keyed pseudonym of clawd.safety.versions: no name on disk): the trainer's
lineage (clawd.trainer.worker.lineages: the adapter, its optimizer, checkpoints and versions' directories), its version
history (versions.jsonl there, numbered with the shared one: a number is never reused), and its `Policy`,
served to that principal alone (`Policy.principals`, clawd.served). Each lineage has a `Learner` of its own,
the shared adapter's learner given the lineage's parts: its trainer (`LineageTrainer`), history, policy,
publisher (`OwnAdapterPublisher`: loaded beside the others, every ready replica) and its part of the sample
store (a `Selection`: that principal's samples, staleness counted in the lineage's own versions). So each
adapter steps, publishes, checkpoints, acknowledges, passes its gate and rolls back as the shared one does,
and the shared learner trains on the samples of principals without one of their own.

A lineage is found again after a restart by its pseudonym: at start for every configured API key, later for a
principal whose samples arrive. Until its learner has published a version, its principal is served the shared
adapter (`Policy.of`).
"""
from __future__ import annotations

import asyncio
import bisect
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from clawd.config.schema import Config
from clawd.engine.client import EngineError
from clawd.engine.lora import adapter_name
from clawd.learning.learner import Learner
from clawd.learning.publisher import Publisher
from clawd.learning.store import SampleStore, Selection
from clawd.pauses import Pauses
from clawd.samples import PSEUDO_PRINCIPAL
from clawd.safety.gate import PromotionGate
from clawd.safety.monitors import Monitors
from clawd.safety.watch import Watch
from clawd.safety.versions import Versions
from clawd.served import Policy
from clawd.trainer.lineage_link import LineageTrainer
from clawd.trainer.link import TrainerSupervisor
from clawd.weights import VERSION_DIR, atomic_write, lineages_root, numbered, remove_lineage, restored_weights

log = logging.getLogger("clawd.lineages")

WATCH_INTERVAL = 1.0    # seconds between looks for principals who qualify (or whose lineage is on disk)
NUMBERS_FLOOR = "newest"        # under the lineages' root: the newest version of any lineage forgotten


class OwnAdapterPublisher(Publisher):
    """A principal's own adapter onto every ready policy replica, beside the others: loaded, nothing paused, and
    the replica's own version (the shared policy's) left as it is. A replica that restarts loads it again before
    it counts as ready (clawd.engine.supervisor)."""

    async def publish(self, weights_dir: str, version: int) -> float:
        replicas = self.replicas
        await self._until_ready(lambda: any(s.is_ready for s in replicas.supervisors), None)
        for sup in [s for s in replicas.supervisors if s.is_ready]:
            async with sup.swap_lock:
                await self._swap(sup.client, weights_dir, version)  # loads the adapter unless it is there
        return 0.0


class SelectedStore:
    """The sample store as one learner sees it: its selection's samples, where the learner counts, takes and
    waits for a batch; everything else is the store's."""

    def __init__(self, store: SampleStore, selection: Selection):
        self.store, self.selection = store, selection

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def fresh(self, current_version: int, max_staleness: int) -> int:
        return self.store.fresh(current_version, max_staleness, self.selection)

    def take_batch(self, n: int, *, current_version: int, max_staleness: int):
        return self.store.take_batch(n, current_version=current_version, max_staleness=max_staleness,
                                     of=self.selection)

    async def wait_for(self, n: int, *, current_version: int | None = None, max_staleness: int | None = None):
        await self.store.wait_for(n, current_version=current_version, max_staleness=max_staleness,
                                  of=self.selection)


def versions_behind(versions: Versions) -> Callable[[int, int], int]:
    """How many of this history's versions lie after a sample's version, up to the current one. Asked for every
    waiting sample at every look for a batch: the sorted numbers are kept until a version is added."""
    cache: list = [-1, []]  # [the history's length, its numbers sorted]

    def count(sample_version: int, current: int) -> int:
        if cache[0] != len(versions):
            cache[:] = [len(versions), versions.numbers()]
        numbers = cache[1]
        return max(0, bisect.bisect_right(numbers, current) - bisect.bisect_right(numbers, sample_version))
    return count


@dataclass
class Lineage:
    """One principal's own adapter, and what trains, serves and watches it."""
    principal: str
    key: str
    policy: Policy
    versions: Versions
    learner: Learner
    watch: Watch | None = None
    tasks: tuple[asyncio.Task, ...] = ()


class Lineages:
    def __init__(self, cfg: Config, *, store: SampleStore, trainer: TrainerSupervisor, publisher: Publisher,
                 policy: Policy, versions: Versions, pauses: Pauses, gate: Callable[[], PromotionGate | None],
                 on_step: Callable, on_publish: Callable, spawn: Callable[..., asyncio.Task],
                 monitors: Monitors | None = None):
        """publisher: the shared adapter's (its replicas, adapters and timeout are every lineage's); gate: makes a
        lineage's promotion gate (None: off); spawn: starts a lineage's learner in the daemon's task group;
        monitors: the behaviour monitors, whose verdicts on a principal's own versions a watch of its own acts on
        (None: off)."""
        self.cfg, self.store, self.trainer, self.shared_publisher = cfg, store, trainer, publisher
        self.policy, self.versions, self.pauses, self.gate = policy, versions, pauses, gate
        self.on_step, self.on_publish, self.spawn, self.monitors = on_step, on_publish, spawn, monitors
        self.root = lineages_root(cfg.state_dir)
        self.lineages: dict[str, Lineage] = {}  # by principal
        self.refused: set[str] = set()  # principals who qualified beyond max_adapters (served the shared adapter)
        self.closed = False  # the drain began (`stop`): the watch attaches no lineage more
        self._given = 0  # the newest number a learner was given (`reserve`)
        # Every lineage on disk counts for numbering from the start, found again or not: a principal named by the
        # `user` field is found only when their samples arrive, and the shared adapter may publish before.
        homes = [path for path in self.root.iterdir() if path.is_dir()] if self.root.is_dir() else []
        self._on_disk = max((_newest_on_disk(path) for path in homes), default=0)
        self._disk_keys = {path.name for path in homes}  # lineages on disk, found again or not
        # The shared learner's part: every principal without an adapter of their own, and who is not about to get
        # one: a qualified principal's samples wait for the watch to give them theirs.
        self.shared = Selection(has=self._shared_has, behind=versions_behind(versions))
        self._pseudonyms: dict[str, str] = {}
        self._trained: dict[str, int] = {}  # samples the shared adapter trained, by pseudonym
        self._trained_at = -1               # the history's length they were counted at

    def newest(self) -> int:
        """The newest version of any lineage, forgotten ones included, and the newest number given (a number is
        never reused, not even a forgotten principal's, whose adapter an engine may still hold)."""
        return max(max((ln.versions.recorded_newest for ln in self.lineages.values()), default=0), self._floor(),
                   self._on_disk, self._given)

    def reserve(self, version: int) -> int:
        """The number a learner's next version gets: `version` (what its own history, trainer and policy say),
        or above every number any learner was given. Learners step at once, and a version is recorded only once
        trained: two that each read the histories before either recorded would both take the same number, and
        the engine, finding its adapter's name loaded, would serve one principal the other's."""
        self._given = max(version, self.versions.newest + 1, self.newest() + 1)
        return self._given

    def _floor(self) -> int:
        """The newest version of the lineages forgotten so far (a bare number: `NUMBERS_FLOOR`)."""
        try:
            return int((self.root / NUMBERS_FLOOR).read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def find(self, principals) -> None:
        """Lineages on disk for these principals (the configured API keys, at start) are attached again."""
        for principal in principals:
            if principal not in self.lineages and self.pseudonym(principal) in self._disk_keys:
                self.attach(principal)

    def attach(self, principal: str) -> Lineage:
        """The principal's lineage: found on disk (its policy the newest version its history lets serve), or
        new (served the shared adapter until its first version)."""
        key = self.pseudonym(principal)
        home = self.root / key
        self._disk_keys.add(key)
        home.mkdir(parents=True, exist_ok=True)
        versions = Versions(home / "versions.jsonl", key_path=self.versions.key_path,
                            numbered_with=lambda: max(self.versions.newest, self.newest()))
        policy = _restored(home, versions, self.cfg.gate.enabled)
        publisher = OwnAdapterPublisher(self.shared_publisher.replicas, self.shared_publisher.timeout,
                                        adapters=self.shared_publisher.adapters,
                                        base_dir=self.shared_publisher.base_dir,
                                        before_load=self.shared_publisher.before_load)
        own = Selection(has=lambda s: s.principal == principal, behind=versions_behind(versions))
        learner = Learner(self.cfg.learner, SelectedStore(self.store, own), LineageTrainer(self.trainer, key),
                          publisher, policy, home, control_seed=self.cfg.train.seed, pauses=self.pauses,
                          versions=versions, gate=self.gate(), lora=True, max_sample_tokens=self.cfg.max_sample_tokens,
                          on_step=self.on_step, on_publish=self.on_publish, reserve=self.reserve)
        # Its own versions' monitors against its own clean versions; a halt or a rollback pauses learning for all.
        watch = None if self.monitors is None else Watch(
            self.monitors, versions, policy, self.pauses, home, lambda target, reason: learner.rollback(
                target, reason=reason), interval=self.cfg.monitors.interval)
        lineage = self.lineages[principal] = Lineage(principal, key, policy, versions, learner, watch)
        lineage.tasks = (self.spawn(self._serve(lineage, publisher), name=f"learner-{key}"),
                         *(() if watch is None else (self.spawn(watch.run(), name=f"monitors-{key}"),)))
        log.info("principal %s: an adapter of their own (lineage %s, v%d)", key, key, policy.version)
        return lineage

    async def _serve(self, lineage: Lineage, publisher: OwnAdapterPublisher) -> None:
        """The lineage's learner, once its principal can be served their own adapter: a version found on disk is
        loaded on the replicas first (an engine that came up before the lineage was found holds none of it), and
        until then they are served the shared one."""
        policy = lineage.policy
        while policy.adapter is not None:
            try:
                await publisher.publish(policy.weights_dir, policy.version)
                break
            except EngineError as exc:
                log.warning("lineage %s: v%d could not be loaded yet (retrying): %s", lineage.key, policy.version, exc)
                await asyncio.sleep(WATCH_INTERVAL)
        self.policy.principals[lineage.principal] = policy
        await lineage.learner.run()

    def pseudonym(self, principal: str) -> str:
        if (key := self._pseudonyms.get(principal)) is None:
            key = self._pseudonyms[principal] = self.versions.pseudonym(principal)
        return key

    def qualifies(self, principal: str) -> bool:
        """Whether the principal should have a lineage: one of theirs is on disk, or their samples (those the
        shared adapter trained on, and those waiting) reach `adapter_min_samples`."""
        if principal in self.lineages or principal.startswith(PSEUDO_PRINCIPAL):
            return False
        key = self.pseudonym(principal)
        if key in self._disk_keys:
            return True
        if self._trained_at != len(self.versions):  # a version was recorded since: count again
            counts: dict[str, int] = {}
            for v in self.versions:
                for k, n in v.principals.items():
                    counts[k] = counts.get(k, 0) + n
            self._trained, self._trained_at = counts, len(self.versions)
        return self._trained.get(key, 0) + self.store.waiting_of(principal) >= self.cfg.train.adapter_min_samples

    def _shared_has(self, sample) -> bool:
        """The shared learner's samples: of principals without a lineage who will not get one (not qualified, or
        no room left)."""
        if sample.principal in self.lineages:
            return False
        return len(self.lineages) >= self.cfg.train.max_adapters or not self.qualifies(sample.principal)

    async def watch(self) -> None:
        """Until `stop` (a task the daemon owns): principals with samples waiting get their lineage, found on disk
        or new once they qualify, within `max_adapters`."""
        while not self.closed:  # from the drain on, no lineage more: one attached then would never be stopped
            for principal in list(self.store.waiting_by_principal()):
                if self.qualifies(principal):
                    if len(self.lineages) >= self.cfg.train.max_adapters:
                        self.refused.add(principal)
                        continue
                    self.refused.discard(principal)
                    self.attach(principal)
            await asyncio.sleep(WATCH_INTERVAL)

    def learner_of(self, version: int) -> Learner | None:
        """The learner whose history holds `version` (clawctl rollback), or None: the shared one's."""
        return next((ln.learner for ln in self.lineages.values() if ln.versions.get(version) is not None), None)

    async def forget(self, principal: str, timeout: float) -> dict | None:
        """`clawctl forget`: the principal's adapter, its versions and checkpoints gone, and they are served the
        shared adapter again. What went, or None when they had none."""
        lineage = self.lineages.pop(principal, None)
        self.refused.discard(principal)
        key = self.pseudonym(principal)
        self._disk_keys.discard(key)
        self._pseudonyms.pop(principal, None)
        self.policy.principals.pop(principal, None)
        if lineage is not None and lineage.tasks:
            for task in lineage.tasks:
                task.cancel()
            await asyncio.wait(lineage.tasks)
        versions = sum(v.version > 0 for v in lineage.versions) if lineage is not None else 0
        if lineage is not None:  # before its history goes: numbers stay above it
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write(self.root / NUMBERS_FLOOR, f"{max(self.newest(), lineage.versions.recorded_newest)}\n".encode())
        if self.trainer.alive:  # the trainer holds the adapter: it deletes it and then its files, in order
            removed = await LineageTrainer(self.trainer, key).forget(timeout)
        else:  # none to ask (starting, restarting): nothing holds the lineage, its files go from here
            removed = remove_lineage(self.cfg.state_dir, key)
        if lineage is not None and lineage.policy.adapter is not None:
            self.shared_publisher.retire(lineage.policy.adapter)  # unloaded once no request carries it
        if lineage is None and not removed:
            return None
        return {"lineage": key, "versions": versions, "adapter": lineage.policy.adapter if lineage else None}

    async def stop(self, timeout: float) -> None:
        self.closed = True  # first: the watch may run while the learners below stop
        for lineage in list(self.lineages.values()):
            await lineage.learner.stop(timeout)
            for task in lineage.tasks:
                task.cancel()

    def snapshot(self) -> dict:
        return {"adapters": len(self.lineages), "max_adapters": self.cfg.train.max_adapters,
                "min_samples": self.cfg.train.adapter_min_samples, "refused": len(self.refused),
                "principals": {p: {"lineage": ln.key, "version": ln.policy.version, "adapter": ln.policy.adapter,
                                   "steps": ln.learner.stats.steps, "busy": ln.learner.busy,
                                   "publishes": ln.learner.stats.publishes,
                                   "rollbacks": ln.learner.stats.rollbacks,
                                   "waiting": self.store.fresh(ln.policy.version, self.cfg.learner.max_staleness,
                                                               Selection(lambda s, p=p: s.principal == p,
                                                                         versions_behind(ln.versions)))}
                               for p, ln in sorted(self.lineages.items())}}


def _newest_on_disk(home: Path) -> int:
    """The newest version a lineage directory names: in its history, or as a published directory."""
    newest = 0
    if (home / "versions.jsonl").is_file():
        for line in (home / "versions.jsonl").read_text(errors="replace").splitlines():
            try:
                newest = max(newest, int(json.loads(line)["version"]))
            except (ValueError, KeyError, TypeError):
                continue  # a torn or damaged line: the history's own reading says so
    return max(newest, max((v for v, _ in numbered(home / "weights", VERSION_DIR)), default=0))


def _restored(home: Path, versions: Versions, gated: bool) -> Policy:
    """A lineage's policy at start: the newest version its checkpoints and history let serve, else none of its
    own yet (its principal is served the shared adapter)."""
    found = restored_weights(home, lambda v: versions.servable(v, gated))
    if found is None:
        return Policy()
    version, path = found
    return Policy(version=version, weight_version=str(version), weights_dir=str(path), adapter=adapter_name(version))

