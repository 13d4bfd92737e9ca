"""Does the CPU engine answer while a model step computes? Busy must never read as hung.

The supervisor polls every engine's `/model_info`; an engine that leaves polls unanswered for
`health_interval` x `health_failures` (15 s by default) is killed as hung. The CPU engine once ran
its model on its HTTP loop, so a poll waited for the whole step in flight: a prefill of 8 prompts of
300 tokens takes about 7 s on one idle core, twice that beside another run, and the engine was
killed under its callers. Now each step runs on a compute thread.

One run measures, on SmolLM2 (or --model) with one torch thread, for the CPU engine of this tree
and, with --against DIR, of another source tree (a checkout of an older commit), side by side in
alternated rounds:

    prefill_s   the longest step: one batch of 8 prompts of 300 tokens, 1 new token each
    load        32 greedy requests (300-token prompts, 48 new tokens, ignore_eos), 8 at a time,
                while /model_info is polled every 0.2 s: tokens/s, the polls' p50 and worst latency
    ratio       worst poll latency / prefill_s: about 1 when a poll waits for the step, near 0 when
                the engine answers during it (target < 0.1)

With --against, also this tree's tokens/s over the other's (the compute thread must not cost
throughput; target >= 0.9). Writes bench/results/liveness.json with provenance; exit 1 when a target
was missed or a request failed, and a traceback (no JSON) when it could not measure.

    .venv/bin/python bench/liveness.py                                # ~1 min on 2 cores
    git worktree add /tmp/old e9d02ae && .venv/bin/python bench/liveness.py --against /tmp/old --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)

RESULTS = ROOT / "bench" / "results"
PROMPT_TOKENS, NEW_TOKENS, REQUESTS, BATCH, POLL_EVERY = 300, 48, 32, 8, 0.2
RATIO_TARGET, THROUGHPUT_TARGET = 0.1, 0.9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _ready(http: aiohttp.ClientSession, url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with {proc.returncode} before it was ready")
        try:
            async with http.get(url + "/model_info", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                if resp.status == 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the engine was not ready in {timeout:g} s")


async def _generate(http: aiohttp.ClientSession, url: str, i: int, new_tokens: int) -> int:
    # Distinct prompts (no two alike), the same in every engine and round.
    body = {"input_ids": [1000 + (i * 7 + j) % 20000 for j in range(PROMPT_TOKENS)],
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}}
    async with http.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"/generate answered {resp.status}: {(await resp.text())[:200]}")
        return len((await resp.json())["output_ids"])


async def measure(src: Path, model: Path) -> dict:
    """One engine from source tree `src`: its longest step, then the load with polls beside it."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen([sys.executable, "-m", "clawd.engine.local", "--model", str(model), "--port", str(port),
                             "--threads", "1", "--max-batch-size", str(BATCH)], cwd=src, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            await _ready(http, url, proc)
            t0 = time.perf_counter()
            await asyncio.gather(*(_generate(http, url, i, 1) for i in range(BATCH)))
            prefill_s = time.perf_counter() - t0
            latencies: list[float] = []
            done = asyncio.Event()

            async def poll() -> None:
                while not done.is_set():
                    t = time.perf_counter()
                    async with http.get(url + "/model_info", timeout=aiohttp.ClientTimeout(total=60)) as resp:
                        await resp.read()
                    latencies.append(time.perf_counter() - t)
                    await asyncio.sleep(POLL_EVERY)

            room = asyncio.Semaphore(BATCH)

            async def one(i: int) -> int:
                async with room:
                    return await _generate(http, url, BATCH + i, NEW_TOKENS)

            poller = asyncio.create_task(poll())
            t0 = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(i) for i in range(REQUESTS))))
            wall = time.perf_counter() - t0
            done.set()
            await poller
    finally:
        proc.terminate()
        proc.wait(30)
    if tokens != REQUESTS * NEW_TOKENS:
        raise RuntimeError(f"{tokens} tokens generated, not {REQUESTS * NEW_TOKENS}")
    worst = max(latencies)
    return {"prefill_s": prefill_s, "tokens_per_s": tokens / wall, "wall_s": wall, "polls": len(latencies),
            "poll_p50_s": statistics.median(latencies), "poll_max_s": worst, "ratio": worst / prefill_s}


def summarise(runs: list[dict]) -> dict:
    keys = ("prefill_s", "tokens_per_s", "poll_p50_s", "poll_max_s", "ratio")
    return {k: statistics.fmean(r[k] for r in runs) for k in keys} | {
        "worst_poll_s": max(r["poll_max_s"] for r in runs), "worst_ratio": max(r["ratio"] for r in runs), "runs": runs}


async def main_async(args: argparse.Namespace) -> dict:
    trees = {"this": ROOT} | ({"against": args.against.resolve()} if args.against else {})
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):  # alternated, so machine noise falls on both
        for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            runs[name].append(await measure(trees[name], args.model))
            print(f"round {r + 1} {name:7}: " + ", ".join(f"{k} {v:.3g}" for k, v in runs[name][-1].items()), flush=True)
    out = {name: summarise(rs) for name, rs in runs.items()}
    met = {f"this: worst poll / longest step < {RATIO_TARGET:g}": out["this"]["worst_ratio"] < RATIO_TARGET}
    if "against" in out:
        out["throughput_ratio"] = out["this"]["tokens_per_s"] / out["against"]["tokens_per_s"]
        met[f"this tokens/s over the other tree's >= {THROUGHPUT_TARGET:g}"] = out["throughput_ratio"] >= THROUGHPUT_TARGET
    return {"model": str(args.model), "against": str(args.against) if args.against else None, "rounds": args.rounds,
            "cores": os.cpu_count(), "workload": {"prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
                                                   "requests": REQUESTS, "batch": BATCH, "poll_every_s": POLL_EVERY},
            "results": out, "met": met, "pass": all(met.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "state/models/SmolLM2-135M-Instruct")
    ap.add_argument("--against", type=Path, help="another source tree (its clawd/ package) to run side by side")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "liveness.json")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    prov = provenance.stamp()
    res = {"provenance": prov, **asyncio.run(main_async(args))}
    for name, r in res["results"].items():
        if isinstance(r, dict):
            print(f"{name:7}: longest step {r['prefill_s']:.2f} s, worst poll {r['worst_poll_s']:.3f} s "
                  f"(ratio {r['worst_ratio']:.3f}), poll p50 {r['poll_p50_s'] * 1000:.1f} ms, {r['tokens_per_s']:.1f} tok/s")
    if "throughput_ratio" in res["results"]:
        print(f"tokens/s, this tree over the other: {res['results']['throughput_ratio']:.3f}")
    for what, ok in res["met"].items():
        print(f"{'met' if ok else 'MISSED'}: {what}")
    return provenance.write(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
