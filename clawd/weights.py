"""The state directory's weights and checkpoints: the layout the trainer writes and the daemon reads.

    state_dir/weights/v{version:06d}     published Hugging Face directories (the engine loads them)
    state_dir/checkpoints/ckpt-{n:08d}   trainer checkpoints; `complete` is written last, and
                                         `state.json` says which version its weights are

Pure file reading, no torch: the daemon uses `restored_weights` at start to launch the policy
engine on what the trainer will resume from, so a restart serves the newest checkpointed
version again instead of the base model.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

VERSION_DIR = re.compile(r"^v(\d{6,})$")
CHECKPOINT_DIR = re.compile(r"^ckpt-(\d{8,})$")


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
