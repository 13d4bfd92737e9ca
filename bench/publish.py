"""Publish seconds, disk against a torch.distributed group, side by side in one run on one engine.

The real trainer child (clawd.trainer.link) and clawd's CPU engine (in this process, as tests/local_engine runs
it) on the same model, SmolLM2-135M-Instruct by default (`make run` prepares it). Rounds alternate: a training
step (which writes its version's directory, as every step does), then that version published to the engine
from disk (pause, /update_weights_from_disk, continue) or over the replica's weight-update group (pause,
begin, one /update_weights_from_distributed per bucket while the trainer broadcasts, end, continue). Each
publish reports the engine's intake held (pause to continue) and its whole time; the round before it
reports the trainer's step with its directory write. Also measured once: the trainer writing a version
directory alone (a `publish` request: what a disk publish costs the trainer beyond its step).

What the ratio means: `held disk / held group` is how much shorter a replica's pause is when the weights
arrive over the group instead of being read back from the directory. The trainer still writes the directory
at every step (restarts, realignment, the gate and rollbacks load it), so the trainer's side is not shortened
here: the directory write stays on the step's critical path, and the note says so.

Exit status 0 when every publish took its path (no fallback) and the engine served each version; 1 otherwise
or when it could not measure. The JSON carries `provenance` (bench/provenance.py).

    .venv/bin/python bench/publish.py                      # SmolLM2, 3 rounds each way: about a minute on 2 cores
    .venv/bin/python bench/publish.py --model tiny --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path(__file__).resolve().parent))
import provenance  # noqa: E402

from clawd.config import Config, ModelConfig, ScoringConfig, StateConfig, TrainConfig  # noqa: E402
from clawd.engine.local.scheduler import Engine  # noqa: E402
from clawd.engine.local.server import parse_args  # noqa: E402
from clawd.engine.replicas import Replicas  # noqa: E402
from clawd.learning.publisher import Publisher  # noqa: E402
from clawd.learning.weight_groups import WeightGroups  # noqa: E402
from clawd.served import Policy  # noqa: E402
from clawd.tools.models import cached_tiny_model  # noqa: E402
from clawd.trainer.link import TrainerSupervisor, trainer_options  # noqa: E402
from tests.local_engine import running, supervised  # noqa: E402
from tests.trainer_handlers import make_sample  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def model_dir(name: str) -> Path:
    if name == "tiny":
        return cached_tiny_model(RESULTS / "tiny-model")
    path = ROOT / "state/models/SmolLM2-135M-Instruct" if name == "smollm2" else Path(name)
    if not (path / "config.json").exists():
        raise SystemExit(f"no model at {path} (make run prepares SmolLM2)")
    return path


async def measure(args, model: Path, work: Path) -> dict:
    cfg = Config(model=ModelConfig(path=str(model)), scoring=ScoringConfig(mode="rl"),
                 state=StateConfig(dir=str(work / "state")),
                 train=TrainConfig(lr=1e-5, reward_baseline="none", checkpoint_every=1000))
    trainer = TrainerSupervisor(trainer_options(cfg), ready_timeout=600)
    engine = Engine(parse_args(["--model", str(model), "--threads", "1", "--context-length", "512"]))
    task = asyncio.create_task(trainer.run())
    rows, out = [], {}
    policy = Policy()
    async with running(engine) as url, supervised(url, policy, ready_timeout=120) as sup:
        try:
            groups = WeightGroups(trainer, address="127.0.0.1", backend="gloo", engine_ranks=1,
                                  bucket_bytes=args.bucket_mb << 20, timeout=300)
            by_disk = Publisher(Replicas([sup], policy), 300)
            by_group = Publisher(Replicas([sup], policy), 300, groups=groups)
            version = 0
            for i in range(2 * args.rounds):
                path = "group" if i % 2 else "disk"
                version += 1
                t0 = time.perf_counter()
                trained = await trainer.train(f"b{version}", version, [make_sample(2 * i), make_sample(2 * i + 1)])
                step_s = time.perf_counter() - t0
                pushes = groups.stats.pushes
                t0 = time.perf_counter()
                held = await (by_group if path == "group" else by_disk).publish(trained.weights_dir, version)
                total = time.perf_counter() - t0
                ok = engine.weight_version == str(version) and (path == "disk" or groups.stats.pushes == pushes + 1)
                rows.append({"version": version, "path": path, "step_with_write_s": round(step_s, 3),
                             "held_s": round(held, 3), "publish_s": round(total, 3), "ok": ok,
                             **({"push_s": round(groups.stats.last_seconds, 3), "bytes": groups.stats.last_bytes}
                                if path == "group" else {})})
                print(f"  v{version} {path:5s}: step+write {step_s:6.2f} s, publish {total:6.2f} s, "
                      f"intake held {held:6.2f} s{'' if ok else '  FAILED'}", flush=True)
            version += 1
            t0 = time.perf_counter()
            await trainer.publish(version, timeout=600)  # the same weights again: the directory write alone
            out["directory_write_s"] = round(time.perf_counter() - t0, 3)
            out["fallbacks"], out["last_error"] = groups.stats.fallbacks, groups.stats.last_error
        finally:
            await trainer.stop(60)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    out["rounds"] = rows
    for path in ("disk", "group"):
        mine = [r for r in rows if r["path"] == path]
        out[path] = {k: round(statistics.median(r[k] for r in mine), 3) for k in ("held_s", "publish_s")}
    out["held_ratio_disk_over_group"] = round(out["disk"]["held_s"] / max(out["group"]["held_s"], 1e-6), 2)
    out["publish_ratio_disk_over_group"] = round(out["disk"]["publish_s"] / max(out["group"]["publish_s"], 1e-6), 2)
    out["pass"] = all(r["ok"] for r in rows) and out["fallbacks"] == 0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, or a model directory")
    p.add_argument("--rounds", type=int, default=3, help="publishes each way")
    p.add_argument("--bucket-mb", type=int, default=512, help="[engine] weight_sync_bucket_mb")
    p.add_argument("--json", type=Path, default=RESULTS / "publish.json")
    args = p.parse_args(argv)
    model = model_dir(args.model)
    with tempfile.TemporaryDirectory(prefix="clawd-bench-publish-") as tmp:
        res = {"provenance": provenance.stamp(), "model": str(model), "args": vars(args),
               **asyncio.run(measure(args, model, Path(tmp)))}
    print(f"publish: intake held disk {res['disk']['held_s']:.2f} s vs group {res['group']['held_s']:.2f} s "
          f"({res['held_ratio_disk_over_group']}x); whole publish {res['disk']['publish_s']:.2f} s vs "
          f"{res['group']['publish_s']:.2f} s; the trainer's directory write alone {res['directory_write_s']:.2f} s; "
          f"{'pass' if res['pass'] else 'FAIL'}")
    dest = args.json
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"wrote {dest}")
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
