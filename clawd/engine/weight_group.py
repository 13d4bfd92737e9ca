"""Weights over torch.distributed, as SGLang 0.5.23 receives them: what the trainer (the sender) and an engine
(a receiver: SGLang, or clawd's CPU engine) share (docs/ARCHITECTURE.md §13).

The protocol, read from SGLang 0.5.23's wheel (srt/utils/common.py init_custom_process_group,
srt/model_executor/model_runner_components/weight_updater.py, srt/weight_sync/tensor_bucket.py):
- `/init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend}`:
  every engine rank joins a process group of its own, beside any default one, by rendezvous at
  `tcp://master_address:master_port` as rank `rank_offset + tp_rank`; rank 0 is the trainer, which hosts
  the store; the store's keys go under the prefix `group_name`. The call returns once every rank joined,
  so the trainer joins at the same time.
- `/update_weights_from_distributed {names, dtypes, shapes, group_name, load_format, weight_version, ...}`
  inside `/begin_weight_update` … `/end_weight_update`: with `load_format` "flattened_bucket" the engine
  allocates one uint8 buffer of the tensors' bytes, in `names` order with no padding (each offset a
  multiple of its dtype's size, else it refuses), and receives it with one broadcast from rank 0; dtypes
  are torch's attribute names ("bfloat16").
`join` makes that group on either end; `bucket`, `pack` and `unpack` are the flattened layout.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


def join(address: str, port: int, world_size: int, rank: int, group_name: str = DEFAULT_GROUP,
         backend: str = "gloo", timeout: float = 600.0):
    """This process's member of the weight-update group (rank 0: the trainer, which hosts the store). Blocks
    until all `world_size` ranks have joined. The group is torch's own kind, registered so that
    `dist.broadcast(..., group=...)` takes it, and needs no default group."""
    wait = datetime.timedelta(seconds=timeout)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=wait))
    store.set_timeout(wait)
    group, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend),
                                              c10d.PrefixStore(group_name, store), group_name=group_name,
                                              timeout=wait)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave(group) -> None:
    dist.destroy_process_group(group)


@dataclass(frozen=True)
class Bucket:
    """One broadcast: the tensors' names, dtype names and shapes, as /update_weights_from_distributed takes them."""
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def nbytes(self) -> int:
        return sum(_numel(s) * _dtype(d).itemsize for s, d in zip(self.shapes, self.dtypes))

    def request(self) -> dict:
        return {"names": list(self.names), "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes],
                "load_format": "flattened_bucket"}


def buckets(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """The tensors dealt into buckets of at most `bucket_bytes` (a larger tensor goes alone), widest dtype
    first within a bucket so that every offset is a multiple of its dtype's size. Pure."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), list(tensors).index(n)))
    out, current, size = [], [], 0
    for name in order:
        n = tensors[name].numel() * tensors[name].element_size()
        if current and size + n > bucket_bytes:
            out.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        out.append(current)
    return [Bucket(tuple(names), tuple(str(tensors[n].dtype).removeprefix("torch.") for n in names),
                   tuple(tuple(tensors[n].shape) for n in names)) for names in out]


def pack(bucket: Bucket, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The bucket's tensors as one flat uint8 tensor, in order, no padding."""
    return torch.cat([tensors[n].contiguous().reshape(-1).view(torch.uint8) for n in bucket.names])


def unpack(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The inverse of `pack`: views into `flat`. Refuses an offset that is not a multiple of its dtype's
    size, as SGLang does ("Unaligned received tensor")."""
    out, offset = {}, 0
    for name, dtype, shape in zip(bucket.names, bucket.dtypes, bucket.shapes):
        dt = _dtype(dtype)
        if offset % dt.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: offset {offset} for {dtype}")
        end = offset + _numel(shape) * dt.itemsize
        out[name] = flat[offset:end].view(dt).reshape(shape)
        offset = end
    if offset != flat.numel():
        raise ValueError(f"the bucket holds {flat.numel()} bytes, its tensors {offset}")
    return out


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _numel(shape) -> int:
    n = 1
    for d in shape:
        if d < 0:
            raise ValueError(f"negative dimension in {shape}")
        n *= d
    return n
