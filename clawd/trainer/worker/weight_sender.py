"""The trainer's end of publishing over torch.distributed: rank 0 joins one weight-update group per policy
replica and broadcasts the current weights into it, bucket by bucket, in the published dtype
(clawd.engine.weight_group holds the protocol, as SGLang 0.5.23 receives it; docs/ARCHITECTURE.md §13).

In a trainer world every rank runs every request: each bucket's tensors are gathered whole on every rank
(a collective per tensor, in the same order everywhere), rank 0 alone casts, packs and broadcasts, and
its outcome reaches every rank (`World.agree`), so a broken group fails the request on all of them at the
same bucket and no rank is left inside a gather.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from clawd import faults
from clawd.engine import weight_group
from clawd.trainer.worker import sharding

log = logging.getLogger("clawd.trainer")


class SyncRefused(Exception):
    """The request cannot be served as asked (no such group, not the asked version): send it from disk."""
    retryable = False


class WeightSender:
    def __init__(self, model: torch.nn.Module, dtype: str, device: torch.device, world=None):
        self.model, self.dtype, self.device, self.world = model, getattr(torch, dtype), device, world
        self.groups: dict[str, tuple[object, str]] = {}  # group name -> (process group, backend); rank 0 only

    @property
    def writer(self) -> bool:
        return self.world is None or self.world.writer

    def named(self) -> dict[str, torch.Tensor]:
        """The state dict as an engine loads it: a tensor shared under two names (tied embeddings) once, under
        its first name, as save_pretrained stores it."""
        seen, out = set(), {}
        for name, tensor in self.model.state_dict().items():  # fresh detached tensors: shared storage tells ties
            local = sharding.local(tensor)
            key = (local.data_ptr(), local.dtype, tuple(tensor.shape)) if local.data_ptr() else name
            if key not in seen:
                seen.add(key)
                out[name] = tensor
        return out

    def layout(self, bucket_bytes: int, named: dict[str, torch.Tensor] | None = None) -> list[weight_group.Bucket]:
        """The buckets of the published weights: the same on every rank (a DTensor's shape is the whole one)."""
        named = self.named() if named is None else named
        meta = {n: torch.empty(t.shape, dtype=self._dtype(t), device="meta") for n, t in named.items()}
        return weight_group.buckets(meta, bucket_bytes)

    def join(self, name: str, address: str, port: int, world_size: int, backend: str, timeout: float) -> None:
        """Rank 0 joins group `name` as its rank 0, hosting the rendezvous at address:port; it returns once the
        engine's ranks joined too. A group of that name already held is left first (the engine's was re-made)."""
        if not self.writer:
            return
        self.leave(name)
        group = weight_group.join(address, port, world_size, 0, name, backend, timeout)
        self.groups[name] = (group, backend)
        log.info("weight-update group %s formed with %d engine rank(s) (%s)", name, world_size - 1, backend)

    def leave(self, name: str) -> None:
        held = self.groups.pop(name, None) if self.writer else None
        if held is not None:
            try:
                weight_group.leave(held[0])
            except Exception as exc:  # a broken group may not tear down cleanly; it is gone from here either way
                log.warning("weight-update group %s: leaving it failed: %s", name, exc)

    def send(self, name: str, bucket_bytes: int) -> dict:
        """Broadcast every bucket of the current weights into group `name`, in `layout(bucket_bytes)` order: what
        the engine receives with one /update_weights_from_distributed per bucket. A failure leaves the group
        (it cannot be trusted again) and raises on every rank."""
        def held():
            if name not in self.groups:
                raise SyncRefused(f"no weight-update group {name!r}: join it first")
        self._on_writer(held)
        named, t0, sent = self.named(), time.perf_counter(), 0
        buckets = self.layout(bucket_bytes, named)
        for bucket in buckets:
            whole = {n: sharding.full(named[n]) for n in bucket.names}  # every rank: a gather per sharded tensor

            def broadcast(bucket=bucket, whole=whole) -> int:
                group, backend = self.groups[name]
                device = self.device if backend == "nccl" else torch.device("cpu")
                flat = weight_group.pack(bucket, {n: t.detach().to(device, self._dtype(t)) for n, t in whole.items()})
                faults.point("trainer.sync.bucket")  # tests: a trainer gone in the middle of a publish
                try:
                    dist.broadcast(flat, src=0, group=group)
                except Exception:
                    self.leave(name)
                    raise
                return flat.numel()
            sent += self._on_writer(broadcast) or 0
            del whole
        seconds = time.perf_counter() - t0
        if self.writer:
            log.info("sent %d bytes in %d bucket(s) to %s in %.2f s", sent, len(buckets), name, seconds)
        return {"bytes": sent, "buckets": len(buckets), "seconds": seconds}

    def _dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if t.is_floating_point() else t.dtype

    def _on_writer(self, work):
        return work() if self.world is None else self.world.agree(work if self.world.writer else None)
