"""Where a benchmark result came from: the UTC date, the commit and whether the work tree was dirty.

Every bench under bench/ stamps its result JSON with `stamp(result)`, which sets
`result["provenance"] = {"date": ..., "commit": ..., "dirty": ...}`; `bench/all.py` reads it back
to mark results that no longer describe the code (docs/ARCHITECTURE.md §12).

    date    UTC, ISO-8601 to the second, taken when the run starts (the code it measures is loaded then)
    commit  the full sha of HEAD: from `git rev-parse HEAD` in this repository (a repository above
            it does not count), else from .git's own files (HEAD, the ref, packed-refs), else
            $CLAWD_COMMIT (a copy of the tree without .git, such as a lent GPU machine's), else "unknown"
    dirty   `git status --porcelain` printed anything; None when git could not say

Standard library only, so that bench/gpu.py stays self-contained on a bare machine: the benches run
as scripts, so this file's folder is on their `sys.path`.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_output(root: Path, *args: str, timeout: float = 20) -> str | None:
    """`git -C root ARGS`'s stdout, or None when git is missing, failed or took too long."""
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _from_dot_git(root: Path) -> str | None:
    git = root / ".git"
    try:
        ref = (git / "HEAD").read_text().strip()
        if not ref.startswith("ref: "):
            return ref or None
        name = ref[5:]
        if (git / name).is_file():
            return (git / name).read_text().strip() or None
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + name):
                return line.split()[0]
    except OSError:
        pass
    return None


def commit(root: Path = ROOT) -> tuple[str, bool | None]:
    """(full sha of HEAD, work tree dirty), by the fallbacks in the module's docstring."""
    top = git_output(root, "rev-parse", "--show-toplevel", "HEAD", timeout=20)
    if top:
        lines = top.splitlines()
        if len(lines) == 2 and Path(lines[0]).resolve() == root.resolve():
            status = git_output(root, "status", "--porcelain", timeout=60)
            return lines[1], None if status is None else bool(status.strip())
    sha = _from_dot_git(root)
    if sha:
        return sha, None
    if os.environ.get("CLAWD_COMMIT"):
        return os.environ["CLAWD_COMMIT"], None
    return "unknown", None


def stamp(result: dict | None = None, root: Path = ROOT) -> dict:
    """The provenance of a result measured now; also set as `result["provenance"]` when a result is given."""
    sha, dirty = commit(root)
    now = datetime.datetime.now(datetime.timezone.utc)
    prov = {"date": now.isoformat(timespec="seconds"), "commit": sha, "dirty": dirty}
    if result is not None:
        result["provenance"] = prov
    return prov


def write(result: dict, path: Path) -> int:
    """Write a bench's result JSON (making its folder), say where, and give its exit status: 0 when it passed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if result["pass"] else 1
