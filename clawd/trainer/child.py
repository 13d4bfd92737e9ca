"""The trainer subprocess: where torch lives (DESIGN §1, §14).

The daemon spawns `main(conn, options)` with the `spawn` context and talks to it
over one socket-pair `Connection`. This module is imported by the daemon to name
the spawn target, so it must not import torch at import time; the handler
(`options["handler"]`, "module:function") is imported only in the child.

Wire format, shared with `trainer_link` (the daemon side):
- A frame is multiprocessing's `send_bytes` framing: a 4-byte big-endian signed
  length and the payload; payloads over 2**31 - 1 bytes send -1 and then an
  8-byte big-endian unsigned length. Both ends can use plain `send_bytes` /
  `recv_bytes`.
- A message is a head frame (a JSON object with a `type`) and then one frame per
  element of each top-level list field, in the order the head's
  `"parts": [[field, count], ...]` names them. A 20 MB batch thus travels as
  many small JSON documents, and neither side decodes 20 MB in one call.
  `train.samples` elements are exactly `Sample.to_json()`.

Messages: ready{pid, step, version, weights_version} (child, once), train{batch_id,
version, samples} -> trained{batch_id, version, weights_dir, metrics, per_sample} or
error{batch_id, message, retryable}; publish{version} -> published{version, weights_dir};
checkpoint{} -> checkpointed{path, step}; ping{n} -> pong{n}; shutdown{} -> the child
exits 0 (no reply). Every request gets exactly one reply, in order.

The handler: `factory(options)` returns an object with `step`, `version` (the newest
version ever published: new ones must be above it) and `weights_version` (the version
whose weights it holds; 0 = the base model), all restored from its last checkpoint;
`train(batch_id, version, samples)` -> {"weights_dir": str, "metrics": dict,
"per_sample": list (optional)}; `publish(version)` -> weights_dir (its current weights
as a new version, checkpointed) and `checkpoint()` -> (path, step). `version` in
`train` is the version the new weights will carry. An exception becomes an `error` reply; it is retryable when
the exception has a true `retryable` attribute (see `RetryableError`).
"""
from __future__ import annotations

import ctypes
import importlib
import json
import multiprocessing
import os
import signal
import struct
from typing import Any, Iterator

from clawd.samples import Sample

DEFAULT_HANDLER = "clawd.trainer.handler:make"  # the real trainer (clawd/trainer/step.py)

_PR_SET_PDEATHSIG = 1
_MAX_SHORT = 0x7FFFFFFF  # multiprocessing sends the 8-byte length only above this


class RetryableError(Exception):
    """Raised by a handler for a failure that may pass on a second try (e.g. out of memory)."""
    retryable = True


def frame_header(n: int) -> bytes:
    """The header `Connection.send_bytes` writes before an n-byte payload (CPython 3.11)."""
    if n > _MAX_SHORT:
        return struct.pack("!i", -1) + struct.pack("!Q", n)
    return struct.pack("!i", n)


def _dump(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def message_frames(msg: dict) -> Iterator[bytes]:
    """A message's frames: the head, then one per element of each top-level list field."""
    if "parts" in msg:
        raise ValueError("'parts' is reserved for the wire format")
    lists = [(k, v) for k, v in msg.items() if isinstance(v, list)]
    head = {k: v for k, v in msg.items() if not isinstance(v, list)}
    if lists:
        head["parts"] = [[k, len(v)] for k, v in lists]
    yield _dump(head)
    for _, items in lists:
        for item in items:
            yield item.to_json() if isinstance(item, Sample) else _dump(item)


def send_message(conn, msg: dict) -> None:
    for frame in message_frames(msg):
        conn.send_bytes(frame)


def recv_message(conn) -> dict:
    """One message; list fields hold their elements' raw JSON bytes (decoded by type)."""
    msg = json.loads(conn.recv_bytes())
    for name, count in msg.pop("parts", []):
        msg[name] = [conn.recv_bytes() for _ in range(count)]
    return msg


def load_handler(path: str):
    module, _, function = path.partition(":")
    if not module or not function:
        raise ValueError(f"handler {path!r} is not 'module:function'")
    return getattr(importlib.import_module(module), function)


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


def main(conn, options: dict) -> None:
    """The child's entry point: handshake, then one reply per request until shutdown or EOF."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which stops us in order
    try:
        handler = load_handler(options.get("handler") or DEFAULT_HANDLER or "")(options)
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
