"""`bin/clawd --plan [--json]`: every process a configuration would start, without starting any.

Built by the same functions that start them (`clawd.engine.launch.engine_launch`,
`clawd.trainer.link.trainer_launch`, `world_launches`), so the plan is what runs. It needs neither SGLang nor a GPU,
only the configuration and the base model's config.json (for the dtype, and the trainer's memory plan:
`clawd.trainer.worker.memory`). No secret appears in it:
engine keys travel in a file only clawd can read, and `env` lists what clawd sets (a value) or
removes (null), never what it inherits.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from clawd.config.schema import Config
from clawd.devices import Launch
from clawd.engine.launch import engine_launch, keys_file_path
from clawd.config.train import recompute_on
from clawd.trainer.options import trainer_launch
from clawd.trainer.worker.memory import MemoryPlan, Shape, describe, plan, problem
from clawd.trainer.worker.world import world_launches
from clawd.weights import restored_weights


def launches(cfg: Config) -> list[Launch]:
    """In start order: the policy engine (each replica), the reference engine, the trainer (each as far as cfg
    starts it)."""
    found = []
    if cfg.engine.launch != "none":
        restored = restored_weights(cfg.state_dir)  # a restart serves the checkpointed version, not the base
        weights, version = ((str(restored[1]), str(restored[0])) if restored
                            else (str(Path(cfg.model.path).resolve()), "0"))
        for i in range(cfg.engine.replicas):  # each replica on its own port (and GPU slice, for SGLang)
            found.append(engine_launch(cfg, "policy", weights, version, keys_file=keys_file_path(cfg, "policy"),
                                       replica=i))
        if cfg.reference_engine_needed:
            found.append(engine_launch(cfg, "reference", str(Path(cfg.model.path).resolve()), "0",
                                       keys_file=keys_file_path(cfg, "reference")))
    if cfg.learner.enabled:
        found.append(trainer_launch(cfg))
        found += world_launches(cfg)  # a trainer of several ranks: torchrun, started by the trainer child
    return found


def plan_json(cfg: Config) -> str:
    memory = memory_json(cfg)
    return json.dumps({"processes": [launch.as_json() for launch in launches(cfg)],
                       **({"trainer_memory": memory} if memory else {})}, indent=2)


def plan_text(cfg: Config) -> str:
    lines = [f"clawd would start (config {cfg.source}), in this order:"]
    for launch in launches(cfg):
        devices = ",".join(map(str, launch.devices)) or "none"
        port = "" if launch.port is None else f", port {launch.port}"
        lines.append(f"\n{launch.role}: GPUs {devices}{port}, ready within {launch.startup_timeout:.0f}s")
        for name, value in launch.env.items():
            lines.append(f"  env {name}={shlex.quote(value)}" if value is not None else f"  env -u {name}")
        lines.append("  " + shlex.join(launch.argv))
    if cfg.engine.launch == "none":
        lines.append(f"\nengines: none (clawd uses the ones at {', '.join(cfg.engine.policy_urls)} and "
                     f"{cfg.engine.reference_url})")
    if memory := memory_plan(cfg):
        lines.append(f"\n{memory[0]}")
    return "\n".join(lines)


def _memory(cfg: Config) -> MemoryPlan | None:
    """The trainer's memory plan; None without a learner or for a config.json it cannot read a decoder's
    shape from. Reads the base model's config.json (OSError, ValueError when it cannot)."""
    if not cfg.learner.enabled:
        return None
    train = cfg.train
    config = json.loads((Path(cfg.model.path) / "config.json").read_text(encoding="utf-8"))
    try:
        shape = Shape.from_config(config)
    except (KeyError, TypeError, ValueError):  # not a decoder's config this plan knows: nothing to plan
        return None
    cuda = train.world.device.startswith("cuda")
    return plan(shape, train, cuda, recompute_on(train.recompute, "cuda" if cuda else "cpu"))


def memory_plan(cfg: Config) -> tuple[str, str | None] | None:
    """The plan as a line, and why it cannot fit the stated GPU (None when it can, or on CPU)."""
    memory = _memory(cfg)
    if memory is None:
        return None
    cuda = cfg.train.world.device.startswith("cuda")
    return describe(memory), problem(memory, cfg.train.world.gpu_memory_gib,
                                     cfg.train.world.memory_fraction) if cuda else None


def memory_json(cfg: Config) -> dict | None:
    memory = _memory(cfg)
    return None if memory is None else memory.as_json()
