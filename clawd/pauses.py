"""Learning's one pause state: a set of reasons, each with the rule that lifts it (docs/ARCHITECTURE.md §8).

Learning runs while no reason holds. Paused learning: chat is served and recorded, no turn becomes
a sample and no training step starts. Only the operator's pause can also stop serving (new chat
requests get 503 + Retry-After). Every reason persists in `state_dir/pause.json` (written
atomically), so a restart cannot silently lift a pause the trainer or the disk asked for:

    operator    `clawctl pause`, or admin.start_paused = true     lifted by `clawctl resume`
    non_finite  the trainer's steps went non-finite in a row        lifted by `clawctl resume`
    disk        a write would leave less than state.min_free_bytes  lifted by itself once there is room;
                (or failed with ENOSPC)                              `clawctl resume` cannot lift it
    gate        a new version failed its evaluation                 lifted by `clawctl resume`
    monitor     a behaviour monitor drifted past its threshold      lifted by `clawctl resume`

`admin.start_paused`: "last" keeps every reason of the file; true adds the operator's reason; false
drops the operator's reason only (a safety pause is not a preference to override at start).
A file from an earlier release ({"learning", "serving", "since", "reason"}) reads as an operator pause.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("clawd.pause")

OPERATOR, NON_FINITE, DISK, GATE, MONITOR = "operator", "non_finite", "disk", "gate", "monitor"
LIFTED_BY = {OPERATOR: "clawctl resume", NON_FINITE: "clawctl resume", DISK: "free space (by itself)",
             GATE: "clawctl resume", MONITOR: "clawctl resume"}
OPERATOR_LIFTS = frozenset(r for r, rule in LIFTED_BY.items() if rule == "clawctl resume")


@dataclass(frozen=True)
class Pause:
    reason: str                # one of LIFTED_BY
    since: float
    detail: str = ""           # for the operator: the trainer's message, the free bytes, the operator's words
    serving: bool = False      # the operator's pause only: chat is refused too


class Pauses:
    def __init__(self, path: Path, start_paused: str | bool = "last"):
        self.path = Path(path)
        self.held: dict[str, Pause] = self._load()
        if start_paused is True and OPERATOR not in self.held:
            self.held[OPERATOR] = Pause(OPERATOR, time.time(), "admin.start_paused")
        elif start_paused is False:
            self.held.pop(OPERATOR, None)
        self.turns_not_learned = 0  # finished turns not scored because learning was paused
        self._running = asyncio.Event()
        self._changed()
        for pause in self.held.values():
            log.warning("starting paused: %s", describe(pause))

    @property
    def learning(self) -> bool:
        """True while any reason holds."""
        return bool(self.held)

    @property
    def serving(self) -> bool:
        pause = self.held.get(OPERATOR)
        return pause is not None and pause.serving

    async def until_running(self) -> None:
        await self._running.wait()

    def hold(self, reason: str, detail: str = "", *, serving: bool = False) -> Pause:
        """Add (or restate) a reason. A reason already held keeps its `since`."""
        if reason not in LIFTED_BY:
            raise ValueError(f"unknown pause reason {reason!r}")
        before = self.held.get(reason)
        pause = Pause(reason, before.since if before else time.time(), detail, serving and reason == OPERATOR)
        if pause != before:
            self.held[reason] = pause
            self._save()
            self._changed()
            if before is None:
                log.warning("learning paused: %s", describe(pause))
        return pause

    def lift(self, reason: str) -> bool:
        """Drop one reason; True when it was held."""
        if self.held.pop(reason, None) is None:
            return False
        self._save()
        self._changed()
        log.warning("pause lifted: %s%s", reason, "" if self.held else "; learning runs")
        return True

    def resume(self) -> list[str]:
        """`clawctl resume`: lift every reason the operator may lift; the reasons still held."""
        for reason in OPERATOR_LIFTS & self.held.keys():
            self.lift(reason)
        return sorted(self.held)

    def snapshot(self) -> dict:
        return {"learning": self.learning, "serving": self.serving,
                "reasons": [{**asdict(p), "lifted_by": LIFTED_BY[p.reason]} for p in self.held.values()]}

    def _changed(self) -> None:
        (self._running.clear if self.held else self._running.set)()

    def _load(self) -> dict[str, Pause]:
        try:
            raw = json.loads(self.path.read_text())
            if "reasons" not in raw:  # an earlier release's file: the operator's pause
                if not raw["learning"]:
                    return {}
                return {OPERATOR: Pause(OPERATOR, raw.get("since") or time.time(),
                                        raw.get("reason") or "", bool(raw["serving"]))}
            pauses = [Pause(**p) for p in raw["reasons"]]
            unknown = [p.reason for p in pauses if p.reason not in LIFTED_BY]
            if unknown:
                raise ValueError(f"unknown reason(s) {unknown}")
            return {p.reason: p for p in pauses}
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError) as exc:
            # A hand-edited or torn file: pausing is the safe reading (it may have held a safety pause).
            log.error("%s is unreadable (%s); starting with learning paused until `clawctl resume`", self.path, exc)
            return {OPERATOR: Pause(OPERATOR, time.time(), f"{self.path.name} was unreadable")}

    def _save(self) -> None:
        """Atomic; a failed write (a full disk) is logged and the state held in memory is still the truth."""
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            with open(tmp, "w") as f:
                f.write(json.dumps({"reasons": [asdict(p) for p in self.held.values()]}) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            log.error("could not save the pause state to %s (%s): it holds until this process ends", self.path, exc)


def describe(pause: Pause) -> str:
    what = "learning and serving" if pause.serving else "learning"
    detail = f" ({pause.detail})" if pause.detail else ""
    return f"{what} paused by {pause.reason}{detail}, lifted by {LIFTED_BY[pause.reason]}"
