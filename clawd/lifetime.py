"""Lifetimes: a stage's in the daemon (`Stage`), and a child process's, which dies with its parent.

`Stage` is what `clawd.daemon.run` does with each stage object (engines, scoring, learning, safety, privacy,
serving, ops): built from the config and the edges it needs, `open`ed as it is built (resources the daemon's
exit stack closes), `start`ed inside the one TaskGroup in build order, told it is `stopping` (all at once: no
new work, no restarts), `drain`ed in reverse order, `cut_short` on a second stop signal, and giving its part
of the status snapshot.

A child dies with its parent through Linux's PR_SET_PDEATHSIG, for every process clawd starts.
A floor module: stdlib only. Called in a child, between fork and exec (as a `preexec_fn`) or first thing
in its main: when the parent dies, however it dies (SIGKILL included), the kernel sends `sig` to the
child, so no engine, trainer or rank outlives the process that supervises it.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import os
import signal

_PR_SET_PDEATHSIG = 1


class Stage:
    """A stage's life in the daemon; each step does nothing unless the stage has something to do there."""

    async def open(self, exits: contextlib.AsyncExitStack) -> None:
        """Resources to open as the stage is built (a client session, a socket); `exits` closes them last."""

    async def start(self, tasks: asyncio.TaskGroup) -> None:
        """Its long-lived tasks, created in the daemon's one group."""

    def stopping(self) -> None:
        """The stop began (before any stage drains): take no new work, restart nothing."""

    async def drain(self) -> None:
        """Finish or hand on what is in flight, then end its tasks (stages drain in reverse build order)."""

    def cut_short(self) -> None:
        """A second stop signal: end what would make the drain wait (kill children, cut connections)."""

    def status(self) -> dict:
        """Its part of the status snapshot (top-level keys)."""
        return {}


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
