"""What the suite builds once per machine (the tiny models, the SmolLM2 conversion) and shares between
pytest-xdist workers and later runs: `.cache/tests/` in the checkout, ignored by git.

An artefact's directory is named by a digest of everything its build reads (the builder's source, the
library versions, the arguments), so a change to any of them builds a new one and removes the old. The
first worker to need it builds it under an exclusive lock while the others wait on that lock; a
manifest of every file's size and modification time, written last, marks it complete, and a directory
whose files no longer match it (a test wrote into it, a build was killed) is built again.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "tests"
MANIFEST = ".suite-manifest.json"


def key(*parts: str, sources: tuple[str, ...] = (), packages: tuple[str, ...] = ()) -> str:
    """A digest of `parts`, the contents of the repository files `sources` and the installed versions
    of `packages`."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() + b"\0")
    for source in sources:
        h.update(source.encode() + b"\0" + (ROOT / source).read_bytes() + b"\0")
    for package in packages:
        h.update(f"{package}=={metadata.version(package)}\0".encode())
    return h.hexdigest()[:16]


def _manifest(root: Path) -> dict[str, list[int]]:
    return {str(p.relative_to(root)): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST}


def _complete(root: Path) -> bool:
    try:
        return json.loads((root / MANIFEST).read_text()) == _manifest(root)
    except (OSError, ValueError):
        return False


def shared(name: str, digest: str, build: Callable[[Path], None], cache: Path = CACHE) -> Path:
    """`cache/NAME-DIGEST`, filled by `build(directory)` the first time any process asks for it."""
    cache.mkdir(parents=True, exist_ok=True)
    root = cache / f"{name}-{digest}"
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its holder dies
        if _complete(root):
            return root
        for old in cache.iterdir():  # an earlier key's build, or this one's torn one
            if re.fullmatch(rf"{re.escape(name)}-[0-9a-f]{{16}}", old.name):
                shutil.rmtree(old)
        root.mkdir()
        build(root)
        (root / MANIFEST).write_text(json.dumps(_manifest(root)))
    return root
