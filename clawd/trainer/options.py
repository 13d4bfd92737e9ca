"""What the real trainer is spawned with, from the daemon's config: its options and, for `bin/clawd --plan`,
its command line. No torch: the daemon imports it.
"""
from __future__ import annotations

import os
import sys

from clawd.config.schema import Config
from clawd.devices import Launch, child_env, device_set


def trainer_options(cfg: Config) -> dict:
    """The options the real trainer (`clawd.trainer.worker.lineages.handler_for`) is spawned with, for a daemon
    run by cfg. `env`: what the child changes in its inherited environment before torch starts CUDA (its GPUs)."""
    return {"mode": cfg.scoring.mode, "model_dir": str(cfg.model_path.resolve()),
            "state_dir": str(cfg.state_dir.resolve()), "train": cfg.train, "dtype": cfg.model.dtype,
            "min_free_bytes": cfg.state.min_free_bytes, "keep_checkpoints": cfg.versions.rollback_depth + 2,
            "checkpoint_base": cfg.versions.rollback_depth > 0,
            "lineages": cfg.train.per_principal,  # an adapter per principal beside the shared one (trainer.lineages)
            "log_level": cfg.logging.level, "env": child_env(cfg, cfg.train.world.gpus, dict(os.environ),
                                                             unbuffered=False)}


def trainer_launch(cfg: Config) -> Launch:
    """The trainer process as `bin/clawd --plan` prints it: multiprocessing's spawn command line, whose
    target is `clawd.trainer.child.main` (the pipe and tracker descriptors exist only at run time)."""
    argv = (sys.executable, "-c", "from multiprocessing.spawn import spawn_main; spawn_main(...)",
            "--multiprocessing-fork")
    return Launch("trainer", argv, trainer_options(cfg)["env"], None, device_set(cfg.train.world.gpus),
                  cfg.learner.trainer_ready_timeout)
