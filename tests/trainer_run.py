"""Run the trainer for a few steps in its own process, for the resume test in test_trainer.py.

    python -m tests.trainer_run MODEL STATE COUNT OUT [--extra-then-hang]   (from the repository root)

Resumes from STATE (or starts fresh), then COUNT times: draw a batch from the global RNGs
(torch, random and numpy, so a resume that lost them would draw other batches), train, publish
the next version, checkpoint with the number of batches done as the journal position. Writes
OUT.json (per-step losses, what it resumed from, the versions it published) and OUT.safetensors
(the final weights). With --extra-then-hang it then trains and publishes one more batch without
a checkpoint, prints "ready" and sleeps until killed.
"""
from __future__ import annotations

import json
import random
import sys
import time

from clawd import startup

startup.loading()  # until the trainer is built, as in clawd's own trainer child (clawd/startup.py)
import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)

from clawd.config.train import LossConfig, OptimizerConfig, TrainConfig
from clawd.samples import Sample  # noqa: E402
from clawd.trainer.worker.step import Trainer  # noqa: E402

CONFIG = TrainConfig(micro_batch_tokens=48, optimizer=OptimizerConfig(lr=1e-3), loss=LossConfig(eps_clip_high=0.28))


def batch(n: int = 4) -> list[Sample]:
    out = []
    for i in range(n):
        length = int(torch.randint(8, 24, ()))
        resp = int(torch.randint(2, length // 2, ()))
        hint = random.random() < 0.5
        out.append(Sample(
            sample_id=f"s{i}", mode="combine", session_id="s", turn_index=i, principal="p",
            tokens=torch.randint(0, 4096, (length,)).tolist(), response_length=resp,
            loss_mask=[int(x) for x in np.random.rand(resp) < 0.9],
            rollout_logprobs=(-8 + np.random.rand(resp)).tolist(),
            temperature=float(np.random.choice([0.7, 1.0])), reward=random.choice([-1.0, 0.0, 1.0]),
            teacher_logprobs=(-8 + np.random.rand(resp)).tolist() if hint else None, has_hint=hint,
            policy_version=0, created=0.0, scored=0.0))
    return out


def main() -> None:
    model, state, count, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    trainer = Trainer(model, state, CONFIG)
    startup.loaded()
    report = {"start_step": trainer.step, "start_version": trainer.version,
              "journal_position": trainer.journal_position, "losses": [], "versions": []}
    for _ in range(count):
        metrics = trainer.train_step(batch(), "combine")
        report["losses"].append(metrics["loss"])
        report["versions"].append(trainer.publish(trainer.version + 1).name)
        trainer.checkpoint(journal_position=trainer.step)
    from safetensors.torch import save_model
    save_model(trainer.model, out + ".safetensors")
    with open(out + ".json", "w") as f:
        json.dump(report, f)
    if "--extra-then-hang" in sys.argv:
        trainer.train_step(batch(), "combine")  # lost with the process: never checkpointed
        trainer.publish(trainer.version + 1)     # but published: its version must not come back
        print("ready", flush=True)
        time.sleep(600)


if __name__ == "__main__":
    main()
