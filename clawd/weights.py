"""The state directory's weights and checkpoints: their layout, and writing a directory durably.

    state_dir/weights/v{version:06d}     published Hugging Face directories (the engine loads them);
                                         in LoRA mode PEFT adapter directories (adapter_config.json)
    state_dir/checkpoints/ckpt-{n:08d}   trainer checkpoints; `complete` is written last, and
                                         `state.json` says which version its weights are
    state_dir/trainer/steps.jsonl        the trained-steps ledger (`Ledger`, `lineage`)

No torch: the daemon uses `restored_weights` at start to launch the policy engine on what the
trainer will resume from, so a restart serves the newest checkpointed version again instead of
the base model. The trainer (clawd.trainer.worker.checkpoints) and the model builder (clawd.tools.models)
write their directories with `atomic_dir` (docs/ARCHITECTURE.md §6, §7), after `check_free`.
"""
from __future__ import annotations

import errno
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


def lineages_root(state_dir: Path) -> Path:
    """Where the principals' own adapters live (adapters per principal)."""
    return Path(state_dir) / "lineages"


def lineage_dir(state_dir: Path, key: str) -> Path:
    """A principal's own adapter's state directory (adapters per principal), keyed by their pseudonym: its
    weights/, checkpoints/, trainer/ and versions.jsonl, laid out as the state directory's own."""
    return lineages_root(state_dir) / key


def remove_lineage(state_dir: Path, key: str) -> bool:
    """A principal's own adapter's directory deleted (`clawctl forget`; by the trainer, or by the daemon when no
    trainer holds it): whether there was one."""
    path = lineage_dir(state_dir, key)
    if not path.is_dir():
        return False
    shutil.rmtree(path)
    return True


def numbered(parent: Path, pattern: re.Pattern) -> list[tuple[int, Path]]:
    """(number, path) of the entries of parent whose name matches pattern, oldest first."""
    if not parent.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in parent.iterdir() if (m := pattern.match(p.name))]
    return sorted(found)


def complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    return [p for _, p in numbered(checkpoints_dir, CHECKPOINT_DIR) if (p / "complete").is_file()]


def restored_weights(state_dir: Path, servable: Callable[[int], bool] = lambda version: True
                     ) -> tuple[int, Path] | None:
    """(version, directory) of the weights a restart serves: the ones the trainer resumes with, when they are
    still published and `servable` (the gate passed them); else the newest published version before them
    that is. None: the base model (the trainer resumes from it, or nothing servable is left); the learner
    then moves the engine onto the trainer's weights, through the gate when they have not passed it."""
    complete = complete_checkpoints(Path(state_dir) / "checkpoints")
    if not complete:
        return None
    newest = json.loads((complete[-1] / "state.json").read_text())["version"]
    for version in range(newest, 0, -1):
        path = version_dir(state_dir, version)
        if is_published(path) and servable(version):
            return version, path
        if version == newest and servable(version):
            return None  # rotated out but fine: the learner publishes the trainer's weights again
    return None


def checkpointed_versions(state_dir: Path) -> dict[int, int]:
    """{version: step} of the complete checkpoints: the versions a rollback can return to."""
    out = {}
    for path in complete_checkpoints(Path(state_dir) / "checkpoints"):
        state = json.loads((path / "state.json").read_text())
        out[state["version"]] = state["step"]
    return out


def is_published(path: Path) -> bool:
    """A published version's directory: a model's, or in LoRA mode a PEFT adapter's."""
    return (Path(path) / "config.json").is_file() or is_adapter(path)


def is_adapter(path: Path) -> bool:
    """A PEFT adapter directory (LoRA mode's published versions)."""
    return (Path(path) / "adapter_config.json").is_file()


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


def atomic_write(dest: Path, data: bytes) -> None:
    """A small file replaced whole: written beside, fsynced, renamed over `dest`, its directory fsynced."""
    tmp = Path(dest).with_name(f".{Path(dest).name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, dest)
    fsync(Path(dest).parent)


def remove_temporaries(parent: Path) -> None:
    """The leftovers of `atomic_dir` calls that a crash interrupted (hidden `.NAME.tmp-*` directories)."""
    if parent.is_dir():
        for p in parent.glob(".*.tmp-*"):
            shutil.rmtree(p)


# --- free space ------------------------------------------------------------------------------

def write_failure_kind(exc: OSError) -> str:
    """"disk" for a full filesystem or quota (learning pauses until there is room), "io" otherwise
    (retried with backoff)."""
    return "disk" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "io"


def check_free(parent: Path, size: int, min_free_bytes: int, what: str) -> None:
    """Raise OSError(ENOSPC) unless writing about `size` bytes under parent leaves `min_free_bytes` free
    (`[state] min_free_bytes`; 0: only a write that fails stops, not the estimate)."""
    if min_free_bytes <= 0:
        return
    free = shutil.disk_usage(parent).free
    if free - size < min_free_bytes:
        raise OSError(errno.ENOSPC, f"writing {what} (~{size / 1e6:.1f} MB) would leave {max(free - size, 0) / 1e6:.1f} MB "
                                    f"free on {parent}, below state.min_free_bytes ({min_free_bytes / 1e6:.1f} MB)")


# --- the trained-steps ledger ----------------------------------------------------------------

def ledger_path(state_dir: Path) -> Path:
    return Path(state_dir) / "trainer" / "steps.jsonl"


class Ledger:
    """state_dir/trainer/steps.jsonl: one JSON line per trainer step, appended after the step,
    `{"step", "batch_id", "version", "samples", "skipped"}` (`version`: what its weights were published
    as, null before a publish; a later publish of the same weights appends the line again with it).

    A line is queued, then written by `flush` (after each step; a failure keeps it queued) and made
    durable by `sync`, which the trainer calls before every checkpoint: `lineage` reads only steps up
    to a checkpoint's, so every line it needs is on disk before that checkpoint is, and lines after the
    last checkpoint describe steps a crash discards anyway. A write cut short is truncated away, and a
    torn last line (a power cut) is cut off when the trainer opens the ledger, so appends never join it."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._queued: list[bytes] = []
        if self.path.is_file():
            with open(self.path, "rb+") as f:
                data = f.read()
                if data and not data.endswith(b"\n"):
                    f.truncate(data.rfind(b"\n") + 1)

    def last_line(self, step: int) -> dict | None:
        """The last line written for `step` (what a resumed trainer's weights were trained on)."""
        found = None
        for line in read_ledger(self.path):
            if line.get("step") == step:
                found = line
        return found

    def add(self, line: dict) -> None:
        self._queued.append((json.dumps(line, separators=(",", ":")) + "\n").encode())

    def flush(self) -> None:
        if not self._queued:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = b"".join(self._queued)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.fstat(fd).st_size
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            except OSError:
                os.ftruncate(fd, start)  # no half line for the next append to join
                raise
        finally:
            os.close(fd)
        self._queued.clear()

    def sync(self) -> None:
        fresh = not self.path.exists()
        self.flush()
        if self.path.exists():
            fsync(self.path)
            if fresh:  # the new file's entry, and its directory's
                fsync(self.path.parent)
                fsync(self.path.parent.parent)


def read_ledger(path: Path) -> list[dict]:
    """The ledger's lines, in order; a torn last line (not yet repaired) is left out."""
    if not Path(path).is_file():
        return []
    out = []
    raw = Path(path).read_bytes().split(b"\n")
    for n, chunk in enumerate(raw):
        if not chunk:
            continue
        try:
            out.append(json.loads(chunk))
        except ValueError:
            if n == len(raw) - 1:
                break  # torn by a crash while appending: that step was never checkpointed
            raise ValueError(f"{path}: line {n + 1} is not JSON") from None
    return out


def checkpointed_samples(state_dir: Path) -> set[str]:
    """The ids of the samples trained into the newest complete checkpoint's weights (its lineage). Such a
    sample must never be trained again, whatever the journal says: a stop between a checkpoint and the
    journal's acknowledgement of its samples leaves them live there."""
    complete = complete_checkpoints(Path(state_dir) / "checkpoints")
    if not complete:
        return set()
    step = json.loads((complete[-1] / "state.json").read_text())["step"]
    return {sample for line in lineage(read_ledger(ledger_path(state_dir)), step) for sample in line["samples"]}


def lineage(lines: list[dict], final_step: int) -> list[dict]:
    """The steps the weights of a checkpoint at `final_step` went through: for each step number from 1 to
    final_step, the LAST line written for it (a resume from a checkpoint at k trains k + 1 again, and its
    new line supersedes the lost one), in step order. Steps without any line are absent."""
    last: dict[int, dict] = {}
    for line in lines:
        if 1 <= line["step"] <= final_step:
            last[line["step"]] = line
    return [last[s] for s in sorted(last)]
