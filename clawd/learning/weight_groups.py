"""Publishing full weights over torch.distributed instead of from disk (docs/ARCHITECTURE.md §13).

Each policy replica has a weight-update group of its own with trainer rank 0 (so publishes still roll, one
replica at a time), formed at its first publish by SGLang's `/init_weights_update_group` while the trainer
joins as rank 0 (clawd.engine.weight_group). A push runs inside the publisher's pause: begin_weight_update,
one `/update_weights_from_distributed` per bucket (load_format "flattened_bucket") while the trainer
broadcasts the same buckets, end_weight_update. The trainer writes the published directory all the same:
restarts, realignment, canaries and rollbacks load it, and the publisher falls back to it whenever a push
fails (a partial update is then overwritten whole from disk) or cannot apply (the trainer holds other
weights than the version published). A group that failed is dropped on both ends and its replica publishes
from disk for `COOLDOWN` seconds before a new group is tried.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field

from clawd import devices
from clawd.engine.client import EngineClient
from clawd.trainer.catalogue import JoinGroup, LeaveGroup, SendWeights

log = logging.getLogger("clawd.learner")

GROUP_TIMEOUT = 60.0  # rendezvous and each bucket's broadcast: both ends are already waiting on each other
COOLDOWN = 300.0      # seconds a replica whose group failed publishes from disk before a new group is tried


@dataclass
class SyncStats:
    pushes: int = 0             # replica publishes that went over a group
    fallbacks: int = 0          # pushes that failed and were published from disk instead
    last_seconds: float = 0.0   # the last push, begin to end
    last_bytes: int = 0
    last_error: str = ""
    groups: dict = field(default_factory=dict)  # replica -> "formed" | "disk until <unix time>"


@dataclass(frozen=True)
class _Group:
    pid: int              # the trainer child that holds rank 0: the group dies with it
    buckets: tuple        # the bodies of /update_weights_from_distributed, in the order the trainer sends them


class WeightGroups:
    def __init__(self, trainer, *, address: str, backend: str, engine_ranks: int, bucket_bytes: int,
                 timeout: float, group_timeout: float = GROUP_TIMEOUT, clock=time.monotonic):
        self.trainer = trainer  # a TrainerSupervisor: `state`, `ask`
        self.address, self.backend, self.engine_ranks = address, backend, engine_ranks
        self.bucket_bytes, self.timeout, self.group_timeout, self.clock = bucket_bytes, timeout, group_timeout, clock
        self.groups: dict[str, _Group] = {}
        self.disk_until: dict[str, float] = {}
        self.stats = SyncStats()

    def applies(self, replica: str, version: int) -> bool:
        """Whether a push of `version` to `replica` can be tried: the trainer holds those weights, published,
        and the replica's group has not failed in the last COOLDOWN seconds."""
        state = self.trainer.state or {}
        return (state.get("weights_version") == version and "publish" not in state.get("owed", [])
                and self.clock() >= self.disk_until.get(replica, 0.0))

    async def form(self, replica: str, engine: EngineClient) -> bool:
        """The replica's group, formed now unless it stands (before the publisher pauses the engine: forming
        waits for both ends); False when it could not be (counted, logged: the publish goes by disk)."""
        try:
            await self._group(replica, engine)
        except Exception as exc:
            await self._drop(replica, engine, f"forming the group: {type(exc).__name__}: {exc}")
            return False
        return True

    async def push(self, replica: str, engine: EngineClient, version: int) -> None:
        """The trainer's current weights into `engine`, which the caller has paused after `form`. Raises on any
        failure, after dropping the group; the engine may then hold a mix of weights: the caller loads the
        directory."""
        started = time.monotonic()
        try:
            group = self.groups.get(replica)
            if group is None or group.pid != self.trainer.pid:
                raise RuntimeError("the group is gone (its trainer child restarted since it was formed)")
            await engine.control("/begin_weight_update", {}, self.timeout)
            try:
                pid, sent = await self._alongside(SendWeights(replica, version, self.bucket_bytes),
                                                  self._receive(replica, engine, group, version))
            finally:
                await engine.control("/end_weight_update", {}, self.timeout)
        except Exception as exc:
            await self._drop(replica, engine, f"{type(exc).__name__}: {exc}")
            raise
        self.stats.pushes += 1
        self.stats.last_seconds, self.stats.last_bytes = time.monotonic() - started, int(sent.bytes)

    async def _receive(self, replica: str, engine: EngineClient, group: _Group, version: int) -> None:
        for i, bucket in enumerate(group.buckets):
            last = i == len(group.buckets) - 1  # the version moves, and the cache is flushed, once all arrived
            body = {**bucket, "group_name": replica, "flush_cache": last}
            if last:
                body["weight_version"] = str(version)
            await engine.control("/update_weights_from_distributed", body, self.timeout)

    async def _group(self, replica: str, engine: EngineClient) -> _Group:
        group = self.groups.get(replica)
        if group is not None and group.pid == self.trainer.pid:
            return group
        if group is not None:  # the trainer child that held rank 0 is gone: so is the engine's end of it
            await self._drop(replica, engine, None)
        port = free_port(self.address)
        world = 1 + self.engine_ranks
        joining = JoinGroup(replica, self.address, port, world, self.backend, self.group_timeout, self.bucket_bytes)
        pid, joined = await self._alongside(joining, engine.control("/init_weights_update_group", {
            "master_address": self.address, "master_port": port, "rank_offset": 1, "world_size": world,
            "group_name": replica, "backend": self.backend}, self.group_timeout + self.timeout))
        group = self.groups[replica] = _Group(pid, tuple(joined.buckets))
        self.stats.groups[replica] = "formed"
        log.info("weight-update group with %s formed: %d bucket(s) of at most %.1f MB", replica, len(group.buckets),
                 self.bucket_bytes / 2 ** 20)
        return group

    async def _alongside(self, request, engine_side) -> tuple[int | None, object]:
        """The trainer's `request` and the engine's calls at the same time (each blocks until the other end
        meets it); the pid of the trainer child that answered and its reply. When the engine's side fails, the
        trainer's request is
        still awaited: it fails too once its collective times out (group_timeout), and the link is free again."""
        trainer = asyncio.ensure_future(self.trainer.ask(request, self.group_timeout + self.timeout))
        try:
            await engine_side
        except asyncio.CancelledError:
            trainer.cancel()
            raise
        except Exception:
            await asyncio.gather(trainer, return_exceptions=True)
            raise
        return await trainer

    async def _drop(self, replica: str, engine: EngineClient, error: str | None) -> None:
        """Forget the group on both ends (each may already have); after a failure, disk for COOLDOWN seconds.
        The trainer is asked only while the child that formed the group lives: a new one has none (and may take
        minutes to start, which the fallback to disk must not wait for); a join that half happened is left
        by the trainer's next join of that name."""
        group = self.groups.pop(replica, None)
        if error is not None:
            self.stats.fallbacks += 1
            self.stats.last_error = error[:500]
            self.disk_until[replica] = self.clock() + COOLDOWN
            self.stats.groups[replica] = f"disk until {time.time() + COOLDOWN:.0f}"
            log.warning("weight-update group with %s failed, publishing from disk for %.0fs: %s", replica,
                        COOLDOWN, error)
        ends = [("engine", lambda: engine.control("/destroy_weights_update_group", {"group_name": replica},
                                                   self.timeout))]
        if group is not None and group.pid == self.trainer.pid:
            ends.append(("trainer", lambda: self.trainer.ask(LeaveGroup(replica), self.timeout)))
        for what, call in ends:
            try:
                await call()
            except Exception as exc:  # "does not exist" when that end already dropped it: nothing left to free
                log.debug("weight-update group %s: the %s's end: %s", replica, what, exc)


def free_port(address: str) -> int:
    """A port free on `address` now, for trainer rank 0's rendezvous store (it binds it a moment later)."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def for_config(cfg, trainer) -> WeightGroups | None:
    """The groups the configuration allows, or None (every publish from disk): LoRA publishes adapters; SGLang
    serves update_weights_from_distributed on one data-parallel rank only; NCCL needs the trainer on a GPU.
    "auto" means groups with the SGLang servers clawd launches only. Not with clawd's CPU engine: it maps a
    published directory straight from the page cache, and on SmolLM2 a replica was held 0.16 s by disk
    against 4.3 s over gloo (bench/publish.py). Not with an engine clawd does not launch (launch "none"): it
    may be anything, and one that cannot join leaves the trainer waiting out its group timeout at each try."""
    eng = cfg.engine
    dp = devices.flag_value(eng.sglang_args, "--dp-size", "--data-parallel-size", "--dp") or "1"
    if trainer is None or eng.weight_sync == "disk" or cfg.train.lora.enabled or dp != "1":
        return None
    if eng.weight_sync == "auto" and eng.launch != "sglang":
        return None
    backend = "gloo" if eng.launch == "local" or cfg.train.world.device != "cuda" else "nccl"
    if eng.launch == "sglang" and backend != "nccl":
        return None
    tp = int(devices.flag_value(eng.sglang_args, "--tp-size", "--tensor-parallel-size", "--tp") or 1)
    return WeightGroups(trainer, address=eng.weight_sync_address, backend=backend,
                        engine_ranks=tp if eng.launch != "local" else 1, bucket_bytes=eng.weight_sync_bucket_mb << 20,
                        timeout=cfg.learner.publish_timeout)
