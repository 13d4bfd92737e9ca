"""What an engine call can fail with, each carrying the HTTP status the client sees."""
from __future__ import annotations


class EngineError(Exception):
    """The engine could not serve a request. `status` is what the client sees."""

    def __init__(self, message: str, status: int = 502, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class EngineUnavailable(EngineError):
    """The engine cannot be reached at all (refused, timed out connecting)."""

    def __init__(self, message: str, retry_after: int = 2):
        super().__init__(message, status=503, retry_after=retry_after)


class EngineUnresponsive(EngineUnavailable):
    """A status call (/model_info, /server_info) got no answer in time: the engine may be hung, not gone."""


class EngineTimeout(EngineError):
    """An engine call ran past a deadline (first byte, idle, total) or was abandoned as the engine's hang was
    noticed. 503 with Retry-After, like a busy engine; not EngineUnavailable, which marks a remote engine down
    after a single call."""

    def __init__(self, message: str, retry_after: int = 2):
        super().__init__(message, status=503, retry_after=retry_after)


class EngineDisconnected(EngineError):
    """The connection to the engine failed under a call (reset, closed): the engine died or restarted. 502."""


class EngineRejected(EngineError):
    """The engine answered 400: the request itself is at fault."""

    def __init__(self, message: str):
        super().__init__(message, status=400)
