"""`make demo`'s defaults on several seeds, pooled: is the style gain real and the correctness guard non-inferior
beyond one run's power?

One demo run (clawd/tools/sim/demo.py: SmolLM2, LoRA, the `concise` style user, gate and monitors on, ~17 min
on 2 cores) measures the guard (greedy answers to 346 held-out facts and definitions, before and after) with a
95 % interval about ±4 points wide: a true cost of 2 points may not show a lower bound above -5 in one run. This
runs the demo once per seed, one after another (a run uses both cores), each into `--work`/seed-N, and pools
the paired changes of every (seed, question): the style users' satisfaction (sampled, the users' answers) and
the guard's correctness. The same question in several seeds is one cluster (what one seed loses, others are
likelier to: the base model's answer to it is the same in all), so the pooled interval resamples questions
(clawd.safety.paired.compare with clusters); the interval that takes every pair as independent is printed beside
it. Targets, as the demo's: style up (the clustered interval above 0) and the guard non-inferior (its clustered
lower bound >= -5 points). Each seed's own verdicts are printed too. A seed whose last version answered every
probe word for word as version 0 did (its monitors rolled every step back, or no step landed) learnt nothing
whose cost could be judged: it is printed and left out of the pooled figures (it would pull the guard's change
toward 0).

Exit status: 0 when every run finished and both targets are met; 1 when a target is missed; 2 when a run failed
or the runs cannot be pooled (their settings differ). The JSON (bench/results/demo-seeds.json) carries
`provenance`, each seed's headline and `pass`.

    .venv/bin/python bench/demo_seeds.py --seeds 1,2,3,4            # ~70 min on 2 cores
    .venv/bin/python bench/demo_seeds.py --seeds 1,2,3,4 --resume   # reuses the seeds --work holds
    .venv/bin/python bench/demo_seeds.py --seeds 1,2 -- --minutes 10  # demo options after --
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)
from clawd.safety import paired  # noqa: E402
from clawd.tools.sim.evaluation import GUARD, NON_INFERIOR  # noqa: E402

RESULTS = ROOT / "bench" / "results"
# What must agree between runs pooled together (a summary's own keys; the seed is what differs).
SETTINGS = ("model", "tuning", "lora_rank", "mode", "judge", "lr", "train", "batch", "max_tokens", "concurrency",
            "temperature", "probes_per_persona", "guard_questions")


def run_seed(seed: int, out: Path, demo_args: list[str]) -> int:
    cmd = [sys.executable, "-m", "clawd.tools.sim.demo", "--seed", str(seed), "--out", str(out), *demo_args]
    print(f"seed {seed}: {' '.join(cmd[1:])}", flush=True)
    with open(out.with_suffix(".log"), "w") as log:
        return subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode


def probes(out: Path) -> tuple[dict, dict]:
    """(before, after): the evaluation answers of version 0 and of the last version, by (persona, style,
    question)."""
    replies = [json.loads(line) for line in (out / "replies.jsonl").read_text().splitlines() if line.strip()]
    mine = [r for r in replies if r["kind"] == "probe"]
    last = max(r["version"] for r in mine)
    before = {(r["persona"], r["style"], r["question"]): r for r in mine if r["version"] == 0}
    after = {(r["persona"], r["style"], r["question"]): r for r in mine if r["version"] == last and last != 0}
    return before, after


def pooled(runs: dict[int, tuple[dict, dict]], which, of: str) -> dict:
    """The paired change in `of` over every seed's answers that `which(key)` selects, clustered by question."""
    b, a, clusters = [], [], []
    for seed, (before, after) in runs.items():
        for key, x in before.items():
            y = after.get(key)
            if y is None or not which(key) or x.get(of) is None or y.get(of) is None:
                continue
            b.append(x[of])
            a.append(y[of])
            clusters.append(key)
    return {"clustered": paired.compare(b, a, clusters=clusters), "independent": paired.compare(b, a)}


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    ours, demo = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2,3,4", help="the demo's --seed of each run (default 1,2,3,4)")
    ap.add_argument("--work", default=str(ROOT / "state" / "demo-seeds"), help="where each seed's run goes")
    ap.add_argument("--resume", action="store_true", help="reuse a seed whose run --work holds (summary.json)")
    ap.add_argument("--out", default=str(RESULTS / "demo-seeds.json"))
    args = ap.parse_args(ours)
    args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    return args, demo


def _iv(r: dict) -> str:
    return f"{100 * r['diff']:+.1f} [{100 * r['low']:+.1f}, {100 * r['high']:+.1f}] (n {r['n']})"


def main(argv: list[str] | None = None) -> int:
    args, demo_args = parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"provenance": provenance.stamp(), "seeds": args.seed_list, "demo_args": demo_args}
    t0 = time.monotonic()
    summaries, runs = {}, {}
    for seed in args.seed_list:
        out = work / f"seed-{seed}"
        if not (args.resume and (out / "summary.json").exists()):
            code = run_seed(seed, out, demo_args)
            if code != 0 or not (out / "summary.json").exists():
                print(f"seed {seed}: the demo exited {code}; its log: {out.with_suffix('.log')}", file=sys.stderr)
                return 2
        summaries[seed] = json.loads((out / "summary.json").read_text())
        runs[seed] = probes(out)
    settings = {seed: {k: s.get(k) for k in SETTINGS} for seed, s in summaries.items()}
    if len({json.dumps(v, sort_keys=True) for v in settings.values()}) > 1:
        print(f"cannot pool runs of different settings: {json.dumps(settings, indent=1)}", file=sys.stderr)
        return 2
    res["settings"] = next(iter(settings.values()))
    res["per_seed"] = {seed: {"headline": s["headline"], "style": s["evaluation"].get("satisfied (sampled)"),
                              "guard": s["evaluation"].get("guard: correct"), "versions": len(s.get("versions", {}))}
                       for seed, s in summaries.items()}
    # No answer of the last version's differs from v0's (a probe it did not answer: no step landed).
    res["learnt_nothing"] = [seed for seed, (before, after) in runs.items()
                             if all(after.get(key, r)["text"] == r["text"] for key, r in before.items())]
    learnt = {seed: run for seed, run in runs.items() if seed not in res["learnt_nothing"]}
    res["style"] = pooled(learnt, lambda key: key[0] != GUARD and key[1] == "sampled", "satisfied")
    res["guard"] = pooled(learnt, lambda key: key[0] == GUARD, "correct")
    style, guard = res["style"]["clustered"], res["guard"]["clustered"]
    res["targets"] = {"style_up": bool(style["n"]) and style["low"] > 0,
                      "guard_non_inferior": bool(guard["n"]) and guard["low"] >= NON_INFERIOR}
    res["pass"] = all(res["targets"].values())
    res["wall_s"] = round(time.monotonic() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"\n{'seed':<6} {'style (sampled), points':<34} {'guard: correct, points':<34} verdicts")
    for seed, row in res["per_seed"].items():
        head = row["headline"]
        print(f"{seed:<6} {_iv(row['style']):<34} {_iv(row['guard']):<34} style up {head['style_up']}, "
              f"guard non-inferior {head['guard_non_inferior']}")
    if res["learnt_nothing"]:
        print(f"left out of the pooled figures, every answer as version 0's: seed(s) {res['learnt_nothing']}")
    for name in ("style", "guard"):
        print(f"pooled {name}: {_iv(res[name]['clustered'])} by question "
              f"({res[name]['clustered']['clusters']} questions); {_iv(res[name]['independent'])} as independent pairs")
    print(f"\ntargets: style up {res['targets']['style_up']}, guard non-inferior (lower bound >= "
          f"{100 * NON_INFERIOR:+.0f}) {res['targets']['guard_non_inferior']}")
    print(f"{'PASS' if res['pass'] else 'FAIL'} in {res['wall_s']:.0f} s; wrote {args.out}")
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
