"""A verifiable task learnt by active rollouts alone: no users, the rollout source's prompt set, group advantages.

`make demo DEMO_ARGS="--task compare"` runs it once (`demo`, below); `bench/learning.py --task compare` runs it
in arms over seeds and gives the verdicts (this module holds the task, one run and the summaries). One fresh
clawd per (arm, seed): the CPU engine, the learner on, no chat traffic; the rollout source draws B prompts × N
answers from a generated prompt set, scores each answer by the set's rules and trains on the group advantages
(clawd/rollouts). Arms: `rl`, and the `shuffled` control (the batch's advantages permuted across its answers:
the same loop with the reward cut off from the answers).

The task, `compare`: "Which number is larger, 47 or 81? Reply with the number only." (larger or smaller, two
different two-digit numbers). SmolLM2-135M-Instruct answers 14 % of the held-out questions right at T 0.7 (by
the rule above): it chats, argues, writes both numbers, or names the wrong one. A reply that names only one of
the two numbers would be right half of the time by chance: the evaluation reports the share of answers that name
exactly one of the two numbers (the form) beside the solve rate, and the solve rate among those (the comparison),
so a gain in form alone shows as such.

The held-out items are drawn from seeds at and above clawd.rollouts.source.EVAL_SEED_BASE and never share a
question with the training set (checked); each is asked once, through clawd's public chat API with the official
`openai` client, with its own sampling seed (the same for every arm and version), never trained on
(`X-Clawd-No-Train`). Before: version 0, with the rollouts paused; after: the rollouts paused once the learner
has taken `--steps` steps and has settled.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import statistics
from pathlib import Path
from typing import Callable

import openai

from clawd.rollouts.source import EVAL_SEED_BASE
from clawd.rollouts.tasks import local_score, parse_task
from clawd.safety import paired
from clawd.tools.sim.launch import Clawd

TASKS = ("compare",)
# The task's settings, chosen by the runs in bench/README.md: what the demo and the learning bench run. A full
# fine-tune; groups of 8 answers at T 1.0 drawn from 4,000 training questions, 32 samples a step; no gate, no
# monitors (the shipped evaluation set asks other things).
DEFAULTS = {"steps": 10, "batch": 32, "lr": 2e-5, "lora_rank": 0, "max_tokens": 24, "temperature": 0.7,
            "probes": 128, "concurrency": 8, "group": 8, "rollout_temperature": 1.0, "train_items": 4000,
            "gate": False}
_INT = re.compile(r"(?<![\d.])\d+(?!\d|\.\d)")  # whole numbers; "42." is 42


def compare_item(seed: int) -> dict:
    """One `compare` question from `seed`, in the rollout set's format (clawd/rollouts/tasks.py)."""
    rng = random.Random(seed)
    a, b = rng.sample(range(10, 100), 2)
    which = rng.choice(("larger", "smaller"))
    answer = max(a, b) if which == "larger" else min(a, b)
    other = a + b - answer
    # The other number must not be written: "74 is larger than 86" ends on the answer, 86, and says the opposite.
    return {"id": f"compare-{seed}", "numbers": [a, b],
            "messages": [{"role": "user",
                          "content": f"Which number is {which}, {a} or {b}? Reply with the number only."}],
            "check": {"number": answer, "not_contains": [str(other)]}}


def train_and_held_out(train: int, held: int) -> tuple[list[dict], list[dict]]:
    """`train` items from seeds 0.., `held` from EVAL_SEED_BASE..; a held-out question never in the training set."""
    train_items = [compare_item(s) for s in range(train)]
    asked = {item["messages"][0]["content"] for item in train_items}
    held_items: list[dict] = []
    seed = EVAL_SEED_BASE
    while len(held_items) < held:
        item = compare_item(seed)
        seed += 1
        if item["messages"][0]["content"] not in asked:
            held_items.append(item)
    return train_items, held_items


def write_set(items: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps({k: item[k] for k in ("id", "messages", "check")}) + "\n" for item in items))


def score_reply(item: dict, text: str) -> dict:
    """solved: the rollouts' own rule (clawd.rollouts.tasks.local_score: the final number is the answer, and
    the other number is not written); form: the reply writes exactly one number, one of the two asked about."""
    named = {int(n) for n in _INT.findall(text)}
    task = parse_task({k: item[k] for k in ("id", "messages", "check")}, item["id"])
    return {"solved": local_score(task, text) == 1.0,
            "form": len(named) == 1 and named <= set(item["numbers"])}


async def ask_held_out(url: str, held: list[dict], *, temperature: float, max_tokens: int,
                       concurrency: int) -> list[dict]:
    """Each held-out item once, seed i for item i: [{id, text, version, solved, form}] in item order."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int, item: dict) -> dict:
        async with limit:
            reply = await client.chat.completions.create(
                model="clawd", messages=item["messages"], temperature=temperature, max_tokens=max_tokens, seed=i,
                user="bench-eval", extra_headers={"X-Clawd-No-Train": "1", "X-Turn-Type": "side"})
        text = reply.choices[0].message.content or ""
        return {"id": item["id"], "text": text, "version": reply.system_fingerprint, **score_reply(item, text)}

    try:
        return list(await asyncio.gather(*(one(i, item) for i, item in enumerate(held))))
    finally:
        await client.close()


def sections(args, control: str, seed: int, set_path: Path) -> dict:
    """The daemon's config for one run: the learner fed by the rollouts alone."""
    train = {"seed": seed, "checkpoint_every": 1000, "keep_versions": 2}
    if args.lora_rank:
        train["lora"] = {"rank": args.lora_rank, "lr": args.lr}
    else:
        train["optimizer"] = {"lr": args.lr}
    return {
        "model": {"path": str(Path(args.model_dir).resolve()), "max_tokens_cap": max(64, args.max_tokens)},
        "engine": {"launch": "local", "cpu_threads": args.threads, "seed": seed, "connect_timeout": 30.0,
                   "max_batch_size": 8},
        "scoring": {"mode": "rl"}, "judge": {"backend": "rules"},
        "learner": {"enabled": True, "rollout_batch_size": args.batch, "min_batch_size": args.batch,
                    "control": control},
        "train": train,
        # With the gate: the demo's, on 16 of the shipped prompts (general questions, none of this task's), so a
        # version that learnt the task at the cost of everything else is held back. No monitors: they read live
        # replies, and there are none.
        "gate": {"enabled": True, "prompts": 16, "samples_per_prompt": 1, "max_tokens": 32} if args.gate
        else {"enabled": False},
        "monitors": {"enabled": False},
        "rollouts": {"enabled": True, "set": str(set_path), "prompts_per_batch": 4,
                     "samples_per_prompt": args.group, "temperature": args.rollout_temperature,
                     "max_new_tokens": args.max_tokens, "max_turns": 1, "concurrency": 8,
                     "backlog": 2 * args.batch},
    }


async def one_run(args, control: str, seed: int, run_dir: Path, echo: Callable[[str], None] | None = None) -> dict:
    """One arm, one seed: the held-out answers before and after `args.steps` steps, and the daemon's counts;
    `echo` is told of each step as it lands (the demo's progress)."""
    run_dir = run_dir.resolve()  # the daemon runs in its own directory: every path it is given is absolute
    run_dir.mkdir(parents=True, exist_ok=True)
    train_items, held = train_and_held_out(args.train_items, args.probes)
    set_path = run_dir / "set.jsonl"
    write_set(train_items, set_path)
    clawd = Clawd(run_dir / "clawd", sections(args, control, seed, set_path), threads=args.threads)
    progress: list[dict] = []
    try:
        await clawd.start()
        clawd.command("rollouts", action="pause")
        if clawd.status()["learner"]["steps"]:
            raise RuntimeError("the learner stepped before the first evaluation")
        ev = dict(temperature=args.temperature, max_tokens=args.max_tokens, concurrency=args.concurrency)
        before = await ask_held_out(clawd.url, held, **ev)
        clawd.command("rollouts", action="resume")
        while (status := clawd.status())["learner"]["steps"] < args.steps:
            r = status["rollouts"]
            point = {"steps": status["learner"]["steps"], "answers": r["answers"], "solved": r["solved"]}
            if not progress or point != progress[-1]:
                if echo is not None and progress and point["steps"] != progress[-1]["steps"]:
                    echo(f"step {point['steps']}: the rollouts so far solved {point['solved']} of {point['answers']}")
                progress.append(point)
            await asyncio.sleep(5)
        clawd.command("rollouts", action="pause")
        if not await clawd.settle(timeout=900):
            raise RuntimeError(f"the learner did not settle; clawd's log:\n{clawd.tail()}")
        after = await ask_held_out(clawd.url, held, **ev)
        status = clawd.status()
    finally:
        code = await clawd.stop()
    return {"before": before, "after": after, "progress": progress, "exit": code, "errors": [],
            "learner": status["learner"], "rollouts": status["rollouts"]}


# ---- the arms over their seeds --------------------------------------------------------------------------------

def tally_arm(runs: dict[int, dict]) -> dict:
    """One arm over its seeds: solved and form before and after, paired over every (seed, item)."""
    pairs = [(b, a) for run in runs.values() for b, a in zip(run["before"], run["after"])]
    out = {of: paired.compare([b[of] for b, _ in pairs], [a[of] for _, a in pairs]) for of in ("solved", "form")}
    out["words"] = {"before": statistics.fmean(len(b["text"].split()) for b, _ in pairs),
                    "after": statistics.fmean(len(a["text"].split()) for _, a in pairs)}
    out["right_when_formed"] = {  # the comparison itself: of the answers naming one of the two numbers, the right one
        side: (sum(x["solved"] for x in xs if x["form"]) / max(1, sum(x["form"] for x in xs)))
        for side, xs in (("before", [b for b, _ in pairs]), ("after", [a for _, a in pairs]))}
    out["by_seed"] = {seed: {"before": statistics.fmean(x["solved"] for x in run["before"]),
                             "after": statistics.fmean(x["solved"] for x in run["after"]),
                             "steps": run["learner"]["steps"], "trained": run["learner"]["samples_trained"],
                             "rollout_solved": run["rollouts"]["solved"], "rollout_answers": run["rollouts"]["answers"],
                             "dropped_agree": run["rollouts"]["dropped_agree"], "groups": run["rollouts"]["groups"]}
                      for seed, run in runs.items()}
    return out


def versus(runs: dict[int, dict], control: dict[int, dict]) -> dict:
    """The arm's change in solved minus the control's, paired by (seed, item): the same question and sampling
    seed in both arms, so the interval is that of the difference the reward made."""
    mine, theirs = [], []
    for seed in sorted(runs.keys() & control.keys()):
        for (b, a), (cb, ca) in zip(zip(runs[seed]["before"], runs[seed]["after"]),
                                    zip(control[seed]["before"], control[seed]["after"])):
            mine.append(float(a["solved"]) - float(b["solved"]))
            theirs.append(float(ca["solved"]) - float(cb["solved"]))
    return paired.compare(theirs, mine)


def examples(run: dict, held: list[dict], k: int = 4, seed: int = 0) -> str:
    """`k` held-out items drawn at random: the question, then the answer before and after, each graded."""
    lines = []
    for i in sorted(random.Random(seed).sample(range(len(held)), k)):
        b, a = run["before"][i], run["after"][i]
        lines.append(f"  {held[i]['messages'][0]['content']}")
        for side, x in (("before", b), ("after ", a)):
            lines.append(f"    {side} [{'solved' if x['solved'] else 'wrong '}] {x['text'][:160]!r}")
    return "\n".join(lines)


def curve(run: dict) -> str:
    return (f"solved {statistics.fmean(x['solved'] for x in run['before']):.2f} -> "
            f"{statistics.fmean(x['solved'] for x in run['after']):.2f} after {run['learner']['steps']} steps")


async def demo(model_dir: Path, out: Path, *, seed: int = 1, threads: int = 1) -> int:
    """`make demo DEMO_ARGS="--task compare"`: one rl run with the task's defaults, its held-out evaluation before
    and after, paired, and four questions drawn at random; summary-compare.json in `out`. Exit 0 when the solve
    rate rose (the paired interval above 0). The shuffled control is bench/learning.py's."""
    args = argparse.Namespace(model_dir=model_dir, threads=threads, **DEFAULTS)
    run_dir = out / "compare"
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"compare: {args.steps} steps of {args.batch} samples from active rollouts alone (groups of {args.group} "
          f"at T {args.rollout_temperature:g}); {args.probes} held-out questions before and after", flush=True)
    run = await one_run(args, "none", seed, run_dir, echo=lambda line: print(line, flush=True))
    result = tally_arm({seed: run})
    _, held = train_and_held_out(args.train_items, args.probes)
    print(f"\n{paired.describe('held-out solved', result['solved'])}: {paired.verdict(result['solved'])}")
    print(f"{paired.describe('one of the two numbers alone', result['form'])}; right when so "
          f"{result['right_when_formed']['before']:.2f} -> {result['right_when_formed']['after']:.2f}; words "
          f"{result['words']['before']:.1f} -> {result['words']['after']:.1f}")
    print(f"\nfour held-out questions drawn at random, before and after:\n{examples(run, held)}")
    (out / "summary-compare.json").write_text(json.dumps({"settings": {k: v for k, v in DEFAULTS.items()},
                                                          "seed": seed, "result": result, "run": run}, indent=1) + "\n")
    print(f"wrote {out / 'summary-compare.json'}")
    return 0 if paired.verdict(result["solved"]) == "up" and run["exit"] == 0 else 1
