"""OPD's signal on a model that can read a hint (SmolLM2), through clawd's own parts end to end.

The chain a wrong answer goes through in opd mode: the simulated user's correction
(clawd/tools/sim/personas.py) → the rules judge's vote and hint (clawd/scoring/rules.py) → the
teacher prompt (judging.teacher_messages, the chat template) → the teacher's log-probs of the
reply (the policy shown the hint) → the OPD term teacher − rollout (losses.opd_term) → one OPD
training step (the trainer). Log-probs are the trainer's own packed path at T = 1.

Asserted, averaged over 8 fact questions of the bank with a distractor, on the tokens that name
the answer in "The answer is X." (the OPD term there, teacher − rollout, for X right and X wrong):
- a correction that carries the answer makes the teacher lower the wrong answer, and prefer the
  right one over the wrong one by more than the rollout does;
- a correction that does not carry it (the `curious` persona, the control) gives less of that
  preference: the information in the hint is what moves the teacher;
- one OPD step on the wrong replies lowers the policy's log-prob of the wrong answer asked
  without any hint.

The tiny test model has random weights and cannot read a hint; this is why OPD is shown here and
on SmolLM2 in bench/learning.py, not on the tiny model.
"""
from __future__ import annotations

import statistics
import types

import pytest

from clawd.config import TrainConfig
from clawd.samples import Sample
from clawd.scoring import judging, rules
from clawd.tokenizer import ChatTokenizer
from clawd.tools.sim import questions
from clawd.tools.sim.personas import PERSONAS
from clawd.trainer.step import Trainer

PREFIX = "The answer is"


def _sample(i: int, prompt: list[int], response: list[int], *, teacher: list[float] | None = None,
            rollout: list[float] | None = None) -> Sample:
    n = len(response)
    return Sample(sample_id=f"s{i}", mode="opd", session_id="s", turn_index=i, principal="p",
                  tokens=prompt + response, response_length=n, loss_mask=[1] * n,
                  rollout_logprobs=rollout or [-1.0] * n, temperature=1.0, reward=0.0,
                  teacher_logprobs=teacher, has_hint=teacher is not None, policy_version=0, created=0.0, scored=0.0)


class Case:
    """One fact question: the plain prompt, a reply naming the answer and one naming a distractor, with the
    positions of those names among the reply's tokens."""

    def __init__(self, tok: ChatTokenizer, item: questions.Item):
        self.item = item
        self.messages = [{"role": "user", "content": item.question}]
        self.prompt = tok.encode_chat(self.messages, None)
        eos = tok.encode("<|im_end|>")
        head = tok.encode(PREFIX)
        self.replies, self.spans = {}, {}
        for kind, name in (("right", item.answers[0]), ("wrong", item.distractors[0])):
            text = f"{PREFIX} {name}."
            ids = tok.encode(text)
            assert ids[:len(head)] == head and tok.decode(ids[len(head):-1]).strip() == name, (text, ids)
            self.replies[kind] = (text, ids + eos)
            self.spans[kind] = range(len(head), len(ids) - 1)

    def hint(self, persona: str) -> str:
        """What the rules judge takes from the persona's correction of the wrong reply."""
        text = self.replies["wrong"][0]
        correction = PERSONAS[persona].correction(text, self.item)
        turn = types.SimpleNamespace(messages=self.messages + [{"role": "assistant", "content": text}])
        vote, hint = rules.rules_vote(turn, [{"role": "user", "content": correction}])
        assert vote == -1 and hint, (persona, correction)
        return hint

    def teacher_prompt(self, tok: ChatTokenizer, hint: str) -> list[int]:
        return tok.encode_chat(judging.teacher_messages(types.SimpleNamespace(messages=self.messages), hint), None)


def _span_mean(lps: list[float], span: range) -> float:
    return statistics.fmean(lps[i] for i in span)


@pytest.mark.slow  # SmolLM2 on CPU: about 15 s with the model converted
def test_a_hint_that_carries_the_answer_moves_the_teacher_and_one_opd_step_moves_the_policy(default_model, tmp_path):
    model_dir, _ = default_model
    tok = ChatTokenizer(model_dir)
    # Facts whose correction names the answer as the reply does ("Canberra", not "eleven" for "11").
    items = [it for it in questions.TRAIN + questions.EVAL
             if it.kind == "fact" and it.distractors and it.answers[0] in it.fact][:8]
    assert len(items) == 8
    cases = [Case(tok, it) for it in items]
    trainer = Trainer(model_dir, tmp_path / "state", TrainConfig(lr=1e-5, seed=0))

    def lps(prompts: list[list[int]], kind: str) -> list[list[float]]:
        return trainer.logprobs([_sample(i, p, c.replies[kind][1]) for i, (p, c) in enumerate(zip(prompts, cases))])

    plain = [c.prompt for c in cases]
    told = [c.teacher_prompt(tok, c.hint("brief")) for c in cases]      # "... : the capital of Italy is Rome."
    untold = [c.teacher_prompt(tok, c.hint("curious")) for c in cases]  # "No, that's wrong." and no answer
    assert all(c.item.answers[0] in c.hint("brief") and c.item.answers[0] not in c.hint("curious") for c in cases)

    gap = {}  # (hint, reply) -> mean over cases of the OPD term on the named answer's tokens
    base = {kind: lps(plain, kind) for kind in ("right", "wrong")}
    teachers = {}
    for name, prompts in (("told", told), ("untold", untold)):
        for kind in ("right", "wrong"):
            teacher = teachers[name, kind] = lps(prompts, kind)
            gap[name, kind] = statistics.fmean(_span_mean(t, c.spans[kind]) - _span_mean(b, c.spans[kind])
                                               for t, b, c in zip(teacher, base[kind], cases))
    print("\nOPD term on the answer's tokens (teacher - rollout, nats):", {k: round(v, 3) for k, v in gap.items()})
    prefers = {name: gap[name, "right"] - gap[name, "wrong"] for name in ("told", "untold")}
    print("teacher's preference for the right answer over the wrong one, beyond the rollout's:", prefers)
    assert gap["told", "wrong"] < -0.5              # the teacher turns from the wrong answer the hint corrects
    assert prefers["told"] > 0.5                    # and prefers the right one it names
    assert prefers["told"] > prefers["untold"] + 0.5  # the hint's information, not its being there

    # One OPD step on the wrong replies, each with the teacher's log-probs under the hint that carries the answer.
    batch = [_sample(i, c.prompt, c.replies["wrong"][1], teacher=t, rollout=b)
             for i, (c, t, b) in enumerate(zip(cases, teachers["told", "wrong"], base["wrong"]))]
    metrics = trainer.train_step(batch, "opd")
    assert not metrics["skipped"]
    after = lps(plain, "wrong")
    moved = statistics.fmean(_span_mean(a, c.spans["wrong"]) - _span_mean(b, c.spans["wrong"])
                             for a, b, c in zip(after, base["wrong"], cases))
    print(f"one OPD step: the wrong answer's log-prob without a hint moved {moved:+.3f} nats")
    assert moved < 0
