"""The trainer process's loop: where torch lives (docs/ARCHITECTURE.md §1, §14).

The daemon spawns `main(conn, factory, options)` with the `spawn` context and talks to it over
one socket-pair `Connection`, in the format of `clawd.trainer.wire`. The daemon imports this
module to name the spawn target, so it imports no torch. `factory` is the handler's factory, a
top-level function pickled by reference (unpickling it imports its module, in the child), or
None for the real trainer, `clawd.trainer.worker.lineages.handler_for`, which imports torch and is imported
here, in the child only.

The handler: `factory(options)` returns an object with `step`, `version` (the newest version ever
published: new ones must be above it) and `weights_version` (the version whose weights it holds;
0 = the base model), all restored from its last checkpoint, and optionally `checkpoint_step` and
`owed` (the writes its last step still needs); `train(batch_id, version, samples, deferred)` -> the
catalogue's `Trained` (`version` is the version the new weights will carry); `publish(version)` ->
weights_dir (its current weights as a new version) and `checkpoint()` -> (path, step). Every reply
carries `state` (`state_of`).

An exception becomes an `error` reply with a `kind`: "disk" (OSError ENOSPC/EDQUOT, from a write or
the free-space check) and "io" (any other OSError) are retryable; "step" (an exception with a true
`fatal` attribute: the model is in an unknown state) is not, and the process exits 1 after replying
so that the daemon restarts it from its last checkpoint; "oom" (the step ran out of memory: the daemon
splits the batch; fatal or not as the exception says) is not retryable; anything else is "request", retryable when
the exception has a true `retryable` attribute (see `RetryableError`). An error reply to `train`
means the handler kept no step for that batch.

A spawned process does not inherit the daemon's logging: `main` sets it up at
`options["log_level"]` (the daemon's [logging] level), on the stderr it shares with the daemon.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Callable

from clawd import startup
from clawd.config.logging import LOG_FORMAT
from clawd.trainer.catalogue import (Checkpoint, Checkpointed, ForgetLineage, JoinGroup, Joined, LeaveGroup, Left,
                                     LineageForgotten, Pong, PublishWeights, Published, Ready, Restore, Restored,
                                     SendWeights, Sent, Train, WaitWritten, Written, message, read_request)
from clawd.trainer.wire import recv_message, send_message
from clawd.weights import write_failure_kind
from clawd.lifetime import die_with_spawner

Factory = Callable[[dict], object]  # options -> handler; a top-level function, so that it pickles by reference


class RetryableError(Exception):
    """Raised by a handler for a failure that may pass on a second try (e.g. out of memory)."""
    retryable = True


def state_of(handler) -> dict:
    """What every reply says of the trainer: its step, its newest version (the next one goes above it),
    the version its weights are, the step of its newest checkpoint and the writes it owes."""
    return {"step": handler.step, "version": handler.version, "weights_version": handler.weights_version,
            "checkpoint_step": getattr(handler, "checkpoint_step", None), "owed": list(getattr(handler, "owed", [])),
            "writing": getattr(handler, "writing", None)}


def error_reply(batch_id, exc: BaseException, handler=None) -> dict:
    if isinstance(exc, OSError):
        kind, retryable, fatal = write_failure_kind(exc), True, False
    else:
        fatal = bool(getattr(exc, "fatal", False))
        kind, retryable = ("step", False) if fatal else ("request", bool(getattr(exc, "retryable", False)))
        if getattr(exc, "kind", None) == "oom":  # the batch's fault: the daemon splits it, never sends it again
            kind, retryable = "oom", False
    reply = {"type": "error", "batch_id": batch_id, "message": f"{type(exc).__name__}: {exc}",
             "retryable": retryable, "kind": kind, "fatal": fatal}
    if handler is not None:
        reply["state"] = state_of(handler)
    return reply


def handle(handler, msg: dict) -> dict:
    """The reply to one request, with the state of the handler it was for: the lineage it names (a handler of
    adapters per principal, clawd.trainer.worker.lineages; its key then in the state too), else the handler's own.
    Handler exceptions become `error` replies."""
    key = msg.get("lineage")
    try:
        target = handler if key is None else _lineage(handler, key)
    except Exception as exc:
        return error_reply(msg.get("batch_id"), exc, handler)
    reply = _reply(target, msg)
    if reply["type"] != "error":
        reply["state"] = state_of(target)
    if key is not None and "state" in reply:
        reply["state"]["lineage"] = key
    return reply


def _lineage(handler, key: str):
    if not hasattr(handler, "lineage"):
        raise ValueError(f"lineage {key!r} asked of a trainer of one adapter")
    return handler.lineage(key)


def _reply(handler, msg: dict) -> dict:
    if msg.get("type") == "ping":  # answered whatever state the handler is in
        return message(Pong(msg.get("n")))
    batch_id = msg.get("batch_id")
    try:
        return message(_handled(handler, read_request(msg)))
    except Exception as exc:
        return error_reply(batch_id, exc, handler)


def _handled(handler, request):
    """The handler's work for one request, as its reply."""
    match request:
        case Train(batch_id=batch_id, version=version, samples=samples, deferred=deferred):
            return handler.train(batch_id, version, samples, deferred=deferred)
        case PublishWeights(version=version):
            return Published(version, str(handler.publish(version)))
        case WaitWritten(version=version):
            return Written(version, handler.written(version))
        case Restore(version=version):
            return Restored(version, handler.restore(version))
        case JoinGroup():
            return Joined(request.name, handler.join_group(request.name, request.address, request.port,
                                                           request.world_size, request.backend, request.timeout,
                                                           request.bucket_bytes))
        case SendWeights(name=name, version=version, bucket_bytes=bucket_bytes):
            return Sent(name=name, version=version, **handler.send_weights(name, version, bucket_bytes))
        case LeaveGroup(name=name):
            handler.leave_group(name)
            return Left(name)
        case Checkpoint():
            path, step = handler.checkpoint()
            return Checkpointed(str(path), step)
        case ForgetLineage(key=key):
            if not hasattr(handler, "forget"):
                raise ValueError("a trainer of one adapter holds no lineage to forget")
            return LineageForgotten(key, handler.forget(key))
    raise ValueError(f"unanswerable request {request!r}")


def ready_message(handler) -> dict:
    """The handshake, with every principal's lineage a handler of adapters per principal resumed."""
    out = {**message(Ready(os.getpid(), handler.step, handler.version, handler.weights_version, 1)),
           "state": state_of(handler)}
    if hasattr(handler, "lineage"):
        out["lineages"] = {key: state_of(h) for key, h in sorted(handler.handlers.items())}
    return out


def main(conn, factory: Factory | None, options: dict) -> None:
    """The child's entry point: handshake, then one reply per request until shutdown or EOF. With a
    trainer world of several ranks, the coordinator's (`clawd.trainer.worker.world`) instead."""
    die_with_spawner()
    world = getattr(options.get("train"), "world", None)  # a TrainConfig's; the tests' handlers have none
    if factory is None and world is not None and world.size > 1:
        logging.basicConfig(level=str(options.get("log_level", "info")).upper(), stream=sys.stderr, format=LOG_FORMAT)
        from clawd.trainer.worker.world import coordinate

        return coordinate(conn, options)
    for name, value in options.get("env", {}).items():  # its GPUs: set before torch initialises CUDA
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which stops us in order
    logging.basicConfig(level=str(options.get("log_level", "info")).upper(), stream=sys.stderr, format=LOG_FORMAT)
    try:
        if factory is None:
            startup.loading()  # until the handler has loaded the model
            from clawd.trainer.worker.lineages import handler_for as factory
        handler = factory(options)
        ready = ready_message(handler)
        startup.loaded()
    except Exception as exc:
        send_message(conn, error_reply(None, exc))
        raise SystemExit(1)
    send_message(conn, ready)
    while True:
        try:
            msg = recv_message(conn)
        except EOFError:
            return  # the daemon is gone
        if msg.get("type") == "shutdown":
            return
        reply = handle(handler, msg)
        send_message(conn, reply)
        if reply.get("fatal"):
            logging.getLogger("clawd.trainer").error("exiting to be restarted from the last checkpoint: %s",
                                                     reply["message"])
            raise SystemExit(1)
