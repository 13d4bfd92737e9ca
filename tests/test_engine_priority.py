"""Priority scheduling in the CPU engine (clawd.engine.local.priority), in process on the tiny model: the
rank rules exactly; the queue taken by priority, a request without one last; a running row that yields
to one ranked well above it stops computing while that one runs and resumes from its kept cache, its
log-probs still those of a plain forward pass; the same load without the flag as the control."""
from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from clawd.engine.local.priority import LAST, Priorities
from clawd.engine.local.scheduler import Engine
from clawd.engine.local.server import parse_args

from .local_engine import running

LOW, HIGH = -20, 0  # more than the default threshold (10) apart: HIGH preempts LOW


def test_ranks_order_and_preemption_rules():
    on, low_first, off = Priorities(True), Priorities(True, low_first=True), Priorities(False)
    assert [on.rank(p) for p in (5, -3, None)] == [5, -3, LAST]
    assert [low_first.rank(p) for p in (5, -3, None)] == [-5, 3, LAST]
    assert [off.rank(p) for p in (5, None)] == [0, 0]
    assert on.outranks(0, -11) and not on.outranks(0, -10) and not on.outranks(-11, 0)  # strictly more than 10
    assert on.outranks(-(10 ** 9), LAST) and not on.outranks(LAST, LAST) and not on.outranks(LAST, 0)
    assert on.yielding([0, -20, LAST, -5], 0) == [1, 2]
    assert on.eligible([0, -5, -20, 0], 0) == 2  # the queue best first: the leading ones not outranked
    assert on.eligible([], 0) == 0 and Priorities(True, threshold=100).eligible([0, -20, LAST], 0) == 2
    assert math.isinf(LAST)


def engine(tiny_model, *flags: str) -> Engine:
    return Engine(parse_args(["--model", str(tiny_model), "--threads", "1", "--seed", "0",
                              "--incremental-streaming-output", *flags]))


def body(ids: list[int], n: int, priority: int | None, seed: int) -> dict:
    out = {"input_ids": ids, "return_logprob": True,
           "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "sampling_seed": seed}}
    return out if priority is None else {**out, "priority": priority}


def teacher(model, prompt: list[int], output: list[int]) -> list[float]:
    with torch.inference_mode():
        lps = torch.log_softmax(model(torch.tensor([prompt + output])).logits[0].float(), -1)
    return [float(lps[len(prompt) - 1 + i, t]) for i, t in enumerate(output)]


async def low_then_high(url: str) -> tuple[list[dict], dict, int]:
    """A long LOW stream; once it has tokens, a short HIGH request. Returns the stream's chunks, the HIGH
    answer, and how many LOW tokens arrived between HIGH's send and its answer."""
    events: list = []
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", json={**body(PROMPT, 160, LOW, 1), "stream": True}) as resp:
            async def read() -> list[dict]:
                chunks = []
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        chunks.append(json.loads(line[6:]))
                        events.append(("low", len(chunks[-1]["output_ids"])))
                        if len(chunks) == 3:
                            events.append("go")
                return chunks

            async def high() -> dict:
                while "go" not in events:
                    await asyncio.sleep(0.001)
                events.append("sent")
                async with http.post(url + "/generate", json=body(PROMPT[:5], 24, HIGH, 2)) as r:
                    out = await r.json()
                events.append("answered")
                return out
            chunks, answer = await asyncio.gather(read(), high())
    between = events[events.index("sent"):events.index("answered")]
    return chunks, answer, sum(n for e, n in (x for x in between if isinstance(x, tuple)))


PROMPT = list(range(20, 60))


@pytest.fixture(scope="module")
def reference(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


async def test_a_higher_request_runs_alone_and_the_lower_resumes_from_its_cache(tiny_model, reference):
    async with running(engine(tiny_model, "--enable-priority-scheduling")) as url:
        chunks, answer, during = await low_then_high(url)
    meta = chunks[-1]["meta_info"]
    ids, lps = sum((c["output_ids"] for c in chunks), []), [e[0] for c in chunks
                                                             for e in c["meta_info"]["output_token_logprobs"]]
    assert len(ids) == 160 and meta["num_retractions"] == 1  # preempted once, as SGLang counts it
    assert answer["meta_info"]["num_retractions"] == 0 and len(answer["output_ids"]) == 24
    # The row computed nothing while HIGH ran (a token or two may be in flight as HIGH arrives) ...
    assert during <= 2, during
    # ... and its cache came back whole: every log-prob is a plain forward pass's, before and after the pause.
    assert max(abs(a - b) for a, b in zip(lps, teacher(reference, PROMPT, ids))) < 1e-4
    high = [e[0] for e in answer["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(high, teacher(reference, PROMPT[:5], answer["output_ids"]))) < 1e-4


async def test_without_the_flag_a_priority_is_ignored_and_both_rows_share_the_steps(tiny_model):
    async with running(engine(tiny_model)) as url:
        chunks, answer, during = await low_then_high(url)
    assert chunks[-1]["meta_info"]["num_retractions"] == 0
    assert during >= 20, during  # LOW decoded beside HIGH's 24 steps


async def test_the_queue_is_taken_by_priority_and_a_request_without_one_goes_last(tiny_model):
    finished: list[str] = []
    async with running(engine(tiny_model, "--enable-priority-scheduling", "--max-batch-size", "1")) as url:
        async with aiohttp.ClientSession() as http:
            async def call(name: str, payload: dict, delay: float) -> None:
                await asyncio.sleep(delay)
                async with http.post(url + "/generate", json=payload) as r:
                    assert r.status == 200, await r.text()
                    finished.append(name)
            # A runs (LOW); then, in this order: B with no priority, E at LOW, C at HIGH.
            await asyncio.gather(call("A", body(PROMPT, 60, LOW, 1), 0), call("B", body(PROMPT, 4, None, 2), 0.05),
                                 call("E", body(PROMPT, 4, LOW, 3), 0.06), call("C", body(PROMPT, 4, HIGH, 4), 0.07))
            async with http.post(url + "/generate", json={**body(PROMPT, 1, None, 5), "priority": "high"}) as r:
                assert r.status == 400 and "priority" in (await r.text())
    # C preempts A (20 above it); A, preempted, goes ahead of E (equal rank, later); B, unranked, is last.
    assert finished == ["C", "A", "E", "B"]
