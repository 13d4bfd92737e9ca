"""Judge and teacher backends against scripted fakes on loopback.

The OpenAI-compatible judge talks to tests/fake_judge.py; the SGLang judge and
the teacher talk to tests/fake_sglang.py through EngineClient. Every failure
mode ends in a result or JudgeFailed within a bound, and is counted.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import subprocess
import sys
import threading
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from clawd.engine.client import EngineClient
from clawd.scoring.judges import (AttemptFailed, CallPolicy, JudgeFailed, JudgeStats, OpenAIJudge, SGLangJudge,
                                backoff_delay, chat_content, error_message, parse_retry_after)
from clawd.scoring.teacher import TOP_WINDOW, Teacher, teacher_logprobs, top_logprobs
from clawd.scoring.resolver import LookupFailed, NoLookups
from clawd.tokenizer import ChatTokenizer
from tests.fake_judge import FakeJudge, Reply
from tests.fake_sglang import ABORTED, FakeSGLang, input_logprob, row_logprob
from tests.load import free_port

FAST = CallPolicy(timeout=0.3, retries=2, backoff_initial=0.01, backoff_max=0.05, concurrency=4)
MESSAGES = [{"role": "system", "content": "You judge."}, {"role": "user", "content": "Was it good?"}]
BOUND = 10.0  # no call in this file may take longer: "nothing stalls"


def settled(stats: JudgeStats) -> bool:
    """Every call ended exactly one way."""
    return stats.calls == stats.ok + stats.failed + stats.cancelled


async def until(predicate, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


class Sleeps(list):
    """Stands in for asyncio.sleep in the backoff: records the delays, waits for none."""

    async def __call__(self, seconds: float) -> None:
        self.append(seconds)


# --------------------------------------------------------------------------
# Pure parts

def test_backoff_is_exponential_jittered_capped_and_honours_retry_after():
    p = CallPolicy(backoff_initial=0.5, backoff_max=8.0)
    assert [backoff_delay(p, i, None, 0.0) for i in range(6)] == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0]
    assert [backoff_delay(p, i, None, 1.0) for i in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert backoff_delay(p, 0, 3.0, 0.9) == 3.0
    assert backoff_delay(p, 0, 120.0, 0.9) == 8.0
    assert backoff_delay(p, 3, 0.0, 0.9) == 0.0
    with pytest.raises(ValueError):
        CallPolicy(concurrency=0)
    with pytest.raises(ValueError):
        CallPolicy(backoff_initial=9.0, backoff_max=8.0)


def test_parse_retry_after():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(" 1.5 ") == 1.5
    assert parse_retry_after("-4") == 0.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412480.0) == 10.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now=1445412500.0) == 0.0
    for bad in (None, "", "soon", "nan", "inf"):
        assert parse_retry_after(bad) is None


def test_error_shapes_and_chat_content():
    assert error_message({"error": {"message": "bad key", "type": "x"}}) == "bad key"
    assert error_message({"error": "overloaded"}) == "overloaded"
    assert error_message({"detail": "Not Found"}) == "Not Found"
    assert error_message("<html>502</html>") == "<html>502</html>"
    assert chat_content({"choices": [{"message": {"role": "assistant", "content": "hi"}}]}) == "hi"
    parts = [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]
    assert chat_content({"choices": [{"message": {"content": parts}}]}) == "ab"
    for bad in ({"choices": []}, {"choices": [{"message": {"content": None}}]}, [], "x", {"error": "e"}):
        with pytest.raises(AttemptFailed) as info:
            chat_content(bad)
        assert (info.value.reason, info.value.kind, info.value.retryable) == ("bad_response", "bad_responses", True)


def test_teacher_alignment_checks():
    r = [8, 9, 10]
    good = {"meta_info": {"input_token_logprobs": [[None, 7, None], [-0.5, 8, None], [-1, 9, None],
                                                    [-2.25, 10, None]]}}
    assert teacher_logprobs(good, r) == [-0.5, -1.0, -2.25]
    wrong = {
        "short": [[None, 7, None], [-0.5, 8, None], [-1.0, 9, None]],
        "long": [[None, 6, None], [None, 7, None], [-0.5, 8, None], [-1.0, 9, None], [-2.0, 10, None]],
        "ids": [[None, 7, None], [-0.5, 8, None], [-1.0, 11, None], [-2.0, 10, None]],
        "null": [[None, 7, None], [-0.5, 8, None], [None, 9, None], [-2.0, 10, None]],
        "nan": [[None, 7, None], [-0.5, 8, None], [math.nan, 9, None], [-2.0, 10, None]],
        "inf": [[None, 7, None], [-0.5, 8, None], [-math.inf, 9, None], [-2.0, 10, None]],
        "text": [[None, 7, None], [-0.5, 8, None], ["-1", 9, None], [-2.0, 10, None]],
        "shape": [[None, 7, None], [-0.5, 8, None], None, [-2.0, 10, None]],
    }
    for name, entries in wrong.items():
        with pytest.raises(AttemptFailed) as info:
            teacher_logprobs({"meta_info": {"input_token_logprobs": entries}}, r)
        assert (info.value.reason, info.value.retryable) == ("teacher_misaligned", False), name
    for body in ({}, {"meta_info": {}}, [], {"meta_info": {"input_token_logprobs": None}}):
        with pytest.raises(AttemptFailed, match="teacher_misaligned"):
            teacher_logprobs(body, r)


# --------------------------------------------------------------------------
# OpenAI-compatible judge against the fake judge

@asynccontextmanager
async def openai_judge(policy: CallPolicy = FAST, *replies: Reply, default: Reply = Reply(), key: str = "sk-test"):
    async with FakeJudge(default, api_key="sk-test") as fake:
        fake.script(*replies)
        async with OpenAIJudge(fake.url, key, "judge-model", policy=policy) as judge:
            judge.jitter = lambda: 0.0
            yield fake, judge


async def test_openai_success_sends_the_request_and_returns_the_content():
    async with openai_judge() as (fake, judge):
        async with asyncio.timeout(BOUND):
            assert await judge.complete(MESSAGES) == "\\boxed{1}"
    (headers, body), = fake.requests
    assert headers["Authorization"] == "Bearer sk-test"
    assert body == {"model": "judge-model", "messages": MESSAGES, "temperature": 0.6, "max_tokens": 1024,
                    "stream": False}
    s = judge.stats
    assert (s.calls, s.ok, s.failed, s.retried, s.latency_count) == (1, 1, 0, 0, 1) and s.latency_sum > 0


async def test_openai_garbage_output_is_returned_as_text():
    garbage = "}}}\\boxed{ maybe <|im_end|> [HINT_START]"
    async with openai_judge(FAST, Reply(content=garbage), Reply(content="")) as (fake, judge):
        assert await judge.complete(MESSAGES) == garbage
        assert await judge.complete(MESSAGES) == ""
    assert (judge.stats.ok, judge.stats.bad_responses) == (2, 0)


async def test_openai_bad_bodies_are_retried_and_counted():
    replies = (Reply(body="<html>gateway</html>"), Reply(body={"error": {"message": "overloaded"}}),
               Reply(content=None), Reply(content="ok"))
    policy = CallPolicy(timeout=1.0, retries=3, backoff_initial=0.01, backoff_max=0.05)
    async with openai_judge(policy, *replies) as (fake, judge):
        assert await judge.complete(MESSAGES) == "ok"
    s = judge.stats
    assert (s.ok, s.bad_responses, s.retried, s.failed) == (1, 3, 3, 0) and len(fake.requests) == 4


async def test_openai_500_then_success_is_retried_and_counted():
    async with openai_judge(FAST, Reply(status=500), Reply(status=503), Reply(content="\\boxed{-1}")) as (fake, judge):
        judge.sleep = sleeps = Sleeps()
        assert await judge.complete(MESSAGES) == "\\boxed{-1}"
    s = judge.stats
    assert (s.calls, s.ok, s.http_errors, s.retried, s.failed) == (1, 1, 2, 2, 0)
    assert sleeps == [0.005, 0.01]  # backoff_initial * 2**i, jitter at its low end
    assert settled(s)


async def test_openai_500s_exhaust_the_retries_and_fail_closed():
    async with openai_judge(FAST, default=Reply(status=500)) as (fake, judge):
        with pytest.raises(JudgeFailed) as info:
            await judge.complete(MESSAGES)
    assert (info.value.reason, info.value.detail) == ("http_500", "fake error 500")
    s = judge.stats
    assert (s.calls, s.ok, s.failed, s.http_errors, s.retried) == (1, 0, 1, 3, 2) and len(fake.requests) == 3


@pytest.mark.parametrize("status", [400, 401, 404, 422])
async def test_openai_4xx_is_not_retried(status):
    async with openai_judge(FAST, Reply(status=status)) as (fake, judge):
        with pytest.raises(JudgeFailed) as info:
            await judge.complete(MESSAGES)
    assert info.value.reason == f"http_{status}" and len(fake.requests) == 1
    assert (judge.stats.http_errors, judge.stats.retried, judge.stats.failed) == (1, 0, 1)


async def test_openai_wrong_key_reports_the_api_error_message():
    async with openai_judge(key="sk-wrong") as (fake, judge):
        with pytest.raises(JudgeFailed) as info:
            await judge.complete(MESSAGES)
    assert (info.value.reason, info.value.detail) == ("http_401", "Incorrect API key provided")
    assert len(fake.requests) == 1


async def test_openai_429_honours_retry_after_up_to_backoff_max():
    policy = CallPolicy(timeout=1.0, retries=3, backoff_initial=0.01, backoff_max=5.0)
    replies = (Reply(status=429, headers={"Retry-After": "2"}), Reply(status=429, headers={"Retry-After": "3600"}),
               Reply(status=429), Reply(content="fine"))
    async with openai_judge(policy, *replies) as (fake, judge):
        judge.sleep = sleeps = Sleeps()
        assert await judge.complete(MESSAGES) == "fine"
    assert sleeps == [2.0, 5.0, 0.02]  # the header, the header capped, plain backoff without one
    assert (judge.stats.http_errors, judge.stats.retried, judge.stats.ok) == (3, 3, 1)


async def test_openai_slow_votes_time_out_are_retried_and_counted():
    policy = CallPolicy(timeout=0.2, retries=2, backoff_initial=0.01, backoff_max=0.05)
    async with openai_judge(policy, Reply(delay=5.0), Reply(delay=5.0)) as (fake, judge):
        async with asyncio.timeout(BOUND):
            assert await judge.complete(MESSAGES) == "\\boxed{1}"
        assert (judge.stats.timeouts, judge.stats.retried, judge.stats.ok) == (2, 2, 1)
        await until(lambda: fake.disconnects == 2)  # the slow attempts were hung up on

    async with openai_judge(policy, default=Reply(hang=True)) as (fake, judge):
        async with asyncio.timeout(BOUND):  # (retries + 1) * timeout + backoff: well under the bound
            with pytest.raises(JudgeFailed, match="^timeout"):
                await judge.complete(MESSAGES)
    s = judge.stats
    assert (s.calls, s.timeouts, s.retried, s.failed, s.ok) == (1, 3, 2, 1, 0) and settled(s)


async def test_openai_connection_refused_fails_closed():
    judge = OpenAIJudge(f"http://127.0.0.1:{free_port()}/v1", "k", "m", policy=FAST)
    async with judge:
        async with asyncio.timeout(BOUND):
            with pytest.raises(JudgeFailed) as info:
                await judge.complete(MESSAGES)
    assert info.value.reason == "connection" and "Connect" in info.value.detail
    s = judge.stats
    assert (s.connection_errors, s.retried, s.failed) == (3, 2, 1)


async def test_openai_connection_dropped_mid_body_is_retried():
    async with openai_judge(FAST, Reply(drop=True)) as (fake, judge):
        assert await judge.complete(MESSAGES) == "\\boxed{1}"
    assert (judge.stats.connection_errors, judge.stats.retried, judge.stats.ok) == (1, 1, 1)


async def test_openai_concurrency_limit_holds():
    policy = CallPolicy(timeout=5.0, retries=0, concurrency=3)
    async with openai_judge(policy, default=Reply(delay=0.2)) as (fake, judge):
        async with asyncio.timeout(BOUND):
            results = await asyncio.gather(*(judge.complete(MESSAGES) for _ in range(9)))
    assert results == ["\\boxed{1}"] * 9
    assert fake.max_active == 3  # reached, never passed
    assert judge.stats.ok == 9


@pytest.mark.parametrize("retries", [0, 1])
async def test_openai_hanging_calls_do_not_stall_the_others(retries):
    # 2 s, not FAST's 0.3 s: the answered calls must beat it whatever the load (under the parallel suite's
    # load all ten first calls of a fresh client once took longer than 0.3 s).
    policy = CallPolicy(timeout=2.0, retries=retries, backoff_initial=0.01, backoff_max=0.02, concurrency=16)
    hang, ok = Reply(hang=True), Reply()
    async with openai_judge(policy, hang, ok, hang, ok, ok, hang, ok, ok, ok, ok) as (fake, judge):
        async with asyncio.timeout(BOUND):
            results = await asyncio.gather(*(judge.complete(MESSAGES) for _ in range(10)),
                                           return_exceptions=True)
    failed = [r for r in results if isinstance(r, JudgeFailed)]
    s = judge.stats
    if retries == 0:  # the hung calls fail closed, the rest are answered
        assert results.count("\\boxed{1}") == 7 and [f.reason for f in failed] == ["timeout"] * 3
        assert (s.ok, s.failed, s.timeouts, s.retried) == (7, 3, 3, 0)
    else:  # the retries of the hung calls are answered
        assert results == ["\\boxed{1}"] * 10
        assert (s.ok, s.failed, s.timeouts, s.retried) == (10, 0, 3, 3)
    assert settled(s)


async def test_openai_cancellation_propagates_in_flight_and_in_backoff():
    async with openai_judge(FAST, Reply(hang=True)) as (fake, judge):
        task = asyncio.create_task(judge.complete(MESSAGES))
        await until(lambda: fake.active == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: fake.disconnects == 1)

    slow_backoff = CallPolicy(timeout=1.0, retries=2, backoff_initial=60.0, backoff_max=60.0)
    async with openai_judge(slow_backoff, Reply(status=500)) as (fake, second):
        task = asyncio.create_task(second.complete(MESSAGES))
        await until(lambda: second.stats.retried == 1)  # asleep in the backoff
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    for s in (judge.stats, second.stats):
        assert (s.calls, s.cancelled, s.failed, s.ok) == (1, 1, 0, 0) and settled(s)


async def test_openai_judge_by_ip_looks_up_no_name_and_starts_no_thread():
    # Names are looked up on the loop (tests/test_judge_dns.py); an IP-literal URL needs no
    # nameserver, and a name reached from it (a redirect) is refused, not sent to a thread.
    threads = set(threading.enumerate())
    async with FakeJudge() as fake:
        async with OpenAIJudge(fake.url, "k", "m", nameserver="127.0.0.1:9") as judge:
            assert isinstance(judge._resolver, NoLookups)
            assert await judge.complete(MESSAGES) == "\\boxed{1}"
            with pytest.raises(LookupFailed, match="judge.invalid"):
                await judge._resolver.resolve("judge.invalid", fake.port)
    assert set(threading.enumerate()) == threads  # no resolver thread, no executor


def test_the_module_imports_neither_torch_nor_transformers():
    code = ("import sys, clawd.scoring.judges; "
            "assert not {'torch', 'transformers'} & set(sys.modules), 'heavy import'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])


# --------------------------------------------------------------------------
# SGLang judge and teacher against the fake SGLang

@pytest.fixture(scope="module")
def tok(tiny_model) -> ChatTokenizer:
    return ChatTokenizer(tiny_model)


@asynccontextmanager
async def sglang(tok: ChatTokenizer, text: str = "Score: \\boxed{1}", responder=None):
    eos = tok.info.eos_ids[0]
    reply = tok.encode(text) + [eos]
    async with FakeSGLang(responder or (lambda ids, sp: reply), eos_id=eos, vocab_size=4096) as fake:
        engine = EngineClient(fake.url)
        await engine.start()
        try:
            yield fake, engine
        finally:
            await engine.close()


def sglang_judge(engine: EngineClient, tok: ChatTokenizer, policy: CallPolicy = FAST) -> SGLangJudge:
    judge = SGLangJudge(engine, tok, policy=policy)
    judge.jitter = lambda: 0.0
    return judge


async def test_sglang_judge_is_token_in_and_decodes_the_output(tok):
    async with sglang(tok, "The answer: \\boxed{-1}") as (fake, engine):
        judge = sglang_judge(engine, tok)
        assert await judge.complete(MESSAGES, rid="turn-7-vote-0") == "The answer: \\boxed{-1}"
    assert fake.requests == [{
        "input_ids": tok.encode_chat(MESSAGES, None), "rid": "turn-7-vote-0.0", "stream": False,
        "sampling_params": {"temperature": 0.6, "top_p": 1.0, "top_k": -1, "max_new_tokens": 1024}}]
    assert (judge.stats.ok, judge.stats.calls) == (1, 1)


async def test_sglang_judge_retries_engine_errors_with_a_fresh_rid(tok):
    async with sglang(tok) as (fake, engine):
        judge = sglang_judge(engine, tok)
        fake.fail_next(500, {"error": "boom"})
        fake.hang_next()
        fake.fail_next(200, {"text": "", "output_ids": [7], "meta_info": {"id": "x", "finish_reason": ABORTED}})
        policy = CallPolicy(timeout=0.3, retries=3, backoff_initial=0.01, backoff_max=0.02)
        judge = sglang_judge(engine, tok, policy)
        async with asyncio.timeout(BOUND):
            assert await judge.complete(MESSAGES, rid="j") == "Score: \\boxed{1}"
    assert [r["rid"] for r in fake.requests] == ["j.0", "j.1", "j.2", "j.3"]
    s = judge.stats
    assert (s.engine_errors, s.timeouts, s.retried, s.ok, s.failed) == (2, 1, 3, 1, 0)
    assert ("j.1", "disconnect") in fake.aborted  # the timed-out attempt was dropped by the engine


async def test_sglang_judge_400_is_final_and_long_prompts_never_leave(tok):
    async with sglang(tok) as (fake, engine):
        judge = sglang_judge(engine, tok)
        fake.fail_next(400, {"error": {"message": "The input is longer than the context"}})
        with pytest.raises(JudgeFailed) as info:
            await judge.complete(MESSAGES)
        assert info.value.reason == "http_400" and "longer than the context" in info.value.detail
        assert len(fake.requests) == 1
        with pytest.raises(JudgeFailed, match="^prompt_too_long"):
            await judge.complete([{"role": "user", "content": "word " * 3000}])
        assert len(fake.requests) == 1
    s = judge.stats
    assert (s.calls, s.failed, s.http_errors, s.retried) == (2, 2, 1, 0) and settled(s)


async def test_sglang_judge_connection_refused_fails_closed(tok):
    engine = EngineClient(f"http://127.0.0.1:{free_port()}")
    await engine.start()
    try:
        judge = sglang_judge(engine, tok)
        async with asyncio.timeout(BOUND):
            with pytest.raises(JudgeFailed, match="^connection"):
                await judge.complete(MESSAGES)
    finally:
        await engine.close()
    assert (judge.stats.connection_errors, judge.stats.retried, judge.stats.failed) == (3, 2, 1)


async def test_sglang_judge_concurrency_limit_and_slow_votes(tok):
    active = peak = 0
    reply = tok.encode("\\boxed{0}") + [tok.info.eos_ids[0]]

    async def responder(ids, sp):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        try:
            await asyncio.sleep(0.15)
        finally:
            active -= 1
        return reply

    async with sglang(tok, responder=responder) as (fake, engine):
        judge = sglang_judge(engine, tok, CallPolicy(timeout=5.0, retries=0, concurrency=2))
        async with asyncio.timeout(BOUND):
            results = await asyncio.gather(*(judge.complete(MESSAGES) for _ in range(6)))
    assert results == ["\\boxed{0}"] * 6 and peak == 2


async def test_teacher_scores_every_response_token_from_the_last_prompt_position(tok):
    p, r = [4088, 383, 198, 1440], [591, 25, 220, 4089]
    async with sglang(tok) as (fake, engine):
        teacher = Teacher(engine, policy=FAST)
        assert await teacher.logprobs(p, r, rid="t") == [input_logprob(len(p) + i, t) for i, t in enumerate(r)]
        assert await teacher.logprobs(p, []) == []
        with pytest.raises(ValueError):
            await teacher.logprobs([], r)
    assert fake.requests == [{
        "input_ids": p + r, "rid": "t.0", "stream": False, "return_logprob": True, "logprob_start_len": 3,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}]
    assert (teacher.stats.calls, teacher.stats.ok) == (1, 1)


async def test_teacher_scores_the_top_k_ids_a_window_of_positions_a_request(tok):
    """Top-K distillation: the teacher's log-probs at each position's top-k ids, from `token_ids_logprob` (the
    union of a window's ids) read back in `input_token_ids_logprobs`; TOP_WINDOW positions a request, so a row
    never holds every id of a long answer."""
    p = [4088, 383, 198, 1440]
    r = [(7 * i + 11) % 4096 for i in range(TOP_WINDOW + 8)]
    tops = [[t, (t + 3) % 4096, 5] for t in r]  # repeated ids across positions: the union is smaller
    async with sglang(tok) as (fake, engine):
        teacher = Teacher(engine, policy=FAST)
        got = await teacher.scores(p, r, tops, rid="t")
    assert got.logprobs == [input_logprob(len(p) + i, t) for i, t in enumerate(r)]
    want = [[row_logprob(input_logprob(len(p) + i, t), t, x, 4096) for x in row] for i, (t, row) in enumerate(zip(r, tops))]
    assert got.top == want
    firsts = sorted(fake.requests, key=lambda b: b["logprob_start_len"])
    assert [(b["rid"], len(b["input_ids"]), b["logprob_start_len"]) for b in firsts] == [
        ("t.w0.0", len(p) + TOP_WINDOW, len(p) - 1), (f"t.w{TOP_WINDOW}.0", len(p) + len(r), len(p) + TOP_WINDOW - 1)]
    assert firsts[1]["token_ids_logprob"] == sorted({x for row in tops[TOP_WINDOW:] for x in row})
    # with the overlap: the teacher's own top-k (the fake's: the token and its next two) shares each position's token
    async with sglang(tok) as (fake, engine):
        both = await Teacher(engine, policy=FAST).scores(p, r, tops, rid="o", with_overlap=True)
    assert both.top == want and both.overlap == len(r)
    assert all(b["top_logprobs_num"] == 3 for b in fake.requests)
    # the misaligned id rows of a window fail closed, like the sampled tokens'
    bad = {"meta_info": {"input_token_ids_logprobs": [None, [[-0.1, 6, None]]]}}
    with pytest.raises(AttemptFailed, match="expected id 5"):
        top_logprobs(bad, [[5]], [5])


async def test_teacher_misalignment_fails_closed_without_retry(tok):
    p, r = [1, 2, 3], [8, 9, 10]

    def answer(entries):
        return {"text": "", "output_ids": [], "meta_info": {
            "id": "x", "finish_reason": {"type": "length", "length": 0}, "input_token_logprobs": entries,
            "output_token_logprobs": []}}

    bad = {"wrong length": [[None, 3, None], [-0.1, 8, None], [-0.2, 9, None]],
           "wrong ids": [[None, 3, None], [-0.1, 8, None], [-0.2, 10, None], [-0.3, 9, None]],
           "null entry": [[None, 3, None], [-0.1, 8, None], [None, 9, None], [-0.3, 10, None]],
           "nan": [[None, 3, None], [-0.1, 8, None], [math.nan, 9, None], [-0.3, 10, None]],
           "none": None}
    async with sglang(tok) as (fake, engine):
        # FAST's 0.3 s would let a loaded machine turn a bad answer into a timeout and a retry: no hang here.
        teacher = Teacher(engine, policy=dataclasses.replace(FAST, timeout=10.0))
        for name, entries in bad.items():
            fake.fail_next(200, answer(entries))
            with pytest.raises(JudgeFailed) as info:
                await teacher.logprobs(p, r)
            assert info.value.reason == "teacher_misaligned", name
        assert len(fake.requests) == len(bad)  # none retried
        fake.fail_next(200, {"text": "", "output_ids": [], "meta_info": {"id": "x", "finish_reason": ABORTED}})
        fake.fail_next(502, "Bad Gateway")
        assert await teacher.logprobs(p, r) == [input_logprob(3 + i, t) for i, t in enumerate(r)]
    s = teacher.stats
    assert (s.calls, s.failed, s.bad_responses, s.engine_errors, s.retried, s.ok) == (6, 5, 5, 2, 2, 1)
    assert settled(s)


async def test_teacher_hanging_engine_times_out_and_others_complete(tok):
    p = [1, 2, 3]
    async with sglang(tok) as (fake, engine):
        teacher = Teacher(engine, policy=CallPolicy(timeout=0.3, retries=0, concurrency=8))
        fake.hang_next(2)
        async with asyncio.timeout(BOUND):
            results = await asyncio.gather(*(teacher.logprobs(p, [10 + i]) for i in range(6)),
                                           return_exceptions=True)
    assert sum(isinstance(r, JudgeFailed) and r.reason == "timeout" for r in results) == 2
    assert sum(isinstance(r, list) for r in results) == 4
    assert (teacher.stats.timeouts, teacher.stats.ok, teacher.stats.failed) == (2, 4, 2)


async def test_teacher_cancellation_propagates(tok):
    async with sglang(tok) as (fake, engine):
        teacher = Teacher(engine, policy=FAST)
        fake.hang_next()
        task = asyncio.create_task(teacher.logprobs([1, 2], [3], rid="c"))
        await until(lambda: fake.in_flight == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: ("c.0", "disconnect") in fake.aborted)
    assert (teacher.stats.cancelled, teacher.stats.failed, teacher.stats.timeouts) == (1, 0, 0)
