"""The real trainer's handler: the messages of `clawd.trainer.wire` -> `Trainer` calls.

Imported only in the spawned trainer process (`clawd.trainer.child` imports it when the link
was given no factory): it imports torch through `clawd.trainer.worker.step`.

A train message takes the optimizer step once, then tries its writes: the weights directory of the
version the daemon asked for, then a checkpoint when one is due. The step and its writes are
separate: a write that fails (a full disk, an I/O error) leaves the step in memory and is reported
in the reply (`failed`), and the handler owes it (`owed`, in every reply's `state`) until a
`publish` or `checkpoint` message writes it alone. Nothing is ever trained twice for a write.

After every step one line goes to the trained-steps ledger (`clawd.weights.Ledger`,
state_dir/trainer/steps.jsonl), synced before every checkpoint.

Its options (`clawd.trainer.options.trainer_options`): mode, model_dir, state_dir and train, a
`TrainConfig` or a [train] table as a dict; dtype, the `[model] dtype` that versions are published
in ("auto", the base model's, when absent); min_free_bytes, what every write must leave free
(`[state] min_free_bytes`; 0 when absent); keep_checkpoints, the complete checkpoints kept (rollback
targets; at least two); checkpoint_base, whether the untrained model is checkpointed before the first
step (so that a rollback can return to it). The GPU share is train's memory_fraction.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from clawd import faults
from clawd.config.loading import config_from_dict
from clawd.config.train import TrainConfig
from clawd.samples import Sample
from clawd.trainer.catalogue import Trained
from clawd.trainer.worker.failures import StepFailed
from clawd.trainer.worker.step import Trainer
from clawd.trainer.worker.weight_sender import SyncRefused, WeightSender
from clawd.weights import Ledger, ledger_path, version_dir, write_failure_kind

log = logging.getLogger("clawd.trainer")


def train_config(train: TrainConfig | dict | None) -> TrainConfig:
    """The options' `train` as a TrainConfig; a table is checked as the config file's [train] is."""
    if isinstance(train, TrainConfig):
        return train
    def as_toml(value):  # asdict's tuples as the file's lists, its groups as tables
        return ({k: as_toml(v) for k, v in value.items()} if isinstance(value, dict) else
                list(value) if isinstance(value, tuple) else value)
    return config_from_dict({"train": as_toml(train or {})}, source="the trainer's options").train


class TrainerHandler:
    def __init__(self, options: dict, world=None, *, beside: TrainerHandler | None = None, adapter: str | None = None):
        """world: this rank's `sharding.World` when the trainer is several ranks (every rank has a handler
        and runs every request; rank 0 keeps the ledger and replies). beside, adapter: a lineage's handler, its
        adapter `adapter` on `beside`'s model (clawd.trainer.worker.lineages)."""
        self.mode = options["mode"]
        self.trainer = Trainer(Path(options["model_dir"]), Path(options["state_dir"]),
                               train_config(options.get("train")), dtype=options.get("dtype", "auto"),
                               min_free_bytes=int(options.get("min_free_bytes", 0)), world=world,
                               keep_checkpoints=int(options.get("keep_checkpoints", 0)),
                               beside=beside and beside.trainer, adapter=adapter)
        self.ledger = Ledger(ledger_path(options["state_dir"])) if world is None or world.writer else None
        # The resumed weights' line: a publish of them under a new version writes it again with that version.
        self._line = self.ledger.last_line(self.trainer.step) if self.trainer.step and self.ledger else None
        self._owe_checkpoint = False  # a checkpoint was due (or the step was skipped) and is not written yet
        if options.get("checkpoint_base") and self.trainer.step == 0:  # the base model: a rollback target too
            self._owe_checkpoint = True
        self._batch: Any = self.trainer.journal_position  # the last trained batch: the checkpoint's position
        self.sender = WeightSender(self.trainer.model, self.trainer.publish_dtype, self.trainer.device, world)

    @property
    def step(self) -> int:
        return self.trainer.step

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def weights_version(self) -> int:
        return self.trainer.weights_version

    @property
    def checkpoint_step(self) -> int:
        return self.trainer.checkpoint_step

    @property
    def owed(self) -> list[str]:
        """The writes the last step still needs, in the order they must happen: "publish" (the weights
        are in no version yet), then "checkpoint" (due, and not written)."""
        t = self.trainer
        out = ["publish"] if t.unpublished else []
        if self._owe_checkpoint or t.checkpoint_due:
            out.append("checkpoint")
        return out

    @property
    def writing(self) -> int | None:
        """The version whose directory is still being written (a deferred publish), or None."""
        return None if self.trainer.writing is None else self.trainer.writing.version

    def train(self, batch_id: str, version: int, samples: list[Sample], deferred: bool = False) -> Trained:
        """One step, then its writes; `deferred`: the directory is written off the critical path (the daemon
        pushes the weights over its groups meanwhile), and a checkpoint due is left owed until it is there."""
        t = self.trainer
        if t.step and t.step == t.checkpoint_step and batch_id == self._batch:
            # The checkpoint this child resumed from already holds this batch's step: its predecessor died
            # after writing it, before its reply, and the batch came again. Never train it twice.
            return Trained(batch_id, version, None, {"skipped": True, "step": t.step, "skip_reason": (
                f"batch {batch_id} is already in the checkpoint of step {t.step} (the trainer died before its "
                "reply)")}, [], checkpointed=True)
        if t.paused:  # the daemon paused on our report and has been resumed by the operator
            t.unpause()
        metrics = t.train_step(samples, self.mode)  # StepFailed: fatal, the child exits after replying
        try:
            return self._after_step(batch_id, version, samples, metrics, deferred)
        except Exception as exc:  # writes report their own failures; anything else must not be retrained on
            raise StepFailed(f"after step {t.step}: {type(exc).__name__}: {exc}") from exc

    def _after_step(self, batch_id: str, version: int, samples: list[Sample], metrics: dict,
                    deferred: bool) -> Trained:
        t = self.trainer
        self._batch = batch_id
        self._line = {"step": t.step, "batch_id": batch_id, "version": None,
                      "samples": [s.sample_id for s in samples], "skipped": bool(metrics["skipped"])}
        weights, failed = None, None
        if metrics["skipped"]:
            # Nothing changed: nothing to publish; the samples are spent (their step was non-finite).
            self._owe_checkpoint = True
            self._note_line()
        else:
            try:
                weights = str(self._publish(version, deferred))
            except OSError as exc:
                failed = self._failed("publish", exc)
                self._note_line()  # the step happened; its version comes with the publish that succeeds
        checkpointed = False
        # Never over weights no version says; after a deferred publish, the checkpoint waits behind its write.
        if failed is None and self.owed == ["checkpoint"] and self.writing is None:
            try:
                self._checkpoint()
                checkpointed = True
            except OSError as exc:
                failed = self._failed("checkpoint", exc)
        return Trained(batch_id, version, weights, metrics, [], checkpointed, failed)

    def publish(self, version: int) -> str:
        """The current weights as `version`: the write a failed train reply left owed, or, after a restart
        from a checkpoint whose version is no longer published (or not what the engine serves), the same
        weights under a new number. Then a checkpoint is owed if due, or if the weights are the checkpoint's
        (so that the next restart serves this version)."""
        republish = not self.trainer.unpublished and self.trainer.step == self.trainer.checkpoint_step
        weights = self._publish(version)
        if republish:
            self._owe_checkpoint = True
        return str(weights)

    def restore(self, version: int) -> int:
        """A rollback to `version`'s checkpoint (weights, optimizer, counters); its step. A checkpoint is then
        owed, so that the next restart resumes here rather than on the abandoned branch."""
        self.trainer.restore(version)
        self._line = self.ledger.last_line(self.trainer.step) if self.trainer.step and self.ledger else None
        self._batch = self.trainer.journal_position
        self._owe_checkpoint = True
        return self.trainer.step

    def join_group(self, name: str, address: str, port: int, world_size: int, backend: str, timeout: float,
                   bucket_bytes: int) -> list[dict]:
        """Form weight-update group `name` with an engine (full weights only); the buckets `send_weights` sends."""
        if self.trainer.cfg.lora.enabled:
            raise SyncRefused("LoRA publishes adapters from disk, not weights over a group")
        self.sender.join(name, address, port, world_size, backend, timeout)
        return [b.request() for b in self.sender.layout(bucket_bytes)]

    def send_weights(self, name: str, version: int, bucket_bytes: int) -> dict:
        """Broadcast the current weights into group `name`, provided they are `version` (published: a step whose
        directory is not written yet, or a rollback to older weights, is sent from disk instead)."""
        t = self.trainer
        if t.weights_version != version or t.unpublished:
            raise SyncRefused(f"the trainer holds v{t.weights_version}{' (unpublished)' if t.unpublished else ''}, "
                              f"not v{version}")
        return self.sender.send(name, bucket_bytes)

    def leave_group(self, name: str) -> None:
        self.sender.leave(name)

    def written(self, version: int) -> str:
        """`version`'s directory, once on disk: a deferred write waited for (written again if it had failed)."""
        self.trainer.settle()
        return str(version_dir(self.trainer.state_dir, version))

    def checkpoint(self) -> tuple[str, int]:
        return str(self._checkpoint()), self.trainer.step

    def _publish(self, version: int, deferred: bool = False) -> Path:
        weights = self.trainer.publish(version, deferred=deferred)
        if self._line is not None and self._line["step"] == self.trainer.step:
            self._line = {**self._line, "version": version}
            self._note_line()
        return weights

    def _checkpoint(self) -> Path:
        if self.ledger is not None:
            self.ledger.sync()  # every line up to this step is on disk before a checkpoint says it happened
        path = self.trainer.checkpoint(self._batch)
        self._owe_checkpoint = False
        faults.point("trainer.checkpoint.done")  # written, not yet replied: the window a retry must not retrain
        return path

    def _note_line(self) -> None:
        if self.ledger is None:
            return
        self.ledger.add(self._line)
        try:
            self.ledger.flush()
        except OSError as exc:  # kept queued: the next checkpoint writes it first, or fails with it
            log.warning("trained-steps ledger: %s (line kept for the next checkpoint)", exc)

    def _failed(self, op: str, exc: OSError) -> dict:
        log.error("step %d: %s failed, owed until written: %s", self.trainer.step, op, exc)
        return {"op": op, "kind": write_failure_kind(exc), "message": f"{type(exc).__name__}: {exc}"}


def make(options: dict, world=None) -> TrainerHandler:
    return TrainerHandler(options, world)
