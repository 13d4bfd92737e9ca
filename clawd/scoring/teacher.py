"""The teacher: log-probs of a response's exact ids under another prompt, by prefill scoring (docs/ARCHITECTURE.md §3).

One request scores a window of response positions: `input_ids = P' + R[:end]`, `max_new_tokens: 0`,
`logprob_start_len = len(P') + start - 1`; `meta_info.input_token_logprobs[1:]` lines up with
R[start:end], first token included, at T = 1 (SGLang 0.5.23 never scales prefill log-probs). For top-K
distillation the same request carries `token_ids_logprob`, the union of the window's top-k ids, and
`meta_info.input_token_ids_logprobs[1:]` gives the teacher's log-prob of each of them at each position
(rows in the request's order; SGLang's `tokenizer_manager.py` and `logprob_result_processor.py`).
Windows bound the answer: a row holds every id of the union, so one request over a 512-token answer
with k = 4 would return up to 512 × 2,048 triples; windows of TOP_WINDOW positions return at most
TOP_WINDOW × 4·TOP_WINDOW, and the engine's prefix cache keeps the repeated prompt cheap.

The same `Teacher` on the frozen reference engine, given the turn's own prompt, gives the reference's
log-probs for the trainer's KL term (`Sample.reference_logprobs`).
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from clawd.checks import is_finite
from clawd.engine.client import EngineClient
from clawd.scoring.judges import AttemptFailed, Backend, CallPolicy, generate_once

TOP_WINDOW = 32  # response positions a top-k request scores


def _misaligned(detail: str) -> AttemptFailed:
    return AttemptFailed("teacher_misaligned", "bad_responses", retryable=False, detail=detail)



def _input_entries(out: Any, key: str, n: int) -> list:
    """`meta_info[key]` of a prefill-scoring answer after its null entry 0, checked to hold n entries."""
    try:
        entries = out["meta_info"][key]
    except (KeyError, TypeError):
        raise _misaligned(f"no meta_info.{key}") from None
    if not isinstance(entries, list) or len(entries) != n + 1:
        got = len(entries) if isinstance(entries, list) else None
        raise _misaligned(f"{got} entries of {key} for {n} response tokens (+1 expected)")
    return entries[1:]


def teacher_logprobs(out: Any, response_ids: list[int]) -> list[float]:
    """The teacher's log-prob of each response token from a prefill-scoring answer,
    checked: one entry per token after the null entry 0, the same ids, finite values."""
    values = []
    for i, (entry, tok) in enumerate(zip(_input_entries(out, "input_token_logprobs", len(response_ids)),
                                         response_ids)):
        ok = isinstance(entry, list) and len(entry) >= 2
        lp = entry[0] if ok else None
        if not ok or entry[1] != tok:
            raise _misaligned(f"token {i}: entry {entry!r}, expected id {tok}")
        if not is_finite(lp):
            raise _misaligned(f"token {i}: log-prob {lp!r}")
        values.append(float(lp))
    return values


def top_logprobs(out: Any, top_ids: list[list[int]], union: list[int]) -> list[list[float]]:
    """The teacher's log-prob of each position's top-k ids from a prefill-scoring answer that asked for
    `union` in `token_ids_logprob`: one row per position after the null entry 0, each holding every id of
    the union in the request's order with a finite value."""
    rows = []
    for i, (entry, want) in enumerate(zip(_input_entries(out, "input_token_ids_logprobs", len(top_ids)), top_ids)):
        if not isinstance(entry, list) or len(entry) != len(union):
            raise _misaligned(f"token {i}: id row of {len(entry) if isinstance(entry, list) else entry!r} entries "
                              f"for {len(union)} ids")
        at: dict[int, float] = {}
        for triple, tid in zip(entry, union):
            if not (isinstance(triple, list) and len(triple) >= 2 and triple[1] == tid and is_finite(triple[0])):
                raise _misaligned(f"token {i}: entry {triple!r}, expected id {tid}")
            at[tid] = float(triple[0])
        rows.append([at[t] for t in want])
    return rows


def overlap(out: Any, top_ids: list[list[int]]) -> int:
    """How many of each position's top-k ids are also among the teacher's own top ids
    (`meta_info.input_top_logprobs[1:]`), summed over the positions: how much of what the student weighs
    the teacher weighs too, under one hint. Rows that are missing or malformed count 0."""
    try:
        rows = out["meta_info"]["input_top_logprobs"][1:]
    except (KeyError, TypeError, IndexError):
        raise _misaligned("no meta_info.input_top_logprobs") from None
    total = 0
    for row, want in zip(rows, top_ids):
        if isinstance(row, list):
            total += len({e[1] for e in row if isinstance(e, list) and len(e) >= 2} & set(want))
    return total


@dataclass(frozen=True)
class TeacherScores:
    logprobs: list[float]                  # at each response token
    top: list[list[float]] | None = None   # at each position's top-k ids, when asked
    overlap: int | None = None             # `overlap` of the teacher's top-k with them, when asked


class Teacher(Backend):
    """Teacher log-probs of the original response ids under a (hinted) prompt (docs/ARCHITECTURE.md §3)."""

    name = "teacher"

    def __init__(self, engine: EngineClient, *, policy: CallPolicy = CallPolicy()):
        super().__init__(policy)
        self.engine = engine

    async def logprobs(self, prompt_ids: list[int], response_ids: list[int], *,
                       rid: str | None = None) -> list[float]:
        """log P(R[t] | P' + R[:t]) at T = 1 for every t, the first response token included."""
        return (await self.scores(prompt_ids, response_ids, rid=rid)).logprobs

    async def scores(self, prompt_ids: list[int], response_ids: list[int], top_ids: list[list[int]] | None = None,
                     *, rid: str | None = None, with_overlap: bool = False) -> TeacherScores:
        """`logprobs`, and with `top_ids` (k ids per response position) the log-probs at those ids too, at
        T = 1: one request for the whole response without them, one per TOP_WINDOW positions with them.
        `with_overlap` (with top_ids): the teacher's own top-k too, for the overlap that picks among hints."""
        if not prompt_ids:
            raise ValueError("the teacher needs a prompt of at least one token")
        if top_ids is not None and len(top_ids) != len(response_ids):
            raise ValueError(f"{len(top_ids)} top-k rows for {len(response_ids)} response tokens")
        if not response_ids:
            return TeacherScores([], [] if top_ids is not None else None)
        rid = rid or f"teacher-{uuid.uuid4().hex}"
        n = len(response_ids)
        step = TOP_WINDOW if top_ids is not None else n
        windows = [(s, min(s + step, n)) for s in range(0, n, step)]
        parts = await asyncio.gather(*(self._window(prompt_ids, response_ids, top_ids, s, e,
                                                    rid if len(windows) == 1 else f"{rid}.w{s}", with_overlap)
                                       for s, e in windows))
        lps = [x for part in parts for x in part.logprobs]
        top = None if top_ids is None else [row for part in parts for row in part.top]
        both = sum(part.overlap for part in parts) if with_overlap and top_ids is not None else None
        return TeacherScores(lps, top, both)

    async def _window(self, prompt_ids: list[int], response_ids: list[int], top_ids: list[list[int]] | None,
                      start: int, end: int, rid: str, with_overlap: bool = False) -> TeacherScores:
        ids = list(prompt_ids) + list(response_ids[:end])
        want = response_ids[start:end]
        rows = None if top_ids is None else top_ids[start:end]
        union = None if rows is None else sorted({t for row in rows for t in row})

        async def attempt(i: int) -> TeacherScores:
            payload = {"input_ids": ids, "rid": f"{rid}.{i}",
                       # prefill log-probs are at T = 1; say so for engines that would scale them
                       "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                       "return_logprob": True, "logprob_start_len": len(prompt_ids) + start - 1}
            if union:
                payload["token_ids_logprob"] = union
                if with_overlap:
                    payload["top_logprobs_num"] = len(rows[0])
            out = await generate_once(self.engine, payload)
            return TeacherScores(teacher_logprobs(out, want), None if rows is None else top_logprobs(out, rows, union),
                                 overlap(out, rows) if union and with_overlap else None)

        return await self._call(attempt)
