"""The [journal] section: how the sample journal reaches the disk."""
from __future__ import annotations

import typing
from dataclasses import dataclass

from clawd.checks import below, not_positive


@dataclass(frozen=True)
class JournalConfig:
    # "interval": every fsync_interval; "always": before each sample is acknowledged
    fsync: typing.Literal["interval", "always"] = "interval"
    fsync_interval: float = 0.1          # seconds between fsyncs: what a power cut may lose
    segment_bytes: int = 64 * 1024 * 1024  # a segment file rotates at this size (bytes, at least 4096)

    def check(self) -> dict[str, str]:
        return not_positive(self, "fsync_interval") | below(self, 4096, "segment_bytes")
