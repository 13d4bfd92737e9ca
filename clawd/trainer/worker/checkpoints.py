"""What the trainer writes and reads under its state directory (docs/ARCHITECTURE.md §6, §7).

    state_dir/weights/v{version:06d}     published Hugging Face directories, the newest keep_versions
    state_dir/checkpoints/ckpt-{n:08d}   everything a resume needs, the newest `keep` (rollback targets)

Every directory is written by `clawd.weights.atomic_dir`: absent or complete. A checkpoint's
`complete` marker is its last file; one without it is never resumed. The trainer process only
(torch); `clawd.weights` reads the same layout in the daemon.

Fault points (clawd.faults): `trainer.publish.write` / `trainer.checkpoint.write` as each write
starts (its temporary directory exists), `trainer.publish.mid` once the safetensors are written and
before the tokenizer files and the rename, `trainer.checkpoint.mid` after the model's tensors and
before the optimizer state. `publish_bytes` / `checkpoint_bytes` estimate a write for the free-space
check that precedes it.
"""
from __future__ import annotations

import contextlib
import copy
import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from clawd import faults
from clawd.weights import CHECKPOINT_DIR, VERSION_DIR, atomic_dir, complete_checkpoints, numbered

CHECKPOINT_FORMAT = 2  # bumped when a checkpoint's files change meaning (1 still loads)
CHECKPOINTS_KEPT = 2

# Files of a model directory that are weights: never copied next to the freshly saved ones.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


# --- published weights -----------------------------------------------------------------------

def publish_weights(model, model_dir: Path, dest: Path, dtype: str = "float32", world=None) -> Path:
    """model as a complete Hugging Face directory at dest (config, generation config, safetensors)
    with the other files of model_dir (the tokenizer's), written atomically. dtype is what the
    engines serve (`clawd.weights.model_dtype`): weights of another dtype are cast to it, one tensor
    at a time into host memory (the device holds no second copy), and config.json says so.
    In a world every rank calls it: each tensor is gathered whole in turn and only rank 0 keeps it,
    cast, on the host (one full copy, in the served dtype), then writes; every rank gets its outcome."""
    target = getattr(torch, dtype)
    if world is not None:
        host = gathered_state_dict(model, target, world)
        return world.agree((lambda: write_published(model, model_dir, dest, dtype, host)) if world.writer else None)
    if all(t.dtype == target for t in model.state_dict().values() if t.is_floating_point()):
        return write_published(model, model_dir, dest, dtype, None)  # the master weights as they are
    return write_published(model, model_dir, dest, dtype, cast_state_dict(model, target))


def host_copy(model, dtype: str, world=None) -> dict[str, torch.Tensor]:
    """What `publish_weights` writes, copied to the host now (rank 0's; {} on the others): a later step cannot
    change it, so `write_published` may write it on a thread (clawd.trainer.worker.publishing)."""
    target = getattr(torch, dtype)
    if world is not None:
        return gathered_state_dict(model, target, world, copy=True)
    return cast_state_dict(model, target, copy=True)


def write_published(model, model_dir: Path, dest: Path, dtype: str, state_dict: dict | None) -> Path:
    """`state_dict` (None: the model's own) as the version directory `dest`, written atomically (rank 0)."""
    dest.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: Path) -> None:
        faults.point("trainer.publish.write")
        if state_dict is None:
            model.save_pretrained(tmp)  # float32 stays bit-exact
        else:
            model.save_pretrained(tmp, state_dict=state_dict)
            config = copy.deepcopy(model.config)  # save_pretrained wrote the model's own dtype
            config.dtype = dtype
            config.save_pretrained(tmp)
        faults.point("trainer.publish.mid")
        copy_model_files(model_dir, tmp)

    return atomic_dir(dest, write)


def copy_model_files(model_dir: Path, dest: Path) -> None:
    """The files of model_dir that are not weights (the tokenizer's, chat template, ...) into dest, where
    dest has no file of that name yet."""
    for src in sorted(Path(model_dir).iterdir()):
        if (src.is_file() and not src.name.startswith(".") and not (dest / src.name).exists()
                and not src.name.endswith(_WEIGHT_SUFFIXES) and not src.name.endswith(".index.json")):
            shutil.copy2(src, dest / src.name)


def gathered_state_dict(model, dtype: torch.dtype, world, copy: bool = False) -> dict[str, torch.Tensor]:
    """The sharded model's state dict, whole, on rank 0's host in dtype (floating-point tensors), gathered
    one tensor at a time (a collective per tensor: every rank calls it in the same order); {} elsewhere.
    Tensors shared under two names (tied embeddings) are gathered once and stay shared. `copy`: never the
    model's own storage (a tensor not sharded, already on the host in dtype, is otherwise returned as it is)."""
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if id(tensor) not in done:
            whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            if world.writer:
                done[id(tensor)] = whole.detach().to("cpu", dtype if whole.is_floating_point() else whole.dtype,
                                                     copy=copy)
            else:
                done[id(tensor)] = None
            del whole
        if world.writer:
            out[name] = done[id(tensor)]
    return out


def cast_state_dict(model, dtype: torch.dtype, copy: bool = False) -> dict[str, torch.Tensor]:
    """model's state_dict with its floating-point tensors cast to dtype on the host (`copy`: always copied, even
    those already on the host in dtype). Tensors that share storage (tied embeddings) stay shared, so
    save_pretrained still writes them once."""
    out: dict[str, torch.Tensor] = {}
    done: dict[tuple, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in done:
            done[key] = tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype, copy=copy)
        out[name] = done[key]
    return out


def _unique_tensors(model):
    """The state dict's tensors, each storage once (tied embeddings are written once)."""
    seen = set()
    for tensor in model.state_dict().values():
        if hasattr(tensor, "to_local"):  # a shard of the world's: a tied one is the same object under both names
            key = ("sharded", id(tensor))
        else:
            key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            yield tensor


def publish_bytes(model, model_dir: Path, dtype: str) -> int:
    """About what `publish_weights` writes: the tensors in dtype and the copied tokenizer files."""
    size = getattr(torch, dtype).itemsize
    tensors = sum(t.numel() * (size if t.is_floating_point() else t.element_size()) for t in _unique_tensors(model))
    files = sum(p.stat().st_size for p in model_dir.iterdir()
                if p.is_file() and not p.name.startswith(".") and not p.name.endswith(_WEIGHT_SUFFIXES))
    return tensors + files


def checkpoint_bytes(model, optimizer, lora: bool = False) -> int:
    """About what `save_checkpoint` writes: the master weights (DCP stores tied ones under each name), only
    the trainable ones with LoRA, and the optimizer's state tensors."""
    tensors = [p for p in model.parameters() if p.requires_grad] if lora else model.state_dict().values()
    weights = sum(t.numel() * t.element_size() for t in tensors)
    state = sum(v.numel() * v.element_size() for per in optimizer.state.values() for v in per.values()
                if isinstance(v, torch.Tensor))
    return weights + state


def prune_versions(weights_dir: Path, keep: int, spare: int) -> None:
    """Remove all but the newest `keep` published versions, and never `spare`: the last checkpoint's,
    which a restart serves again (clawd.weights.restored_weights)."""
    for version, path in numbered(weights_dir, VERSION_DIR)[:-keep]:
        if version != spare:
            shutil.rmtree(path)


def newest_published(weights_dir: Path) -> int:
    """The highest version under weights_dir, 0 without one."""
    return max((v for v, _ in numbered(weights_dir, VERSION_DIR)), default=0)


# --- checkpoints ---------------------------------------------------------------------------------
#
# Format 2 (any world size): ckpt-N/dcp holds the model and the optimizer as torch.distributed.checkpoint
# wrote them, sharded by the ranks that saved them and loadable at any other world size (DCP reshards
# on load); rng-R.pt is rank R's random state; state.json the counters (world_size among them);
# `complete` last. Format 1 (one process, before the trainer world): model.safetensors, optimizer.pt
# (AdamW's state by parameter index), rng.pt; still loaded, by any world size.

def save_checkpoint(checkpoints_dir: Path, model, optimizer, state: dict[str, Any], world=None,
                    keep: int = CHECKPOINTS_KEPT) -> Path:
    """A new ckpt-N: the model, the optimizer, every rank's RNG state and `state` (the trainer's
    counters, JSON-serialisable) in state.json; then only the newest `keep` complete ones are kept,
    and none of a step above this one's: after a rollback those are the abandoned branch. In a world
    every rank calls it; rank 0 names the directory and finishes it."""
    np_state, py_state = np.random.get_state(), random.getstate()
    state = {"format": CHECKPOINT_FORMAT, **state, "world_size": 1 if world is None else world.size,
             "python_rng": [py_state[0], list(py_state[1]), py_state[2]],
             "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    model_sd, optim_sd = _state_dicts(model, optimizer, state.get("lora"))
    rank = 0 if world is None else world.rank

    def shards(tmp: Path) -> None:  # every rank
        with _alone_is_meant(world):
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"), no_dist=world is None)
        _each_rank(world, lambda: torch.save(_rng_state(), tmp / f"rng-{rank}.pt"))

    def write(tmp: Path) -> None:  # rank 0
        faults.point("trainer.checkpoint.write")
        if world is not None:
            world.broadcast(("tmp", str(tmp)))
        shards(tmp)
        faults.point("trainer.checkpoint.mid")
        (tmp / "state.json").write_text(json.dumps(state, allow_nan=True) + "\n")
        (tmp / "complete").write_text(f"{CHECKPOINT_FORMAT}\n")  # last: the rest is in place

    return _led_by_rank0(world, lambda: _new_checkpoint(checkpoints_dir, write, state["step"], keep), shards)


@contextlib.contextmanager
def _alone_is_meant(world):
    """DCP warns on every single-process save and load, even when told so (no_dist): here one process is meant."""
    with warnings.catch_warnings():
        if world is None:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _new_checkpoint(checkpoints_dir: Path, write, step: int, keep: int) -> Path:
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    existing = numbered(checkpoints_dir, CHECKPOINT_DIR)
    n = existing[-1][0] + 1 if existing else 1
    dest = atomic_dir(checkpoints_dir / f"ckpt-{n:08d}", write)
    branch = [p for p in complete_checkpoints(checkpoints_dir) if p == dest or checkpoint_state(p)["step"] <= step]
    kept = branch[-keep:]
    for _, path in numbered(checkpoints_dir, CHECKPOINT_DIR):
        if path not in kept:  # older ones, abandoned ones, and any without its marker (never ours to resume)
            shutil.rmtree(path)
    return dest


def checkpoint_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / "state.json").read_text())


def checkpoint_of(checkpoints_dir: Path, version: int) -> Path | None:
    """The newest complete checkpoint whose weights are `version` (what a rollback to it restores)."""
    for path in reversed(complete_checkpoints(checkpoints_dir)):
        if checkpoint_state(path)["version"] == version:
            return path
    return None


def _led_by_rank0(world, lead, follow):
    """Rank 0 runs `lead`, which first broadcasts ("tmp", path) to the others, who then run `follow(path)`
    (the collectives `lead` makes after its broadcast, in the same order). Rank 0's outcome, a result
    or an exception, then reaches every rank, so that all raise or none does. Rank 0 may fail alone
    only before its broadcast or after the last collective."""
    if world is None:
        return lead()
    if world.writer:
        try:
            outcome = ("done", ("ok", lead()))
        except Exception as exc:
            outcome = ("done", ("raise", exc))
        world.broadcast(outcome)
    else:
        outcome = world.broadcast()
        if outcome[0] == "tmp":
            try:
                follow(Path(outcome[1]))
            except Exception:
                pass  # rank 0 met the same collective's failure: its outcome, next, is what counts
            outcome = world.broadcast()
    kind, value = outcome[1]
    if kind == "raise":
        raise value
    return value


def _each_rank(world, work) -> None:
    """Every rank runs `work`; if any raised, every rank raises the first one (a file each rank writes)."""
    try:
        work()
        mine = None
    except Exception as exc:
        mine = exc
    errors = [mine] if world is None else world.gather(mine)
    if first := next((e for e in errors if e is not None), None):
        raise first


def _rng_state() -> dict:
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _options(lora: dict | None):
    """LoRA: the frozen base is the model directory's, so a checkpoint holds only the adapters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=lora is not None, strict=lora is None)


def _state_dicts(model, optimizer, lora: dict | None) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts as DCP saves and loads them; with LoRA the model's holds
    the trainable tensors alone (torch's ignore_frozen_params keeps a tied output layer, frozen as it is)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(lora))
    if lora is not None:
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in trainable}
    return model_sd, optim_sd


def latest_checkpoint(checkpoints_dir: Path) -> Path | None:
    """The newest checkpoint with its `complete` marker, or None."""
    complete = complete_checkpoints(checkpoints_dir)
    return complete[-1] if complete else None


def load_checkpoint(path: Path, model, optimizer, device: torch.device, world=None, seed: int = 0,
                    lora: dict | None = None) -> dict[str, Any]:
    """Restore the model, the optimizer and the RNGs from the checkpoint at path, whatever world size
    wrote it; its state.json. RNG states are per rank: they are restored when the world size is the
    writer's, and otherwise every rank is seeded from (seed, step, rank). The step draws no random
    number (dropout is off, nothing is sampled), so what it computes does not depend on them.
    `lora`: the trainer's adapter shape (None: a full fine-tune); a checkpoint of another is refused."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = json.loads((path / "state.json").read_text())
    if state["format"] not in (1, CHECKPOINT_FORMAT):
        raise ValueError(f"{path}: checkpoint format {state['format']} is not 1 or {CHECKPOINT_FORMAT}")
    if state.get("lora") != lora:
        raise ValueError(f"{path} was written by a trainer with LoRA {state.get('lora') or 'off'}, this one has "
                         f"{lora or 'LoRA off'}: move {path.parent} aside to train from the base model again")
    size, rank = (1, 0) if world is None else (world.size, world.rank)
    if state["format"] == 1:
        model_sd, optim_sd = _format1_state(path, model, optimizer)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=StateDictOptions(full_state_dict=True, strict=False))
        rng_file = path / "rng.pt"
    else:
        model_sd, optim_sd = _state_dicts(model, optimizer, lora)
        box = {"model": model_sd, "optim": optim_sd}
        with _alone_is_meant(world):
            dcp.load(box, checkpoint_id=str(path / "dcp"), no_dist=world is None)
        set_state_dict(model, optimizer, model_state_dict=box["model"], optim_state_dict=box["optim"],
                       options=_options(lora))
        rng_file = path / f"rng-{rank}.pt"
    if state.get("world_size", 1) == size and rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        v, internal, gauss = state["python_rng"]
        random.setstate((v, tuple(internal), gauss))
        kind, keys, *rest = state["numpy_rng"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    else:
        seed_all((seed + 1_000_003 * state["step"] + 7919 * rank) % 2**32)
    return state


def _format1_state(path: Path, model, optimizer) -> tuple[dict, dict]:
    """A format-1 checkpoint as full state dicts keyed by parameter name: the safetensors (tied weights
    written once come back under every name) and AdamW's state, which format 1 kept by parameter index
    (the order of `model.parameters()`, the optimizer's)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = list(model.named_parameters(remove_duplicate=False))
    model_sd = {name: next(tensors[n] for n, q in params if q is p and n in tensors) for name, p in params}
    model_sd |= {name: tensors[name] for name, _ in model.named_buffers() if name in tensors}
    old = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    optim_sd = {"state": {names[i]: st for i, st in old["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in old["param_groups"]]}
    return model_sd, optim_sd


def seed_all(seed: int) -> None:
    """A fresh start's RNGs: torch's, Python's and NumPy's."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
