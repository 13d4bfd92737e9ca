"""How a training step fails, as the trainer process reports it (clawd.trainer.child turns these into the
wire's error kinds: "step", "oom"). Runs in the trainer process only (torch)."""
from __future__ import annotations

import torch


class TrainingPaused(RuntimeError):
    """train_step while learning is paused after non-finite steps; `unpause()` lifts it."""


class StepFailed(RuntimeError):
    """The step raised after it began changing state: the model is in an unknown state, and the trainer
    process must be restarted from its last checkpoint."""
    fatal = True
    kind = "step"


class OutOfMemory(StepFailed):
    """The step ran out of memory: the batch is too big for the device, not the trainer broken (the daemon
    splits the batch, and excludes a sample that cannot fit alone). `fatal` unless nothing had changed yet:
    one process whose every optimizer step of the batch was still to come carries on (gradients dropped);
    an update already applied, or other ranks left inside a collective, restart from the checkpoint."""
    kind = "oom"

    def __init__(self, message: str, *, fatal: bool):
        super().__init__(message)
        self.fatal = fatal


def out_of_memory(exc: BaseException) -> bool:
    """An allocation that failed: torch's device OOM, the CPU allocator's, or Python's MemoryError."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))
