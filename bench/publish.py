"""Publish seconds, disk against a torch.distributed group, side by side in one run on one engine.

The real trainer child (clawd.trainer.link) and clawd's CPU engine (in this process, as tests/local_engine runs
it) on the same model, SmolLM2-135M-Instruct by default (`make run` prepares it). Rounds cycle over three
paths: "disk" (the step writes its version's directory, then the engine loads it: pause,
/update_weights_from_disk, continue), "group" (the step writes the directory, then the weights go over the
replica's weight-update group: pause, begin, one /update_weights_from_distributed per bucket while the
trainer broadcasts, end, continue) and "deferred" (what the daemon does with groups: the step replies once
the weights are copied to the host, the push runs while a trainer thread writes the directory, and the
publish returns once the directory is on disk). Each round reports the step's reply, the moment the engine
first served the version (`served_s`, from the step's start: the critical path to users) and the moment the
publish returned (`policy_s`: the policy moves then), with the engine's intake held (pause to continue). Also
measured once: the trainer writing a version directory alone (a `publish` request).

What the ratios mean: `held disk / held group` is how much shorter a replica's pause is when the weights
arrive over the group; `served group / served deferred` is how much sooner users get a version when the
directory is written off the critical path.

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

from clawd.config.model import ModelConfig
from clawd.config.schema import Config
from clawd.config.scoring import ScoringConfig
from clawd.config.state import StateConfig
from clawd.config.train import LossConfig, OptimizerConfig, TrainConfig
from clawd.engine.local.scheduler import Engine  # noqa: E402
from clawd.engine.local.server import parse_args  # noqa: E402
from clawd.engine.replicas import Replicas  # noqa: E402
from clawd.learning.publisher import Publisher  # noqa: E402
from clawd.learning.weight_groups import WeightGroups  # noqa: E402
from clawd.served import Policy  # noqa: E402
from clawd.tools.models import cached_tiny_model  # noqa: E402
from clawd.trainer.link import TrainerSupervisor  # noqa: E402
from clawd.trainer.options import trainer_options  # noqa: E402
from clawd.weights import is_published  # noqa: E402
from tests.local_engine import running, supervised  # noqa: E402
from tests.trainer_handlers import make_sample  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PATHS = ("disk", "group", "deferred")


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
                 train=TrainConfig(checkpoint_every=1000, optimizer=OptimizerConfig(lr=1e-5),
                                   loss=LossConfig(reward_baseline="none")))
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
            for i in range(len(PATHS) * args.rounds):
                path = PATHS[i % len(PATHS)]
                version += 1
                served: list[float] = []

                async def watch(v=str(version)):
                    while engine.weight_version != v:
                        await asyncio.sleep(0.002)
                    served.append(time.perf_counter())
                watcher = asyncio.create_task(watch())
                t0 = time.perf_counter()
                trained = await trainer.train(f"b{version}", version, [make_sample(2 * i), make_sample(2 * i + 1)],
                                              deferred=path == "deferred")
                step_s = time.perf_counter() - t0
                pushes = groups.stats.pushes
                held = await (by_disk if path == "disk" else by_group).publish(trained.weights_dir, version)
                policy_s = time.perf_counter() - t0
                await asyncio.wait_for(watcher, 5)
                ok = (engine.weight_version == str(version) and is_published(Path(trained.weights_dir))
                      and (path == "disk" or groups.stats.pushes == pushes + 1))
                rows.append({"version": version, "path": path, "step_reply_s": round(step_s, 3),
                             "served_s": round(served[0] - t0, 3), "policy_s": round(policy_s, 3),
                             "held_s": round(held, 3), "ok": ok,
                             **({"push_s": round(groups.stats.last_seconds, 3), "bytes": groups.stats.last_bytes}
                                if path != "disk" else {})})
                print(f"  v{version} {path:8s}: step reply {step_s:6.2f} s, served at {served[0] - t0:6.2f} s, "
                      f"policy at {policy_s:6.2f} s, intake held {held:6.2f} s{'' if ok else '  FAILED'}", flush=True)
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
    for path in PATHS:
        mine = [r for r in rows if r["path"] == path]
        out[path] = {k: round(statistics.median(r[k] for r in mine), 3)
                     for k in ("step_reply_s", "served_s", "policy_s", "held_s")}
    out["held_ratio_disk_over_group"] = round(out["disk"]["held_s"] / max(out["group"]["held_s"], 1e-6), 2)
    out["served_ratio_group_over_deferred"] = round(out["group"]["served_s"] / max(out["deferred"]["served_s"], 1e-6), 2)
    out["served_ratio_disk_over_deferred"] = round(out["disk"]["served_s"] / max(out["deferred"]["served_s"], 1e-6), 2)
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
          f"({res['held_ratio_disk_over_group']}x); served after the step's start: disk {res['disk']['served_s']:.2f} s, "
          f"group {res['group']['served_s']:.2f} s, deferred {res['deferred']['served_s']:.2f} s "
          f"(group/deferred {res['served_ratio_group_over_deferred']}x); policy moved: "
          + ", ".join(f"{p} {res[p]['policy_s']:.2f} s" for p in PATHS)
          + f"; the trainer's directory write alone {res['directory_write_s']:.2f} s; {'pass' if res['pass'] else 'FAIL'}")
    dest = args.json
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"wrote {dest}")
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
