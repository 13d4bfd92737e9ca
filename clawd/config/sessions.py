"""The [sessions] section: how long a conversation lives and how many are held."""
from __future__ import annotations

import typing
from dataclasses import dataclass

from clawd.checks import below, not_positive


@dataclass(frozen=True)
class SessionsConfig:
    # Without X-Turn-Type / turn_type: "main" (trained) or "side"
    default_turn_type: typing.Literal["main", "side"] = "main"
    session_idle_timeout: float = 900.0  # seconds without a request before a session closes
    session_max_turns: int = 256         # a session closes at this many main turns
    max_sessions: int = 10_000           # most live sessions; past it the least recently active one closes
    max_bytes: int = 512 * 1024 * 1024   # live sessions' messages; the least recently used close first
    sweep_interval: float = 5.0          # seconds between checks for idle sessions

    def check(self) -> dict[str, str]:
        return (not_positive(self, "session_idle_timeout", "sweep_interval")
                | below(self, 1, "session_max_turns", "max_sessions", "max_bytes"))
