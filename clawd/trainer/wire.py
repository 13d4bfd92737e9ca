"""The trainer's wire format, for both ends of its socket pair (docs/ARCHITECTURE.md §1, §14).

The daemon (`clawd.trainer.link`) reads and writes it with asyncio streams; the trainer process
(`clawd.trainer.child`) with plain `Connection.send_bytes` / `recv_bytes`. No torch.

Frames. A frame is multiprocessing's `send_bytes` framing: a 4-byte big-endian signed length and
the payload; payloads over 2**31 - 1 bytes send -1 and then an 8-byte big-endian unsigned length.

Messages. A message is a head frame (a JSON object with a `type`) and then one frame per element
of each top-level list field, in the order the head's `"parts": [[field, count], ...]` names
them. A 20 MB batch thus travels as many small JSON documents, and neither side decodes 20 MB in
one call. `train.samples` elements are exactly `Sample.to_json()`.

The catalogue. The child speaks first, once: ready{pid, step, version, weights_version, world_size, state}, or
error{batch_id: null, message, retryable, kind, fatal} if it could not start (and exits 1). Then
every request gets exactly one reply, in order:

    train{batch_id, version, samples, deferred?}
                                       -> trained{batch_id, version, weights_dir, metrics,
                                                  per_sample, checkpointed, failed, state}
                                          (deferred: weights_dir is written on a thread, `writing` in
                                          the state, and a checkpoint due is left owed)
    publish{version}                   -> published{version, weights_dir, state}
    written{version}                   -> written{version, weights_dir, state} (once a deferred write of the
                                          directory is on disk; written again if it had failed)
    checkpoint{}                       -> checkpointed{path, step, state}
    restore{version}                   -> restored{version, step, state} (a rollback: a checkpoint is then owed)
    join_group{name, address, port, world_size, backend, timeout, bucket_bytes}
                                       -> joined{name, buckets} (rank 0 forms weight-update group `name`
                                          with an engine, which joins at the same time: clawd.engine.weight_group)
    send_weights{name, version, bucket_bytes} -> sent{name, version, bytes, buckets, seconds, state}
                                          (broadcasts the weights, `joined`'s buckets in order, while the
                                          engine receives each; refused unless they are `version`)
    leave_group{name}                  -> left{name}
    forget_lineage{key}                -> lineage_forgotten{key, removed} (adapters per principal: the lineage's
                                          adapter and directory deleted; clawd.trainer.worker.lineages)
    ping{n}                            -> pong{n, state}
    shutdown{}                         -> no reply: the child exits 0

With adapters per principal (clawd.trainer.worker.lineages) a request may name its lineage, `lineage` beside its
fields (absent: the shared one); its reply's `state` is then that lineage's, with `lineage` in it, and `ready`
carries `lineages`: each principal's lineage the child resumed, by key, its state.

`state` is the trainer's after the request: {step, version (the newest published: the next goes
above it), weights_version, checkpoint_step, owed (writes the last step still needs, in order:
"publish", "checkpoint"), writing (the version whose directory a deferred write is still writing, or
null)}. A train takes its optimizer step once; `failed` is null, or
{op: "publish" | "checkpoint", kind: "disk" | "io", message} when a write after the step failed:
the step is kept (weights_dir null when its publish failed) and the write is retried alone with
publish{version} / checkpoint{}, never by training again.

Any request may instead get error{batch_id, message, retryable, kind, fatal, state} (batch_id: the
request's, or null): kind "disk" or "io" (a write failed; retryable), "step" (fatal: the step
raised, the child exits 1 after replying and is restarted from its checkpoint), "oom" (the step ran out
of memory: the batch is split by the daemon, never sent again whole; `fatal` as for "step" when the
trainer's state may have moved or other ranks were left in a collective) or "request";
`retryable` says whether sending it again may help. An error reply to train means no step was kept.

Both ends build and read these messages as the dataclasses of `clawd.trainer.catalogue`.
"""
from __future__ import annotations

import asyncio
import collections
import json
import struct
from typing import Any, Iterator

from clawd.samples import Sample

_MAX_SHORT = 0x7FFFFFFF  # multiprocessing sends the 8-byte length only above this


class ProtocolError(Exception):
    """Bytes that are not a well-formed message."""


# ---- frames -----------------------------------------------------------------------------------

def frame_header(n: int) -> bytes:
    """The header `Connection.send_bytes` writes before an n-byte payload (CPython 3.11)."""
    if n > _MAX_SHORT:
        return struct.pack("!i", -1) + struct.pack("!Q", n)
    return struct.pack("!i", n)


async def _frame_body(reader: asyncio.StreamReader, header: bytes, stats: collections.Counter) -> bytes:
    (n,) = struct.unpack("!i", header)
    if n == -1:  # the long form: an 8-byte unsigned length follows
        (n,) = struct.unpack("!Q", await reader.readexactly(8))
    elif n < 0:
        raise ProtocolError(f"frame length {n}")
    body = await reader.readexactly(n)
    stats["frames_in"] += 1
    stats["bytes_in"] += n
    return body


async def read_frame(reader: asyncio.StreamReader, stats: collections.Counter | None = None) -> bytes:
    """One `send_bytes` frame; `asyncio.IncompleteReadError` at end of stream."""
    return await _frame_body(reader, await reader.readexactly(4), collections.Counter() if stats is None else stats)


# ---- messages ---------------------------------------------------------------------------------

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
    """The child's send: one `send_bytes` per frame."""
    for frame in message_frames(msg):
        conn.send_bytes(frame)


def recv_message(conn) -> dict:
    """The child's receive: one message; list fields hold their elements' raw JSON bytes (decoded by type)."""
    msg = json.loads(conn.recv_bytes())
    for name, count in msg.pop("parts", []):
        msg[name] = [conn.recv_bytes() for _ in range(count)]
    return msg


def relay_message(src, dst) -> dict:
    """One message from `src` to `dst`, frame by frame and unchanged (the trainer world's coordinator);
    its head, list fields as counts. EOFError: `src` closed; OSError: `dst` did."""
    raw = src.recv_bytes()
    head = json.loads(raw)
    dst.send_bytes(raw)
    for _, count in head.get("parts", []):
        for _ in range(count):
            dst.send_bytes(src.recv_bytes())
    return head


def retitled(head: bytes, **fields) -> bytes:
    """An encoded head frame with `fields` replaced (a retried train under a new version)."""
    return _dump({**json.loads(head), **fields})


async def encode_message(msg: dict) -> list[bytes]:
    """A message's frames, encoded one element at a time so a large batch never stalls the loop."""
    frames = []
    for frame in message_frames(msg):
        frames.append(frame)
        await asyncio.sleep(0)
    return frames


def _well_formed(parts) -> bool:
    """`parts` is [[field, count], ...]."""
    return isinstance(parts, list) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], int) for p in parts)


async def read_message(reader: asyncio.StreamReader, stats: collections.Counter | None = None) -> dict | None:
    """The daemon's receive: one message, list fields decoded element by element; None at a clean
    end of stream. Bad framing raises ProtocolError, bad JSON ValueError."""
    stats = collections.Counter() if stats is None else stats
    try:
        header = await reader.readexactly(4)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ProtocolError("the stream ended inside a frame header") from exc
        return None
    try:
        msg = json.loads(await _frame_body(reader, header, stats))
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            raise ProtocolError(f"a message head must be an object with a type, not {msg!r:.80}")
        parts = msg.pop("parts", [])
        if not _well_formed(parts):
            raise ProtocolError(f"bad parts {parts!r:.80}")
        for name, count in parts:
            msg[name] = [json.loads(await read_frame(reader, stats)) for _ in range(count)]
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError("the stream ended inside a message") from exc
    return msg


def answers(request: dict, reply: dict) -> bool:
    """Whether `reply` is the catalogue's answer to `request` ({"type": "start"}: the handshake)."""
    kind, want = reply["type"], request["type"]
    if want == "start":
        return kind in ("ready", "error")
    if kind == "error":
        return reply.get("batch_id") == request.get("batch_id")
    if want == "ping":
        return kind == "pong" and reply.get("n") == request.get("n")
    if want == "train":
        return kind == "trained" and reply.get("batch_id") == request["batch_id"] \
            and reply.get("version") == request["version"]
    if want in ("publish", "written"):
        return (kind == {"publish": "published", "written": "written"}[want]
                and reply.get("version") == request["version"])
    if want == "restore":
        return kind == "restored" and reply.get("version") == request["version"]
    if want in ("join_group", "send_weights", "leave_group"):
        return kind == {"join_group": "joined", "send_weights": "sent", "leave_group": "left"}[want] \
            and reply.get("name") == request["name"]
    if want == "forget_lineage":
        return kind == "lineage_forgotten" and reply.get("key") == request["key"]
    return want == "checkpoint" and kind == "checkpointed"
