"""A child process that dies with its parent (Linux's PR_SET_PDEATHSIG), for every process clawd starts.

A floor module: stdlib only. Called in a child, between fork and exec (as a `preexec_fn`) or first thing
in its main: when the parent dies, however it dies (SIGKILL included), the kernel sends `sig` to the
child, so no engine, trainer or rank outlives the process that supervises it.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel for `sig` when the parent process dies. It applies to the parent at call time: a
    caller that may have been orphaned before the call must check `os.getppid()` after it (as
    `die_with_spawner` does). Between fork and exec (`preexec_fn`) pass `sig` with functools.partial."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def die_with_spawner() -> None:
    """First thing in a `multiprocessing` child's main (the trainer, the encoder worker): die with the daemon,
    and exit at once if it already died before the signal was armed."""
    die_with_parent()
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)
