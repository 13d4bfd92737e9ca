"""Active rollouts beside live chat: what they cost live users, and a model's solve rate on an environment.

Live first, measured side by side in one run: the same daemon settings and the same live load (`--requests`
chat requests from `--users` simulated users, each reading a reply for about `--think` seconds before the
next, `--max-tokens` new tokens) against a daemon without rollouts and against one whose rollouts run the
environment (`--env`, default the calculator) with `[rollouts] concurrency` 2 and `live_headroom`
`--headroom` (0). The users' reading time is the idle capacity the rollouts may take; a load with none
leaves them none (they wait, and the bench says they did not run). A third arm runs the same rollouts
with the engine's priority scheduling off (`[engine] priority_scheduling = "off"`; the default turns it
on while rollouts run): what the engine's preemption of rollout rows adds to the daemon's live-first gate.
Alternated rounds (`--rounds`), so a slow moment of the machine falls on every arm. Reported: each arm's
live p50 and p99 latency, their ratios to the arm without rollouts (targets, for the default: p50 <=
1.25x, p99 <= 1.5x), and how much the rollouts did meanwhile (groups, answers). The learner is off in
every arm: what is measured is the engine's share.

The solve rate (`--solve N`): N episodes of the environment from held-out seeds (from
clawd.rollouts.source.EVAL_SEED_BASE on, never trained) at `--temperature`, on the model as it is: the
rate, how many episodes called a tool, how they ended, and two transcripts.

    .venv/bin/python bench/rollouts.py --model .cache/tests/<tiny>   # the tiny model: ~2 min on 2 cores
    .venv/bin/python bench/rollouts.py --solve 32                    # SmolLM2: the calculator's solve rate too

Writes bench/results/rollouts.json with provenance; exit 1 when a target was missed or a live request
failed, a traceback (no JSON) when it could not measure.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from clawd.rollouts.source import EVAL_SEED_BASE  # noqa: E402
from clawd.tools.sim.launch import Clawd  # noqa: E402
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)

RESULTS = ROOT / "bench" / "results"
P50_TARGET, P99_TARGET = 1.25, 1.5
CALCULATOR = "clawd.rollouts.envs.calculator:Calculator"


def quantile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def live_load(url: str, users: int, requests: int, max_tokens: int,
                    think: float) -> tuple[list[float], int]:
    """(latencies of the successful requests in seconds, failures): `users` sessions, one request at a time,
    each user reading its reply for `think` seconds (0.5-1.5x, seeded) before the next: the gaps that leave
    the engine idle are the capacity the rollouts may use."""
    latencies, failures = [], 0
    per_user = requests // users

    async def user(u: int, http: aiohttp.ClientSession) -> None:
        nonlocal failures
        rng = random.Random(u)
        for i in range(per_user):
            await asyncio.sleep(think * rng.uniform(0.5, 1.5))
            body = {"model": "m", "max_tokens": max_tokens, "temperature": 0.7, "user": f"bench-{u}",
                    "messages": [{"role": "user", "content": f"Tell me one fact about the number {u * 100 + i}."}]}
            started = time.monotonic()
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                if resp.status == 200:
                    latencies.append(time.monotonic() - started)
                else:
                    failures += 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await asyncio.gather(*(user(u, http) for u in range(users)))
    return latencies, failures


ARMS = ("without", "with", "with, no priority")  # rollouts off; on (the default); on, the engine's priority off


async def arm(model: Path, name: str, args: argparse.Namespace) -> dict:
    rollouts = name != "without"
    sections = {"model": {"path": str(model), "max_tokens_cap": max(args.max_tokens, 64)},
                "engine": {"launch": "local", "max_batch_size": 8}, "learner": {"enabled": False},
                "scoring": {"mode": "rl"}, "judge": {"backend": "rules"},
                "gate": {"enabled": False}, "monitors": {"enabled": False}}
    if rollouts:  # the learner is off: the source's backlog cap would stop it, so it is set out of reach
        sections["learner"] = {"enabled": True, "rollout_batch_size": 10**6, "min_batch_size": 10**6}
        sections["rollouts"] = {"enabled": True, "environments": [args.env], "concurrency": 2,
                                "live_headroom": args.headroom,
                                "max_new_tokens": args.max_tokens, "max_turns": 3, "backlog": 10**6}
        sections["engine"]["priority_scheduling"] = "off" if name == "with, no priority" else "auto"
    with tempfile.TemporaryDirectory(prefix="clawd-bench-rollouts-") as tmp:
        clawd = Clawd(Path(tmp), sections, threads=args.threads)
        await clawd.start()
        try:
            if rollouts:
                await asyncio.sleep(args.warmup)  # the rollouts get going before the live load starts
            started = time.monotonic()
            latencies, failures = await live_load(clawd.url, args.users, args.requests, args.max_tokens, args.think)
            seconds = time.monotonic() - started
            status = clawd.status()
        finally:
            await clawd.stop()
    out = {"p50_s": statistics.median(latencies) if latencies else None,
           "p99_s": quantile(latencies, 0.99) if latencies else None, "requests": len(latencies),
           "failures": failures, "seconds": round(seconds, 1)}
    if rollouts:
        r = status["rollouts"]
        out["rollouts"] = {k: r[k] for k in ("groups", "answers", "solved", "waited_live", "env_failed")}
    return out


async def solve_rate(model: Path, args: argparse.Namespace) -> dict:
    """The model's solve rate on held-out seeds of the environment, through the real agent loop."""
    from clawd.engine.client import EngineClient
    from clawd.engine.local.scheduler import Engine
    from clawd.engine.local.server import build_app, parse_args
    from clawd.rollouts.episode import EpisodeLimits, run_episode
    from clawd.rollouts.worker import DeploymentWorker
    from clawd.tokenizer import ChatTokenizer

    engine = Engine(parse_args(["--model", str(model), "--threads", str(args.threads or 1), "--seed", "0",
                                "--max-batch-size", "8"]))
    runner = web.AppRunner(build_app(engine), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine.load()
    run = asyncio.create_task(engine.run())
    tokenizer, worker = ChatTokenizer(model), DeploymentWorker()
    client = EngineClient(f"http://127.0.0.1:{runner.addresses[0][1]}")
    await client.start()
    slots = asyncio.Semaphore(8)
    limits = EpisodeLimits(max_turns=4, max_new_tokens=args.max_tokens * 4, temperature=args.temperature)

    async def one(seed: int):
        async with slots:
            return await run_episode(args.env, seed, worker, client.generate, tokenizer, limits)

    try:
        episodes = await asyncio.gather(*(one(EVAL_SEED_BASE + i) for i in range(args.solve)))
    finally:
        await client.close()
        await worker.close()
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        engine.shutdown()
        await runner.cleanup()
    called = sum(any(m.get("tool_calls") for m in e.transcript if m.get("role") == "assistant") for e in episodes)
    return {"episodes": len(episodes), "solved": sum(e.reward == 1.0 for e in episodes),
            "rate": sum(e.reward == 1.0 for e in episodes) / len(episodes), "called_a_tool": called,
            "ended": dict(collections.Counter(e.ended for e in episodes)), "errors": sum(e.errors for e in episodes),
            "temperature": args.temperature,
            "transcripts": [[{k: m.get(k) for k in ("role", "content", "tool_calls") if m.get(k)}
                             for m in e.transcript] for e in episodes[:2]]}


async def main_async(args: argparse.Namespace) -> dict:
    arms: dict[str, list[dict]] = {name: [] for name in ARMS}
    for _ in range(args.rounds):
        for name in ARMS:
            arms[name].append(await arm(args.model, name, args))
            print(f"{name} rollouts: {arms[name][-1]}", flush=True)
    pooled = {name: {"p50_s": statistics.median([r["p50_s"] for r in runs]),
                     "p99_s": max(r["p99_s"] for r in runs), "failures": sum(r["failures"] for r in runs)}
              for name, runs in arms.items()}
    ratios = {name: {q: round(pooled[name][f"{q}_s"] / pooled["without"][f"{q}_s"], 3) for q in ("p50", "p99")}
              for name in ARMS[1:]}
    p50, p99 = ratios["with"]["p50"], ratios["with"]["p99"]
    did = sum(r["rollouts"]["answers"] for r in arms["with"])
    met = {f"live p50 with rollouts <= {P50_TARGET}x without": p50 <= P50_TARGET,
           f"live p99 with rollouts <= {P99_TARGET}x without": p99 <= P99_TARGET,
           "no live request failed": sum(p["failures"] for p in pooled.values()) == 0,
           "the rollouts ran meanwhile": did > 0}
    out = {"settings": {k: str(v) for k, v in vars(args).items()}, "runs": arms, "pooled": pooled,
           "p50_ratio": p50, "p99_ratio": p99, "ratios": ratios, "met": met}
    if args.solve:
        out["solve"] = await solve_rate(args.model, args)
    out["pass"] = all(met.values())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "state/models/SmolLM2-135M-Instruct")
    ap.add_argument("--env", default=CALCULATOR, help="the environment the rollouts run (module:Class)")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--requests", type=int, default=48, help="live requests per arm and round")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--think", type=float, default=2.0, help="seconds a user reads a reply before its next request")
    ap.add_argument("--headroom", type=int, default=0, help="[rollouts] live_headroom")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds the rollouts run before the live load")
    ap.add_argument("--threads", type=int, default=1, help="the CPU engine's torch threads")
    ap.add_argument("--solve", type=int, default=0, help="also: the solve rate over N held-out episodes")
    ap.add_argument("--temperature", type=float, default=0.7, help="the solve rate's sampling temperature")
    ap.add_argument("--out", type=Path, default=RESULTS / "rollouts.json")
    args = ap.parse_args()
    args.model = args.model.resolve()  # the daemon runs in its own directory
    if args.users < 1 or args.requests < args.users or args.rounds < 1:
        ap.error("--users >= 1, --requests >= --users, --rounds >= 1")
    res = {"provenance": provenance.stamp(), **asyncio.run(main_async(args))}
    base = res["pooled"]["without"]
    for name in ARMS[1:]:
        p, r = res["pooled"][name], res["ratios"][name]
        print(f"{name} rollouts: live p50 {base['p50_s'] * 1000:.0f} -> {p['p50_s'] * 1000:.0f} ms ({r['p50']}x), "
              f"p99 {base['p99_s'] * 1000:.0f} -> {p['p99_s'] * 1000:.0f} ms ({r['p99']}x)")
    if "solve" in res:
        s = res["solve"]
        print(f"solve rate: {s['solved']}/{s['episodes']} ({s['rate']:.0%}), {s['called_a_tool']} called a tool, "
              f"ended {s['ended']}")
    for what, ok in res["met"].items():
        print(f"{'met' if ok else 'MISSED'}: {what}")
    return provenance.write(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
