"""The trainer world: one step on N ranks equals the step on one (docs/ARCHITECTURE.md §13).

Runs in the trainer's ranks only (torch). `World` is this rank's place in the process group that
`clawd.trainer.worker.rank` joined under torchrun; `clawd.trainer.worker.step.Trainer` takes one and asks it
for everything that differs from a single process:

- **Sharding** (`shard`): FSDP2, one `fully_shard` per decoder layer, then the root (which holds
  the embeddings, the final norm and the output layer, tied or not). On CUDA its parameters are
  gathered in bf16 and gradients reduced in float32 over float32 master weights (NCCL); on CPU
  everything is float32 (gloo). Gradients are **summed** over ranks, not averaged
  (`set_gradient_divide_factor(1)`, as plain SUM collectives): every rank's loss is already divided by the whole batch's
  normaliser, so the sum is the one-rank gradient. FSDP's default mean would divide it by N
  again, and Adam would hide it (its update is nearly scale-free).
- **The batch split** (`split_by_tokens`, pure): every rank gets the whole batch (the daemon
  sends one; rank 0 broadcasts it), so the normaliser and the reward baseline are the whole
  batch's with no extra collective, and each rank trains on its share: samples dealt by length,
  longest first, to the rank with the fewest tokens. Ranks must run the same number of forwards
  (each one all-gathers every layer), so a rank with fewer micro-batches runs empty ones (one
  token, loss mask 0: no loss, no gradient).
- **What one process reads alone**: the loss parts are summed over ranks (`all_sum`), the
  gradient norm from the squared norms of the local shards, the per-token diagnostics gathered
  (`gather`). Rank 0 writes: it checks free space and decides, and every rank follows its word
  (`agree`), so that no rank waits in a collective that another one left by raising.
"""
from __future__ import annotations

import datetime
import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from clawd.trainer.worker.batches import micro_batch, pack


def split_by_tokens(lengths: list[int], ranks: int) -> list[list[int]]:
    """Sample indices per rank, balanced by tokens: longest first (ties by index), each to the rank
    with the fewest tokens so far (ties: the lowest rank). Each share is in index order. Pure."""
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


@dataclass
class World:
    """This rank in the trainer world. `size` 1 with no process group is never built: a single
    process passes no World at all."""
    rank: int
    size: int
    local_rank: int
    device: torch.device

    @property
    def writer(self) -> bool:
        """Rank 0: the one that writes files and talks to the daemon."""
        return self.rank == 0

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank."""
        box = [obj if self.writer else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, work: Callable[[], Any] | None) -> Any:
        """Rank 0 runs `work` (the others pass None); its result is returned on every rank, and its
        exception (an OSError from a full disk, say) is raised on every rank."""
        outcome: tuple[str, Any] = ("ok", None)
        if self.writer and work is not None:
            try:
                outcome = ("ok", work())
            except Exception as exc:
                outcome = ("raise", _picklable(exc))
        kind, value = self.broadcast(outcome)
        if kind == "raise":
            raise value
        return value

    def barrier(self) -> None:
        dist.barrier()


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def join(timeout: float) -> World:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment):
    NCCL with one GPU per local rank when CUDA is visible, else gloo. `timeout` bounds every
    collective, so a rank that died or hangs fails the others instead of blocking them for torch's
    default 30 minutes (10 with NCCL). Across hosts gloo listens on the interface that reaches node 0
    (`gloo_interface`) unless GLOO_SOCKET_IFNAME names one."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if not cuda and "GLOO_SOCKET_IFNAME" not in os.environ:
        if interface := gloo_interface(os.environ.get("MASTER_ADDR", "")):
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout),
                            device_id=device if cuda else None)
    return World(rank=dist.get_rank(), size=dist.get_world_size(), local_rank=local_rank, device=device)


def gloo_interface(master: str) -> str | None:
    """The interface this host reaches `master` (the rendezvous host, node 0) through, for gloo to listen on;
    None when that is the loopback (a world of one host) or cannot be told (IPv6, no route, not Linux).

    Left alone, gloo listens on the address this host's own name resolves to, and tells the other ranks to
    connect there: on hosts whose /etc/hosts maps the name to 127.0.1.1 or 127.0.0.1 (Debian's default,
    most containers), every rank of another host then connects to its own loopback and the world never
    forms. The route to node 0 names the interface the other hosts reach this one through as well."""
    import fcntl
    import ipaddress
    import socket
    import struct

    if not master:
        return None
    try:
        address = socket.getaddrinfo(master, None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # a datagram socket's connect sends nothing: it only picks the route
            local = s.getsockname()[0]
            if ipaddress.ip_address(local).is_loopback:
                return None
            for _, name in socket.if_nameindex():
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))[20:24]
                except OSError:
                    continue  # no IPv4 address on it
                if socket.inet_ntoa(got) == local:
                    return name
    except (OSError, ValueError, IndexError) as exc:  # gloo then picks as it would alone: said in the log
        logging.getLogger("clawd.trainer").info("trainer world: no interface found toward %s (%s); gloo chooses",
                                                master, exc)
    return None


def shard(model: torch.nn.Module, world: World) -> torch.nn.Module:
    """FSDP2 over a 1-D mesh of every rank: each decoder layer of `model.model` (the Hugging Face model
    inside the trainer's scorer) its own group, then the root, `model`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(world.device.type, (world.size,))
    mp = MixedPrecisionPolicy()  # float32 throughout on CPU
    if world.device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = getattr(model.model.get_decoder(), "layers", None)
    if layers is None:
        raise NotImplementedError(f"{type(model.model).__name__}: no decoder layers to shard")
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # A plain SUM, never divided: gloo has neither AVG nor PREMUL_SUM, and NCCL's SUM is zero-copy.
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's local shard (itself when not sharded)."""
    return t.to_local() if hasattr(t, "to_local") else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor, gathered from every rank (a collective: every rank must call it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def grad_norm(params: list[torch.nn.Parameter], world: World) -> float:
    """The L2 norm of the whole gradient: each rank's local squared norms (float64), summed over ranks."""
    from clawd.trainer.worker.losses import squared_norm

    squares = [squared_norm(local(p.grad).detach()) for p in params if p.grad is not None]
    sq = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64, device=world.device)
    return float(world.all_sum(sq).sqrt())


def empty_row(vocab_token: int = 0):
    """The one-token, no-loss sample a rank with fewer micro-batches forwards to keep step with the others."""
    from clawd.samples import Sample

    return Sample(sample_id="padding", mode="rl", session_id="padding", turn_index=0, principal="padding",
                  tokens=[vocab_token, vocab_token], response_length=1, loss_mask=[0], rollout_logprobs=[0.0],
                  temperature=1.0, reward=0.0, teacher_logprobs=None, has_hint=False, policy_version=0,
                  created=0.0, scored=0.0)


def packed(samples: list, tokens: int, device: torch.device, world: World | None) -> list:
    """`samples` packed into micro-batches of at most `tokens` padded tokens (`batches.pack`); in a world, this
    rank's share of them (`split_by_tokens`), with empty ones added so that every rank runs as many."""
    lengths = [len(s.tokens) - 1 for s in samples]
    if world is None:
        return [micro_batch(samples, rows, device) for rows in pack(lengths, tokens)]
    packs = [[[rows[i] for i in g] for g in pack([lengths[j] for j in rows], tokens)]
             for rows in split_by_tokens(lengths, world.size)]
    mine = [micro_batch(samples, rows, device) for rows in packs[world.rank]]
    return mine + [micro_batch([empty_row()], [0], device) for _ in range(max(map(len, packs)) - len(mine))]
