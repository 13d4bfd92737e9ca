"""Scoring in the daemon: finished turns → judge → teacher → journal, against fakes and the real engine."""
from __future__ import annotations

import asyncio
import time

import openai
import pytest

from clawd.scoring import judging
from .fake_sglang import FakeSGLang, input_logprob, row_logprob
from .harness import Daemon, wait_ready_async
from .test_api import Script

HINT = "Answer in one short sentence, without a list."


class JudgeScript(Script):
    """The reference engine as a judge: a -1 vote for RL prompts, a +1 vote with a hint for hint prompts."""

    def __call__(self, input_ids, sampling_params):
        prompt = self.decode(input_ids)
        if "hindsight" in prompt.lower():
            text = f"The user wanted brevity. \\boxed{{1}}\n[HINT_START]{HINT}[HINT_END]"
        else:
            text = "The user asked for a change. \\boxed{-1}"
        return self.tok.encode(text, add_special_tokens=False).ids + [self.eos]


async def _wait_records(daemon, kind, n, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        recs = daemon.records(kind)
        if len(recs) >= n:
            return recs
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{kind} records: {daemon.records(kind)}")


@pytest.mark.parametrize("top_k", [0, 3])
async def test_combine_mode_builds_a_hinted_sample_with_exact_teacher_logprobs(tiny_model, tmp_path, top_k):
    """With top_k, the reply's top-k ids come from the policy engine, the teacher's log-probs at them from the
    reference engine, and so do the reference's own log-probs of the reply (the KL term's, kl_loss_coef > 0)."""
    policy_script, judge_script = Script(tiny_model), JudgeScript(tiny_model)
    train = {"loss": {"opd_top_k": top_k, "kl_coef": 0.1} if top_k else {"opd_top_k": 0}}
    async with FakeSGLang(responder=policy_script, eos_id=policy_script.eos) as policy, \
            FakeSGLang(responder=judge_script, eos_id=judge_script.eos) as reference:
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)},
                                   "engine": {"launch": "none", "url": policy.url, "reference_url": reference.url},
                                   "scoring": {"mode": "combine", "prm_m": 2}, "train": train,
                                   "judge": {"backend": "sglang", "engine": "reference"}}, wait_ready=False)
        try:
            await wait_ready_async(daemon)
            client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
            messages = [{"role": "user", "content": "List three otter facts."}]
            first = await client.chat.completions.create(model="m", messages=messages)
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "Too long. Shorter, please."}]
            await client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Session-Done": "1"})
            judged = await _wait_records(daemon, "judge", 2)
            await client.close()
        finally:
            assert daemon.stop() == 0

    by_turn = {r["turn_index"]: r for r in judged}
    assert by_turn[1] == {**by_turn[1], "emitted": False, "reason": "session_done"}
    rec = by_turn[0]
    assert rec["votes"] == [-1, -1] and rec["score"] == -1 and rec["hint"] == HINT
    assert rec["emitted"] is True and rec["reason"] == "opd+rl" and rec["reward"] == -1.0
    assert len(rec["raw"]) == 4 and all("boxed" in t for t in rec["raw"])

    (sample,) = daemon.samples()
    (turn,) = [t for t in daemon.records() if t["turn_index"] == 0]
    assert sample.sample_id == rec["sample_id"]
    assert sample.tokens == turn["prompt_ids"] + turn["response_ids"]
    assert sample.rollout_logprobs == turn["response_logprobs"] and sample.reward == -1.0 and sample.has_hint

    # The teacher scored the original response ids under the hinted prompt, first token included.
    scorings = [r for r in reference.requests if r["sampling_params"].get("max_new_tokens") == 0]
    (scoring,) = [r for r in scorings if judging.HINT_MARKER in judge_script.decode(r["input_ids"])]
    ids, start = scoring["input_ids"], scoring["logprob_start_len"]
    response = turn["response_ids"]
    assert ids[len(ids) - len(response):] == response and start == len(ids) - len(response) - 1
    assert HINT in judge_script.decode(ids)
    assert sample.teacher_logprobs == [input_logprob(start + 1 + i, t) for i, t in enumerate(response)]
    if not top_k:
        assert len(scorings) == 1 and sample.top_ids is None and sample.reference_logprobs is None
        assert all("top_logprobs_num" not in r for r in policy.requests)
        return
    # each reply token's top-k ids, as the policy engine reported them (the fake: the token and its neighbours)
    assert [r.get("top_logprobs_num") for r in policy.requests] == [top_k, top_k] and len(response) <= 32
    want_ids = [[(t + j) % policy.vocab_size for j in range(top_k)] for t in response]
    assert turn["response_top_ids"] == sample.top_ids == want_ids
    assert scoring["token_ids_logprob"] == sorted({x for row in want_ids for x in row})
    assert sample.teacher_top_logprobs == [[row_logprob(input_logprob(start + 1 + i, t), t, x, reference.vocab_size)
                                            for x in row] for i, (t, row) in enumerate(zip(response, want_ids))]
    # the reference's log-probs of the reply under the turn's own prompt
    (plain,) = [r for r in scorings if r is not scoring]
    assert plain["input_ids"] == turn["prompt_ids"] + response and plain["logprob_start_len"] == len(turn["prompt_ids"]) - 1
    assert sample.reference_logprobs == [input_logprob(len(turn["prompt_ids"]) + i, t) for i, t in enumerate(response)]


async def test_judge_down_fails_closed_and_serving_goes_on(tiny_model, tmp_path):
    script = Script(tiny_model)
    async with FakeSGLang(responder=script, eos_id=script.eos) as policy:
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)},
                                   "engine": {"launch": "none", "url": policy.url,
                                              "reference_url": "http://127.0.0.1:9"},
                                   "scoring": {"mode": "rl", "prm_m": 3},
                                   "judge": {"backend": "sglang", "engine": "reference", "retries": 1,
                                             "backoff_initial": 0.01, "backoff_max": 0.02, "timeout": 1.0}},
                        wait_ready=False)
        try:
            await wait_ready_async(daemon)
            client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
            messages = [{"role": "user", "content": "hi"}]
            first = await client.chat.completions.create(model="m", messages=messages)
            messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "ok"}]
            await client.chat.completions.create(model="m", messages=messages)
            (rec,) = await _wait_records(daemon, "judge", 1)
            assert rec["votes"] == [None, None, None] and rec["reason"] == judging.JUDGE_FAILED
            stats = daemon.get("/debug/process")[1]["scoring"]
            assert stats["excluded"] == {"judge_failed": 1} and stats["votes"] == {"failed": 3}
            await client.close()
        finally:
            assert daemon.stop() == 0
        assert daemon.samples() == []


@pytest.fixture
def real_daemon(tiny_model, tmp_path):
    d = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 8},
                          "engine": {"launch": "local"}, "scoring": {"mode": "rl"}, "judge": {"backend": "rules"}})
    yield d
    d.stop()


@pytest.mark.slow
def test_rules_judge_on_the_real_engine_journals_a_sample(real_daemon):
    client = openai.OpenAI(base_url=real_daemon.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Name a river."}]
    reply = client.chat.completions.create(model="m", messages=messages)
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "Thanks, that's great!"}]
    client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Session-Done": "1"})
    deadline = time.monotonic() + 10
    while len(real_daemon.records("judge")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert real_daemon.stop() == 0
    (sample,) = real_daemon.samples()
    (turn,) = [t for t in real_daemon.records() if t["turn_index"] == 0]
    assert sample.reward == 1.0 and not sample.has_hint and sample.teacher_logprobs is None
    assert sample.tokens == turn["prompt_ids"] + turn["response_ids"]
    assert sample.rollout_logprobs == turn["response_logprobs"] and sample.loss_mask == [1] * len(turn["response_ids"])
    assert sample.principal == "anonymous" and sample.policy_version == 0


@pytest.mark.slow
async def test_shutdown_cancels_turns_still_being_judged_and_says_so(tiny_model, tmp_path):
    script = Script(tiny_model)
    async with FakeSGLang(responder=script, eos_id=script.eos) as policy, FakeSGLang() as reference:
        reference.hang_next(10)
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)},
                                   "server": {"drain_timeout": 1.0},
                                   "engine": {"launch": "none", "url": policy.url, "reference_url": reference.url},
                                   "scoring": {"mode": "rl"}, "judge": {"backend": "sglang", "timeout": 60.0}},
                        wait_ready=False)
        await wait_ready_async(daemon)
        client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        first = await client.chat.completions.create(model="m", messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "ok"}]
        await client.chat.completions.create(model="m", messages=messages)
        await client.close()
        while reference.in_flight == 0:
            await asyncio.sleep(0.02)
        started = time.monotonic()
        stopping = asyncio.get_running_loop().run_in_executor(None, daemon.stop)  # the fakes keep running
        assert await stopping == 0
        assert time.monotonic() - started < 15
    reasons = sorted(r["reason"] for r in daemon.records("judge"))
    assert reasons == ["scoring_cancelled", "shutdown"]
