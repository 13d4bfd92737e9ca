"""Teacher alignment (docs/ARCHITECTURE.md §3) on the tiny model through the real CPU engine.

The teacher's log-probs of a response under the unchanged prompt must equal the
rollout's own log-probs at temperature 1 and a teacher-forced forward pass,
first response token included; under a hinted prompt they must equal a forward
pass on that prompt. Also when the engine batches several scorings together.
"""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from clawd.engine.client import EngineClient
from clawd.scoring.judges import CallPolicy
from clawd.scoring import teacher as teacher_module
from clawd.scoring.teacher import Teacher
from clawd.tokenizer import ChatTokenizer

REPO = Path(__file__).resolve().parents[1]
# Measured: at most 9.54e-7, one float32 ulp at |log-prob| ~ 8 (2**-20). Asserted: two ulps.
TOL = 2e-6
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a short function that adds two numbers."}]
HINT = "\n\n[user's hint / instruction]\nUse type hints and a docstring."


@pytest.fixture(scope="module")
def engine_url(tiny_model, tmp_path_factory):
    """A CPU engine process serving the tiny model on a socket bound here and handed over."""
    sock = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    log_path = tmp_path_factory.mktemp("teacher") / "engine.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "clawd.engine.local", "--model", str(tiny_model),
                                 "--fd", str(sock.fileno()), "--threads", "1", "--max-batch-size", "8"],
                                pass_fds=(sock.fileno(),), cwd=REPO, stdout=log, stderr=log)
    sock.close()
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"engine exited:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"engine not healthy:\n{log_path.read_text()}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=30) as resp:
                    if resp.status == 200:
                        break
            except OSError:  # still loading
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def ref(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(tiny_model) -> ChatTokenizer:
    return ChatTokenizer(tiny_model)


@pytest.fixture
async def engine(engine_url):
    client = EngineClient(engine_url)
    await client.start()
    yield client
    await client.close()


def forced(model, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """log_softmax(logits) at T = 1 of each response token under one forward pass of P + R."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + response_ids])).logits[0].float()
    lps = torch.log_softmax(logits, -1)
    return [float(lps[len(prompt_ids) - 1 + i, t]) for i, t in enumerate(response_ids)]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


async def rollout(engine: EngineClient, prompt_ids: list[int], seed: int) -> tuple[list[int], list[float]]:
    out = await engine.generate({"input_ids": prompt_ids, "return_logprob": True, "sampling_params": {
        "temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": seed}})
    return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def hinted(messages: list[dict]) -> list[dict]:
    """The teacher prompt: the hint appended to the last user message (docs/ARCHITECTURE.md §5)."""
    return [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + HINT}]


@pytest.mark.slow
async def test_teacher_equals_rollout_and_forward_pass_first_token_included(engine, tok, ref):
    p = tok.encode_chat(QUESTION, None)
    r, rollout_lps = await rollout(engine, p, seed=3)
    assert len(r) == 12
    teacher = Teacher(engine, policy=CallPolicy(timeout=60.0))
    lps = await teacher.logprobs(p, r)
    reference = forced(ref, p, r)
    assert len(lps) == len(r)
    assert abs(lps[0] - rollout_lps[0]) <= TOL and abs(lps[0] - reference[0]) <= TOL  # the first token
    assert max_diff(lps, rollout_lps) <= TOL
    assert max_diff(lps, reference) <= TOL
    assert max_diff(rollout_lps, reference) <= TOL
    assert teacher.stats.ok == 1


async def test_teacher_under_a_hinted_prompt_equals_a_forward_pass_on_it(engine, tok, ref):
    p = tok.encode_chat(QUESTION, None)
    p_hint = tok.encode_chat(hinted(QUESTION), None)
    assert len(p_hint) > len(p)
    r, _ = await rollout(engine, p, seed=4)
    teacher = Teacher(engine, policy=CallPolicy(timeout=60.0))
    lps = await teacher.logprobs(p_hint, r)
    assert max_diff(lps, forced(ref, p_hint, r)) <= TOL
    assert max_diff(lps, forced(ref, p, r)) > 1e-3  # the hint changed the teacher


async def test_concurrent_scorings_batched_by_the_engine_stay_aligned(engine, tok, ref):
    """Prompts of different lengths scored at once, which the engine may left-pad into one batch."""
    convs = [QUESTION, hinted(QUESTION), [{"role": "user", "content": "Hi"}]]
    prompts = [tok.encode_chat(c, None) for c in convs]
    responses = [(await rollout(engine, p, seed=10 + i))[0][: 5 + 3 * i] for i, p in enumerate(prompts)]
    teacher = Teacher(engine, policy=CallPolicy(timeout=60.0))
    results = await asyncio.gather(*(teacher.logprobs(p, r) for p, r in zip(prompts, responses)))
    for p, r, lps in zip(prompts, responses, results):
        assert max_diff(lps, forced(ref, p, r)) <= TOL


def forced_rows(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """log_softmax(logits) at T = 1 over the whole vocabulary at each response position: [R, V]."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + response_ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(response_ids)]


async def test_top_k_distillation_rows_from_the_rollout_to_the_hinted_teacher(engine, tok, ref, monkeypatch):
    """The rollout's top-k ids are the policy's k most likely at each position, and the hinted teacher's
    log-probs at them equal a forward pass on the hinted prompt; windows of 5 positions, so the union of ids
    and the window's offsets are exercised on the real engine."""
    monkeypatch.setattr(teacher_module, "TOP_WINDOW", 5)
    p, p_hint = tok.encode_chat(QUESTION, None), tok.encode_chat(hinted(QUESTION), None)
    out = await engine.generate({"input_ids": p, "return_logprob": True, "top_logprobs_num": 4, "sampling_params": {
        "temperature": 0.7, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 5}})
    r, tops = out["output_ids"], [[e[1] for e in row] for row in out["meta_info"]["output_top_logprobs"]]
    assert len(tops) == len(r) == 12 and all(len(row) == 4 for row in tops)
    policy = forced_rows(ref, p, r)
    assert tops == policy.topk(4).indices.tolist()  # the order at T = 0.7 is that at T = 1
    teacher = Teacher(engine, policy=CallPolicy(timeout=60.0))
    got = await teacher.scores(p_hint, r, tops)
    want = forced_rows(ref, p_hint, r).gather(-1, torch.tensor(tops))
    assert max(abs(x - y) for row, wrow in zip(got.top, want.tolist()) for x, y in zip(row, wrow)) <= TOL
    assert max_diff(got.logprobs, forced(ref, p_hint, r)) <= TOL
    assert teacher.stats.ok == 3  # 12 positions in windows of 5
