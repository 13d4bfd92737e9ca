"""Where OPD's signal lands on SmolLM2 with a frozen teacher: the hint's placement, token-level against top-K.

The chain is clawd's own: a simulated user's correction of a wrong answer (clawd/tools/sim/personas.py,
the `brief` persona names the right answer) → the rules judge's hint (clawd/scoring/rules.py) → the
teacher prompt → the frozen model's T = 1 log-probs of the reply under it → the OPD term → one trainer step
(clawd/trainer/worker/step.py). Fact questions of the bank with a distractor; each reply is "<opening> the answer
is X." with three openings: none ("The answer is X."), and two of the register a teacher shown feedback
may prefer ("You're right, …", "I'm sorry, …").

Measured, averaged over the questions (nats; teacher − policy at T = 1, where the teacher is the frozen
initial model shown the hint and the policy the same model without it):
  gap.<placement>.answer_wrong / answer_right   on the tokens naming X (wrong: the distractor)
  gap.<placement>.opening                       on "The answer is" of the plain reply
  gap.<placement>.register_<opening>            on the register opening's tokens
  with placement "user" (the hint appended to the user's message: clawd's teacher_messages),
  "system" (the same block as the system message, in place of the template's default one) and
  "system_default" (the block after the template's default system text).
  topk_mass.<where>   the top-K advantage's Σ_k |A_k| per position (k = 4, clip 1), answer against opening.
Then one opd step from the same weights on the wrong replies (token-level, then top-K), and the change in
the policy's log-probs without a hint: of the wrong answer, the right answer, and each register opening, and
of the first token of each name after "The answer is" (right_over_wrong: the right one's change minus the
wrong one's, the step's preference where the two compete).

    .venv/bin/python bench/opd_signal.py [--items 8] [--steps 4] [--lr 2e-6] [--out bench/results/opd-signal.json]

Targets (`met` in the JSON): under the daemon's placement ("system_default", judge.hint_placement = "system")
the teacher prefers the right answer over the wrong one by more than 0.5 nats, and favours the register
opening less than with the hint in the user's message; the top-K steps raise the right answer's first token
against the wrong one's (right_over_wrong > 0) and by more than the token-level steps do. Exits 1 when a target
is missed, 2 when it could not measure (no model, too few questions). About 4 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from provenance import stamp  # noqa: E402  (bench/ is on sys.path when run as a script)

from clawd.samples import Sample  # noqa: E402
from clawd.scoring import judging, rules  # noqa: E402
from clawd.tokenizer import ChatTokenizer  # noqa: E402
from clawd.tools.sim import questions  # noqa: E402
from clawd.tools.sim.personas import PERSONAS  # noqa: E402
from clawd.config.train import LossConfig, OptimizerConfig, TrainConfig

K = 4
OPENINGS = {"plain": "", "right": "You're right, ", "sorry": "I'm sorry, "}


class Case:
    """One fact question: its plain prompt, the hint from the brief persona's correction of the wrong reply, and
    replies "<opening>the answer is X." for X right and wrong, with the token spans of the opening and of X."""

    def __init__(self, tok: ChatTokenizer, item: questions.Item):
        self.item = item
        self.messages = [{"role": "user", "content": item.question}]
        self.prompt = tok.encode_chat(self.messages, None)
        eos = tok.encode("<|im_end|>")
        self.replies: dict[tuple[str, str], tuple[list[int], range, range]] = {}
        for opening, lead in OPENINGS.items():
            head_text = f"{lead}the answer is" if lead else "The answer is"
            head = tok.encode(head_text)
            lead_ids = tok.encode(lead.rstrip()) if lead else []
            for kind, name in (("right", item.answers[0]), ("wrong", item.distractors[0])):
                ids = tok.encode(f"{head_text} {name}.")
                if ids[:len(head)] != head:
                    raise ValueError(f"{head_text!r} does not tokenise as a prefix of the reply")
                self.replies[opening, kind] = (ids + eos, range(len(lead_ids)) if lead else range(len(head)),
                                               range(len(head), len(ids) - 1))
        wrong = f"The answer is {item.distractors[0]}."
        correction = PERSONAS["brief"].correction(wrong, item)
        turn = types.SimpleNamespace(messages=self.messages + [{"role": "assistant", "content": wrong}])
        vote, self.hint = rules.rules_vote(turn, [{"role": "user", "content": correction}])
        if vote != -1 or not self.hint:
            raise ValueError(f"no hint from {correction!r}")

    def teacher_prompt(self, tok: ChatTokenizer, placement: str) -> list[int]:
        if placement == "user":
            return tok.encode_chat(judging.teacher_messages(types.SimpleNamespace(messages=self.messages), self.hint),
                                   None)
        block = f"{judging.HINT_MARKER}\n{judging.teacher_hint(self.hint)}"
        if placement == "system_default":  # after the template's own default system text, which stays
            block = f"{default_system(tok)}\n\n{block}"
        return tok.encode_chat([{"role": "system", "content": block}, *self.messages], None)


def default_system(tok: ChatTokenizer) -> str:
    """The system text a ChatML template adds when the conversation has none (SmolLM2's names itself)."""
    text = tok.decode(tok.encode_chat([{"role": "user", "content": "x"}], None))
    return text.split("system\n", 1)[1].split("\nuser\n", 1)[0] if text.startswith("system\n") else ""


def rows(model, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """log_softmax(logits) at T = 1 at each reply position: [R, V]."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + reply])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(reply)]


def at(r: torch.Tensor, ids: list[int]) -> list[float]:
    return r.gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


def span_mean(values: list[float], span: range) -> float:
    return statistics.fmean(values[i] for i in span)


def sample(i: int, prompt: list[int], reply: list[int], teacher: list[float], top=None, *,
           rollout: list[float]) -> Sample:
    """An opd sample of `reply` as the policy itself sampled it (rollout: its own log-probs, so TIS weighs 1)."""
    n = len(reply)
    return Sample(sample_id=f"s{i}", mode="opd", session_id="s", turn_index=i, principal="p", tokens=prompt + reply,
                  response_length=n, loss_mask=[1] * n, rollout_logprobs=rollout, temperature=1.0, reward=0.0,
                  teacher_logprobs=teacher, has_hint=True, policy_version=0, created=0.0, scored=0.0,
                  top_ids=top and top[0], teacher_top_logprobs=top and top[1])


def measure(model_dir: Path, n_items: int, lr: float, state: Path, n_steps: int = 1) -> dict:
    from clawd.trainer.worker.step import Trainer  # torch and transformers: loaded once the arguments are good
    tok = ChatTokenizer(model_dir)
    items = [it for it in questions.listed_facts() if it.distractors and it.answers[0] in it.fact][:n_items]
    if len(items) < n_items:
        print(f"only {len(items)} fact questions with a distractor; asked for {n_items}", file=sys.stderr)
        raise SystemExit(2)
    cases = [Case(tok, it) for it in items]
    model = Trainer(model_dir, state / "probe", TrainConfig(seed=0)).model  # the frozen initial weights

    gap: dict[str, dict[str, float]] = {}
    topk_mass: dict[str, float] = {}
    for placement in ("user", "system", "system_default"):
        acc: dict[str, list[float]] = {}
        for c in cases:
            told = c.teacher_prompt(tok, placement)
            for (opening, kind), (ids, lead, name) in c.replies.items():
                policy, teacher = rows(model, c.prompt, ids), rows(model, told, ids)
                g = [t - p for t, p in zip(at(teacher, ids), at(policy, ids))]
                if opening == "plain":
                    acc.setdefault(f"answer_{kind}", []).append(span_mean(g, name))
                    if kind == "wrong":
                        acc.setdefault("opening", []).append(span_mean(g, lead))
                        if placement == "user":  # the top-K advantage's mass where it lands
                            top = policy.topk(K).indices
                            old, tea = policy.gather(-1, top), teacher.gather(-1, top)
                            mass = (torch.softmax(old, -1) * (tea - old).clamp(-1, 1)).abs().sum(-1).tolist()
                            topk_mass.setdefault("answer", []).append(span_mean(mass, name))
                            topk_mass.setdefault("opening", []).append(span_mean(mass, lead))
                elif kind == "wrong":
                    acc.setdefault(f"register_{opening}", []).append(span_mean(g, lead))
        gap[placement] = {k: round(statistics.fmean(v), 4) for k, v in acc.items()}
    topk_mass = {k: round(statistics.fmean(v), 4) for k, v in topk_mass.items()}

    def logprob_spans(trainer) -> dict[str, float]:
        """The policy's mean log-prob, without a hint, of each span the step should or should not move, and of the
        first token of each name after the same "The answer is" (where right and wrong compete directly)."""
        out: dict[str, list[float]] = {}
        for c in cases:
            for kind in ("right", "wrong"):
                ids, _, name = c.replies["plain", kind]
                out.setdefault(f"{kind}_first", []).append(at(rows(trainer.model, c.prompt, ids), ids)[name[0]])
            for key, (opening, kind, part) in {"wrong_answer": ("plain", "wrong", 2), "right_answer": ("plain", "right", 2),
                                                "register_right": ("right", "wrong", 1),
                                                "register_sorry": ("sorry", "wrong", 1)}.items():
                ids, lead, name = c.replies[opening, kind]
                lps = at(rows(trainer.model, c.prompt, ids), ids)
                out.setdefault(key, []).append(span_mean(lps, (lead, name)[part - 1]))
        return {k: statistics.fmean(v) for k, v in out.items()}

    steps = {}
    for placement, form in [(p, f) for p in ("user", "system_default") for f in ("token", "topk")]:
        trainer = Trainer(model_dir, state / f"{placement}-{form}", TrainConfig(
            seed=0, optimizer=OptimizerConfig(lr=lr),
            loss=LossConfig(opd_clip=1.0, opd_top_k=K if form == "topk" else 0)))
        before = logprob_spans(trainer)
        batch = []
        for i, c in enumerate(cases):  # the frozen teacher: the initial weights, scored before any step
            ids = c.replies["plain", "wrong"][0]
            policy, teacher = rows(trainer.model, c.prompt, ids), rows(trainer.model, c.teacher_prompt(tok, placement), ids)
            top = None
            if form == "topk":
                top_ids = policy.topk(K).indices
                top = (top_ids.tolist(), teacher.gather(-1, top_ids).tolist())
            batch.append(sample(i, c.prompt, ids, at(teacher, ids), top, rollout=at(policy, ids)))
        for _ in range(n_steps):  # the same batch again: lp_old is each step's own, the teacher stays
            metrics = trainer.train_step(batch, "opd")
        after = logprob_spans(trainer)
        moved = {k: round(after[k] - before[k], 5) for k in before}
        steps[f"{placement}/{form}"] = {"moved": moved, "right_over_wrong": round(moved["right_first"] - moved["wrong_first"], 5),
                       "grad_norm": round(metrics["grad_norm"], 4), "skipped": metrics["skipped"]}
    return {"items": len(cases), "k": K, "lr": lr, "steps": n_steps, "gap": gap, "topk_mass": topk_mass,
            "one_step": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps on the batch (default 4)")
    ap.add_argument("--model", type=Path, default=ROOT / "state/models/SmolLM2-135M-Instruct")
    ap.add_argument("--state", type=Path, default=ROOT / "bench/results/opd-signal-state")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/opd-signal.json")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"no model at {args.model}: run `make model` first", file=sys.stderr)
        return 2
    if args.items < 1 or args.steps < 1:
        print("--items and --steps must be at least 1", file=sys.stderr)
        return 2
    started, provenance = time.monotonic(), stamp()  # the code measured is the code loaded now
    result = {**measure(args.model, args.items, args.lr, args.state, args.steps), "provenance": provenance,
              "wall_s": round(time.monotonic() - started, 1)}
    gap, step = result["gap"], result["one_step"]
    result["met"] = {
        "teacher prefers the right answer": gap["system_default"]["answer_right"] - gap["system_default"]["answer_wrong"] > 0.5,
        "less register than in the user's message": gap["system_default"]["register_right"] < gap["user"]["register_right"],
        "top-K raises right over wrong": step["system_default/topk"]["right_over_wrong"] > 0,
        "top-K beats token-level": step["system_default/topk"]["right_over_wrong"] > step["system_default/token"]["right_over_wrong"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if all(result["met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
