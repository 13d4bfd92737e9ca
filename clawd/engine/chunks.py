"""A streamed /generate's events as `Chunk`s of new output: the events of one network read become one chunk
(I/O-free: the engine client feeds it what it parsed).

One chunk a read, not one an event: an engine that runs ahead of clawd (a burst of tokens in one read) then
costs one reply event and one write for them all, and the merge itself is one list extend per event, the
log-prob and top-k columns being split out once for the read (per event, a chunk and its three small lists
cost about as much as decoding the event's JSON).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from clawd.engine.errors import EngineError, EngineRejected


@dataclass(slots=True)
class Chunk:
    """New output since the previous chunk; `finish` is set on the last one. (Not frozen: a frozen dataclass's
    `__init__` sets each field through `object.__setattr__`, ~1 us more per chunk.)"""

    ids: list[int]
    logprobs: list[float | None]
    logprob_ids: list[int]
    finish: dict[str, Any] | None
    meta: dict[str, Any]
    top_ids: list[list[int]] = dataclasses.field(default_factory=list)  # with top_logprobs_num: each token's top-k
    more: bool = False  # the stream's end came with it (the same read): a writer may wait to write them together


def top_ids(rows: Any) -> list[list[int]]:
    """The ids of `meta_info.output_top_logprobs` rows ([log-prob, id, text] triples, or null for none)."""
    return [[e[1] for e in row] if isinstance(row, list) else [] for row in rows or []]


def error_text(body: Any) -> str:
    """SGLang's error bodies come in several shapes (SGLang 0.5.23: docs/ARCHITECTURE.md §10)."""
    if isinstance(body, dict):
        err = body.get("error", body.get("message"))
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return str(body)[:500]


class StreamChunks:
    """The new output of one stream's events, `add`ed as they are parsed and `take`n as one chunk per read.
    Cumulative events (SGLang's default: each repeats everything so far) give what follows the tokens already
    added; incremental ones give all they carry."""

    __slots__ = ("incremental", "seen", "_ids", "_rows", "_tops", "_meta")

    def __init__(self, incremental: bool):
        self.incremental = incremental
        self.seen = 0  # tokens added so far, taken or not
        self._ids: list[int] = []
        self._rows: list[Any] = []  # [log-prob, id, text] per token
        self._tops: list[Any] = []  # each token's top-k rows
        self._meta: dict[str, Any] | None = None  # the last event's: None while nothing waits to be taken

    def add(self, event: Any) -> None:
        """One parsed event. An error event raises, leaving what came before it to `take`: EngineRejected for
        SGLang's 400s (its ValueErrors inside a started stream), else EngineError."""
        if not isinstance(event, dict):
            raise EngineError("engine sent a stream chunk that is not a JSON object")
        if "error" in event:
            err = event["error"]
            if isinstance(err, dict) and err.get("code") == 400:
                raise EngineRejected(error_text(event))
            raise EngineError(f"engine stream error: {error_text(event)}")
        ids = event.get("output_ids") or []
        meta = event.get("meta_info") or {}
        rows = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        if not self.incremental:
            seen = self.seen
            ids, rows, tops = ids[seen:], rows[seen:], tops[seen:]
        self.seen += len(ids)
        if self._meta is None:  # the read's first event: its lists are taken as they are (parsed here, held by none)
            self._ids, self._rows, self._tops = ids, rows, tops
        else:
            self._ids += ids
            self._rows += rows
            self._tops += tops
        self._meta = meta

    def take(self) -> Chunk | None:
        """What the events added since the last `take` carry, as one chunk (the last event's finish and meta);
        None when none was added."""
        meta = self._meta
        if meta is None:
            return None
        self._meta = None
        rows = self._rows
        return Chunk(ids=self._ids, logprobs=[e[0] for e in rows], logprob_ids=[e[1] for e in rows],
                     finish=meta.get("finish_reason"), meta=meta, top_ids=top_ids(self._tops))

