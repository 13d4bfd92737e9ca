"""The real trainer's handler: the messages of `clawd.trainer.wire` -> `Trainer` calls.

Imported only in the spawned trainer process (`clawd.trainer.child` imports it when the link
was given no factory): it imports torch through `clawd.trainer.step`. A train message trains one
batch, publishes the new weights as the version the daemon asked for, and checkpoints when due,
so the reply tells the daemon both where the weights are and whether the batch's samples are now
safe to acknowledge in the journal.

Its options (`clawd.trainer.link.trainer_options`): mode, model_dir, state_dir and train, a
`TrainConfig` or a [train] table as a dict; dtype, the `[model] dtype` that versions are published
in ("auto", the base model's, when absent). The GPU share is train's memory_fraction.
"""
from __future__ import annotations

from pathlib import Path

from clawd.config import TrainConfig, config_from_dict
from clawd.samples import Sample
from clawd.trainer.step import Trainer


def train_config(train: TrainConfig | dict | None) -> TrainConfig:
    """The options' `train` as a TrainConfig; a table is checked as the config file's [train] is."""
    if isinstance(train, TrainConfig):
        return train
    table = {k: list(v) if isinstance(v, tuple) else v for k, v in (train or {}).items()}
    return config_from_dict({"train": table}, source="the trainer's options").train


class TrainerHandler:
    def __init__(self, options: dict):
        self.mode = options["mode"]
        self.trainer = Trainer(Path(options["model_dir"]), Path(options["state_dir"]),
                               train_config(options.get("train")), dtype=options.get("dtype", "auto"))

    @property
    def step(self) -> int:
        return self.trainer.step

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def weights_version(self) -> int:
        return self.trainer.weights_version

    def train(self, batch_id: str, version: int, samples: list[Sample]) -> dict:
        t = self.trainer
        if t.paused:  # the daemon paused on our report and has been resumed by the operator
            t.unpause()
        metrics = t.train_step(samples, self.mode)
        if metrics["skipped"]:
            # Nothing changed: nothing to publish; the samples are spent (their step was non-finite).
            t.checkpoint(batch_id)
            return {"weights_dir": None, "metrics": metrics, "checkpointed": True}
        weights = t.publish(version)
        checkpointed = t.checkpoint_due
        if checkpointed:
            t.checkpoint(batch_id)
        return {"weights_dir": str(weights), "metrics": metrics, "checkpointed": checkpointed}

    def publish(self, version: int) -> str:
        """After a restart from a checkpoint whose version is no longer published (or is not what
        the engine serves): the same weights under a new version, and a checkpoint that says so."""
        weights = self.trainer.publish(version)
        self.trainer.checkpoint(self.trainer.journal_position)
        return str(weights)

    def checkpoint(self) -> tuple[str, int]:
        return str(self.trainer.checkpoint(None)), self.trainer.step


def make(options: dict) -> TrainerHandler:
    return TrainerHandler(options)
