"""Learning on CPU, end to end (docs/ARCHITECTURE.md §2): a scripted user's preference is learnt, in rl and in combine mode.

The real daemon, the CPU engine on the tiny random-weight model, the rules judge and the learner.
The user asks short questions and prefers short replies: at most MAX_CHARS characters, checked
on the reply text itself. A short reply is thanked (+1); a long one is corrected, and the
correction says what was wanted (-1, and in combine mode the hint the teacher is shown).
With MAX_TOKENS tokens per reply the untrained model meets the bound about a third of the time
(measured: 36% over 300 draws, 30% on the evaluation set); the model can only learn it by preferring shorter tokens.

The satisfaction rate is measured on a fixed evaluation set (no_train turns, temperature 1, a
fixed seed per prompt, so before and after see the same random draws) before training and
after STEPS training steps, each on ROLLOUT_BATCH conversations sampled from the current policy.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from .harness import Daemon

MAX_TOKENS = 8        # tokens per reply (max_tokens_cap)
MAX_CHARS = 34        # the user's preference: a reply of at most this many characters
CORRECTION = f"No, that's wrong. Keep it short: at most {MAX_CHARS} characters."
THANKS = "Thanks, that's perfect."
EVAL_PROMPTS = 40
ROLLOUT_BATCH = 8
STEPS = 32            # seed 3 in rl mode needs ~25 steps (at 20 it had only reached 0.45)
LR = 3e-2
MARGIN = 0.3          # after - before; measured over training seeds 1-4 (20 steps): +0.15 to +0.7; 32 steps: 0.3 -> 1.0 (seeds 1, 3)


def satisfies(text: str) -> bool:
    return len(text) <= MAX_CHARS


def _rate(texts: list[str]) -> float:
    return sum(map(satisfies, texts)) / len(texts)


class User:
    """The scripted user: the official client, several conversations at once so the engine batches them."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0, timeout=120)
        self.pool = ThreadPoolExecutor(8)

    def evaluate(self) -> float:
        def ask(i: int) -> str:
            reply = self.client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"Question {i}: tell me about topic {i}."}],
                temperature=1.0, seed=1_000_000 + i, extra_headers={"X-Clawd-No-Train": "1"})
            return reply.choices[0].message.content or ""
        return _rate(list(self.pool.map(ask, range(EVAL_PROMPTS))))

    def converse(self, i: int, seed: int) -> bool:
        """One conversation: a request, the user's verdict on the reply, then the session ends."""
        messages = [{"role": "user", "content": f"Request {i}: say something."}]
        reply = self.client.chat.completions.create(model="m", messages=messages, temperature=1.0, seed=seed)
        good = satisfies(reply.choices[0].message.content or "")
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": THANKS if good else CORRECTION}]
        # Its own reply ends the session unjudged (no next state): one token is enough.
        self.client.chat.completions.create(model="m", messages=messages, max_tokens=1,
                                            extra_headers={"X-Session-Done": "1"})
        return good

    def train(self, steps: int, seed: int) -> list[float]:
        """Each step: a batch of conversations on the current policy, then wait for its publish."""
        rates = []
        for step in range(steps):
            ids = range(step * ROLLOUT_BATCH, (step + 1) * ROLLOUT_BATCH)
            rates.append(sum(self.pool.map(lambda i: self.converse(i, seed * 100_000 + i), ids)) / ROLLOUT_BATCH)
            deadline = time.monotonic() + 120
            while self.learner()["publishes"] < step + 1:
                assert time.monotonic() < deadline, self.learner()
                time.sleep(0.05)
        return rates

    def learner(self) -> dict:
        return self.daemon.get("/debug/process")[1]["learner"]


def learn(tiny_model, tmp_path, mode: str, seed: int, steps: int = STEPS) -> tuple[float, float, list[float], dict]:
    """(rate before, rate after, rate per training batch, learner stats) for one run."""
    daemon = Daemon(tmp_path, {
        "model": {"path": str(tiny_model), "max_tokens_cap": MAX_TOKENS},
        "engine": {"launch": "local", "seed": seed},
        "scoring": {"mode": mode},
        # combine: the teacher is the current policy shown the hint (no second CPU engine).
        "judge": {"teacher_engine": "policy"},
        "learner": {"enabled": True, "rollout_batch_size": ROLLOUT_BATCH, "min_batch_size": 1},
        "train": {"lr": LR, "seed": seed}})
    try:
        user = User(daemon)
        before = user.evaluate()
        rates = user.train(steps, seed)
        after = user.evaluate()
        learner = user.learner()
    finally:
        assert daemon.stop() == 0
    return before, after, rates, learner


@pytest.mark.slow  # 15-70 s per mode on 2 cores, depending on load
@pytest.mark.parametrize("mode", ["rl", "combine"])
def test_a_scripted_users_preference_is_learnt(tiny_model, tmp_path, mode):
    before, after, rates, learner = learn(tiny_model, tmp_path, mode, seed=1)
    print(f"\n{mode}: satisfied before {before:.3f}, after {after:.3f}; per batch {rates}")
    assert learner["steps"] == STEPS and learner["publishes"] == STEPS and learner["failed_publishes"] == 0
    assert before >= 0.2  # the untrained model meets the preference often enough to learn from
    assert after - before >= MARGIN
