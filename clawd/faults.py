"""Named fault points: where a test makes clawd fail on purpose, at a chosen place, not by luck of timing.

A write site or a step that a failure catalogue names calls `faults.point("name")` just before (or in
the middle of) the work it guards. Nothing happens unless the point is armed, either in-process
(`arm`, for tests that run the code directly) or for a whole process tree through the environment
variable CLAWD_FAULTS, read once per process, so a daemon or trainer started by a test inherits it:

    CLAWD_FAULTS="trainer.checkpoint.mid=kill@2,journal.append=enospc"

`name=action` fires at every pass; `name=action@N` only at the Nth pass (counted per process, from 1);
`@N+` at the Nth pass and every one after. Actions:

    kill    SIGKILL this process (a crash with no cleanup, as the OOM killer or a power cut would)
    enospc  raise OSError(ENOSPC), as a full disk does
    eio     raise OSError(EIO)
    hang    block the calling thread for an hour (a hung dependency: only its watchdog ends it)
    slow    block the calling thread for SLOW_SECONDS, then go on (a busy step: a long prefill, a loaded machine)
    oom     raise MemoryError, as an allocation the device (or host) cannot satisfy does

An unknown action or a malformed spec raises at the first point: a test that meant to inject a fault
must not pass because the fault never fired.
"""
from __future__ import annotations

import errno
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass

ENV = "CLAWD_FAULTS"
ACTIONS = ("kill", "enospc", "eio", "hang", "slow", "oom")
SLOW_SECONDS = 2.0


@dataclass(frozen=True)
class Fault:
    action: str
    at: int | None = None     # None: every pass
    onward: bool = False      # with at: that pass and every later one

    def fires(self, n: int) -> bool:
        return self.at is None or n == self.at or (self.onward and n > self.at)


_armed: dict[str, Fault] | None = None  # None until the environment is read
_passes: Counter[str] = Counter()


def parse(spec: str) -> dict[str, Fault]:
    """`"a=kill@2,b=enospc"` → {"a": Fault("kill", 2), "b": Fault("enospc")}."""
    faults = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, eq, rest = item.partition("=")
        action, _, at = rest.partition("@")
        if not eq or not name or action not in ACTIONS:
            raise ValueError(f"{ENV}: {item!r} is not name=action[@N[+]] with an action in {', '.join(ACTIONS)}")
        onward = at.endswith("+")
        at = at.rstrip("+")
        if at and not (at.isdigit() and int(at) >= 1):
            raise ValueError(f"{ENV}: {item!r}: the pass after @ must be a number from 1")
        faults[name] = Fault(action, int(at) if at else None, onward)
    return faults


def arm(name: str, action: str, at: int | None = None, onward: bool = False) -> None:
    """Arm one point in this process (tests); its pass count restarts."""
    if action not in ACTIONS:
        raise ValueError(f"unknown fault action {action!r}")
    _table()[name] = Fault(action, at, onward)
    _passes.pop(name, None)


def reset() -> None:
    """Disarm everything armed in-process and forget the counts; the environment is read again."""
    global _armed
    _armed = None
    _passes.clear()


def passes(name: str) -> int:
    """How many times `name` was reached while armed (a test checks that its fault had a chance)."""
    return _passes[name]


def point(name: str) -> None:
    """A place where the fault `name`, when armed, happens."""
    fault = _table().get(name)
    if fault is None:
        return
    _passes[name] += 1
    if not fault.fires(_passes[name]):
        return
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "hang":
        time.sleep(3600)
    elif fault.action == "slow":
        time.sleep(SLOW_SECONDS)
    elif fault.action == "oom":
        raise MemoryError(f"out of memory (fault point {name})")
    else:
        code = errno.ENOSPC if fault.action == "enospc" else errno.EIO
        raise OSError(code, f"{os.strerror(code)} (fault point {name})")


def _table() -> dict[str, Fault]:
    global _armed
    if _armed is None:
        _armed = parse(os.environ.get(ENV, ""))
    return _armed
