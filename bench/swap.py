"""Publishing weights under load: how long the engine's intake is held, and whether any request fails.

One run, one daemon (docs/ARCHITECTURE.md §6, §12): the tiny model on clawd's CPU engine, the learner on with
`rollout_batch_size` 1, so every +1 sample is a training step and a publish. Closed-loop users
(the official `openai` client, non-streamed and streamed, every other conversation thanked so the
rules judge makes a sample) chat until `--publishes` publishes have happened.
  per publish  the learner's `published vN in Ts, intake held Hs` line: T is the whole publish
               (pause, update from disk, continue, model_info check), H the pause → continue part.
               The line's timestamp is the publish's end, so its window is [end − T, end]; the
               hold's window is the CPU engine's `generation paused` → `generation continued`
  per request  start, end, the first streamed chunk (clawd sends headers only once the engine's
               first chunk is there), any exception at all as a failure
Side by side in the same run: the latency (start to end) of requests that overlapped a publish
window beside those that overlapped none, and the same split by hold windows; the headline is
`overlap p50 / clear p50` by publish. Read it against the intake held: a request caught by a swap
should lose about H, no more. Longer requests overlap more windows, and requests that are clear
ran beside training steps instead, so the ratio is a view of the cost, not a pure measure of it.
Target: 0 failed requests. Exit status: 0 when no request failed, the daemon exited 0 and the
publishes were reached; 1 otherwise, or (a traceback, no JSON written) when it could not measure.
The JSON carries `provenance` (bench/provenance.py) and `pass`.

    .venv/bin/python bench/swap.py                  # about 25 s on 2 cores; writes bench/results/swap.json
    .venv/bin/python bench/swap.py --publishes 20 --concurrency 8 --threads 0 2>/tmp/clawd.log
    .venv/bin/python bench/swap.py --lora           # LoRA vs full fine-tune per publish: bench/lora.py, its own flags
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from clawd.tools.models import cached_tiny_model  # noqa: E402
from tests.harness import Daemon  # noqa: E402
from tests.load import load_until_published, publish_windows  # noqa: E402
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)

RESULTS = ROOT / "bench" / "results"


def tiny_model() -> Path:
    """The tiny test model, built once into the git-ignored results folder."""
    return cached_tiny_model(RESULTS / "tiny-model")


def p50_max(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0, "p50": None, "max": None}
    return {"n": len(xs), "p50": round(statistics.median(xs), 4), "max": round(max(xs), 4)}


def run(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="clawd-bench-swap-") as tmp:
        daemon = Daemon(Path(tmp), {"model": {"path": str(args.model), "max_tokens_cap": args.max_tokens},
                                    "engine": {"launch": "local"},
                                    "learner": {"enabled": True, "rollout_batch_size": 1, "min_batch_size": 1},
                                    "train": {"optimizer": {"lr": args.lr}}})
        t0 = time.time()
        try:
            requests, learner = load_until_published(daemon, users=args.concurrency, publishes=args.publishes,
                                                      timeout=args.timeout, max_tokens=args.max_tokens)
        finally:
            exit_code = daemon.stop()
        load_s = time.time() - t0

    pubs = publish_windows(daemon.lines)
    served = [r for r in requests if r["ok"]]
    failed = [r for r in requests if not r["ok"]]
    for r in requests:
        r["latency"] = r["end"] - r["start"]
        r["overlaps_publish"] = [p["version"] for p in pubs if r["start"] < p["end"] and r["end"] > p["start"]]
        r["overlaps_hold"] = [p["version"] for p in pubs if p["hold_start"] is not None
                              and r["start"] < p["hold_end"] and r["end"] > p["hold_start"]]

    def side_by_side(key: str) -> dict:
        """Latency of served requests that overlapped a window of this kind beside those that did not."""
        over = p50_max([r["latency"] for r in served if r[key]])
        clear = p50_max([r["latency"] for r in served if not r[key]])
        ratio = over["p50"] / clear["p50"] if over["p50"] and clear["p50"] else None
        return {"overlapping_s": over, "clear_s": clear, "p50_ratio": ratio}

    by_publish, by_hold = side_by_side("overlaps_publish"), side_by_side("overlaps_hold")
    ok = not failed and exit_code == 0 and len(pubs) >= args.publishes
    for r in requests:  # times relative to the load's start read better in the JSON
        r.update({k: round(r[k] - t0, 4) for k in ("start", "end", "first") if k in r},
                 latency=round(r["latency"], 4), wait=round(r["wait"], 4))
    for p in pubs:
        p.update({k: round(p[k] - t0, 3) for k in ("start", "end", "hold_start", "hold_end") if p[k] is not None})
    # Publishes from the log, the ones after the load stopped (the daemon drains) included.
    failed_pubs = sum("clawd.learner: publishing v" in line for line in daemon.lines)
    return {"publishes": len(pubs), "failed_publishes": failed_pubs, "learner": learner, "requests_served": len(served),
            "requests_failed": len(failed), "failures": [r["error"] for r in failed],
            "intake_held_s": p50_max([p["intake_held_s"] for p in pubs]),
            "publish_s": p50_max([p["publish_s"] for p in pubs]),
            "streamed_wait_s": p50_max([r["wait"] for r in served if r["stream"]]),
            "latency_by_publish": by_publish, "latency_by_hold": by_hold,
            "overlap_over_clear_p50": by_publish["p50_ratio"],
            "daemon_exit_code": exit_code, "load_s": round(load_s, 1), "cores": os.cpu_count(),
            "per_publish": pubs, "per_request": requests, "targets": {"requests_failed": 0}, "pass": ok}


def table(res: dict) -> str:
    def s(x):
        return "-" if x is None else f"{x:.3f}"

    def pm(d):
        return f"{s(d['p50'])} / {s(d['max'])}"

    rows = [("publishes", f"{res['publishes']}", ""),
            ("failed publishes", f"{res['failed_publishes']}", ""),
            ("requests served", f"{res['requests_served']}", ""),
            ("requests failed", f"{res['requests_failed']}",
             "target 0 " + ("ok" if res["requests_failed"] == 0 else "MISSED")),
            ("intake held per publish (s)", pm(res["intake_held_s"]), "p50 / max"),
            ("publish total (s)", pm(res["publish_s"]), "p50 / max"),
            ("streamed, first chunk (s)", pm(res["streamed_wait_s"]), f"p50 / max of {res['streamed_wait_s']['n']}")]
    for name, d in (("publish", res["latency_by_publish"]), ("hold", res["latency_by_hold"])):
        ratio = "-" if d["p50_ratio"] is None else f"{d['p50_ratio']:.2f}x"
        rows += [(f"latency, clear of any {name} (s)", pm(d["clear_s"]), f"p50 / max of {d['clear_s']['n']}"),
                 (f"latency, overlapping a {name} (s)", pm(d["overlapping_s"]),
                  f"p50 / max of {d['overlapping_s']['n']}"),
                 ("  overlap p50 / clear p50", ratio, "")]
    return "\n".join(f"{a:<34} {b:>15}  {c}".rstrip() for a, b, c in rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--lora" in argv:  # another measurement with its own flags and JSON: bench/lora.py
        import lora
        return lora.main([a for a in argv if a != "--lora"])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lora", action="store_true",
                   help="measure LoRA against the full fine-tune per publish instead (bench/lora.py; see its --help)")
    # 100, not 10: publishes come every ~0.15 s here, so with 10 only ~10 requests overlap none,
    # and the headline ratio swung from 0.9 to 1.35 between runs.
    p.add_argument("--publishes", type=int, default=100, help="stop the load after this many publishes")
    p.add_argument("--concurrency", type=int, default=4, help="closed-loop users")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens per request (and the daemon's cap)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=1,
                   help="OMP_NUM_THREADS for the daemon's engine and trainer (0: torch's default)")
    p.add_argument("--timeout", type=float, default=300, help="give up waiting for the publishes after this long")
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny test model)")
    p.add_argument("--json", type=Path, default=RESULTS / "swap.json")
    args = p.parse_args(argv)
    args.model = args.model or tiny_model()
    if args.threads:
        # The engine and the trainer inherit it. With torch's default (a thread per core) their
        # OpenMP threads stall each other on 2 cores, and every request and publish takes ~10x longer.
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    prov = provenance.stamp()
    t0 = time.monotonic()
    res = {"provenance": prov, **run(args)}
    res["wall_s"] = round(time.monotonic() - t0, 1)
    res["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print()
    print(table(res))
    for err in sorted(set(res["failures"]))[:10]:
        print(f"  failed: {err}")
    if res["daemon_exit_code"] != 0:
        print(f"the daemon exited with {res['daemon_exit_code']}")
    print(f"\noverall: {'PASS' if res['pass'] else 'FAIL'} in {res['wall_s']:.0f} s "
          f"(load {res['load_s']:.0f} s on {res['cores']} cores)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
