"""Learning on CPU, end to end (docs/ARCHITECTURE.md §2): a scripted user's preference is learnt in rl mode,
for two seeds, and a negative control fed the same judge's rewards shuffled learns far less.

The real daemon, the CPU engine on the tiny random-weight model, the rules judge and the learner.
The user asks short questions and prefers short replies: some visible text, at most MAX_CHARS
characters, checked on the reply's content (an empty reply, or one moved whole into
`reasoning_content`, does not count). A satisfying reply is thanked (+1); any other is corrected
(-1). With MAX_TOKENS tokens per reply the untrained model meets the bound about a third of the
time; the model can only learn it by preferring shorter tokens.

Each seed trains twice from the same start: the arm, and its control with `[learner] control =
"shuffle_rewards"` (the batch's rewards permuted across its replies: clawd/learning/controls.py).
Same users, same judge, same number of steps and samples; only the link between a reply and its
reward is cut. The satisfaction rate is measured on a fixed evaluation set (no_train turns, prompts
never trained on, temperature 1, a fixed seed per prompt, so before and after see the same random
draws) before training and after STEPS steps of ROLLOUT_BATCH conversations each.

Measured (24 steps, lr 1e-2, clawd's batch-mean baseline, one torch thread per process as the suite
runs it: tests/conftest.py): seed 1 the arm 0.30 -> 1.00, the control 0.30 -> 0.475; seed 2 the arm
0.30 -> 0.80, the control 0.30 -> 0.30; the same in two runs (2026-12-03). Seed 2 gave exactly these
figures on one trainer rank and on a world of 2 (FSDP2 under torchrun), as a step on two ranks equals
the step on one (tests/test_distributed_trainer.py); the suite runs both seeds on one rank, as the
world's 3 processes cost 23 of the seed's 58 CPU-s. With 16 steps neither seed met MARGIN (arm
0.30 -> 0.575 and 0.55). With torch's default threads the same seeds gave 0.85 / 0.325 and 0.875 / 0.425: the
thread count changes float sums, and so the walk. A run is deterministic: the learner trains each
batch in a canonical order (limits.canonical) and the control deals its permutation in one too, so
neither follows the order concurrent scorings reached the store. Before that, the control's end point
moved from run to run (0.30 -> 0.30 up to 0.65 over CI runs), and twice crossed the bound below; a
different seed's walk may still land anywhere in that range. The control is not flat: a random walk of the weights
spreads the tiny model's next-token distribution, which by itself ends some replies sooner, and
shorter is what this user wants. So the test asserts what separates learning from that drift:
the arm gains at least MARGIN, the control moves less than CONTROL_BOUND, and the arm's gain beats
the control's by at least MARGIN. combine mode is not run here: on this model the teacher (the
policy shown the hint) cannot read the hint, so its OPD term is noise, not a test of OPD (that is
tests/test_opd_signal.py, on SmolLM2); at 24 steps it slowed learning (0.30 -> 0.475, seed 1).
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
STEPS = 24
LR = 1e-2
BASELINE = "batch_mean"  # clawd's default; with "none" only 1 of seeds 1-3 learnt in 32 steps (see the note below)
MARGIN = 0.3          # the arm's gain, and its lead over the control's change (measured: see above)
CONTROL_BOUND = 0.25  # the control's |after - before|


def satisfies(text: str) -> bool:
    return bool(text.strip()) and len(text) <= MAX_CHARS


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
            # Its step and then its publish (a batch whose rewards all agree publishes nothing): the next batch
            # is served by the newest policy whatever the load (waiting for the step alone raced the publish).
            while (learner := self.learner())["publishes"] + learner["skipped_steps"] < step + 1:
                assert time.monotonic() < deadline, learner
                time.sleep(0.05)
        return rates

    def learner(self) -> dict:
        return self.daemon.get("/debug/process")[1]["learner"]


def learn(tiny_model, tmp_path, mode: str, seed: int, control: str = "none",
          steps: int = STEPS, baseline: str = BASELINE) -> tuple[float, float, list[float], dict]:
    """(rate before, rate after, rate per training batch, learner stats) for one run."""
    (tmp_path / control).mkdir()
    daemon = Daemon(tmp_path / control, {
        "model": {"path": str(tiny_model), "max_tokens_cap": MAX_TOKENS},
        "engine": {"launch": "local", "seed": seed},
        "scoring": {"mode": mode},
        # combine: the teacher is the current policy shown the hint (no second CPU engine).
        "judge": {"teacher_engine": "policy"},
        "learner": {"enabled": True, "rollout_batch_size": ROLLOUT_BATCH, "min_batch_size": 1,
                    "control": control},
        "train": {"seed": seed, "optimizer": {"lr": LR}, "loss": {"reward_baseline": baseline}}})
    try:
        user = User(daemon)
        before = user.evaluate()
        rates = user.train(steps, seed)
        after = user.evaluate()
        learner = user.learner()
        trainer = daemon.get("/debug/process")[1]["trainer"]
        assert trainer["world_size"] == 1 and trainer["restarts"] == 0
    finally:
        assert daemon.stop() == 0
    return before, after, rates, learner


@pytest.mark.slow  # about 31 s per seed on 2 idle cores (two runs of 24 steps), more under load
@pytest.mark.parametrize("seed", [1, 2])
def test_a_scripted_users_preference_is_learnt_and_a_shuffled_reward_control_learns_far_less(tiny_model, tmp_path, seed):
    runs = {"arm": learn(tiny_model, tmp_path, "rl", seed),
            "control": learn(tiny_model, tmp_path, "rl", seed, control="shuffle_rewards")}
    for name, (before, after, rates, learner) in runs.items():
        print(f"\nrl seed {seed}, {name}: satisfied before {before:.3f}, after {after:.3f}; "
              f"per batch {rates}")
        assert learner["steps"] == STEPS and learner["failed_publishes"] == 0
        assert learner["publishes"] == STEPS - learner["no_signal_steps"]
        assert learner["samples_trained"] == STEPS * ROLLOUT_BATCH and learner["control"] == name.replace(
            "arm", "none").replace("control", "shuffle_rewards")
    (before, after), (c_before, c_after) = runs["arm"][:2], runs["control"][:2]
    assert c_before == before  # the same model, prompts and draws before training
    assert before >= 0.2  # the untrained model meets the preference often enough to learn from
    assert after - before >= MARGIN
    assert abs(c_after - before) < CONTROL_BOUND
    assert (after - before) - (c_after - before) >= MARGIN
