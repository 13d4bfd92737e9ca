"""The [logging] section: the log level, and the one line format of the daemon and its children."""
from __future__ import annotations

import typing
from dataclasses import dataclass


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the daemon's lines and the trainer process's


@dataclass(frozen=True)
class LoggingConfig:
    level: typing.Literal["debug", "info", "warning", "error"] = "info"  # the lowest level logged (to stderr)

    check = dict  # nothing to check beyond the type
