"""The disk budget (clawd.ops.disk): a low or full disk pauses learning, never serving, and the pause
lifts by itself when there is room again; a record write that fails loses its line, not the request."""
from __future__ import annotations

import errno
import json
import time

import openai
import pytest

from clawd import faults
from clawd.ops.disk import MARGIN, DiskBudget
from clawd.pauses import DISK, OPERATOR, Pauses
from clawd.records import RecordWriter

from .fake_sglang import FakeSGLang
from .harness import Daemon, wait_ready_async
from .test_api import Script

GIB = 2**30


class Free:
    """A filesystem whose free space the test sets."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, path) -> int:
        return self.n


def test_under_the_floor_pauses_and_above_it_by_the_margin_lifts(tmp_path):
    pauses, free = Pauses(tmp_path / "pause.json"), Free(2 * GIB)
    disk = DiskBudget(tmp_path, GIB, pauses, free=free)
    disk.poll()
    assert not pauses.learning and disk.snapshot() == {"free_bytes": 2 * GIB, "min_free_bytes": GIB, "full_writes": 0}
    free.n = GIB - 1
    disk.poll()
    assert list(pauses.held) == [DISK] and "1024 MiB free" in pauses.held[DISK].detail
    free.n = GIB + MARGIN - 1  # back above the floor, not yet by the margin: no flapping
    disk.poll()
    assert pauses.learning
    free.n = GIB + MARGIN
    disk.poll()
    assert not pauses.learning


def test_a_full_write_pauses_at_once_and_other_errors_do_not(tmp_path):
    pauses = Pauses(tmp_path / "pause.json")
    disk = DiskBudget(tmp_path, 0, pauses, free=Free(10 * GIB))
    disk.failed(OSError(errno.EIO, "I/O error"))
    assert not pauses.learning
    disk.failed(OSError(errno.ENOSPC, "No space left on device"))
    assert list(pauses.held) == [DISK] and disk.full_writes == 1
    assert pauses.resume() == [DISK]  # the operator cannot lift it while it holds
    disk.poll()  # the space is there after all: the next poll lifts it
    assert not pauses.learning


def test_the_poll_leaves_other_reasons_alone(tmp_path):
    pauses = Pauses(tmp_path / "pause.json")
    pauses.hold(OPERATOR)
    DiskBudget(tmp_path, 0, pauses, free=Free(10 * GIB)).poll()
    assert list(pauses.held) == [OPERATOR]


def test_a_failed_record_write_leaves_no_torn_line_and_the_next_one_lands(tmp_path):
    faults.reset()
    writer = RecordWriter(tmp_path, kind="turns")
    seen = []
    writer.on_error = seen.append
    try:
        assert writer.write({"n": 1}, 0.0)
        faults.arm("records.write", "enospc", at=1)
        assert not writer.write({"n": 2}, 0.0)
        assert writer.write({"n": 3}, 0.0)
    finally:
        faults.reset()
        writer.close()
    lines = (tmp_path / "turns-1970-01-01.jsonl").read_text().splitlines()
    assert [json.loads(line)["n"] for line in lines] == [1, 3]
    assert (writer.written, writer.failed) == (2, 1) and [e.errno for e in seen] == [errno.ENOSPC]


def _status(daemon) -> dict:
    return daemon.get("/debug/process")[1]


def _wait(predicate, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


@pytest.mark.slow
async def test_enospc_on_a_record_write_keeps_serving_and_pauses_learning_until_the_disk_is_back(
        tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV, "records.write=enospc@2")  # the second record line of the daemon
    script = Script(tiny_model)
    async with FakeSGLang(responder=script, eos_id=script.eos) as fake:
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)}, "engine": {"launch": "none", "url": fake.url},
                                   "state": {"min_free_bytes": 0}}, wait_ready=False)
        try:
            await wait_ready_async(daemon)
            client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
            messages = [{"role": "user", "content": "one"}]
            for turn in range(3):  # one session: the failed write must not leak its in-flight count
                reply = await client.chat.completions.create(model="m", messages=messages)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": f"next {turn}"}]
            await client.close()
            # The second line written (a turn's or its judge record) was lost; the rest landed.
            def one_lost():
                snap = _status(daemon)
                return sum(w["failed"] for w in snap["records"].values()) == 1 and snap

            snap = _wait(one_lost)
            assert snap["disk"]["full_writes"] == 1 and snap["chat"]["engine_errors"] == 0
            # The pause was held; the next poll finds the space and lifts it.
            assert "paused by disk (a write failed" in "".join(daemon.lines)
            _wait(lambda: not _status(daemon)["paused"]["learning"], timeout=15)
            assert "pause lifted: disk" in "".join(daemon.lines)
        finally:
            assert daemon.stop() == 0
    assert "Traceback" not in "".join(daemon.lines)


async def test_a_floor_above_the_free_space_starts_with_learning_paused_and_serving(tiny_model, tmp_path):
    script = Script(tiny_model)
    async with FakeSGLang(responder=script, eos_id=script.eos) as fake:
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)}, "engine": {"launch": "none", "url": fake.url},
                                   "state": {"min_free_bytes": 2**62}}, wait_ready=False)
        try:
            await wait_ready_async(daemon)
            client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                 extra_headers={"X-Session-Done": "1"})
            await client.close()
            snap = _status(daemon)
            assert [p["reason"] for p in snap["paused"]["reasons"]] == [DISK] and not snap["paused"]["serving"]
            assert snap["scoring"]["not_learned_while_paused"] >= 1
        finally:
            assert daemon.stop() == 0


def test_a_pause_that_comes_back_soon_after_its_lift_waits_longer_each_time(tmp_path):
    pauses, now = Pauses(tmp_path / "pause.json"), [0.0]
    disk = DiskBudget(tmp_path, GIB, pauses, free=Free(10 * GIB), clock=lambda: now[0])
    waits = []
    for _ in range(4):  # the trainer's write does not fit although the floor is met: held again at once
        pauses.hold(DISK, "the trainer's checkpoint failed")
        held_at = now[0]
        while DISK in pauses.held:
            disk.poll()
            now[0] += 1.0
        waits.append(now[0] - 1.0 - held_at)
    assert waits == [0.0, 5.0, 10.0, 20.0]
    now[0] += 61.0  # a pause long after the last lift is not a relapse
    pauses.hold(DISK)
    disk.poll()
    assert not pauses.learning
