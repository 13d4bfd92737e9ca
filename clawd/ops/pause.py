"""The operator's pause: learning only, or learning and serving (docs/ARCHITECTURE.md §8).

Paused learning: chat is served and recorded, but no turn becomes a sample and
no training step starts. Paused serving also refuses new chat requests (503 +
Retry-After). The state is written to `state_dir/pause.json` (atomically) so a
restart keeps it, unless `admin.start_paused` says otherwise.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("clawd.pause")


@dataclass(frozen=True)
class Paused:
    learning: bool = False
    serving: bool = False
    since: float | None = None
    reason: str | None = None


class PauseState:
    def __init__(self, path: Path, start_paused: str | bool = "last"):
        self.path = Path(path)
        self.current = Paused()
        self.turns_not_learned = 0  # finished turns not scored because learning was paused
        if start_paused == "last":
            self.current = self._load()
        elif start_paused:
            self.current = Paused(learning=True, since=time.time(), reason="admin.start_paused")
        if self.current.learning:
            log.warning("starting paused (%s%s)", "learning and serving" if self.current.serving else "learning",
                        f": {self.current.reason}" if self.current.reason else "")

    @property
    def learning(self) -> bool:
        return self.current.learning

    @property
    def serving(self) -> bool:
        return self.current.serving

    def pause(self, *, serving: bool = False, reason: str | None = None) -> Paused:
        self.current = Paused(learning=True, serving=serving, since=time.time(),
                              reason=reason or "paused by the operator")
        self._save()
        return self.current

    def resume(self) -> Paused:
        self.current = Paused()
        self._save()
        return self.current

    def _load(self) -> Paused:
        try:
            raw = json.loads(self.path.read_text())
            return Paused(learning=bool(raw["learning"]), serving=bool(raw["serving"]), since=raw.get("since"),
                          reason=raw.get("reason"))
        except FileNotFoundError:
            return Paused()
        except (ValueError, KeyError, TypeError) as exc:  # a hand-edited or torn file: say so, start running
            log.error("%s is unreadable (%s); starting unpaused", self.path, exc)
            return Paused()

    def _save(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(asdict(self.current)) + "\n")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
