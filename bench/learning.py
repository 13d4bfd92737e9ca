"""Learning, arm by arm: the same simulated users in rl, opd, combine and two negative controls, several seeds.

For each arm and seed, one fresh clawd (the CPU engine, the `rules` judge, the learner on)
and the simulated users of clawd/tools/sim (personas, multi-turn sessions of every style, tool
calls, the official `openai` client). The run goes in lockstep, one training step at a time:

    users talk until the learner has a batch  →  hold the users between requests  →
    the step trains and publishes  →  evaluate  →  release the users

Arms: the modes `rl`, `opd` and `combine`, and two negative controls, rl with the reward cut off
from the replies (`[learner] control`, clawd/learning/controls.py): `shuffled` trains on the
batch's rewards permuted across its replies, `zero` on rewards of 0. Same users, same judge, same
steps; a control must not move the metrics, so a gain the loop makes from any reward at all shows.

The evaluation set is held out and fixed: each persona's first --probes evaluation questions (never
asked in the sessions), each with its own sampling seed, never trained on (`X-Clawd-No-Train`), so
every step of every arm and seed sees the same prompts and the same random draws, and only the
weights differ. Per step: satisfaction, mean ± std over the seeds (min–max). Per arm: satisfied,
correct (the right answer is there; substance personas only) and styled before and after, the
paired change over all (seed, question) pairs with its 95% bootstrap interval (clawd/safety/paired.py),
and the degeneration metrics of the last evaluation's answers (clawd/safety/degeneration.py) with what
they flag against the first.

Profiles (`--model`): `tiny` (default), the random-weight test model, whose only learnable
preference is its length (the form-only persona `form:terse`, wanting 1–2 words, at 8 tokens a
reply: a random model knows no answers, so the substance personas would measure nothing here);
`smollm2`, the default model with the demo's personas, which want the right answer too (slow:
about a minute a step on 2 cores). In opd mode the rules judge's hint is the user's
correction and the teacher is the frozen reference shown it (`--teacher policy`: the policy itself): a
model that cannot read the hint (the tiny one) gives OPD nothing to learn from, which the table shows.
`--train KEY=VALUE` sets a [train] key for every run (the recipe's knobs: aggregation, ppo_mini_batches,
warmup_steps, ...), recorded in the JSON.

    .venv/bin/python bench/learning.py                  # tiny model, 5 arms × 3 seeds; writes bench/results/learning.json
    .venv/bin/python bench/learning.py --arms rl,shuffled --seeds 1 --steps 5
    .venv/bin/python bench/learning.py --model smollm2 --seeds 1 --out bench/results/learning-smollm2.json
    .venv/bin/python bench/learning.py --model smollm2 --arms rl --seeds 1 --lora   # writes learning-lora.json
    .venv/bin/python bench/learning.py --model smollm2 --lora --seeds 2 --jobs 2 --resume

Every finished run (one arm, one seed) is saved beside the output, in `<out>.runs/<arm>-<seed>.json` with the
settings it ran under; `--resume` reuses the saved runs whose settings match and runs only the rest, so an
interrupted SmolLM2 bench (about 25 minutes a run) loses one run, not hours. `--jobs 2` runs two at a time: a run
in lockstep keeps about one core busy (its engine, then its trainer, each on `--threads` 1), so two share 2 cores
with little waiting. The figures are learning, not speed, so running side by side changes none of them.

`--task compare`: no users and no judge; a verifiable task learnt from active rollouts alone (a generated
prompt set, its own rules, group advantages; clawd/tools/sim/verifiable.py), arms rl and shuffled, 128 held-out
questions before and after each run, the paired change of each arm and of rl beyond the control, and four
held-out questions per arm with both answers. It passes when rl's solve rate rose and rose beyond the control's
(both paired intervals above 0); writes bench/results/learning-compare.json. About 48 min for 2 seeds, --jobs 2.

`--principals`: adapters per principal against one shared adapter, two users who want opposite things
(bench/principals.py, its own flags and JSON).

`--lora` trains LoRA adapters instead of the whole model (`[train.lora] rank`, 16 or `--lora-rank N`; the
default alpha and target modules): the runs then take `--lr` as `[train.lora] lr` (default: ten times the profile's
full fine-tune lr, the ratio at which SmolLM2's LoRA learnt in the demo), and the JSON records `lora_rank`.

Targets: satisfaction after / before > 1 in every judged mode arm (every mode but opd on the tiny
model, which cannot read the hint), and no change in every control arm (the paired interval of
its satisfaction change includes 0). Exit status: 0 when every run was clean (no client error,
clawd exited 0) and every target was met; 1 when a run failed or a target was missed (or a ratio
could not be taken: satisfaction 0 before), or (a traceback) when it could not measure. The JSON
carries `provenance` (bench/provenance.py), `targets` and `pass`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from clawd.config.train import overlay  # noqa: E402
from clawd.safety import degeneration, paired  # noqa: E402
from clawd.tools.models import cached_tiny_model  # noqa: E402
from clawd.tools.sim.launch import Clawd  # noqa: E402
from clawd.tools.sim import verifiable  # noqa: E402
from clawd.tools.sim.personas import persona  # noqa: E402
from clawd.tools.sim.users import Users, rate  # noqa: E402
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)

RESULTS = ROOT / "bench" / "results"
# arm -> (scoring mode, [learner] control)
ARMS = {"rl": ("rl", "none"), "opd": ("opd", "none"), "combine": ("combine", "none"),
        "shuffled": ("rl", "shuffle_rewards"), "zero": ("rl", "zero_rewards")}
CONTROLS = ("shuffled", "zero")
# The control a mode arm must beat. `zero` is in no verdict: a zero advantage is a zero gradient, so it
# cannot move anything and says nothing; `shuffled` trains on real rewards cut from their replies.
CONTROL = "shuffled"
TARGET_RATIO = 1.0  # satisfaction after the last step / before the first, in every judged mode arm: above it
PROFILES = {
    "tiny": {"personas": "form:terse", "max_tokens": 8, "temperature": 1.0, "lr": 3e-2, "batch": 8, "steps": 20,
             "probes": 48, "concurrency": 4, "eval_every": 1, "arms": "rl,opd,combine,shuffled,zero"},
    # The style user (rewarded on one complete on-topic sentence alone) and the corrections user (the right
    # answer alone; its probes are its own questions reworded): what RL and OPD can each honestly teach.
    # A verifiable task learnt from active rollouts alone (clawd/tools/sim/verifiable.py): no users, no personas.
    "compare": {"personas": "", "eval_every": 10, "arms": "rl,shuffled",
                **{k: verifiable.DEFAULTS[k] for k in ("max_tokens", "temperature", "lr", "batch", "steps", "probes",
                                                       "concurrency")}},
    "smollm2": {"personas": "concise,corrector", "max_tokens": 48, "temperature": 0.7, "lr": 1e-5, "batch": 32,
                "steps": 6, "probes": 64, "concurrency": 8, "eval_every": 6, "arms": "rl,opd,combine,shuffled"},
}


def tiny_model() -> Path:
    """The tiny test model, built once into the git-ignored results folder."""
    return cached_tiny_model(RESULTS / "tiny-model")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny, smollm2, or a model directory (with the smollm2 profile)")
    ap.add_argument("--task", choices=verifiable.TASKS,
                    help="learn a verifiable task from active rollouts instead of users "
                         "(clawd/tools/sim/verifiable.py; SmolLM2)")
    ap.add_argument("--gate", action="store_true", help="with --task: the promotion gate on (16 shipped prompts)")
    ap.add_argument("--arms", help=f"comma-separated, of {', '.join(ARMS)} (default: the profile's)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 1..N per mode (default 3)")
    for name, kind in (("steps", int), ("batch", int), ("lr", float), ("max_tokens", int), ("probes", int),
                       ("temperature", float), ("concurrency", int), ("eval_every", int)):
        ap.add_argument("--" + name.replace("_", "-"), type=kind, help="default: the profile's")
    ap.add_argument("--personas", help="default: the profile's")
    ap.add_argument("--baseline", choices=("batch_mean", "none"), default="batch_mean",
                    help="[train.loss] reward_baseline (default batch_mean, clawd's)")
    ap.add_argument("--teacher", choices=("policy", "reference"), default="reference",
                    help="opd/combine teacher engine (default reference, clawd's: the frozen initial weights; "
                         "'policy' teaches the policy by itself)")
    ap.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                    help="a [train] setting for every run, VALUE in TOML (aggregation=\"token_sum\", "
                         "ppo_mini_batches=2); repeatable")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for clawd's engine and trainer")
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters ([train.lora] rank), lr as its lr")
    ap.add_argument("--lora-rank", type=int, default=None, help="the adapters' rank (default 16; implies --lora)")
    ap.add_argument("--out", help="default bench/results/learning.json (learning-lora.json with --lora)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1; 2 on 2 cores: a run keeps about one busy)")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the finished runs saved in <out>.runs/ whose settings match; run the rest")
    args = ap.parse_args(argv)
    if args.lora_rank is not None and args.lora_rank < 1:
        ap.error("--lora-rank must be at least 1")
    args.lora_rank = (args.lora_rank or 16) if args.lora or args.lora_rank else 0
    if args.lora_rank and args.lr is None:  # LoRA: on SmolLM2 5e-4, the rate its saved runs were measured at
        # (the demo's settings runs: 1e-4 learnt too little; the demo now runs 3e-4, which cost its guard
        # less), on the tiny model ten times the full rate
        args.lr = 3e-1 if args.model == "tiny" else 5e-4
    args.out = args.out or str(RESULTS / (f"learning-{args.task}.json" if args.task else
                                          "learning-lora.json" if args.lora_rank else "learning.json"))
    if args.task and args.model == "tiny":
        args.model = "smollm2"  # the task is SmolLM2's: the random-weight model answers nothing
    profile = PROFILES[args.task or ("tiny" if args.model == "tiny" else "smollm2")]
    for key in ("group", "rollout_temperature", "train_items"):  # the task's rollouts, as the demo runs them
        setattr(args, key, verifiable.DEFAULTS[key])
    args.gate = args.gate or verifiable.DEFAULTS["gate"]
    for key, value in profile.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.train_keys = {k.strip(): tomllib.loads(f"v = {v}")["v"] for k, _, v in (t.partition("=") for t in args.train)}
    except tomllib.TOMLDecodeError as exc:
        ap.error(f"--train: {exc} (strings are quoted: aggregation=\"token_sum\")")
    args.arm_list = [m.strip() for m in args.arms.split(",") if m.strip()]
    if not args.arm_list or any(m not in ARMS for m in args.arm_list):
        ap.error(f"--arms must name some of {', '.join(ARMS)}")
    if min(args.seeds, args.steps, args.batch, args.probes, args.concurrency, args.max_tokens, args.eval_every,
           args.jobs) < 1:
        ap.error("--seeds, --steps, --batch, --probes, --concurrency, --max-tokens, --eval-every and --jobs must be at least 1")
    try:
        args.persona_list = [persona(p.strip()) for p in args.personas.split(",") if p.strip()]
    except ValueError as exc:
        ap.error(str(exc))
    if args.model == "tiny":
        args.model_dir = tiny_model()
    else:
        args.model_dir = ROOT / "state/models/SmolLM2-135M-Instruct" if args.model == "smollm2" else Path(args.model)
        if not (args.model_dir / "config.json").exists():
            ap.error(f"no model at {args.model_dir} (make model)")
    return args


async def one_run(args: argparse.Namespace, arm: str, seed: int, run_dir: Path) -> dict:
    """One arm, one seed: [(steps, versions, satisfaction)] from step 0 to args.steps, the first and last
    evaluation's answers, plus the daemon's counts."""
    mode, control = ARMS[arm]
    clawd = Clawd(run_dir, {
        "model": {"path": str(args.model_dir), "max_tokens_cap": args.max_tokens},
        # As in the demo: room for the post-swap /model_info check on a busy CPU engine (clawd/tools/sim/demo.py).
        "engine": {"launch": "local", "cpu_threads": args.threads, "seed": seed, "connect_timeout": 30.0},
        "scoring": {"mode": mode},
        "judge": {"backend": "rules", "teacher_engine": args.teacher},
        "learner": {"enabled": True, "rollout_batch_size": args.batch, "min_batch_size": 1, "control": control},
        "train": overlay({"seed": seed, "checkpoint_every": 1000, "keep_versions": 2, "optimizer": {"lr": args.lr},
                          "loss": {"reward_baseline": args.baseline}, **lora_keys(args)}, args.train_keys),
        "sessions": {"session_idle_timeout": 120.0, "sweep_interval": 2.0},
    }, threads=args.threads)
    users: Users | None = None
    points: list[dict] = []
    try:
        await clawd.start()
        users = Users(clawd.url, args.persona_list, seed=seed, concurrency=args.concurrency,
                      max_tokens=args.max_tokens, temperature=args.temperature, keep_text=True)
        first = await evaluate(clawd, users, args)
        points.append(first)
        users.gate.clear()
        driving = asyncio.create_task(users.run())
        while points[-1]["steps"] < args.steps:
            done = points[-1]["steps"]
            users.gate.set()
            await until_batch_taken(clawd, users, driving, args.batch, done)
            users.gate.clear()
            await users.quiet()
            if not await clawd.settle(timeout=600):
                raise RuntimeError(f"the learner did not settle; clawd's log:\n{clawd.tail()}")
            steps = clawd.status()["learner"]["steps"]
            if steps % args.eval_every == 0 or steps >= args.steps:
                points.append(await evaluate(clawd, users, args))
            else:
                points.append({"steps": steps, "versions": [], "satisfied": None, "words": None})
        users.stop()
        await driving
        status = clawd.status()
    finally:
        if users is not None:
            await users.close()
        code = await clawd.stop()
    last = next(p for p in reversed(points) if p.get("replies"))
    answers = {"before": [r.to_json() for r in first.pop("replies")], "after": [r.to_json() for r in last.pop("replies")]}
    for p in points:
        p.pop("replies", None)
    return {"points": points, "answers": answers, "exit": code, "errors": users.errors,
            "sessions": len(users.sessions), "ended": users.ended, "scoring": status["scoring"],
            "learner": status["learner"]}


def plan(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(arm, seed) in the order they start: seed by seed, so an interrupted bench has whole seeds."""
    return [(arm, seed) for seed in range(1, args.seeds + 1) for arm in args.arm_list]


# What a saved run's figures depend on: a run is reused only under the same values of all of them.
SETTINGS = ("task", "gate", "model_dir", "personas", "steps", "batch", "lr", "lora_rank", "baseline", "teacher",
            "train_keys", "max_tokens", "temperature", "probes", "concurrency", "eval_every", "threads")


def settings(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in ((k, getattr(args, k)) for k in SETTINGS)}


def save_run(folder: Path, arm: str, seed: int, settings_: dict, run: dict) -> None:
    """One finished run, written whole (a temporary file renamed) with the settings it ran under."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{arm}-{seed}.json.tmp"
    tmp.write_text(json.dumps({"settings": settings_, "run": run}) + "\n")
    os.replace(tmp, folder / f"{arm}-{seed}.json")


def load_run(folder: Path, arm: str, seed: int, settings_: dict) -> dict | None:
    """A saved run of this arm and seed under the same settings (JSON's round trip applied to them), else None."""
    path = folder / f"{arm}-{seed}.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    if saved["settings"] != json.loads(json.dumps(settings_)):
        print(f"{arm:9s} seed {seed}: the saved run in {path} ran under other settings: running it again", flush=True)
        return None
    return saved["run"]


def curve(run: dict) -> str:
    return " ".join("-" if p["satisfied"] is None else f"{p['satisfied']:.2f}" for p in run["points"])


def lora_keys(args: argparse.Namespace) -> dict:
    """[train]'s LoRA table for a run: the rank, and the lr as LoRA's; none for a full fine-tune."""
    return {"lora": {"rank": args.lora_rank, "lr": args.lr}} if args.lora_rank else {}


async def until_batch_taken(clawd: Clawd, users: Users, driving: asyncio.Task, batch: int, done: int) -> None:
    """Poll until the learner has a full batch (or has taken it): the users then stop for the step."""
    while True:
        st = clawd.status()
        learner = st["learner"]
        if (st["queue"]["effective"] >= batch or learner["steps"] > done or learner["waiting_since"] is None):
            return
        if driving.done():
            driving.result()
            raise RuntimeError("the users stopped")
        if not clawd.alive():
            raise RuntimeError(f"clawd exited; its log:\n{clawd.tail()}")
        await asyncio.sleep(0.05)


async def evaluate(clawd: Clawd, users: Users, args: argparse.Namespace) -> dict:
    replies = await users.evaluate(args.probes, seed=1)  # the same evaluation set for every mode and seed
    steps = clawd.status()["learner"]["steps"]
    return {"steps": steps, "versions": sorted({r.version for r in replies if r.version is not None}),
            "satisfied": rate(replies), "correct": rate(replies, "correct"), "styled": rate(replies, "styled"),
            "words": statistics.fmean(r.words for r in replies), "replies": replies}


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def table(results: dict, arms: list[str], steps: int) -> str:
    """Satisfaction per step: mean ± std over seeds (min–max), one column per arm; then per arm its paired
    change, correctness and style, and degeneration."""
    head = f"{'step':>4}  " + "  ".join(f"{m:^25s}" for m in arms)
    lines = [head, "-" * len(head)]
    for s in range(steps + 1):
        if not any(str(s) in results[m]["by_step"] for m in arms):
            continue  # not evaluated after this step (--eval-every)
        cells = []
        for m in arms:
            row = results[m]["by_step"].get(str(s))
            cells.append(f"{'-':^25s}" if row is None else
                         f"{row['mean']:.2f} ± {row['std']:.2f} ({row['min']:.2f}–{row['max']:.2f})".center(25))
        lines.append(f"{s:>4}  " + "  ".join(cells))
    lines.append("")
    for m in arms:
        r = results[m]
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        lines.append(f"{m:9s} satisfaction {r['before']:.2f} -> {r['after']:.2f}: after / before {ratio}"
                     f"  (seeds: {', '.join(f'{a:.2f}' for a in r['after_by_seed'])})")
        for of, result in r["paired"].items():
            lines.append(f"{'':9s}   {paired.describe(of, result)}: {paired.verdict(result)}")
        d = r["degeneration"]
        lines.append(f"{'':9s}   answers: words {d['before']['mean_words']:.1f} -> {d['after']['mean_words']:.1f}, "
                     f"distinct-2 {_f(d['before']['distinct_2'])} -> {_f(d['after']['distinct_2'])}, one-word "
                     f"{_f(d['before']['one_word_share'])} -> {_f(d['after']['one_word_share'])}, repeated openings "
                     f"{_f(d['before']['repeated_opening_share'])} -> {_f(d['after']['repeated_opening_share'])}"
                     + (f"; flags: {'; '.join(d['flags'])}" if d["flags"] else "; no flags"))
    return "\n".join(lines)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def judged_arms(args: argparse.Namespace) -> list[str]:
    """The mode arms whose ratio is held to the target: opd only where the teacher can read the hint."""
    return [m for m in args.arm_list if m not in CONTROLS and (m != "opd" or args.model != "tiny")]


def summarise_arm(runs: dict[int, dict], steps: int) -> dict:
    """One arm over its seeds: satisfaction per step, before/after, the paired change over every
    (seed, question) pair, and the degeneration of the answers before and after."""
    by_step: dict[str, dict] = {}
    for s in range(steps + 1):
        vals = [p["satisfied"] for r in runs.values() for p in r["points"] if p["steps"] == s and p["satisfied"] is not None]
        if vals:
            by_step[str(s)] = spread(vals)
    before = statistics.fmean(r["points"][0]["satisfied"] for r in runs.values())
    after_by_seed = [next(p for p in reversed(r["points"]) if p["satisfied"] is not None)["satisfied"]
                     for r in runs.values()]
    after = statistics.fmean(after_by_seed)
    pairs = []
    for r in runs.values():
        later = {(a["persona"], a["question"]): a for a in r["answers"]["after"]}
        pairs += [(b, later[(b["persona"], b["question"])]) for b in r["answers"]["before"]
                  if (b["persona"], b["question"]) in later]
    compared = {of: paired.compare([b[of] for b, _ in pairs], [a[of] for _, a in pairs])
                for of in ("satisfied", "correct", "styled") if all(x[of] is not None for pair in pairs for x in pair)}
    per_persona = {p: {of: paired.compare([b[of] for b, _ in mine], [a[of] for _, a in mine])
                       for of in ("satisfied", "correct", "styled")
                       if all(x[of] is not None for pair in mine for x in pair)}
                   for p in sorted({b["persona"] for b, _ in pairs})
                   for mine in [[(b, a) for b, a in pairs if b["persona"] == p]]}
    ev_before = degeneration.summarise(b["text"] for b, _ in pairs)
    ev_after = degeneration.summarise(a["text"] for _, a in pairs)
    return {"by_step": by_step, "before": before, "after": after, "after_by_seed": after_by_seed,
            "ratio": after / before if before else None, "paired": compared, "by_persona": per_persona,
            "degeneration": {"before": ev_before, "after": ev_after, "flags": degeneration.flags(ev_after, ev_before)},
            "runs": runs}


def _changes(arm: dict, persona: str, of: str) -> dict[tuple, float]:
    """{(seed, question): after - before} of one arm's held-out answers for one persona."""
    out = {}
    for seed, run in arm["runs"].items():
        later = {(a["persona"], a["question"]): a for a in run["answers"]["after"]}
        for b in run["answers"]["before"]:
            a = later.get((b["persona"], b["question"]))
            if b["persona"] == persona and a is not None and b[of] is not None and a[of] is not None:
                out[(seed, b["question"])] = float(a[of]) - float(b[of])
    return out


def versus_control(results: dict, arm: str, persona: str, of: str) -> dict:
    """The arm's change minus the control's, paired by (seed, question): the same prompt and draw in both arms,
    so the interval is that of the difference the reward made (clawd.safety.paired over the per-question changes)."""
    mine, ctrl = _changes(results[arm], persona, of), _changes(results[CONTROL], persona, of)
    keys = sorted(mine.keys() & ctrl.keys())
    return paired.compare([ctrl[k] for k in keys], [mine[k] for k in keys])


# SmolLM2's verdicts: (arm, persona, measure) whose change must beat the shuffled control's. The style user's
# satisfaction is what RL can teach; the corrections user's correctness on its facts reworded, what OPD can.
VERSUS = (("rl", "concise", "satisfied"), ("combine", "concise", "satisfied"),
          ("opd", "corrector", "correct"), ("combine", "corrector", "correct"))


def versus_table(results: dict, args: argparse.Namespace) -> dict[str, dict]:
    """Every VERSUS comparison the run can make (its arm, the control and the persona were run)."""
    personas = {p.name for p in args.persona_list}
    return {f"{arm} vs {CONTROL}: {persona} {of}": versus_control(results, arm, persona, of)
            for arm, persona, of in VERSUS if arm in results and CONTROL in results and persona in personas}


def missed_targets(results: dict, args: argparse.Namespace) -> list[str]:
    if args.model != "tiny":  # SmolLM2: each judged arm beats the shuffled control where it can teach
        return [f"{name}: {paired.describe('change beyond the control', r)}"
                for name, r in versus_table(results, args).items() if paired.verdict(r) != "up"]
    out = [f"{m}: satisfaction after / before {results[m]['ratio']}, target > {TARGET_RATIO:g}"
           for m in judged_arms(args) if results[m]["ratio"] is None or results[m]["ratio"] <= TARGET_RATIO]
    out += [f"{m} (the control): satisfaction moved, {paired.describe('satisfied', results[m]['paired']['satisfied'])}"
            for m in args.arm_list if m == CONTROL and paired.verdict(results[m]["paired"]["satisfied"]) != "no change"]
    return out


async def main_async(args: argparse.Namespace) -> int:
    prov = provenance.stamp()
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="clawd-learn-"))  # short paths: the admin socket lives here
    tuning = f"LoRA rank {args.lora_rank}" if args.lora_rank else "full fine-tune"
    print(f"learning bench: {args.model_dir.name} ({tuning}), personas {args.personas}, {args.steps} steps of {args.batch} "
          f"samples, lr {args.lr:g}, reward baseline {args.baseline}, teacher {args.teacher}, "
          f"[train] {args.train_keys or 'defaults'}, max_tokens {args.max_tokens}, "
          f"T {args.temperature}, {args.probes} held-out probes/persona, arms {', '.join(args.arm_list)}, "
          f"seeds 1..{args.seeds}, {args.jobs} at a time, load {os.getloadavg()[0]:.1f}", flush=True)
    saved = Path(args.out).with_suffix(".runs")
    done: dict[tuple[str, int], dict] = {}
    limit = asyncio.Semaphore(args.jobs)

    async def run_one(arm: str, seed: int) -> None:
        if args.resume and (run := load_run(saved, arm, seed, settings(args))) is not None:
            done[arm, seed] = run
            print(f"{arm:9s} seed {seed}: {curve(run)}  (saved {run['provenance']['date']}, commit "
                  f"{str(run['provenance']['commit'])[:7]})", flush=True)
            return
        async with limit:
            t = time.monotonic()
            if args.task:
                run = await verifiable.one_run(args, ARMS[arm][1], seed, scratch / f"{arm}-{seed}")
            else:
                run = await one_run(args, arm, seed, scratch / f"{arm}-{seed}")
        run["provenance"] = provenance.stamp()
        save_run(saved, arm, seed, settings(args), run)
        done[arm, seed] = run
        print(f"{arm:9s} seed {seed}: {verifiable.curve(run) if args.task else curve(run)}  "
              f"({time.monotonic() - t:.0f} s, {run.get('sessions', 0)} sessions, {len(run['errors'])} errors, "
              f"exit {run['exit']})", flush=True)

    try:
        async with asyncio.TaskGroup() as runs:  # one run failing to measure cancels (and stops) the others
            for arm, seed in plan(args):
                runs.create_task(run_one(arm, seed))
    finally:
        shutil.rmtree(scratch)
    if args.task:
        return task_report(args, done, prov, started)
    results, failures = {}, []
    for arm in args.arm_list:
        for seed in range(1, args.seeds + 1):
            run = done[arm, seed]
            if run["exit"] != 0 or run["errors"]:
                failures.append(f"{arm} seed {seed}: exit {run['exit']}, errors {run['errors'][:3]}")
        results[arm] = summarise_arm({seed: done[arm, seed] for seed in range(1, args.seeds + 1)}, args.steps)
    print("\nsatisfaction on the held-out evaluation set after each step (mean ± std over seeds, min–max)\n")
    print(table(results, args.arm_list, args.steps))
    versus = versus_table(results, args)
    if versus:
        print("\neach arm's change beyond the shuffled control's, paired by (seed, question):")
        for name, r in versus.items():
            print(f"  {paired.describe(name, r)}: {paired.verdict(r)}")
    missed = missed_targets(results, args)
    out = {"provenance": prov, "model": str(args.model_dir), "profile": args.model, "personas": args.personas,
           "lora_rank": args.lora_rank, "steps": args.steps, "batch": args.batch, "lr": args.lr,
           "reward_baseline": args.baseline, "train": args.train_keys,
           "max_tokens": args.max_tokens, "temperature": args.temperature, "probes_per_persona": args.probes,
           "seeds": args.seeds, "jobs": args.jobs, "teacher": args.teacher, "wall_s": round(time.monotonic() - started, 1),
           "cores": os.cpu_count(), "arms": results, "versus_control": versus, "failures": failures,
           "targets": {"ratio_above": TARGET_RATIO, "judged_arms": judged_arms(args),
                       "controls_unchanged": [m for m in args.arm_list if m == CONTROL],
                       "versus_control": [f"{a} vs {CONTROL}: {p} {of}" for a, p, of in VERSUS]},
           "missed": missed, "pass": not failures and not missed}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{time.monotonic() - started:.0f} s; wrote {args.out}")
    for f in failures:
        print("FAILED:", f, file=sys.stderr)
    for m in missed:
        print("MISSED:", m, file=sys.stderr)
    targets = (f"beyond the {CONTROL} control in {', '.join(versus) or 'nothing'}" if args.model != "tiny" else
               f"after / before > {TARGET_RATIO:g} in {', '.join(judged_arms(args)) or 'no arm'}; no change in "
               f"{CONTROL if CONTROL in args.arm_list else 'no control'}")
    print(f"overall: {'PASS' if out['pass'] else 'FAIL'} ({targets})")
    return 0 if out["pass"] else 1


def task_report(args: argparse.Namespace, done: dict[tuple[str, int], dict], prov: dict, started: float) -> int:
    """The verifiable task's verdicts: each mode arm's held-out solve rate up, and beyond the shuffled control's."""
    seeds = range(1, args.seeds + 1)
    failures = [f"{arm} seed {seed}: exit {done[arm, seed]['exit']}" for arm in args.arm_list for seed in seeds
                if done[arm, seed]["exit"] != 0]
    results = {arm: verifiable.tally_arm({seed: done[arm, seed] for seed in seeds}) for arm in args.arm_list}
    versus = {f"{arm} vs {CONTROL}": verifiable.versus({s: done[arm, s] for s in seeds},
                                                       {s: done[CONTROL, s] for s in seeds})
              for arm in args.arm_list if arm not in CONTROLS and CONTROL in args.arm_list}
    print(f"\n{args.task}: held-out solve rate, paired over (seed, item), {args.probes} items x {args.seeds} seeds\n")
    for arm, r in results.items():
        print(f"{arm:9s} {paired.describe('solved', r['solved'])}: {paired.verdict(r['solved'])}")
        print(f"{'':9s} {paired.describe('one of the two numbers alone', r['form'])}; right when so "
              f"{r['right_when_formed']['before']:.2f} -> {r['right_when_formed']['after']:.2f}; words "
              f"{r['words']['before']:.1f} -> {r['words']['after']:.1f}")
        for seed, b in r["by_seed"].items():
            print(f"{'':9s} seed {seed}: {b['before']:.2f} -> {b['after']:.2f} ({b['steps']} steps, "
                  f"{b['trained']} samples; rollouts {b['rollout_solved']}/{b['rollout_answers']} solved, "
                  f"{b['dropped_agree']} of {b['groups']} groups agreed)")
    for name, r in versus.items():
        print(f"  {paired.describe(name, r)}: {paired.verdict(r)}")
    _, held = verifiable.train_and_held_out(args.train_items, args.probes)
    for arm in args.arm_list:
        print(f"\n{arm}, seed 1: four held-out questions, before and after\n{verifiable.examples(done[arm, 1], held)}")
    missed = [f"{name}: {paired.describe('change beyond the control', r)}" for name, r in versus.items()
              if paired.verdict(r) != "up"]
    missed += [f"{arm}: {paired.describe('solved', results[arm]['solved'])}" for arm in args.arm_list
               if arm not in CONTROLS and paired.verdict(results[arm]["solved"]) != "up"]
    out = {"provenance": prov, "task": args.task, "gate": args.gate, "model": str(args.model_dir), "steps": args.steps,
           "batch": args.batch,
           "lr": args.lr, "lora_rank": args.lora_rank, "group": args.group,
           "rollout_temperature": args.rollout_temperature,
           "max_tokens": args.max_tokens, "temperature": args.temperature, "probes": args.probes, "seeds": args.seeds,
           "jobs": args.jobs, "wall_s": round(time.monotonic() - started, 1), "arms": results, "versus_control": versus,
           "runs": {f"{arm}-{seed}": run for (arm, seed), run in done.items()}, "failures": failures,
           "missed": missed, "pass": not failures and not missed}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{time.monotonic() - started:.0f} s; wrote {args.out}")
    for line in failures + missed:
        print("FAILED:" if line in failures else "MISSED:", line, file=sys.stderr)
    print(f"overall: {'PASS' if out['pass'] else 'FAIL'} "
          f"(solved up in every mode arm, and beyond the {CONTROL} control)")
    return 0 if out["pass"] else 1


def main() -> int:
    if "--principals" in sys.argv[1:]:  # adapters per principal against one shared: bench/principals.py, its own flags
        import principals
        return principals.main([a for a in sys.argv[1:] if a != "--principals"])
    return asyncio.run(main_async(parse_args()))


if __name__ == "__main__":
    sys.exit(main())
