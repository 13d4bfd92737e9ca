"""The trainer's messages as dataclasses, built and read on both ends of its pipe (docs/ARCHITECTURE.md §1).

The daemon (`clawd.trainer.link`, `clawd.learning.weight_groups`) builds a request and reads the reply as these;
the child (`clawd.trainer.child`) reads the request and builds the reply as these. On the wire each is the
catalogue's JSON object (`clawd.trainer.wire`): `{"type": <kind>, <its fields>}`, every reply with the
trainer's `state` beside its fields. No torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from clawd.samples import Sample


# ---- requests: daemon → child -----------------------------------------------------------------

@dataclass(frozen=True)
class Train:
    batch_id: str
    version: int           # the version the new weights will carry
    samples: list          # Samples (the daemon sends them pre-encoded; `read_request` decodes them)
    deferred: bool = False  # the directory written off the critical path


@dataclass(frozen=True)
class PublishWeights:
    version: int


@dataclass(frozen=True)
class WaitWritten:
    version: int           # the directory a deferred write is writing: answered once it is on disk


@dataclass(frozen=True)
class Checkpoint:
    pass


@dataclass(frozen=True)
class Restore:
    version: int


@dataclass(frozen=True)
class JoinGroup:
    name: str
    address: str
    port: int
    world_size: int
    backend: str
    timeout: float
    bucket_bytes: int


@dataclass(frozen=True)
class SendWeights:
    name: str
    version: int
    bucket_bytes: int


@dataclass(frozen=True)
class LeaveGroup:
    name: str


@dataclass(frozen=True)
class ForgetLineage:
    key: str               # a principal's lineage (clawd.trainer.worker.lineages): its adapter and directory deleted


@dataclass(frozen=True)
class Ping:
    n: int | None = None


REQUESTS: dict[str, type] = {"train": Train, "publish": PublishWeights, "written": WaitWritten,
                             "checkpoint": Checkpoint, "restore": Restore, "join_group": JoinGroup,
                             "send_weights": SendWeights, "leave_group": LeaveGroup, "forget_lineage": ForgetLineage,
                             "ping": Ping}


# ---- replies: child → daemon ------------------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    pid: int
    step: int
    version: int          # the newest version the trainer has published: new ones go above it
    weights_version: int  # the version whose weights it holds (its checkpoint's); 0: the base model
    world_size: int = 1   # the trainer's ranks (clawd.trainer.worker.world)


@dataclass(frozen=True)
class Trained:
    batch_id: str
    version: int
    weights_dir: str | None  # None: nothing published (the step was skipped, or `failed` says its publish failed)
    metrics: dict
    per_sample: list
    checkpointed: bool = False  # the batch's samples may now be acknowledged in the journal
    failed: dict | None = None  # {op, kind, message}: a write after the step failed; the step is kept
    state: dict | None = None   # the trainer's after the step (the catalogue's `state`)


@dataclass(frozen=True)
class Published:
    version: int
    weights_dir: str


@dataclass(frozen=True)
class Written(Published):
    """A deferred write's directory, on disk now."""


@dataclass(frozen=True)
class Checkpointed:
    path: str
    step: int


@dataclass(frozen=True)
class Restored:
    version: int
    step: int


@dataclass(frozen=True)
class Joined:
    name: str
    buckets: list          # the bodies of the engine's /update_weights_from_distributed, in order


@dataclass(frozen=True)
class Sent:
    name: str
    version: int
    bytes: int
    buckets: int
    seconds: float


@dataclass(frozen=True)
class Left:
    name: str


@dataclass(frozen=True)
class LineageForgotten:
    key: str
    removed: bool          # whether the trainer held it or its directory was there


@dataclass(frozen=True)
class Pong:
    n: int | None = None


REPLIES: dict[str, type] = {"ready": Ready, "trained": Trained, "published": Published, "written": Written,
                            "checkpointed": Checkpointed, "restored": Restored, "joined": Joined, "sent": Sent,
                            "left": Left, "lineage_forgotten": LineageForgotten, "pong": Pong}
_KIND = {cls: kind for kind, cls in (*REQUESTS.items(), *REPLIES.items())}


def message(value: Any) -> dict:
    """A request or a reply as its wire message (the child's `handle` sets every reply's `state`)."""
    return {"type": _KIND[type(value)], **{f.name: getattr(value, f.name) for f in dataclasses.fields(value)}}


def _typed(table: dict[str, type], msg: dict):
    cls = table.get(msg.get("type"))
    if cls is None:
        raise ValueError(f"unknown message type {msg.get('type')!r}")
    return cls(**{f.name: msg[f.name] for f in dataclasses.fields(cls) if f.name in msg})


def read_request(msg: dict):
    """The request a wire message carries, a train's samples decoded; ValueError for an unknown type."""
    request = _typed(REQUESTS, msg)
    if isinstance(request, Train):
        request = dataclasses.replace(request, samples=[Sample.from_json(raw) for raw in request.samples])
    return request


def read_reply(msg: dict):
    """The reply a wire message carries (its `state` kept only by `Trained`; the link keeps every reply's)."""
    return _typed(REPLIES, msg)
