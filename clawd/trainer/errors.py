"""How the trainer fails, as the daemon sees it: the exceptions of `clawd.trainer.link` (its child died, timed
out or spoke out of turn; the handler raised; a batch failed every attempt). No torch: the daemon imports it.
"""
from __future__ import annotations


class TrainerError(Exception):
    """The trainer could not do what was asked."""


class TrainerDied(TrainerError):
    """The child exited (or closed its end) before replying."""


class TrainerTimeout(TrainerError):
    """No reply in time; the child was killed, since its replies can no longer be matched."""


class TrainerProtocolError(TrainerError):
    """The child sent something that is not the reply expected; it was killed."""


class TrainerUnavailable(TrainerError):
    """No live trainer within the wait, or the supervisor is stopping."""


class HandlerError(TrainerError):
    """The handler raised. `retryable` says whether trying again may help; `kind` is the wire's ("disk",
    "io", "step", "request"); `fatal`: the child exits and is restarted from its checkpoint."""

    def __init__(self, message: str, *, retryable: bool, batch_id: str | None = None, kind: str = "request",
                 fatal: bool = False):
        super().__init__(message)
        self.retryable = retryable
        self.batch_id = batch_id
        self.kind = kind
        self.fatal = fatal

    @classmethod
    def of(cls, reply: dict, batch_id: str | None = None) -> "HandlerError":
        return cls(reply["message"], retryable=reply["retryable"], batch_id=batch_id,
                   kind=reply.get("kind", "request"), fatal=bool(reply.get("fatal", False)))


class TrainFailed(TrainerError):
    """A batch failed every attempt; the caller keeps its samples."""

    def __init__(self, message: str, *, attempts: int):
        super().__init__(message)
        self.attempts = attempts
