"""Learning's one pause state (clawd.pauses): reasons, the rule that lifts each, persistence."""
from __future__ import annotations

import asyncio
import json

import pytest

from clawd.pauses import DISK, NON_FINITE, OPERATOR, Pauses


def test_reasons_accumulate_and_learning_runs_only_when_none_holds(tmp_path):
    p = Pauses(tmp_path / "pause.json")
    assert not p.learning and not p.serving
    p.hold(NON_FINITE, "3 non-finite steps in a row")
    p.hold(DISK, "512 MiB free, 1 GiB wanted")
    assert p.learning and not p.serving and sorted(p.held) == [DISK, NON_FINITE]
    assert p.lift(NON_FINITE) and not p.lift(NON_FINITE)
    assert p.learning
    assert p.lift(DISK) and not p.learning


def test_an_operator_resume_does_not_lift_a_disk_pause(tmp_path):
    p = Pauses(tmp_path / "pause.json")
    p.hold(OPERATOR, "audit", serving=True)
    p.hold(NON_FINITE)
    p.hold(DISK, "disk full")
    assert p.serving
    assert p.resume() == [DISK]
    assert p.learning and not p.serving
    snap = p.snapshot()
    assert snap["learning"] and [r["reason"] for r in snap["reasons"]] == [DISK]
    assert snap["reasons"][0]["lifted_by"] == "free space (by itself)" and snap["reasons"][0]["detail"] == "disk full"


def test_only_the_operator_pause_stops_serving(tmp_path):
    p = Pauses(tmp_path / "pause.json")
    assert not p.hold(DISK, serving=True).serving


def test_restating_a_reason_keeps_its_since(tmp_path):
    p = Pauses(tmp_path / "pause.json")
    first = p.hold(DISK, "1")
    again = p.hold(DISK, "2")
    assert again.since == first.since and again.detail == "2"


def test_unknown_reason_is_refused(tmp_path):
    with pytest.raises(ValueError):
        Pauses(tmp_path / "pause.json").hold("whim")


def test_every_reason_survives_a_restart(tmp_path):
    p = Pauses(tmp_path / "pause.json")
    p.hold(NON_FINITE, "nan")
    p.hold(OPERATOR, "audit")
    again = Pauses(tmp_path / "pause.json")
    assert again.held == p.held


@pytest.mark.parametrize("start, expected", [("last", [NON_FINITE, OPERATOR]), (True, [NON_FINITE, OPERATOR]),
                                             (False, [NON_FINITE])])
def test_start_paused_touches_the_operator_reason_only(tmp_path, start, expected):
    p = Pauses(tmp_path / "pause.json")
    p.hold(NON_FINITE, "nan")
    p.hold(OPERATOR, "audit")
    assert sorted(Pauses(tmp_path / "pause.json", start).held) == expected
    fresh = Pauses(tmp_path / "none.json", True)
    assert list(fresh.held) == [OPERATOR] and fresh.held[OPERATOR].detail == "admin.start_paused"


def test_an_earlier_release_file_reads_as_an_operator_pause(tmp_path):
    path = tmp_path / "pause.json"
    path.write_text(json.dumps({"learning": True, "serving": True, "since": 1700000000.0, "reason": "audit"}))
    p = Pauses(path)
    assert p.serving and p.held[OPERATOR].since == 1700000000.0 and p.held[OPERATOR].detail == "audit"
    path.write_text(json.dumps({"learning": False, "serving": False, "since": None, "reason": None}))
    assert not Pauses(path).learning


def test_an_unreadable_file_starts_paused(tmp_path):
    path = tmp_path / "pause.json"
    path.write_text("{torn")
    p = Pauses(path)
    assert p.learning and list(p.held) == [OPERATOR] and "unreadable" in p.held[OPERATOR].detail


async def test_until_running_waits_for_the_last_reason(tmp_path):
    p = Pauses(tmp_path / "pause.json")
    await asyncio.wait_for(p.until_running(), 1)
    p.hold(OPERATOR)
    p.hold(DISK)
    waiter = asyncio.ensure_future(p.until_running())
    p.resume()
    await asyncio.sleep(0.01)
    assert not waiter.done()
    p.lift(DISK)
    await asyncio.wait_for(waiter, 1)


def test_a_failed_save_keeps_the_state_in_memory(tmp_path, caplog):
    p = Pauses(tmp_path / "missing-dir" / "pause.json")
    p.hold(DISK, "full")
    assert p.learning and "could not save the pause state" in caplog.text
