"""What the trainer writes and reads under its state directory (docs/ARCHITECTURE.md §6, §7).

    state_dir/weights/v{version:06d}     published Hugging Face directories, the newest keep_versions
    state_dir/checkpoints/ckpt-{n:08d}   everything a resume needs, the newest CHECKPOINTS_KEPT

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

import copy
import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from clawd import faults
from clawd.weights import CHECKPOINT_DIR, VERSION_DIR, atomic_dir, complete_checkpoints, numbered

CHECKPOINT_FORMAT = 1  # bumped when a checkpoint's files change meaning
CHECKPOINTS_KEPT = 2

# Files of a model directory that are weights: never copied next to the freshly saved ones.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


# --- published weights -----------------------------------------------------------------------

def publish_weights(model, model_dir: Path, dest: Path, dtype: str = "float32") -> Path:
    """model as a complete Hugging Face directory at dest (config, generation config, safetensors)
    with the other files of model_dir (the tokenizer's), written atomically. dtype is what the
    engines serve (`clawd.weights.model_dtype`): weights of another dtype are cast to it, one tensor
    at a time into host memory (the device holds no second copy), and config.json says so."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    target = getattr(torch, dtype)

    def write(tmp: Path) -> None:
        faults.point("trainer.publish.write")
        if all(t.dtype == target for t in model.state_dict().values() if t.is_floating_point()):
            model.save_pretrained(tmp)  # the master weights as they are: float32 stays bit-exact
        else:
            model.save_pretrained(tmp, state_dict=cast_state_dict(model, target))
            config = copy.deepcopy(model.config)  # save_pretrained wrote the model's own dtype
            config.dtype = dtype
            config.save_pretrained(tmp)
        faults.point("trainer.publish.mid")
        for src in sorted(model_dir.iterdir()):
            if (src.is_file() and not src.name.startswith(".") and not (tmp / src.name).exists()
                    and not src.name.endswith(_WEIGHT_SUFFIXES) and not src.name.endswith(".index.json")):
                shutil.copy2(src, tmp / src.name)

    return atomic_dir(dest, write)


def cast_state_dict(model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """model's state_dict with its floating-point tensors cast to dtype on the host. Tensors that share
    storage (tied embeddings) stay shared, so save_pretrained still writes them once."""
    out: dict[str, torch.Tensor] = {}
    done: dict[tuple, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in done:
            done[key] = tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype)
        out[name] = done[key]
    return out


def _unique_tensors(model):
    """The state dict's tensors, each storage once (tied embeddings are written once)."""
    seen = set()
    for tensor in model.state_dict().values():
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


def checkpoint_bytes(model, optimizer) -> int:
    """About what `save_checkpoint` writes: the master weights and the optimizer's state tensors."""
    weights = sum(t.numel() * t.element_size() for t in _unique_tensors(model))
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


# --- checkpoints -----------------------------------------------------------------------------

def save_checkpoint(checkpoints_dir: Path, model, optimizer, state: dict[str, Any]) -> Path:
    """A new ckpt-N: the model, the optimizer, every RNG's state and `state` (the trainer's
    counters, JSON-serialisable) in state.json; then only the newest CHECKPOINTS_KEPT complete
    ones are kept."""
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    existing = numbered(checkpoints_dir, CHECKPOINT_DIR)
    n = existing[-1][0] + 1 if existing else 1
    np_state, py_state = np.random.get_state(), random.getstate()
    state = {"format": CHECKPOINT_FORMAT, **state,
             "python_rng": [py_state[0], list(py_state[1]), py_state[2]],
             "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()

    def write(tmp: Path) -> None:
        faults.point("trainer.checkpoint.write")
        save_model(model, str(tmp / "model.safetensors"))
        faults.point("trainer.checkpoint.mid")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(rng, tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps(state, allow_nan=True) + "\n")
        (tmp / "complete").write_text(f"{CHECKPOINT_FORMAT}\n")  # last: the rest is in place

    dest = atomic_dir(checkpoints_dir / f"ckpt-{n:08d}", write)
    keep = complete_checkpoints(checkpoints_dir)[-CHECKPOINTS_KEPT:]
    for _, path in numbered(checkpoints_dir, CHECKPOINT_DIR):
        if path not in keep:  # older ones, and any without its marker (never ours to resume)
            shutil.rmtree(path)
    return dest


def latest_checkpoint(checkpoints_dir: Path) -> Path | None:
    """The newest checkpoint with its `complete` marker, or None."""
    complete = complete_checkpoints(checkpoints_dir)
    return complete[-1] if complete else None


def load_checkpoint(path: Path, model, optimizer, device: torch.device) -> dict[str, Any]:
    """Restore the model, the optimizer and every RNG from the checkpoint at path; its state.json."""
    state = json.loads((path / "state.json").read_text())
    if state["format"] != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: checkpoint format {state['format']} is not {CHECKPOINT_FORMAT}")
    load_model(model, str(path / "model.safetensors"), strict=True, device=str(device))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    rng = torch.load(path / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    v, internal, gauss = state["python_rng"]
    random.setstate((v, tuple(internal), gauss))
    kind, keys, *rest = state["numpy_rng"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))
    return state


def seed_all(seed: int) -> None:
    """A fresh start's RNGs: torch's, Python's and NumPy's."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
