"""clawd.scoring.handover: finished turns pass privacy in slices of the loop, in the order they finished.

A turn whose PII scan is costly (digit-dense text) must not hold the event loop: the old handover scanned it
whole inside the chat request that finished it (~1 s for 8 KB of "2024-01-02 ", ~seconds for a few such
messages), and nothing else ran meanwhile."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace

from clawd.pauses import Pauses
from clawd.privacy.policy import Privacy
from clawd.config.privacy import PrivacyConfig
from clawd.records import RecordWriter
from clawd.scoring.handover import TurnHandover
from clawd.turns import FinishedTurn, Turn

from .loop_turns import LoopTurns

T0 = 1_790_000_000.0
HEAVY = "0123456  " * 4000 + "call +44 20 7946 0958"  # thousands of possible phones: many slices


class Scoring:
    """Stands in for the scorer: the turns submitted, in order."""

    def __init__(self):
        self.submitted: list[str] = []

    def submit(self, finished: FinishedTurn) -> None:
        self.submitted.append(finished.turn.request_id)


def _finished(n: int, content: str = "What is 2+2?") -> FinishedTurn:
    turn = Turn(session_id="s", turn_index=n, principal="alice", request_id=f"chatcmpl-{n}", rid=f"r{n}",
                prompt_ids=[1, 2, 3], response_ids=[4, 5], response_logprobs=[-0.5, -0.25], temperature=1.0,
                messages=[{"role": "user", "content": content}], tools=None,
                reply={"role": "assistant", "content": "4."}, finish_reason="stop", policy_version=0,
                weight_version="0", created=T0)
    return FinishedTurn(turn, [{"role": "user", "content": "Thanks!"}], None, T0 + n)


def _handover(tmp_path, tasks: list) -> tuple[TurnHandover, Scoring, RecordWriter]:
    scoring = Scoring()
    records = RecordWriter(tmp_path / "records")

    def spawn(coro, name=None):
        task = asyncio.get_running_loop().create_task(coro, name=name)
        tasks.append(task)
        return task

    handover = TurnHandover(records, scoring, Pauses(tmp_path / "pause.json", False), Privacy(PrivacyConfig()),
                            spawn=spawn)
    return handover, scoring, records


def _recorded(records: RecordWriter) -> list[str]:
    return [json.loads(line)["request_id"] for path in records.files() for line in path.read_text().splitlines()]


def test_a_cheap_turn_is_handed_over_at_once(tmp_path):
    async def main():
        tasks: list = []
        handover, scoring, records = _handover(tmp_path, tasks)
        handover(_finished(1))
        assert scoring.submitted == ["chatcmpl-1"] and tasks == [] and handover.stats.deferred == 0
        assert _recorded(records) == ["chatcmpl-1"]

    asyncio.run(main())


def test_a_costly_scan_runs_in_slices_while_the_loop_serves_and_turns_keep_their_order(tmp_path):
    async def main():
        tasks: list = []
        handover, scoring, records = _handover(tmp_path, tasks)
        async with LoopTurns() as turns:
            handover(_finished(1, HEAVY))
            handover(_finished(2))  # cheap, but finished after: waits behind the first
            assert scoring.submitted == [] and handover.waiting == 2 and handover.stats.deferred == 1
            before = turns.count
            await handover.flush()
            assert turns.count - before >= 3  # the loop ran other work between the slices of the scan
        assert scoring.submitted == ["chatcmpl-1", "chatcmpl-2"]
        assert _recorded(records) == ["chatcmpl-1", "chatcmpl-2"]
        assert handover.waiting == 0 and all(t.done() for t in tasks)
        # The costly turn's phone was found, and its record redacted.
        first = json.loads(records.files()[0].read_text().splitlines()[0])
        assert "+44 20 7946 0958" not in first["messages"][0]["content"] and first["pii"]["phone"] >= 1

    asyncio.run(main())


def test_a_scan_that_fails_loses_its_turn_only(tmp_path, caplog):
    async def main():
        tasks: list = []
        handover, scoring, records = _handover(tmp_path, tasks)
        real = handover.privacy.scan_turn

        def scan_turn(finished):
            if finished.turn.request_id == "chatcmpl-1":
                yield from real(finished)
                raise RuntimeError("a defect in detection")
            yield from real(finished)

        handover.privacy.scan_turn = scan_turn
        handover(_finished(1, HEAVY))
        handover(_finished(2))
        await handover.flush()
        assert scoring.submitted == ["chatcmpl-2"] and handover.stats.failed == 1

    asyncio.run(main())
    assert "the PII scan of a turn failed" in caplog.text


def test_a_forget_drops_the_persons_turns_still_waiting_for_their_scan(tmp_path):
    async def main():
        tasks: list = []
        handover, scoring, records = _handover(tmp_path, tasks)
        bob = _finished(3)
        bob = FinishedTurn(replace(bob.turn, principal="bob"), bob.next_state, bob.reason, bob.finished)
        handover(_finished(1, HEAVY))  # alice's, being scanned
        handover(bob)
        handover(_finished(2))  # alice's, waiting
        assert handover.forget("alice") == 2
        await handover.flush()
        assert scoring.submitted == ["chatcmpl-3"] and _recorded(records) == ["chatcmpl-3"]

    asyncio.run(main())


def test_a_scan_that_fails_at_once_does_not_fail_the_caller(tmp_path, caplog):
    async def main():
        tasks: list = []
        handover, scoring, records = _handover(tmp_path, tasks)

        def scan_turn(finished):
            raise RuntimeError("a defect in detection")
            yield

        handover.privacy.scan_turn = scan_turn
        handover(_finished(1))  # inside the request that finished it: it must not raise there
        assert scoring.submitted == [] and handover.stats.failed == 1 and tasks == []

    asyncio.run(main())
    assert "the PII scan of a turn failed" in caplog.text
