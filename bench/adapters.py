"""What N adapters cost clawd's CPU engine: memory, load time and the per-request overhead, N = 1, 4, 16.

With adapters per principal (`[train] adapters = "per_principal"`, docs/ARCHITECTURE.md §15) the policy engine
holds the shared adapter and one per principal beside the base. One run, side by side on one model (default
SmolLM2-135M-Instruct, `make model`), LoRA rank `--rank` (16) on every attention and MLP projection:

  adapters  `--adapters` (16) distinct PEFT adapter directories made first (in a subprocess with PEFT: its
            initialisation, then every B matrix drawn small and random, so that each adapter changes the
            output as a trained one does).
  engines   per N, a fresh CPU engine (`python -m clawd.engine.local`, one torch thread) with the flags
            clawd gives it for N principals (`TrainConfig.lora_flags`: `--max-loras-per-batch 4 + N`), and
            one plain engine without LoRA. Per engine: its RSS once ready, the seconds of each of N
            `/load_lora_adapter` calls and its RSS after them (`/proc/PID/status` VmRSS); then `--requests`
            rounds of `/generate` (a 64-token prompt, 16 new tokens, greedy), each round one request naming
            the base (no adapter) and one naming an adapter (the i-th, cycling), order alternating; then
            `--batches` rounds of min(N, 8) requests at once, each naming a different adapter, against as
            many at once naming none: what a batch mixing principals costs.

Printed side by side: RSS added per adapter, load seconds (p50), a request's seconds with an adapter over the
same request without (p50 of the per-round ratio) and over the plain engine's, and a mixed batch's seconds over
the base batch's. Exit status: 0 when measured; 2 when it could not measure (the JSON holds the error). The
JSON (bench/results/adapters.json) carries `provenance` (bench/provenance.py). No target: these are costs for
an operator to size `max_adapters` with, on this CPU engine; SGLang keeps adapters in a pool of its own.

    .venv/bin/python bench/adapters.py                     # ~4 min on 2 cores; writes bench/results/adapters.json
    .venv/bin/python bench/adapters.py --model tiny --ns 1,4 --requests 3 --batches 1
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)
from lora import Engine, Measuring, model_dir  # noqa: E402  (bench/lora.py: a CPU engine child, talked to with urllib)

RESULTS = ROOT / "bench" / "results"
DEFAULT_MODEL = ROOT / "state/models/SmolLM2-135M-Instruct"
PROMPT = list(range(100, 164))  # 64 token ids; every run asks the same
NEW_TOKENS = 16


def make_adapters(model: Path, rank: int, n: int, dest: Path) -> list[str]:
    """n adapter directories under dest (a subprocess: PEFT and torch stay out of this process)."""
    code = f"""
import torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from clawd.config.train import TrainConfig, LoraConfig
from clawd.trainer.worker import adapters
cfg = TrainConfig(lora=LoraConfig(rank={rank})).lora
model = adapters.wrap(AutoModelForCausalLM.from_pretrained({str(model)!r}, dtype=torch.float32), cfg.rank, cfg.alpha,
                      cfg.target_modules)
for i in range({n}):
    torch.manual_seed(i)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    adapters.publish(model, Path({str(dest)!r}) / f"a{{i}}")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}, timeout=900)
    if done.returncode != 0:
        raise Measuring(f"making the adapters failed: {done.stderr[-3000:]}")
    return [str(dest / f"a{i}") for i in range(n)]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise Measuring(f"no VmRSS for {pid}")


def generate(engine: Engine, adapter: str | None) -> float:
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                                     "ignore_eos": True}}
    if adapter is not None:
        body["lora_path"] = adapter
    seconds, answer = engine.post("/generate", body)
    if len(answer.get("output_ids") or []) != NEW_TOKENS:
        raise Measuring(f"/generate gave {str(answer)[:300]}")
    return seconds


def at_once(engine: Engine, adapters: list[str | None]) -> float:
    """Seconds until every one of these requests (one per entry) has its reply, sent together."""
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(adapters)) as pool:
        list(pool.map(lambda a: generate(engine, a), adapters))
    return time.perf_counter() - t0


def measure(args, n: int, dirs: list[str], plain_s: list[float], work: Path) -> dict:
    from clawd.config.train import LoraConfig, TrainConfig

    flags = TrainConfig(lora=LoraConfig(rank=args.rank), adapters="per_principal", max_adapters=n).lora_flags()
    engine = Engine(args.model, flags, work / f"engine-{n}.log", args.timeout)
    try:
        engine.wait_ready()
        before = rss(engine.proc.pid)
        loads = [engine.post("/load_lora_adapter", {"lora_name": f"a{i}", "lora_path": dirs[i]})[0] for i in range(n)]
        after = rss(engine.proc.pid)
        base_s, adapter_s = [], []
        for r in range(args.requests):
            pair = [(base_s, None), (adapter_s, f"a{r % n}")]
            for into, adapter in (pair if r % 2 else pair[::-1]):
                into.append(generate(engine, adapter))
        width = min(n, 8)
        mixed_s, same_s = [], []
        for b in range(args.batches):
            pair = [(mixed_s, [f"a{(b + i) % n}" for i in range(width)]), (same_s, [None] * width)]
            for into, adapters in (pair if b % 2 else pair[::-1]):
                into.append(at_once(engine, adapters))
    finally:
        engine.stop()
    ratio = [a / b for a, b in zip(adapter_s, base_s)]
    return {"n": n, "rss_ready_bytes": before, "rss_loaded_bytes": after,
            "rss_per_adapter_bytes": (after - before) / n, "load_s": loads, "load_s_p50": statistics.median(loads),
            "first_load_s": loads[0], "request_base_s": base_s, "request_adapter_s": adapter_s,
            "adapter_over_base_p50": statistics.median(ratio),
            "adapter_over_plain_engine_p50": statistics.median(adapter_s) / statistics.median(plain_s),
            "batch_width": width, "batch_mixed_s": mixed_s, "batch_base_s": same_s,
            "mixed_over_base_batch_p50": statistics.median(m / s for m, s in zip(mixed_s, same_s))}


def plain_engine(args, work: Path) -> dict:
    engine = Engine(args.model, (), work / "engine-plain.log", args.timeout)
    try:
        engine.wait_ready()
        seconds = [generate(engine, None) for _ in range(args.requests)]
        return {"rss_ready_bytes": rss(engine.proc.pid), "request_s": seconds}
    finally:
        engine.stop()


def table(res: dict) -> str:
    rows = [("N adapters", "RSS +MB/adapter", "load s p50", "first load s", "req adapter/base", "vs plain engine",
             "mixed batch/base")]
    for m in res["engines"]:
        rows.append((str(m["n"]), f"{m['rss_per_adapter_bytes'] / 1e6:.1f}", f"{m['load_s_p50']:.3f}",
                     f"{m['first_load_s']:.3f}", f"{m['adapter_over_base_p50']:.2f}x",
                     f"{m['adapter_over_plain_engine_p50']:.2f}x",
                     f"{m['mixed_over_base_batch_p50']:.2f}x ({m['batch_width']} at once)"))
    plain = res["plain"]
    rows.append(("plain engine", f"RSS {plain['rss_ready_bytes'] / 1e6:.0f} MB", "", "",
                 f"{statistics.median(plain['request_s']):.3f} s/request", "", ""))
    return "\n".join("  ".join(f"{c:>17}" if i else f"{c:<13}" for i, c in enumerate(r)).rstrip() for r in rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory, or `tiny` (default SmolLM2-135M)")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank (default 16)")
    p.add_argument("--ns", default="1,4,16", help="adapter counts, one engine each (default 1,4,16)")
    p.add_argument("--requests", type=int, default=8, help="rounds of one base and one adapter request (default 8)")
    p.add_argument("--batches", type=int, default=3, help="rounds of a mixed and a base batch (default 3)")
    p.add_argument("--timeout", type=float, default=600, help="seconds an engine call may take")
    p.add_argument("--out", type=Path, default=RESULTS / "adapters.json")
    args = p.parse_args(argv)
    args.n_list = [int(x) for x in args.ns.split(",") if x.strip()]
    if not args.n_list or min(args.n_list) < 1 or min(args.rank, args.requests, args.batches) < 1:
        p.error("--ns, --rank, --requests and --batches must be at least 1")
    args.model = model_dir(p, args.model)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res: dict = {"provenance": provenance.stamp(), "model": str(args.model), "rank": args.rank,
                 "cores": os.cpu_count(), "prompt_tokens": len(PROMPT), "new_tokens": NEW_TOKENS}
    t0 = time.monotonic()
    RESULTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="adapters-work-", dir=RESULTS))
    code = 0
    try:
        dirs = make_adapters(args.model, args.rank, max(args.n_list), work / "adapters")
        res["plain"] = plain_engine(args, work)
        res["engines"] = [measure(args, n, dirs, res["plain"]["request_s"], work) for n in args.n_list]
    except (Measuring, subprocess.TimeoutExpired) as exc:
        res["error"] = str(exc)
        code = 2
    finally:
        shutil.rmtree(work)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    res["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    if code == 2:
        print(f"could not measure: {res['error']}", file=sys.stderr)
    else:
        print(f"\n{args.model.name}, LoRA rank {args.rank}, CPU engine (one torch thread), "
              f"load {os.getloadavg()[0]:.1f}\n")
        print(table(res))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\n{'measured' if code == 0 else 'FAILED'} in {res['wall_s']:.0f} s; wrote {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
