"""`make demo`: watch clawd learn from simulated users, live, then a plot and a summary.

    python -m clawd.tools.sim.demo [--minutes 19] [--concurrency 8] [--seed 1] [--model DIR] ...

It starts clawd as `make run` would, on the default model (SmolLM2-135M-Instruct on
clawd's CPU engine) with the `rules` judge and the learner on, on a fresh state
directory under --out. Then:

1. before: the held-out evaluation (clawd/tools/sim/evaluation.py), all served by version 0 and never
   trained on (`X-Clawd-No-Train`): --probes questions per persona, each sampled with its own seed and
   greedy, and the correctness guard, greedy answers to the held-out facts and definitions that were not
   chosen on the base model's answers (--guard);
2. learning: simulated users (clawd/tools/sim/users.py) talk to clawd until the time budget
   (or --steps) is reached, while the terminal shows the policy version, training
   steps, effective samples toward the next batch, hint acceptance, and per version
   the users' satisfaction split into correctness and style, the judge's mean reward,
   the mean length and distinct-2 of the answers;
3. after: the same evaluation on the last version, compared with v0 question by question (the change
   and its 95% paired bootstrap interval, clawd/safety/paired.py): the style users' satisfaction, sampled (the
   headline) and greedy, the guard's correctness (non-inferior when its lower bound is above -5
   points), how many of the users' thanks came from retries, and four questions drawn at random,
   v0's answer beside the last's;
4. `learning.png` (satisfaction, correctness, style and mean reward per policy version, and the
   evaluation set before and after with the paired intervals) and `summary.json` in --out, with
   every reply in `replies.jsonl` and clawd's log in `clawd.log`.

The users' satisfaction per version counts every answer served by that version, a retry after a
correction included: the live figures flatter the model (the "first try" share is fairer) and are
progress, not evidence. The evidence is the held-out evaluation, where the prompts and the random
draws are the same on both sides and the comparison is paired.

The default user, `concise` (clawd/tools/sim/personas.py), asks easy known-answer questions and wants
one complete sentence that names what was asked; it rewards that style alone, whatever the answer, so
correctness is measured beside it by the guard, never multiplied into the reward. SmolLM2 meets the
style on about a fifth of its sampled answers at T 0.7 and half its greedy ones. The defaults (rl mode,
LoRA adapters of rank 16 at lr 3e-4, 48 tokens a reply at T 0.7, gate and monitors on) take 16-18 min on 2
cores; the settings were chosen by the runs in bench/README.md. With the earlier form-only personas
(`--personas form:brief,form:plain`) a run took the evaluation set from 38% satisfied to 100% while
the answers collapsed ("The answer is a planet."): the documented example of a reward hack.
`--full` (`make demo DEMO_ARGS=--full`): a full fine-tune at lr 1e-5 (--lr); `--lora-rank N` another rank.
`--no-safety`: no gate, no monitors, no rollback checkpoints (learning as before them: the control).
`--train KEY=VALUE` sets any [train] key (loss.kl_coef=0.3).
`--task compare`: no users at all; a verifiable task learnt from active rollouts alone
(clawd/tools/sim/verifiable.py), about 13 min.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import random
import shutil
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from clawd.config.train import overlay
from clawd.safety import degeneration, paired
from clawd.tools.sim import evaluation, verifiable
from clawd.tools.sim.launch import Clawd
from clawd.tools.sim.personas import PERSONAS, persona
from clawd.tools.sim.progress import Display, Judged, clock, fmt, pct
from clawd.tools.sim.users import Reply, Users, by_persona, by_version, rate

DEFAULT_MODEL = "state/models/SmolLM2-135M-Instruct"
DEFAULT_PERSONAS = "concise"
EXAMPLES = 4  # evaluation questions shown before and after, drawn at random
EVAL_BATCH = 32  # evaluation answers asked at once (and the engine's batch): on 2 cores a batch of 32 answers
# ~1.7 a second where the users' 8 at once got ~1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m clawd.tools.sim.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"Hugging Face model directory (default {DEFAULT_MODEL})")
    ap.add_argument("--task", choices=verifiable.TASKS, help="learn a verifiable task from active rollouts alone, "
                    "no users (clawd/tools/sim/verifiable.py; --seed, --threads and --out apply)")
    ap.add_argument("--minutes", type=float, default=19.0, help="time budget, start to plot (default 19)")
    ap.add_argument("--steps", type=int, default=0, help="stop the users after this many training steps (0: time only)")
    ap.add_argument("--concurrency", type=int, default=8, help="simulated users at once (default 8)")
    ap.add_argument("--seed", type=int, default=1, help="seeds the sessions, the engine and the trainer (default 1)")
    ap.add_argument("--personas", default=DEFAULT_PERSONAS,
                    help=f"comma-separated, name[:param] (default {DEFAULT_PERSONAS}; known: {', '.join(PERSONAS)})")
    ap.add_argument("--mode", choices=("rl", "opd", "combine"), default="rl", help="clawd's scoring mode (default rl)")
    ap.add_argument("--teacher", choices=("policy", "reference"), default="reference",
                    help="teacher engine in opd/combine (default reference: the frozen initial weights, clawd's "
                         "default; 'policy' makes the policy its own teacher and warns)")
    ap.add_argument("--lr", type=float, default=None, help="learning rate (default 3e-4; with --full 1e-5)")
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters on the frozen base (the default)")
    ap.add_argument("--full", action="store_true", help="a full fine-tune instead of LoRA adapters")
    ap.add_argument("--no-safety", action="store_true", help="no gate, monitors or rollback checkpoints (a control)")
    ap.add_argument("--lora-rank", type=int, default=None, help="the adapters' rank (default 16; implies --lora)")
    ap.add_argument("--batch", type=int, default=8, help="effective samples per training step (default 8)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per reply (default 48)")
    ap.add_argument("--temperature", type=float, default=0.7, help="the users' sampling temperature (default 0.7)")
    ap.add_argument("--probes", type=int, default=64,
                    help="evaluation questions per persona, each sampled and greedy, before and after (default 64)")
    ap.add_argument("--guard", type=int, default=None,
                    help="held-out facts and definitions in the correctness guard, greedy (default all; 0: none)")
    ap.add_argument("--tool-share", type=float, default=0.15, help="share of sessions offered a tool (default 0.15)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for clawd's engine and trainer (default 1)")
    ap.add_argument("--idle-timeout", type=float, default=20.0, help="seconds before abandoned sessions close (default 20)")
    ap.add_argument("--out", default="state/demo", help="where the plot, summary and clawd's state go (default state/demo)")
    ap.add_argument("--keep-weights", action="store_true", help="keep the weights and checkpoints (~2.7 GB for SmolLM2)")
    ap.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                    help="a [train] setting, VALUE in TOML (loss.kl_coef=0.05); repeatable")
    args = ap.parse_args(argv)
    try:
        args.train_keys = {k.strip(): tomllib.loads(f"v = {v}")["v"] for k, _, v in (t.partition("=") for t in args.train)}
    except tomllib.TOMLDecodeError as exc:
        ap.error(f"--train: {exc} (strings are quoted: aggregation=\"token_sum\")")
    if args.lora_rank is not None and args.lora_rank < 1:
        ap.error("--lora-rank must be positive")
    if args.full and (args.lora or args.lora_rank):
        ap.error("--full and --lora/--lora-rank exclude each other")
    # LoRA rank 16 at lr 3e-4 by default: of the settings measured on the grown bank (bench/README.md, the
    # demo's settings) it lost least on the guard while raising the style well above its aim (run 8 against
    # run 7's 5e-4, same seed).
    args.lora_rank = 0 if args.full else (args.lora_rank or 16)
    args.lr = (3e-4 if args.lora_rank else 1e-5) if args.lr is None else args.lr
    args.tuning = f"LoRA rank {args.lora_rank}" if args.lora_rank else "full fine-tune"
    for name in ("minutes", "concurrency", "batch", "max_tokens", "probes", "lr", "idle_timeout"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    try:
        args.persona_list = [persona(p.strip()) for p in args.personas.split(",") if p.strip()]
    except ValueError as exc:
        ap.error(str(exc))
    if not args.persona_list:
        ap.error("no personas")
    if not (Path(args.model) / "config.json").exists():
        ap.error(f"no model at {args.model} (run `make model` first)")
    return args


def clawd_sections(args: argparse.Namespace, state_dir: Path) -> dict[str, dict[str, Any]]:
    """The daemon's config: `make run`'s defaults but for what the demo needs."""
    return {
        "model": {"path": str(Path(args.model).resolve()), "max_tokens_cap": args.max_tokens},
        # The check after a weight swap reads /model_info with a timeout of max(connect_timeout, 5 s); a CPU engine
        # re-prefilling the requests the swap retracted can take longer on 2 cores, and the swap is then redone.
        "engine": {"launch": "local", "cpu_threads": args.threads, "seed": args.seed, "connect_timeout": 30.0,
                   "max_batch_size": EVAL_BATCH},
        "scoring": {"mode": args.mode},
        "judge": {"backend": "rules", "teacher_engine": args.teacher},
        "learner": {"enabled": True, "rollout_batch_size": args.batch, "min_batch_size": 1},
        # A rollback returns to a checkpoint: one a version (a few seconds each for SmolLM2 and its optimizer).
        "train": overlay({"seed": args.seed, "checkpoint_every": 1000 if args.no_safety else 1, "keep_versions": 2,
                          "optimizer": {"lr": args.lr},
                          **({"lora": {"rank": args.lora_rank, "lr": args.lr}} if args.lora_rank else {})},
                         args.train_keys),
        "sessions": {"session_idle_timeout": args.idle_timeout, "sweep_interval": 2.0},
        "state": {"dir": str(state_dir)},
        # The gate on 16 of the prompts that ship, one short answer each (all 50 take minutes a version on 2 cores,
        # beside the users); monitors that judge a version once it served 12 answers (a demo version serves 15-30).
        **({"gate": {"enabled": False}, "monitors": {"enabled": False}, "versions": {"rollback_depth": 0}}
           if args.no_safety else {"gate": {"prompts": 16, "samples_per_prompt": 1, "max_tokens": 32},
                                   "monitors": {"min_replies": 12, "interval": 2.0}, "versions": {"rollback_depth": 2}}),
    }


async def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    out = Path(args.out)
    run_dir = out / "clawd"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # every demo starts from the base model
    out.mkdir(parents=True, exist_ok=True)
    clawd = Clawd(run_dir, clawd_sections(args, (run_dir / "state").resolve()), threads=args.threads)
    names = ", ".join(f"{p.name} ({p.preference})" for p in args.persona_list)
    print(f"clawd demo: {Path(args.model).name} on the CPU engine, {args.tuning}, mode {args.mode}, "
          f"rules judge, lr {args.lr:g}, batch {args.batch}, max_tokens {args.max_tokens}, {args.concurrency} users, "
          f"seed {args.seed}, budget {args.minutes:g} min\npersonas: {names}", flush=True)
    await clawd.start()
    print(f"{clock(time.monotonic() - started)}  clawd ready at {clawd.url} (log: {clawd.log_path})", flush=True)
    # One or two questions a session (and a retry after a correction) keep prompts, and training steps, short.
    users = Users(clawd.url, args.persona_list, seed=args.seed, concurrency=args.concurrency,
                  max_tokens=args.max_tokens, temperature=args.temperature, questions=(1, 2),
                  tool_share=args.tool_share, keep_text=True)
    judged = Judged(clawd)
    try:
        t = time.monotonic()
        guard = None if args.guard == 0 else evaluation.guard_persona(limit=args.guard)
        before = await evaluation.run(users, args.persona_list, args.probes, args.seed, guard, concurrency=EVAL_BATCH)
        eval_seconds = time.monotonic() - t
        print(f"{clock(time.monotonic() - started)}  before: {_evaluated(before)}", flush=True)

        display = Display(users, clawd, judged, started, args.mode)
        # The users stop early enough for the last evaluation and the plot to fit the budget: room for the step
        # training when they stop and one more on the samples already taken (a step is its training seconds,
        # then a publish and the gate's check).
        def deadline() -> float:
            step = ((display.status.get("learner") or {}).get("last_metrics") or {}).get("seconds", 30.0)
            return started + args.minutes * 60 - 1.2 * eval_seconds - 2 * step - 60

        def enough() -> bool:
            steps = (display.status.get("learner") or {}).get("steps", 0)
            return time.monotonic() > deadline() or (args.steps > 0 and steps >= args.steps)

        async def watch() -> None:
            while True:
                display.poll()
                if not clawd.alive():
                    raise RuntimeError(f"clawd exited ({clawd.proc.returncode}); its log:\n{clawd.tail()}")
                await asyncio.sleep(2)

        watcher = asyncio.create_task(watch())
        driving = asyncio.create_task(users.run(until=enough))
        done, _ = await asyncio.wait([watcher, driving], return_when=asyncio.FIRST_COMPLETED)
        if watcher in done:  # clawd went away: stop the users and say why
            users.stop()
            await driving
            watcher.result()
        watcher.cancel()
        # A step may still be training on the last samples: let it publish, so one version answers all probes.
        step_seconds = ((display.status.get("learner") or {}).get("last_metrics") or {}).get("seconds", 60.0)
        # Past the budget if need be: an evaluation that straddles a publish compares no one version with v0.
        if not await clawd.settle(2 * step_seconds + 90):
            print("\nthe learner was still busy: the evaluation may straddle a publish", flush=True)
        display.poll()
        display.line(force=True)
        display.done()

        after = await evaluation.run(users, args.persona_list, args.probes, args.seed, guard, concurrency=EVAL_BATCH)
        print(f"{clock(time.monotonic() - started)}  after: {_evaluated(after)}", flush=True)
        status = clawd.status()
        history = clawd.command("versions", last=10_000)["versions"]
    finally:
        await users.close()
        code = await clawd.stop()
    judged.refresh()
    if not args.keep_weights:  # a few GB of tensors; the records, the journal and the log stay
        for name in ("weights", "checkpoints"):
            if (clawd.state / name).exists():
                shutil.rmtree(clawd.state / name)
    summary = summarize(args, users, before, after, judged, status, code, time.monotonic() - started)
    summary["safety"] = {"events": display.events, "versions": [
        {"version": v["version"], "parent": v["parent"], "status": v["status"], "detail": v.get("detail"),
         "gate": v["gate"] and {k: v["gate"].get(k) for k in ("score", "diff", "low", "high", "passed")},
         "alarms": [a["detail"] for a in (v.get("monitors") or {}).get("alarms", [])]} for v in history]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out / "replies.jsonl", "w") as f:
        for r in before + users.replies + after:
            f.write(json.dumps(r.to_json()) + "\n")
    png = plot(summary, out / "learning.png")
    print_summary(summary, out, png)
    if code != 0:
        print(f"clawd exited with {code}; its log: {clawd.log_path}", file=sys.stderr)
        return 1
    return 0


def _sampled(replies: list[Reply]) -> list[Reply]:
    """The personas' sampled evaluation answers: what the users would get (not greedy, not the guard)."""
    return [r for r in replies if r.style == "sampled" and r.persona != evaluation.GUARD]


def _evaluated(replies: list[Reply]) -> str:
    sampled, guard = _sampled(replies), [r for r in replies if r.persona == evaluation.GUARD]
    line = (f"{len(replies)} evaluation answers on v{_versions(replies)}; sampled: satisfied {pct(rate(sampled))}, "
            f"correct {pct(rate(sampled, 'correct'))}, styled {pct(rate(sampled, 'styled'))}")
    greedy = [r for r in replies if r.style == "greedy" and r.persona != evaluation.GUARD]
    line += f"; greedy: satisfied {pct(rate(greedy))}"
    return line + (f"; guard: correct {pct(rate(guard, 'correct'))} of {len(guard)}" if guard else "")


def _versions(replies: list[Reply]) -> str:
    vs = sorted({r.version for r in replies if r.version is not None})
    return ",".join(map(str, vs)) if vs else "?"


def _fingerprint(guard) -> str:
    """The guard's questions in their order, hashed: its answers are keyed by position, so runs pooled
    together (bench/demo_seeds.py) must have asked the same ones."""
    text = "\n".join(i.question for i in guard.held_out)
    return f"{len(guard.held_out)}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def summarize(args: argparse.Namespace, users: Users, before: list[Reply], after: list[Reply], judged: Judged,
              status: dict, code: int, seconds: float) -> dict[str, Any]:
    versions = by_version(users.replies)
    rewards = judged.by_version()
    for v, row in versions.items():
        row["judge"] = rewards.get(v)
    b, a = by_persona(_sampled(before)), by_persona(_sampled(after))
    last = max(versions) if versions else 0  # the last version that answered the users
    personas = {}
    for p in args.persona_list:
        personas[p.name] = {
            "preference": p.preference,
            "before": {"version": 0, **b.get(p.name, {})},
            "after": {"version": _versions([r for r in after if r.persona == p.name]), **a.get(p.name, {})},
            "live_v0": versions.get(0, {}).get("personas", {}).get(p.name),
            "live_last": versions.get(last, {}).get("personas", {}).get(p.name),
        }
    learner = status.get("learner") or {}
    pairs = [(x, y) for x, y in evaluation.pairs(before, after) if x.style == "sampled" and x.persona != evaluation.GUARD]
    by_name = {p.name: p for p in args.persona_list}
    # Drawn at random (seeded) from the evaluation set, not chosen: what the answers read like.
    examples = [{"persona": b.persona, "question": by_name[b.persona].probe_question(b.question),
                 "before": b.text, "before_grade": _grade(b), "after": a.text, "after_grade": _grade(a),
                 "after_version": a.version}
                for b, a in random.Random(args.seed).sample(pairs, min(EXAMPLES, len(pairs)))]
    return {
        "model": str(args.model), "tuning": args.tuning, "lora_rank": args.lora_rank, "mode": args.mode,
        "judge": "rules", "seed": args.seed, "lr": args.lr, "train": args.train_keys,
        "batch": args.batch, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
        "temperature": args.temperature, "probes_per_persona": args.probes,
        "guard_questions": _fingerprint(evaluation.guard_persona(limit=args.guard)) if args.guard != 0 else None,
        "seconds": round(seconds, 1),
        "evaluation": (results := evaluation.compare(before, after)),
        "headline": evaluation.headline(results),
        "retries": evaluation.retry_share(users.replies),
        "satisfaction": {"before": rate(_sampled(before)), "after": rate(_sampled(after)), "after_version": _versions(after),
                         "live_v0": versions.get(0, {}).get("satisfied"), "live_last": versions.get(last, {}).get("satisfied"),
                         "live_last_version": last, "last_version": status["policy"]["version"]},
        "personas": personas,
        "versions": {str(v): row for v, row in versions.items()},
        "daemon": {"exit": code, "steps": learner.get("steps"), "publishes": learner.get("publishes"),
                   "failed_publishes": learner.get("failed_publishes"), "stale_dropped": learner.get("stale_dropped"),
                   "samples_trained": learner.get("samples_trained"), "samples_collected": status["queue"]["collected"],
                   "dropped_after_rollback": learner.get("dropped_after_rollback"),
                   "samples_waiting": status["queue"]["waiting"], "votes": status["scoring"]["votes"],
                   "excluded": status["scoring"]["excluded"], "hints_accepted": status["scoring"]["hints_accepted"]},
        "users": {"sessions": len(users.sessions), "ended": users.ended, "errors": users.errors[:20],
                  "styles": collections.Counter(p.style for p in users.sessions),
                  "tool_sessions": sum(p.tools for p in users.sessions),
                  "streamed_sessions": sum(p.stream for p in users.sessions),
                  "replies": collections.Counter(r.kind for r in users.replies)},
        "examples": examples,
        "degeneration": _degeneration(users, before, after),
    }


def _grade(r: Reply) -> str:
    if r.correct is None:
        return "satisfied" if r.satisfied else "not satisfied"
    return f"{'right' if r.correct else 'wrong'} answer, {'styled' if r.styled else 'not styled'}"


def _degeneration(users: Users, before: list[Reply], after: list[Reply]) -> dict[str, Any]:
    """Whether answers collapse while their form pleases: the evaluation answers before and after (the same
    held-out questions, a fair comparison) with the metrics that crossed a threshold, and the live replies per
    version (clawd.safety.degeneration; closing and tool-call replies are not answers and are left out)."""
    ev_before = degeneration.summarise(r.text for r in _sampled(before))
    ev_after = degeneration.summarise(r.text for r in _sampled(after))
    return {"evaluation": {"before": ev_before, "after": ev_after, "flags": degeneration.flags(ev_after, ev_before)},
            "live": {str(v): row for v, row in degeneration.by_version(r.to_json() for r in users.replies).items()}}


def plot(summary: dict[str, Any], path: Path) -> Path | None:
    """The PNG: left, satisfaction and the judge's mean reward per version; right, each persona before/after."""
    try:
        import matplotlib
    except ImportError:
        print("no PNG: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {int(v): row for v, row in summary["versions"].items()}
    vs = sorted(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    sizes = [12 + 2 * rows[v]["answers"] for v in vs]
    left.plot(vs, [rows[v]["satisfied"] for v in vs], color="tab:blue", lw=1.5)
    left.scatter(vs, [rows[v]["satisfied"] for v in vs], s=sizes, color="tab:blue", label="users satisfied (live, retries included)")
    for of, color in (("correct", "tab:purple"), ("styled", "tab:orange")):  # what satisfaction is made of
        cv = [v for v in vs if rows[v].get(of) is not None]
        if cv:
            left.plot(cv, [rows[v][of] for v in cv], color=color, lw=1, ls=":", marker=".", label=f"{of} (live)")
    gated = [(v["version"], v["gate"]["score"]) for v in summary.get("safety", {}).get("versions", [])
             if v.get("gate") and v["gate"].get("score") is not None]
    if gated:  # the gate's own check of each version (correct answers on its prompts): what a form hack erodes
        left.plot(*zip(*gated), color="tab:brown", lw=1.2, marker="s", ms=4, label="gate score (its checks)")
    left.set_xlabel("policy version")
    left.set_ylabel("satisfaction rate")
    left.set_ylim(-0.02, 1.02)
    sat = summary["satisfaction"]
    after_v = [int(x) for x in str(sat["after_version"]).split(",") if x.isdigit()]
    if sat["before"] is not None:
        left.scatter([0], [sat["before"]], marker="*", s=180, color="tab:green", zorder=5, label="evaluation set")
    if sat["after"] is not None and after_v:
        left.scatter([max(after_v)], [sat["after"]], marker="*", s=180, color="tab:green", zorder=5)
    reward_axis = left.twinx()
    rv = [v for v in vs if rows[v].get("judge")]
    reward_axis.plot(rv, [rows[v]["judge"]["reward"] for v in rv], color="tab:red", lw=1.2, ls="--",
                     marker="o", ms=3, label="judge's mean reward")
    reward_axis.set_ylim(-1.04, 1.04)
    reward_axis.set_ylabel("mean reward")
    for v in summary.get("safety", {}).get("versions", []):  # what the gate rejected and the monitors rolled back
        if v["status"] in ("rejected", "rolled_back"):
            left.axvspan(v["version"] - 0.4, v["version"] + 0.4, color="tab:red" if v["status"] == "rejected"
                         else "tab:gray", alpha=0.15, lw=0)
    handles = left.get_legend_handles_labels()[0] + reward_axis.get_legend_handles_labels()[0]
    left.legend(handles, [h.get_label() for h in handles], loc="lower right", fontsize=8)
    left.set_title(f"{Path(summary['model']).name}, {summary['tuning']}, mode {summary['mode']}, rules judge; dot size: answers")

    # Right: the held-out evaluation set, v0 and the last version on the same questions and seeds, with the
    # paired difference's 95% interval (clawd.safety.paired) drawn around the last version's bar.
    metrics = [m for m, r in summary["evaluation"].items() if r["n"]]  # a guard with no v0-right answer: no bar
    xs = range(len(metrics))
    ev = summary["evaluation"]
    right.bar([x - 0.2 for x in xs], [ev[m]["before"] for m in metrics], width=0.4, color="tab:gray", label="v0")
    after_bars = [ev[m]["after"] for m in metrics]
    errors = [[ev[m]["diff"] - ev[m]["low"] for m in metrics], [ev[m]["high"] - ev[m]["diff"] for m in metrics]]
    right.bar([x + 0.2 for x in xs], after_bars, width=0.4, color="tab:green", yerr=errors, capsize=4,
              label=f"v{summary['satisfaction']['after_version']} (bar: paired 95% interval of the change)")
    right.set_xticks(list(xs), [f"{m}\n{100 * ev[m]['diff']:+.0f} pts" for m in metrics], fontsize=8)
    right.set_ylim(0, 1.02)
    right.set_title("held-out evaluation set")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_summary(summary: dict[str, Any], out: Path, png: Path | None) -> None:
    sat = summary["satisfaction"]
    print(f"\nafter {clock(summary['seconds'])} ({summary['tuning']}): {summary['daemon']['steps']} training steps, "
          f"last version v{sat['last_version']}; {summary['users']['sessions']} sessions "
          f"{summary['users']['ended']}, {len(summary['users']['errors'])} errors")
    d = summary["daemon"]
    print(f"samples: {d['samples_collected']} collected, {d['samples_trained']} trained, {d['stale_dropped']} dropped "
          f"as stale, {d['dropped_after_rollback']} dropped by rollbacks, {d['samples_waiting']} still waiting")
    print(f"{'persona':12s} {'preference':24s} {'v0':>5s} {'v' + str(sat['after_version']):>6s}   (evaluation set)")
    for name, p in summary["personas"].items():
        print(f"{name:12s} {p['preference']:24s} {pct(p['before'].get('satisfied')):>5s} {pct(p['after'].get('satisfied')):>6s}")
    print(f"{'all':12s} {'':24s} {pct(sat['before']):>5s} {pct(sat['after']):>6s}")
    print(f"paired, v0 vs v{sat['after_version']} on the same held-out questions and seeds:")
    for of, result in summary["evaluation"].items():
        print(f"  {paired.describe(of, result)}: {paired.verdict(result)}")
    head, retries = summary["headline"], summary["retries"]
    print(f"style satisfaction up (sampled, interval above 0): {'yes' if head['style_up'] else 'no'}; guard "
          + ("not measured" if head["guard_non_inferior"] is None else
             f"non-inferior (correct, lower bound >= {evaluation.NON_INFERIOR:+.0%}, n {head['guard_n']}, "
             f"{head['guard_v0_right']} right at v0): "
             f"{'yes' if head['guard_non_inferior'] else 'no'}"))
    print(f"live thanks from retries (the correction already in context): {retries['from_retries']} of "
          f"{retries['thanked']}")
    print(f"live: satisfied {pct(sat['live_v0'])} of answers served by v0, {pct(sat['live_last'])} by "
          f"v{sat['live_last_version']}")
    deg = summary["degeneration"]["evaluation"]
    print("evaluation answers, v0 -> last: " + ", ".join(
        f"{name} {fmt(deg['before'][key])} -> {fmt(deg['after'][key])}"
        for name, key in (("words", "mean_words"), ("distinct-2", "distinct_2"), ("one-word", "one_word_share"),
                          ("repeated openings", "repeated_opening_share"))))
    for flag in deg["flags"]:
        print(f"  degeneration: {flag}")
    safety = summary.get("safety") or {}
    statuses = collections.Counter(v["status"] for v in safety.get("versions", []))
    print(f"gate and monitors: {len(safety.get('events', []))} decision(s); versions "
          + (", ".join(f"{n} {s}" for s, n in sorted(statuses.items())) or "none"))
    for event in safety.get("events", []):
        print(f"  {_one_line(event, 200)}")
    print(f"\n{len(summary['examples'])} evaluation questions drawn at random (seed {summary['seed']}):")
    for ex in summary["examples"]:
        width = len(f"v{ex['after_version']}:")
        print(f"{ex['persona']}: {ex['question']}\n  {'v0:':<{width}} {_one_line(ex['before'])}  [{ex['before_grade']}]\n"
              f"  v{ex['after_version']}: {_one_line(ex['after'])}  [{ex['after_grade']}]")
    print(f"wrote {out / 'summary.json'}" + (f", {png}" if png else ""))


def _one_line(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.task:
            return asyncio.run(verifiable.demo(Path(args.model), Path(args.out), seed=args.seed, threads=args.threads))
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
