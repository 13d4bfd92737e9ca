"""The edge from serving to scoring: every finished turn passes privacy (consent, PII: what may be trained
and recorded), is written to the turn records and counted by its version's behaviour monitors; it becomes a
scoring task unless learning is paused (then it is served and recorded, never a sample).

Turns are handed over in the order they finished. The PII scan is the costly part and the daemon has one
thread, so it runs in slices of the loop (`SLICE`): a turn whose scan ends within one slice is handed over at
once, inside the caller (a chat request, the session sweeper, the drain); one that needs more waits in a
queue that a task of its own works through, a slice at a time, and every later turn waits behind it. `flush`
waits for the queue to empty (the drain, before scoring stops).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator

from clawd.pauses import Pauses
from clawd.privacy.policy import Privacy
from clawd.records import RecordWriter
from clawd.safety.monitors import Monitors
from clawd.scoring.scorer import Scorer
from clawd.turns import FinishedTurn

log = logging.getLogger("clawd.handover")

SLICE = 0.005  # seconds of the loop a scan may hold before it yields (it overshoots by one step: a few ms)


def advance(steps: Generator[None, None, Any], seconds: float) -> bool:
    """Runs `steps` for about `seconds`; True when it ended."""
    deadline = time.perf_counter() + seconds
    try:
        while True:
            next(steps)
            if time.perf_counter() >= deadline:
                return False
    except StopIteration:
        return True


@dataclass
class HandoverStats:
    deferred: int = 0  # turns whose scan needed more than one slice of the loop
    failed: int = 0    # turns lost to an error in their scan (logged with its traceback)


class TurnHandover:
    def __init__(self, records: RecordWriter, scorer: Scorer, pauses: Pauses, privacy: Privacy,
                 monitors: Monitors | None = None, *, on_turn: Callable[[], None] = lambda: None,
                 spawn: Callable[..., asyncio.Task]):
        """on_turn: counts each turn handed over (turns per minute); spawn: starts a task owned by the daemon
        (the queue's worker)."""
        self.records = records
        self.scorer = scorer
        self.pauses = pauses
        self.on_turn = on_turn
        self.privacy = privacy
        self.monitors = monitors
        self.spawn = spawn
        self.stats = HandoverStats()
        # Turns waiting, oldest first: [turn, its scan once begun, dropped by a forget].
        self._queue: collections.deque[list] = collections.deque()
        self._worker: asyncio.Task | None = None

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def __call__(self, finished: FinishedTurn) -> None:
        if not self._queue:
            scan = self.privacy.scan_turn(finished)
            try:
                done = advance(scan, SLICE)
            except Exception:  # as in `_work`: the caller (another request) must not fail for this turn
                self._lost()
                return
            if done:
                self._deliver(finished)
                return
            self.stats.deferred += 1
            self._queue.append([finished, scan, False])
        else:
            self._queue.append([finished, None, False])
        if self._worker is None:
            self._worker = self.spawn(self._work(), name="turn-handover")

    def forget(self, principal: str) -> int:
        """Drops the principal's turns still waiting for their scan (`clawctl forget`); returns how many."""
        mine = [entry for entry in self._queue if entry[0].turn.principal == principal and not entry[2]]
        for entry in mine:
            entry[2] = True  # the worker passes it over; the one being scanned is dropped when its scan ends
        return len(mine)

    async def flush(self) -> None:
        """Returns once every turn handed over so far has passed."""
        while self._worker is not None:
            await asyncio.wait([self._worker])

    async def _work(self) -> None:
        try:
            while self._queue:
                entry = self._queue[0]
                if entry[1] is None:
                    entry[1] = self.privacy.scan_turn(entry[0])
                try:
                    while not entry[2] and not advance(entry[1], SLICE):
                        await asyncio.sleep(0)
                except Exception:  # a defect in detection: this turn is lost, the ones behind it are not
                    self._lost()
                else:
                    if not entry[2]:
                        self._deliver(entry[0])
                self._queue.popleft()
        finally:
            self._worker = None

    def _lost(self) -> None:
        """Called inside an `except`: the turn whose scan raised is neither recorded nor learned from."""
        self.stats.failed += 1
        log.exception("the PII scan of a turn failed; the turn is neither recorded nor learned from")

    def _deliver(self, finished: FinishedTurn) -> None:
        finished, record = self.privacy.admit(finished)
        if record is not None:
            self.records.write(record, finished.finished)
        self.on_turn()
        if self.monitors is not None:
            self.monitors.observe_turn(finished.turn.policy_version, finished.to_record(), keep_text=record is not None)
        if self.pauses.learning:
            self.pauses.turns_not_learned += 1
            self.scorer.ratings.passed_over(finished.turn.request_id)  # a rating of it is recorded, not trained
            return
        self.scorer.submit(finished)


