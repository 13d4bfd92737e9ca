"""The local engine's sequences: one HTTP request's group, each sequence's state, a stream's cursor.

Plain state the scheduler (scheduler.py) drives and the server reads; no model, no loop.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from clawd.engine.local.logprob_rows import Pairs, select_rows
from clawd.engine.local.wire import GenerateItem


class Group:
    """The sequences of one HTTP request and the queue its handler reads events from."""

    def __init__(self, stream: bool):
        self.stream = stream
        self.reqs: list[Req] = []
        # (index, tokens so far, final): one per streamed token, and one final per sequence
        self.events: asyncio.Queue[tuple[int, int, bool]] = asyncio.Queue()


class Req:
    """One sequence: its validated request, its progress, and where to report it."""

    def __init__(self, item: GenerateItem, group: Group, index: int, seed: int):
        self.item = item
        self.params = item.params
        self.rid = item.rid
        self.prompt = list(item.prompt)
        self.group, self.index = group, index
        self.generator = torch.Generator().manual_seed(seed % 2**64)  # any int seed is valid
        self.t0 = time.perf_counter()
        self.queued_at = time.monotonic()  # since when it waits for room in the batch
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.input_logprobs: list[float | None] | None = None
        # top_logprobs_num / token_ids_logprob rows, as [log-prob, id] pairs: input ones with a None
        # entry 0 like input_logprobs, and one output row per output token (one for prefill only).
        self.input_top: list[Pairs | None] = []
        self.input_chosen: list[Pairs | None] = []
        self.output_top: list[Pairs] = []
        self.output_chosen: list[Pairs] = []
        self.versions: list[dict] = []  # SGLang's weight_versions spans over output indices
        self.finish: dict | None = None
        self.started = False  # has been in a batch (an abort is then "Aborted", not "in waiting queue")
        self.abort_requested = False
        self.num_retractions = 0
        self.rank: float = 0  # its priority's rank (priority.py): higher runs first, and preempts lower
        self.kv = None  # a preempted request's own Batch (its KV kept) while it waits to rejoin; None: prefill it

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.item.return_logprob and self.item.logprob_start_len >= 0 and self.input_logprobs is None

    def append(self, tok: int, lp: float, version: str, row: torch.Tensor | None = None) -> None:
        """One output token, its log-prob and the log-prob row it was sampled from."""
        n = len(self.output_ids)
        self.output_ids.append(tok)
        self.output_logprobs.append(lp)
        if row is not None:
            self.keep_output_row(row)
        if self.versions and self.versions[-1]["version"] == version:
            self.versions[-1]["end"] = n + 1
        else:
            self.versions.append({"version": version, "start": n, "end": n + 1})

    def keep_input_rows(self, rows: torch.Tensor) -> None:
        """The scored prompt's rows [len - start - 1, V]: entry 0 (position start) has none."""
        if self.item.wants_rows:
            top, chosen = select_rows(rows, self.item.top_logprobs_num, self.item.logprob_ids)
            self.input_top, self.input_chosen = [None, *top], [None, *chosen]

    def keep_output_row(self, row: torch.Tensor) -> None:
        if self.item.wants_rows:
            top, chosen = select_rows(row[None], self.item.top_logprobs_num, self.item.logprob_ids)
            self.output_top += top
            self.output_chosen += chosen

    def notify(self, final: bool) -> None:
        n = len(self.output_ids)
        if final or (self.group.stream and n % self.params.stream_interval == 0):
            self.group.events.put_nowait((self.index, n, final))


@dataclass
class Cursor:
    """What an incremental stream has already sent for one sequence."""
    n: int = 0
    text: str = ""
