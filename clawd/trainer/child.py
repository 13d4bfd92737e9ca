"""The trainer process's loop: where torch lives (docs/ARCHITECTURE.md §1, §14).

The daemon spawns `main(conn, factory, options)` with the `spawn` context and talks to it over
one socket-pair `Connection`, in the format of `clawd.trainer.wire`. The daemon imports this
module to name the spawn target, so it imports no torch. `factory` is the handler's factory, a
top-level function pickled by reference (unpickling it imports its module, in the child), or
None for the real trainer, `clawd.trainer.handler.make`, which imports torch and is imported
here, in the child only.

The handler: `factory(options)` returns an object with `step`, `version` (the newest version ever
published: new ones must be above it) and `weights_version` (the version whose weights it holds;
0 = the base model), all restored from its last checkpoint; `train(batch_id, version, samples)`
-> {"weights_dir": str | None, "metrics": dict, "per_sample": list (optional), "checkpointed":
bool (optional)}, where `version` is the version the new weights will carry; `publish(version)`
-> weights_dir (its current weights as a new version, checkpointed) and `checkpoint()` ->
(path, step). An exception becomes an `error` reply; it is retryable when the exception has a
true `retryable` attribute (see `RetryableError`).

A spawned process does not inherit the daemon's logging: `main` sets it up at
`options["log_level"]` (the daemon's [logging] level), on the stderr it shares with the daemon.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys
from typing import Callable

from clawd.config import LOG_FORMAT
from clawd.samples import Sample
from clawd.trainer.wire import recv_message, send_message

_PR_SET_PDEATHSIG = 1

Factory = Callable[[dict], object]  # options -> handler; a top-level function, so that it pickles by reference


class RetryableError(Exception):
    """Raised by a handler for a failure that may pass on a second try (e.g. out of memory)."""
    retryable = True


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)  # the daemon died before the signal was armed


def _error(batch_id, exc: BaseException) -> dict:
    return {"type": "error", "batch_id": batch_id, "message": f"{type(exc).__name__}: {exc}",
            "retryable": bool(getattr(exc, "retryable", False))}


def handle(handler, msg: dict) -> dict:
    """The reply to one request. Handler exceptions become `error` replies."""
    kind = msg.get("type")
    if kind == "ping":
        return {"type": "pong", "n": msg.get("n")}
    batch_id = msg.get("batch_id")
    try:
        if kind == "train":
            samples = [Sample.from_json(raw) for raw in msg.get("samples", [])]
            out = handler.train(batch_id, msg["version"], samples)
            weights = out["weights_dir"]  # None: the step was skipped, nothing to publish
            return {"type": "trained", "batch_id": batch_id, "version": msg["version"],
                    "weights_dir": None if weights is None else str(weights), "metrics": out.get("metrics", {}),
                    "per_sample": list(out.get("per_sample", [])),
                    "checkpointed": bool(out.get("checkpointed", False))}
        if kind == "publish":
            weights = handler.publish(msg["version"])
            return {"type": "published", "version": msg["version"], "weights_dir": str(weights)}
        if kind == "checkpoint":
            path, step = handler.checkpoint()
            return {"type": "checkpointed", "path": str(path), "step": step}
        raise ValueError(f"unknown message type {kind!r}")
    except Exception as exc:
        return _error(batch_id, exc)


def main(conn, factory: Factory | None, options: dict) -> None:
    """The child's entry point: handshake, then one reply per request until shutdown or EOF."""
    _die_with_parent()
    for name, value in options.get("env", {}).items():  # its GPUs: set before torch initialises CUDA
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which stops us in order
    logging.basicConfig(level=str(options.get("log_level", "info")).upper(), stream=sys.stderr, format=LOG_FORMAT)
    try:
        if factory is None:
            from clawd.trainer.handler import make as factory
        handler = factory(options)
        ready = {"type": "ready", "pid": os.getpid(), "step": handler.step, "version": handler.version,
                 "weights_version": handler.weights_version}
    except Exception as exc:
        send_message(conn, _error(None, exc))
        raise SystemExit(1)
    send_message(conn, ready)
    while True:
        try:
            msg = recv_message(conn)
        except EOFError:
            return  # the daemon is gone
        if msg.get("type") == "shutdown":
            return
        send_message(conn, handle(handler, msg))
