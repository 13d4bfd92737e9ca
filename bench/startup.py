"""What a CPU engine and a trainer cost to start, with and without clawd.startup (the garbage collector held
off while torch, transformers and the model load, then the loaded objects frozen out of later collections).

Side by side in one run, alternating, `--rounds` times each:
  engine   `python -m clawd.engine.local --model M` (the entry point clawd launches), its process CPU
           (user + system, from /proc) when it logs `loaded ...`: imports, model load, listener
  trainer  clawd.trainer.child.main's start-up in a process of its own: clawd.trainer.worker.handler's import
           and `make(options)` with the options a daemon on the same model passes (trainer_options)
"Without" is the same code with clawd.startup's two calls made no-ops in that process. Each start also
reports what one full collection (`gc.collect()`) costs once it is ready: the serving and training
paths pay that whenever the collector reaches the oldest generation, which freezing empties.
Printed: the median CPU to ready of each, and the ratio with / without. Target: with < without for
both (a ratio under 1). Exit status: 0 when met; 1 when missed; 2 when it could not measure (a start
failed). The JSON carries `provenance` (bench/provenance.py) and `pass`.

    .venv/bin/python bench/startup.py               # about 2 min on 2 cores; bench/results/startup.json
    .venv/bin/python bench/startup.py --rounds 10 --model state/models/SmolLM2-135M-Instruct
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from clawd.tools.models import cached_tiny_model  # noqa: E402
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)

RESULTS = ROOT / "bench" / "results"
NO_STARTUP = "import clawd.startup as s; s.loading = s.loaded = lambda: None; "

# The engine, as clawd launches it, then (after its `loaded` line) one full collection timed on request.
ENGINE = """{patch}import gc, runpy, signal, sys, time
def collect(*_):
    t = time.process_time(); gc.collect(); print(f"collect {{time.process_time() - t:.4f}}", file=sys.stderr, flush=True)
signal.signal(signal.SIGUSR1, collect)
sys.argv = ["clawd.engine.local", "--model", {model!r}, "--port", "0", "--threads", "1"]
runpy.run_module("clawd.engine.local", run_name="__main__")
"""

# clawd.trainer.child.main's start-up, without the pipe to a daemon.
TRAINER = """{patch}import gc, json, time
from clawd import startup
startup.loading()
from clawd.trainer.worker.handler import make
from clawd.config.loading import config_from_dict
from clawd.trainer.options import trainer_options
cfg = config_from_dict({{"model": {{"path": {model!r}}}, "state": {{"dir": {state!r}}}}})
handler = make(trainer_options(cfg))
startup.loaded()
cpu = time.process_time()
t = time.process_time(); gc.collect(); collect = time.process_time() - t
print(json.dumps({{"cpu": cpu, "collect": collect}}), flush=True)
"""


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_start(model: Path, with_startup: bool, timeout: float) -> dict:
    code = ENGINE.format(patch="" if with_startup else NO_STARTUP, model=str(model))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stderr:
            if " loaded " in line:
                time.sleep(0.2)  # past startup.loaded(), which follows the line
                cpu = proc_cpu(proc.pid)
                break
            if time.monotonic() > deadline:
                raise TimeoutError("no `loaded` line")
        else:
            raise RuntimeError(f"the engine exited ({proc.wait()}) before it loaded")
        proc.send_signal(10)  # SIGUSR1: one full collection, timed
        for line in proc.stderr:
            if line.startswith("collect "):
                return {"cpu": round(cpu, 2), "collect": float(line.split()[1])}
        raise RuntimeError("the engine exited before it collected")
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stderr.close()


def trainer_start(model: Path, with_startup: bool, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="clawd-bench-startup-") as state:
        code = TRAINER.format(patch="" if with_startup else NO_STARTUP, model=str(model), state=state)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the trainer start failed ({done.returncode}): {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {"cpu": round(out["cpu"], 2), "collect": round(out["collect"], 4)}


def summary(runs: list[dict]) -> dict:
    return {"cpu_median": round(statistics.median(r["cpu"] for r in runs), 3),
            "cpu_min": min(r["cpu"] for r in runs), "cpu_max": max(r["cpu"] for r in runs),
            "collect_median_s": round(statistics.median(r["collect"] for r in runs), 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6, help="starts of each kind, with and without (alternating)")
    p.add_argument("--model", type=Path, default=None, help="a model directory (default: the tiny test model)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one start may take")
    p.add_argument("--out", type=Path, default=RESULTS / "startup.json")
    args = p.parse_args(argv)
    model = args.model or cached_tiny_model(RESULTS / "tiny-model")
    result = provenance.stamp({"bench": "startup", "model": str(model), "rounds": args.rounds})
    runs = {kind: {"with": [], "without": []} for kind in ("engine", "trainer")}
    could_not = None
    try:
        for n in range(args.rounds):
            for kind, start in (("engine", engine_start), ("trainer", trainer_start)):
                for arm in (("with", "without") if n % 2 == 0 else ("without", "with")):
                    runs[kind][arm].append(start(model, arm == "with", args.timeout))
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as e:
        could_not = f"{type(e).__name__}: {e}"
    result["runs"] = runs
    if could_not is None:
        figures = {}
        for kind in runs:
            w, wo = summary(runs[kind]["with"]), summary(runs[kind]["without"])
            figures[kind] = {"with": w, "without": wo, "cpu_ratio": round(w["cpu_median"] / wo["cpu_median"], 3)}
            print(f"{kind:<8} CPU-s to ready: with {w['cpu_median']:.2f} ({w['cpu_min']:.2f}-{w['cpu_max']:.2f}), "
                  f"without {wo['cpu_median']:.2f} ({wo['cpu_min']:.2f}-{wo['cpu_max']:.2f}): "
                  f"ratio {figures[kind]['cpu_ratio']:.3f}; one full collection after: "
                  f"{w['collect_median_s'] * 1000:.1f} ms with, {wo['collect_median_s'] * 1000:.1f} ms without")
        result["figures"] = figures
        result["pass"] = all(f["cpu_ratio"] < 1 for f in figures.values())
    else:
        print(f"could not measure: {could_not}", file=sys.stderr)
        result["could_not_measure"], result["pass"] = could_not, False
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'met' if result['pass'] else 'MISSED'}; written to {args.out}")
    return 2 if could_not else (0 if result["pass"] else 1)


if __name__ == "__main__":
    sys.exit(main())
