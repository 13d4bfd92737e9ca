"""Writing a version's directory: now, or on a thread off the trainer's critical path (docs/ARCHITECTURE.md §13).

A version is a complete Hugging Face directory in the served dtype (full weights) or a PEFT adapter's (LoRA),
after a check that the write leaves `[state] min_free_bytes` free. With weight-update groups the engines take a
new version from the trainer's memory, so the directory (restarts, realignment, the gate and rollbacks load it)
need not be on disk before they do. The trainer copies the weights to the host in the served dtype (the same
gather a synchronous write makes), replies, and this thread writes the copy while the version is pushed. The
copy is kept until the directory is on disk, so a write that failed is written again from it (`result`), never
from weights a later step changed. The trainer settles a pending write before anything that needs it or would
race it: the next step, a checkpoint, a restore, another publish.

The thread is the trainer process's, never the daemon's (one event loop, no threads): only `clawd.trainer.worker.step`
imports this module, in the child (tests/test_layout.py checks that the daemon imports nothing that starts one).
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from clawd.trainer.worker import adapters, checkpoints
from clawd.weights import check_free

log = logging.getLogger("clawd.trainer")


def check_room(model, model_dir: Path, dest: Path, dtype: str, lora: bool, min_free_bytes: int) -> None:
    """OSError ENOSPC unless writing `dest` leaves min_free_bytes free (on the rank that writes)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    size = adapters.adapter_bytes(model, dtype) if lora else checkpoints.publish_bytes(model, model_dir, dtype)
    check_free(dest.parent, size, min_free_bytes, dest.name)


def write_version(model, model_dir: Path, version: int, dest: Path, dtype: str, *, lora: bool, world,
                  deferred: bool, then: Callable[[], None], adapter: str = "default") -> tuple[Path, DeferredWrite | None]:
    """The version directory `dest`, written now; or, `deferred` (full weights only), the weights copied to the host
    now and written on a thread, which runs `then` (pruning older versions) after it: the pending write."""
    if deferred and not lora:
        host = checkpoints.host_copy(model, dtype, world)

        def write() -> Path:
            out = checkpoints.write_published(model, model_dir, dest, dtype, host)
            then()
            return out
        return dest, DeferredWrite(version, write if world is None or world.writer else None)
    if lora:  # a PEFT adapter directory: the engine keeps the base and loads it beside
        dest = adapters.publish(model, dest, dtype, world, adapter=adapter)
    else:
        dest = checkpoints.publish_weights(model, model_dir, dest, dtype, world=world)
    return dest, None


class DeferredWrite:
    """One version's directory being written by `write` on a thread (on the rank that writes; `write` None
    on the others, which only wait for rank 0's outcome)."""

    def __init__(self, version: int, write: Callable[[], Path] | None):
        self.version = version
        self._write = write
        self._dest: Path | None = None
        self._thread = None
        if write is not None:
            self._thread = threading.Thread(target=self._run, name=f"clawd-publish-v{version}", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._dest = self._write()
        except Exception as exc:  # kept for `result`, which writes again from the same copy
            log.error("writing v%d's directory failed (written again when it is needed): %s: %s", self.version,
                      type(exc).__name__, exc)

    def result(self) -> Path | None:
        """Wait for the write; one that failed is tried again now, on the calling thread, and raises when it
        fails again (the copy is kept for the next call). None on a rank that does not write."""
        if self._thread is None:
            return None
        self._thread.join()
        if self._dest is None:
            self._dest = self._write()
        return self._dest
