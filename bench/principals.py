"""Adapters per principal against one shared adapter: two users who want opposite things, on SmolLM2, LoRA.

`bench/learning.py --principals` runs this (so does `.venv/bin/python bench/principals.py`). Two simulated users
(clawd/tools/sim), each a principal of their own (the `user` field, `[auth] trust_user_field`): `form:brief:8`
wants an answer of fewer than eight words, `form:plain` a real answer of eight words or more without a list (the
opposite lengths); the rules judge reads their thanks and corrections (rl). Two arms, the same seeds, users,
judge and budget (gate and monitors off in both):

  shared         `[train] adapters = "shared"`: one LoRA adapter learns from both.
  per_principal  `[train] adapters = "per_principal"`, `adapter_min_samples = 1`: each user's samples train an
                 adapter of their own (docs/ARCHITECTURE.md §15), served to them alone.

Per arm and seed, one fresh clawd (the CPU engine and trainer, one thread each): each user's held-out probes
(`--probes` questions of their own pool never asked in the sessions, fixed sampling seeds, T `--temperature`,
never trained, asked as that user so that they are served that user's adapter) before any step; the users talk
until the learners together have published `--steps` versions from batches of `--batch` samples (a batch whose
rewards all agree changes nothing and does not count), learning then paused by the operator's command so that no
arm trains more (a step already under way lands first: `busy` in status); the probes again. Reported per user and arm: satisfaction
before and after, the paired change over (seed, question) with its 95 % bootstrap interval
(clawd/safety/paired.py), and per_principal's change beyond shared's, paired the same way (the same probes and
draws in both arms). Target: per_principal beats shared for both users (that interval above 0).

Exit status: 0 when every run was clean and the target met; 1 when a run failed or the target was missed. The
JSON (bench/results/learning-principals.json) carries `provenance`, each run's answers, and `pass`.

    .venv/bin/python bench/learning.py --principals                 # ~50 min on 2 cores (--jobs 2)
    .venv/bin/python bench/principals.py --seeds 1 --steps 2 --probes 8 --batch 8   # a quick look
    .venv/bin/python bench/principals.py --same-questions --seeds 4 --resume --out F  # seeds F lacks, beside its own
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)
from clawd.safety import paired  # noqa: E402
from clawd.tools.sim.launch import Clawd  # noqa: E402
from clawd.tools.sim.personas import TIPS, form_only, persona  # noqa: E402
from clawd.tools.sim.users import Users  # noqa: E402

RESULTS = ROOT / "bench" / "results"
ARMS = ("shared", "per_principal")
PERSONAS = ("form:brief:8", "form:plain")  # fewer than 8 words (facts); 8 words or more, without a list (tips)
# --same-questions: both ask the same tips questions (and are probed on the same held-out ones), so that one
# adapter cannot satisfy both by telling their topics apart: `lists` wants a list, `plain` none (both 8+ words).
# SmolLM2 lists ~40 % of its tips answers: a preference it meets often enough to learn either way.
SAME = (form_only("lists", "a_list", None, TIPS, min_words=8), persona("form:plain"))


def users_of(args) -> list:
    return list(SAME) if args.same_questions else [persona(p) for p in PERSONAS]


def principal_of(p) -> str:
    return f"user-{p.name}"


def busy(status: dict) -> bool:
    """A learner (the shared adapter's or a principal's) has a step, promotion or rollback under way."""
    own = (status.get("lineages") or {}).get("principals") or {}
    return status["learner"]["busy"] or any(p["busy"] for p in own.values())


def total(status: dict, what: str) -> int:
    """`what` ("steps", "publishes") of every learner: the shared adapter's and each principal's own."""
    own = (status.get("lineages") or {}).get("principals") or {}
    return status["learner"][what] + sum(p[what] for p in own.values())


async def one_run(args, arm: str, seed: int, run_dir: Path) -> dict:
    clawd = Clawd(run_dir, {
        "model": {"path": str(args.model_dir), "max_tokens_cap": args.max_tokens},
        "engine": {"launch": "local", "cpu_threads": 1, "seed": seed, "connect_timeout": 30.0},
        "auth": {"trust_user_field": True},
        "scoring": {"mode": "rl"}, "judge": {"backend": "rules"},
        "learner": {"enabled": True, "rollout_batch_size": args.batch, "min_batch_size": 1},
        "train": {"seed": seed, "checkpoint_every": 1000, "keep_versions": 2, "adapters": arm,
                  "adapter_min_samples": 1, "max_adapters": 4, "lora": {"rank": args.rank, "lr": args.lr}},
        "sessions": {"session_idle_timeout": 120.0, "sweep_interval": 2.0},
        "gate": {"enabled": False}, "monitors": {"enabled": False},
    }, threads=1)
    users = None
    try:
        await clawd.start()
        users = Users(clawd.url, users_of(args), seed=seed, concurrency=args.concurrency,
                      max_tokens=args.max_tokens, temperature=args.temperature, keep_text=True,
                      principal_of=principal_of)
        before = await users.evaluate(args.probes, seed=1)
        driving = asyncio.create_task(users.run())
        deadline = time.monotonic() + 60 * args.max_minutes  # a user whose rewards always agree never publishes
        while total(clawd.status(), "publishes") < args.steps and time.monotonic() < deadline:
            if driving.done():
                driving.result()
                raise RuntimeError("the users stopped")
            await asyncio.sleep(0.5)
        clawd.command("pause")  # no arm trains beyond the budget: what is queued stays queued
        users.stop()
        await driving
        settle = time.monotonic() + 600  # a step under way lands before the probes: they see one version each
        while busy(status := clawd.status()) and time.monotonic() < settle:
            await asyncio.sleep(0.5)
        after = await users.evaluate(args.probes, seed=1)
    finally:
        if users is not None:
            await users.close()
        code = await clawd.stop()
    return {"before": [r.to_json() for r in before], "after": [r.to_json() for r in after], "exit": code,
            "errors": users.errors if users else None, "steps": total(status, "steps"),
            "publishes": total(status, "publishes"), "learner": status["learner"], "lineages": status.get("lineages"),
            "policy": status["policy"]["version"], "settled": not busy(status)}


def satisfied(run: dict, when: str, who: str) -> dict[int, bool]:
    """question -> satisfied, of one persona's probes."""
    return {r["question"]: bool(r["satisfied"]) for r in run[when] if r["persona"] == who}


def report(runs: dict[tuple[str, int], dict], seeds: list[int], names: list[str]) -> dict:
    """Per user: each arm's paired change (before -> after, by (seed, question)), and per_principal's change
    beyond shared's, paired the same way."""
    out: dict = {}
    for who in names:
        row: dict = {}
        changes: dict[str, dict] = {}
        for arm in ARMS:
            keys, before, after = [], [], []
            for s in seeds:
                was, now = satisfied(runs[(arm, s)], "before", who), satisfied(runs[(arm, s)], "after", who)
                for q in sorted(set(was) & set(now)):
                    keys.append((s, q))
                    before.append(was[q])
                    after.append(now[q])
            row[arm] = paired.compare(before, after)
            changes[arm] = {k: float(a) - float(b) for k, b, a in zip(keys, before, after)}
        common = sorted(set(changes["shared"]) & set(changes["per_principal"]))
        row["per_principal_beyond_shared"] = paired.compare([changes["shared"][k] for k in common],
                                                            [changes["per_principal"][k] for k in common])
        out[who] = row
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="training steps of every learner together (default 8)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--probes", type=int, default=64, help="held-out probes per user (default 64)")
    ap.add_argument("--lr", type=float, default=5e-4, help="[train.lora] lr (default 5e-4, the learning bench's)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2)")
    ap.add_argument("--max-minutes", type=float, default=40, help="the users stop after this long, budget met or not")
    ap.add_argument("--same-questions", action="store_true",
                    help="both users ask the same questions (a list vs none, on the tips pool): no topic to tell them by")
    ap.add_argument("--resume", action="store_true",
                    help="reuse the runs --out already holds whose settings match; run only the missing seeds")
    ap.add_argument("--model", default=str(ROOT / "state/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--out", default=str(RESULTS / "learning-principals.json"))
    args = ap.parse_args(argv)
    args.model_dir = Path(args.model)
    if not (args.model_dir / "config.json").exists():
        ap.error(f"no model at {args.model_dir} (make model)")
    if min(args.seeds, args.steps, args.batch, args.probes, args.jobs) < 1:
        ap.error("--seeds, --steps, --batch, --probes and --jobs must be at least 1")
    return args


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def _iv(d: dict) -> str:
    return (f"{100 * d['diff']:+.0f} pts [{100 * d['low']:+.0f}, {100 * d['high']:+.0f}] ({d['n']} pairs; "
            f"{d['better']} up, {d['worse']} down)") if d["n"] else "-"


# Settings a saved run must share with this invocation for --resume to reuse it.
_RUN_SETTINGS = ("steps", "batch", "probes", "lr", "rank", "max_tokens", "temperature", "concurrency", "max_minutes",
                 "same_questions", "model")


def settings_of(args: dict) -> dict:
    return {k: args.get(k) for k in _RUN_SETTINGS}


def saved_runs(args) -> dict[tuple[str, int], dict]:
    """--resume: the runs of --out made under the same settings, by (arm, seed)."""
    path = Path(args.out)
    if not (args.resume and path.exists()):
        return {}
    old = json.loads(path.read_text())
    if settings_of(old["args"]) != settings_of({k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}):
        print(f"--resume: {path} was made under other settings; running every seed", flush=True)
        return {}
    runs = {}
    for key, run in old["runs"].items():
        arm, _, seed = key.rpartition("-")
        runs[(arm, int(seed))] = run
    return runs


async def run_all(args) -> dict:
    seeds = list(range(1, args.seeds + 1))
    work = Path(tempfile.mkdtemp(prefix="principals-", dir=RESULTS))
    limit = asyncio.Semaphore(args.jobs)
    runs = {key: run for key, run in saved_runs(args).items() if key[1] in seeds}
    if runs:
        print(f"--resume: reusing {', '.join(f'{a} seed {s}' for a, s in sorted(runs))}", flush=True)

    async def job(arm: str, seed: int) -> None:
        async with limit:
            t0 = time.monotonic()
            runs[(arm, seed)] = await one_run(args, arm, seed, work / f"{arm}-{seed}")
            runs[(arm, seed)]["wall_s"] = round(time.monotonic() - t0, 1)
            run = runs[(arm, seed)]
            print(f"{arm} seed {seed}: {run['publishes']} versions from {run['steps']} steps in {run['wall_s']:.0f} s",
                  flush=True)
    await asyncio.gather(*(job(a, s) for s in seeds for a in ARMS if (a, s) not in runs))
    return {"runs": {f"{a}-{s}": r for (a, s), r in runs.items()}, "work": str(work),
            "report": report(runs, seeds, [p.name for p in users_of(args)])}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    res: dict = {"provenance": provenance.stamp(), "model": str(args.model_dir), "cores": os.cpu_count(),
                 "personas": [p.name for p in users_of(args)], "args": {k: str(v) if isinstance(v, Path) else v
                                                      for k, v in vars(args).items()}}
    t0 = time.monotonic()
    res.update(asyncio.run(run_all(args)))
    res["wall_s"] = round(time.monotonic() - t0, 1)
    clean = all(r["exit"] == 0 and not r["errors"] for r in res["runs"].values())
    met = all(paired.verdict(row["per_principal_beyond_shared"]) == "up" for row in res["report"].values())
    res["pass"] = clean and met
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"\n{Path(args.model_dir).name}, LoRA rank {args.rank} at {args.lr:g}, {args.steps} versions from batches of "
          f"{args.batch}, {args.seeds} seed(s), {args.probes} probes per user\n")
    print(f"{'user':<8} {'arm':<14} {'before':>7} {'after':>7}  change (95 %)")
    for who, row in res["report"].items():
        for arm in ARMS:
            r = row[arm]
            print(f"{who:<8} {arm:<14} {_pct(r['before']):>7} {_pct(r['after']):>7}  {_iv(r)}")
        print(f"{who:<8} {'per_principal beyond shared':<31}  {_iv(row['per_principal_beyond_shared'])}")
    print(f"\n{'PASS' if res['pass'] else 'FAIL'} in {res['wall_s']:.0f} s; wrote {args.out}")
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
