"""The state directory's weights and checkpoints: their layout, and writing a directory durably.

    state_dir/weights/v{version:06d}     published Hugging Face directories (the engine loads them)
    state_dir/checkpoints/ckpt-{n:08d}   trainer checkpoints; `complete` is written last, and
                                         `state.json` says which version its weights are

No torch: the daemon uses `restored_weights` at start to launch the policy engine on what the
trainer will resume from, so a restart serves the newest checkpointed version again instead of
the base model. The trainer (clawd.trainer.checkpoints) and the model builder (clawd.tools.models)
write their directories with `atomic_dir` (docs/ARCHITECTURE.md §6, §7).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

VERSION_DIR = re.compile(r"^v(\d{6,})$")
CHECKPOINT_DIR = re.compile(r"^ckpt-(\d{8,})$")


# --- the layout ------------------------------------------------------------------------------

def version_dir(state_dir: Path, version: int) -> Path:
    return Path(state_dir) / "weights" / f"v{version:06d}"


def numbered(parent: Path, pattern: re.Pattern) -> list[tuple[int, Path]]:
    """(number, path) of the entries of parent whose name matches pattern, oldest first."""
    if not parent.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in parent.iterdir() if (m := pattern.match(p.name))]
    return sorted(found)


def complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    return [p for _, p in numbered(checkpoints_dir, CHECKPOINT_DIR) if (p / "complete").is_file()]


def restored_weights(state_dir: Path) -> tuple[int, Path] | None:
    """(version, directory) of the weights the trainer resumes with, when they are still published;
    None when it resumes from the base model or that version's directory is gone (kept versions
    rotated out): then the learner publishes the trainer's weights as a new version once it is up."""
    complete = complete_checkpoints(Path(state_dir) / "checkpoints")
    if not complete:
        return None
    version = json.loads((complete[-1] / "state.json").read_text())["version"]
    path = version_dir(state_dir, version)
    if version > 0 and (path / "config.json").is_file():
        return version, path
    return None


def model_dtype(model_dir: Path, configured: str = "auto") -> str:
    """The dtype the engines serve and the trainer publishes: `[model] dtype`, or with "auto" the base
    model's config.json (`dtype`, or `torch_dtype` as older transformers wrote it; float32 when it says
    nothing, as transformers then loads it). Named explicitly on every SGLang launch: its own "auto"
    serves a float32 config as float16 (docs/ARCHITECTURE.md §10)."""
    if configured != "auto":
        return configured
    config = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"{model_dir}/config.json: dtype {dtype!r} is not bfloat16, float16 or float32")
    return dtype


# --- durable directories ---------------------------------------------------------------------

def fsync(path: Path) -> None:
    """fsync a file or a directory (O_RDONLY + fsync works for both)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under root, deepest first, then root itself."""
    for path in [*sorted(root.rglob("*"), reverse=True), root]:
        fsync(path)


def atomic_dir(dest: Path, write: Callable[[Path], None], *, replace: bool = False) -> Path:
    """Run write(tmp) into a hidden sibling of dest (`.NAME.tmp-*`), give what it wrote the umask's
    usual modes, fsync it and rename it to dest, so dest is never seen half written. An existing
    dest is refused (FileExistsError), or with replace=True moved aside and removed after the
    rename. A failure removes the temporary directory and re-raises."""
    dest = Path(dest)
    if dest.exists() and not replace:
        raise FileExistsError(f"{dest} already exists")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    old = None
    try:
        write(tmp)
        # mkdtemp makes 0700 and some writers 0600; the engine may run as another user.
        umask = os.umask(0)
        os.umask(umask)
        for path in [tmp, *tmp.rglob("*")]:
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)
        fsync_tree(tmp)
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / dest.name)
        os.replace(tmp, dest)
        fsync(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old)
    return dest


def remove_temporaries(parent: Path) -> None:
    """The leftovers of `atomic_dir` calls that a crash interrupted (hidden `.NAME.tmp-*` directories)."""
    if parent.is_dir():
        for p in parent.glob(".*.tmp-*"):
            shutil.rmtree(p)
