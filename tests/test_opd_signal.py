"""OPD's signal on a model that can read a hint (SmolLM2), through clawd's own parts end to end.

The chain a wrong answer goes through in opd mode: the simulated user's correction
(clawd/tools/sim/personas.py) → the rules judge's vote and hint (clawd/scoring/rules.py) → the
teacher prompt (judging.teacher_messages in the system message, the daemon's default placement, the
chat template's default system text kept) → the frozen teacher's log-probs of the reply → the OPD
term → training steps (the trainer). Log-probs are the trainer's own packed path at T = 1.

Asserted, averaged over 8 fact questions of the bank with a distractor, on the tokens that name
the answer in "The answer is X." (the OPD term there, teacher − policy, for X right and X wrong):
- a correction that carries the answer makes the teacher prefer the right answer over the wrong one
  by more than the policy does; a correction that does not carry it (the `curious` persona, the
  control) gives less of that preference: the information in the hint is what moves the teacher;
- in the system message the teacher favours a "You're right," opening less than with the hint in the
  user's message (why the hint goes there: a teacher that reads it in the user's turn answers feedback);
- three top-K OPD steps on the wrong replies raise the policy's first token of the right answer, asked
  without a hint, against that of the wrong one; three steps from the control's teacher, whose hint does not
  carry the answer, do not.
bench/opd_signal.py measures the same and more (both placements, one step, the register's drift).

The tiny test model has random weights and cannot read a hint; this is why OPD is shown here and
on SmolLM2 in bench/learning.py, not on the tiny model.
"""
from __future__ import annotations

import statistics
import types

import pytest
import torch

from clawd.config.train import LossConfig, OptimizerConfig, TrainConfig
from clawd.samples import Sample
from clawd.scoring import judging, rules
from clawd.tokenizer import ChatTokenizer
from clawd.tools.sim import questions
from clawd.tools.sim.personas import PERSONAS
from clawd.trainer.worker.step import Trainer

PREFIX = "The answer is"
REGISTER = "You're right,"
K = 4
STEPS = 3  # top-K steps on the batch of wrong replies


def _sample(i: int, prompt: list[int], response: list[int], *, teacher: list[float] | None = None,
            rollout: list[float] | None = None, top: tuple | None = None) -> Sample:
    n = len(response)
    return Sample(sample_id=f"s{i}", mode="opd", session_id="s", turn_index=i, principal="p",
                  tokens=prompt + response, response_length=n, loss_mask=[1] * n,
                  rollout_logprobs=rollout or [-1.0] * n, temperature=1.0, reward=0.0,
                  teacher_logprobs=teacher, has_hint=teacher is not None, policy_version=0, created=0.0, scored=0.0,
                  top_ids=top and top[0], teacher_top_logprobs=top and top[1])


class Case:
    """One fact question: the plain prompt, a reply naming the answer and one naming a distractor, with the
    positions of those names among the reply's tokens, and a reply opening with "You're right,"."""

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
        lead = tok.encode(REGISTER)
        ids = tok.encode(f"{REGISTER} the answer is {item.distractors[0]}.")
        assert ids[:len(lead)] == lead
        self.replies["register"], self.spans["register"] = (REGISTER, ids + eos), range(len(lead))

    def hint(self, persona: str) -> str:
        """What the rules judge takes from the persona's correction of the wrong reply."""
        text = self.replies["wrong"][0]
        correction = PERSONAS[persona].correction(text, self.item)
        turn = types.SimpleNamespace(messages=self.messages + [{"role": "assistant", "content": text}])
        vote, hint = rules.rules_vote(turn, [{"role": "user", "content": correction}])
        assert vote == -1 and hint, (persona, correction)
        return hint

    def teacher_prompt(self, tok: ChatTokenizer, hint: str, placement: str = "system") -> list[int]:
        return tok.encode_chat(judging.teacher_messages(types.SimpleNamespace(messages=self.messages), hint, placement,
                                                        tok.default_system()), None)


def _span_mean(lps: list[float], span: range) -> float:
    return statistics.fmean(lps[i] for i in span)


@pytest.mark.slow  # SmolLM2 on CPU: about 60 s with the model converted
def test_a_hint_that_carries_the_answer_moves_the_teacher_and_top_k_steps_move_the_policy(default_model, tmp_path):
    model_dir, _ = default_model
    tok = ChatTokenizer(model_dir)
    # Facts whose correction names the answer as the reply does ("Canberra", not "eleven" for "11"); the bank's
    # listed ones, the items this was measured on (questions.MORE's came later).
    items = [it for it in questions.listed_facts() if it.distractors and it.answers[0] in it.fact][:8]
    assert len(items) == 8
    cases = [Case(tok, it) for it in items]
    trainer = Trainer(model_dir, tmp_path / "probe", TrainConfig(seed=0))  # the frozen initial weights

    def lps(prompts: list[list[int]], kind: str, model: Trainer = trainer) -> list[list[float]]:
        return model.logprobs([_sample(i, p, c.replies[kind][1]) for i, (p, c) in enumerate(zip(prompts, cases))])

    def gaps(prompts: list[list[int]], kind: str) -> list[float]:
        """Each case's OPD term (teacher − policy) averaged over the span of `kind`'s reply that names the answer."""
        return [_span_mean(t, c.spans[kind]) - _span_mean(b, c.spans[kind])
                for t, b, c in zip(lps(prompts, kind), base[kind], cases)]

    plain = [c.prompt for c in cases]
    told = [c.teacher_prompt(tok, c.hint("brief")) for c in cases]      # "... : the capital of Italy is Rome."
    untold = [c.teacher_prompt(tok, c.hint("curious")) for c in cases]  # "No, that's wrong." and no answer
    assert all(c.item.answers[0] in c.hint("brief") and c.item.answers[0] not in c.hint("curious") for c in cases)
    assert tok.default_system() and all(tok.decode(p).count(tok.default_system()) == 1 for p in told)

    base = {kind: lps(plain, kind) for kind in ("right", "wrong", "register")}
    gap = {(name, kind): statistics.fmean(gaps(prompts, kind))
           for name, prompts in (("told", told), ("untold", untold)) for kind in ("right", "wrong")}
    print("\nOPD term on the answer's tokens (teacher - policy, nats):", {k: round(v, 3) for k, v in gap.items()})
    prefers = {name: gap[name, "right"] - gap[name, "wrong"] for name in ("told", "untold")}
    print("teacher's preference for the right answer over the wrong one, beyond the policy's:", prefers)
    assert prefers["told"] > 0.5                    # the teacher prefers the right answer the hint names
    assert prefers["told"] > prefers["untold"] + 0.5  # the hint's information, not its being there
    in_user = [c.teacher_prompt(tok, c.hint("brief"), "user") for c in cases]
    register = {name: statistics.fmean(gaps(prompts, "register")) for name, prompts in (("system", told),
                                                                                           ("user", in_user))}
    print("OPD term on a \"You're right,\" opening, by placement:", register)
    assert register["system"] < register["user"] - 0.3  # measured 0.45 against 1.29

    # Three top-K steps on the wrong replies from the same weights, each trainer's teacher under its hint: the one that
    # names the answer, and the control's, which does not. One update a step (bench/opd_signal.py measures the
    # shipped two), each batch built once from the frozen initial weights, which both trainers start from.
    tops = [rows(trainer, c.prompt, c.replies["wrong"][1]).topk(K).indices for c in cases]
    moved = {}
    for name, prompts in (("told", told), ("untold", untold)):
        batch = []
        for i, (c, b, top) in enumerate(zip(cases, base["wrong"], tops)):
            ids = c.replies["wrong"][1]
            teacher = rows(trainer, prompts[i], ids)
            batch.append(_sample(i, c.prompt, ids, teacher=teacher.gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist(),
                                 rollout=b, top=(top.tolist(), teacher.gather(-1, top).tolist())))
        model = Trainer(model_dir, tmp_path / name, TrainConfig(
            seed=0, ppo_mini_batches=1, optimizer=OptimizerConfig(lr=2e-6), loss=LossConfig(opd_top_k=K)))
        for _ in range(STEPS):
            assert not model.train_step(batch, "opd")["skipped"]
        first = {kind: statistics.fmean(a[c.spans[kind][0]] - b[c.spans[kind][0]] for a, b, c in
                                        zip(lps(plain, kind, model), base[kind], cases)) for kind in ("right", "wrong")}
        moved[name] = first["right"] - first["wrong"]
        del model
    print(f"{STEPS} top-K steps: the right answer's first token against the wrong one's, without a hint: {moved}")
    assert moved["told"] > 0.1 and moved["untold"] < moved["told"] - 0.1  # measured +0.14 and -0.27


def rows(trainer: Trainer, prompt: list[int], reply: list[int]):
    """The model's T = 1 log-prob rows over the vocabulary at each reply position."""
    with torch.inference_mode():
        logits = trainer.model(torch.tensor([prompt + reply])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(reply)]
