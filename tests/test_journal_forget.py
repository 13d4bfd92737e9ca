"""Forgetting a person: the journal rewrite (crash points, ENOSPC, queued records), BASE replay,
SampleStore.forget/of, and quarantined spans found by principal."""
import asyncio
import errno
import os
import signal
import traceback
from pathlib import Path

import pytest

from clawd import faults
from clawd.learning.frames import HEADER, encode_ack, encode_append, encode_base, scan_records
from clawd.learning.journal import Journal, JournalWriteError, segment_name
from clawd.learning.journal_files import forget_quarantined, principal_key, quarantined_for
from clawd.learning.store import Forgotten, SampleStore
from clawd.samples import Sample

MARK = b"FORGET-ME-7f3a"  # in every payload that must leave the disk


@pytest.fixture(autouse=True)
def disarmed():
    faults.reset()
    yield
    faults.reset()


def sample(sid: str, principal: str, version: int = 0) -> Sample:
    return Sample(sample_id=sid, mode="rl", session_id="s", turn_index=0, principal=principal,
                  tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1], rollout_logprobs=[-0.5, -1.0],
                  temperature=1.0, reward=1.0, teacher_logprobs=None, has_hint=False,
                  policy_version=version, created=1.0, scored=2.0)


def files_holding(d: Path, needle: bytes) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and needle in p.read_bytes())


def segs(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("journal-*.seg"))


async def reopened(d: Path) -> list[tuple[str, bytes]]:
    j = Journal(d)
    entries = j.open()
    await j.close()
    return entries


OLD = [("k1", b"keep one"), ("f1", b"forget " + MARK), ("k2", b"keep two"), ("f2", MARK + b" again")]
NEW = [("k1", b"keep one"), ("k2", b"keep two")]


async def build_old(d: Path) -> Journal:
    """Three segments: live entries to keep and to forget, and acked bytes holding MARK too."""
    j = Journal(d, segment_bytes=80)
    j.open()
    await j.append("acked", b"acked " + MARK)
    await j.ack(["acked"])
    for entry_id, payload in OLD:
        await j.append(entry_id, payload)
    assert len(j.segments) >= 3
    return j


# ---- the rewrite ------------------------------------------------------------------------

async def test_rewrite_keeps_exactly_the_given_entries_across_reopen(tmp_path):
    j = await build_old(tmp_path)
    done = await j.rewrite([("k1", b"keep one"), ("never-appended", b"x"), ("acked", b"y"), ("k2", b"keep two")])
    new = segment_name(j.segments[0])
    assert segs(tmp_path) == [new] and j.live == 2
    assert (tmp_path / new).read_bytes() == HEADER + encode_base() + b"".join(encode_append(*e) for e in NEW)
    assert (done.kept, done.bytes_after, done.left) == (2, (tmp_path / new).stat().st_size, 0)
    assert done.bytes_before > done.bytes_after
    await j.append("k3", b"after")          # the new segment is the active one
    assert await j.ack(["k1", "f1"]) == 1    # f1 is no longer there to ack
    await j.close()
    assert await reopened(tmp_path) == [("k2", b"keep two"), ("k3", b"after")]


async def test_forgotten_and_acked_bytes_are_in_no_file_afterwards(tmp_path):
    j = await build_old(tmp_path)
    assert files_holding(tmp_path, MARK)
    await j.rewrite(NEW)
    assert files_holding(tmp_path, MARK) == []
    await j.close()
    assert await reopened(tmp_path) == NEW and files_holding(tmp_path, MARK) == []


async def test_queued_appends_are_written_first_and_kept_when_named_queued_acks_hold(tmp_path):
    j = Journal(tmp_path)
    j.open()
    for entry_id, payload in OLD:
        await j.append(entry_id, payload)
    # queued in this loop iteration, not yet written when the rewrite starts
    results = await asyncio.gather(j.append("q1", b"queued"), j.ack(["k2"]),
                                   j.rewrite([*NEW, ("q1", b"queued")]))
    assert results[1] == 1 and results[2].kept == 2  # k2's ack went first: it is not live any more
    assert files_holding(tmp_path, b"keep two") == []  # nor are its bytes on disk
    await j.close()
    assert await reopened(tmp_path) == [("k1", b"keep one"), ("q1", b"queued")]


async def test_a_failed_queued_write_fails_the_rewrite_and_changes_nothing(tmp_path):
    j = Journal(tmp_path)
    j.open()
    await j.append("k1", b"keep one")
    faults.arm("journal.write", "enospc", at=1)
    got = await asyncio.gather(j.append("q1", b"q"), j.rewrite([]), return_exceptions=True)
    assert all(isinstance(e, JournalWriteError) and e.errno == errno.ENOSPC for e in got)
    await j.close()
    assert await reopened(tmp_path) == [("k1", b"keep one")]


@pytest.mark.parametrize("point", ["journal.rewrite.write", "journal.rewrite.fsync", "journal.rewrite.rename",
                                   "journal.rewrite.dirsync"])
async def test_a_failed_rewrite_leaves_the_old_journal_whole_and_usable(tmp_path, point):
    j = await build_old(tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in segs(tmp_path)}
    faults.arm(point, "enospc", at=1)
    with pytest.raises(JournalWriteError, match="rewrite failed") as err:
        await j.rewrite(NEW)
    assert err.value.errno == errno.ENOSPC and faults.passes(point) == 1 and j.write_failures == 1
    assert {name: (tmp_path / name).read_bytes() for name in segs(tmp_path)} == before  # no new segment
    assert not list(tmp_path.glob("*.tmp"))
    await j.append("k3", b"after")
    assert await j.ack(["f1"]) == 1
    done = await j.rewrite(NEW + [("k3", b"after")])  # room again: the retry goes through
    assert done.kept == 3 and files_holding(tmp_path, MARK) == []
    await j.close()
    assert await reopened(tmp_path) == NEW + [("k3", b"after")]


async def test_a_superseded_segment_that_cannot_be_deleted_is_retried_by_compaction(tmp_path):
    j = await build_old(tmp_path)
    first = segs(tmp_path)[0]
    faults.arm("journal.rewrite.delete", "eio", at=1)
    done = await j.rewrite(NEW)
    assert done.left == 1 and segs(tmp_path)[0] == first and len(segs(tmp_path)) == 2
    assert await reopened_copy(tmp_path) == NEW  # were it to crash now, BASE supersedes it
    assert [p.name for p in j.compact()] == [first] and segs(tmp_path) == [segment_name(j.segments[0])]
    await j.close()
    assert await reopened(tmp_path) == NEW and files_holding(tmp_path, MARK) == []


async def reopened_copy(d: Path) -> list[tuple[str, bytes]]:
    copy = d.parent / (d.name + "-copy")
    copy.mkdir()
    for name in segs(d):
        (copy / name).write_bytes((d / name).read_bytes())
    return await reopened(copy)


# ---- crash points: SIGKILL in a forked child at each step ----------------------------------

async def _child_rewrite(d: str, point: str | None, at: int) -> None:
    j = Journal(d)
    j.open()
    if point:
        faults.arm(point, "kill", at=at)
    await j.rewrite(NEW)
    os.kill(os.getpid(), signal.SIGKILL)  # a crash right after: nothing closed


def fork_rewrite(d: Path, point: str | None, at: int) -> None:
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        try:
            asyncio.run(_child_rewrite(str(d), point, at))
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(70)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


@pytest.mark.parametrize("point,at,expect", [
    ("journal.rewrite.write", 1, "old"),
    ("journal.rewrite.fsync", 1, "old"),
    ("journal.rewrite.rename", 1, "old"),    # the new segment whole, under its .tmp name
    ("journal.rewrite.dirsync", 1, "new"),   # renamed, not yet a single old segment deleted
    ("journal.rewrite.delete", 1, "new"),
    ("journal.rewrite.delete", 2, "new"),    # some old segments deleted, some not
    (None, 0, "new"),
])
def test_a_crash_at_any_step_of_the_rewrite_replays_the_old_or_the_new_journal_whole(tmp_path, point, at, expect):
    async def setup():
        await (await build_old(tmp_path)).close()
    asyncio.run(setup())
    old_segments = segs(tmp_path)
    fork_rewrite(tmp_path, point, at)
    if point:
        assert len(segs(tmp_path)) > 1  # the kill came before the rewrite was done
    entries = asyncio.run(reopened(tmp_path))
    if expect == "old":
        assert entries == OLD and segs(tmp_path) == old_segments
    else:
        assert entries == NEW and len(segs(tmp_path)) == 1 and files_holding(tmp_path, MARK) == []
    assert not list(tmp_path.glob("*.tmp")) and not (tmp_path / "quarantine").exists()


# ---- BASE at replay ---------------------------------------------------------------------

async def test_segments_before_a_base_segment_are_deleted_unread_and_never_quarantined(tmp_path):
    damaged = HEADER + encode_append("f1", MARK) + b"\xffJR\xc1garbage" + encode_append("f2", MARK)
    (tmp_path / segment_name(1)).write_bytes(damaged)
    (tmp_path / segment_name(2)).write_bytes(HEADER + encode_append("f3", MARK))
    (tmp_path / segment_name(3)).write_bytes(HEADER + encode_base() + encode_append("k1", b"keep one"))
    (tmp_path / segment_name(4)).write_bytes(HEADER + encode_append("k2", b"keep two") + encode_ack(["k1"]))
    j = Journal(tmp_path)
    assert j.open() == [("k2", b"keep two")]
    assert segs(tmp_path) == [segment_name(3), segment_name(4)] and j.quarantined_records == 0
    assert files_holding(tmp_path, MARK) == []
    await j.close()


def test_a_base_record_anywhere_but_a_segments_start_is_damage():
    ok = scan_records(HEADER + encode_base() + encode_append("a", b"1"))
    assert [kind for kind, _ in ok.records] == [3, 1] and ok.damaged == []
    late = HEADER + encode_append("a", b"1") + encode_base() + encode_append("b", b"2")
    scan = scan_records(late)
    at = len(HEADER) + len(encode_append("a", b"1"))
    assert scan.records == [(1, ("a", b"1")), (1, ("b", b"2"))]
    assert scan.damaged == [(at, len(encode_base()), "BASE record past a segment's start")]


# ---- the store ----------------------------------------------------------------------------

ALICE = "alice-7f3a"  # her name is the marker: it appears in her samples' bytes and nowhere else


async def open_store(path) -> SampleStore:
    store = SampleStore(Journal(path, segment_bytes=4096))
    await store.replay()
    return store


async def test_forget_removes_waiting_and_marks_in_flight_which_is_never_requeued(tmp_path):
    store = await open_store(tmp_path)
    for s in [sample("a1", ALICE), sample("b1", "bob"), sample("a2", ALICE), sample("b2", "bob"),
              sample("a3", ALICE), sample("c1", "carol", version=-9)]:
        await store.put(s)
    batch, stale = store.take_batch(2, current_version=0, max_staleness=4)
    assert [s.sample_id for s in batch] == ["a1", "b1"] and [s.sample_id for s in stale] == ["c1"]
    assert [s.sample_id for s in store.of(ALICE)] == ["a2", "a3", "a1"]  # waiting, then in flight
    got = await store.forget(ALICE)
    held = [("b1", sample("b1", "bob")), ("b2", sample("b2", "bob"))]
    size = len(HEADER + encode_base()) + sum(len(encode_append(i, s.to_json())) for i, s in held)
    assert got == Forgotten(waiting=2, in_flight=1, quarantined=0, journal_bytes_before=got.journal_bytes_before,
                            journal_bytes_after=size)
    assert got.journal_bytes_before > size
    assert store.of(ALICE) == [] and [s.sample_id for s in store.of("bob")] == ["b2", "b1"]
    assert store.waiting_by_principal() == {"bob": 1} and store.depth == 2 and store.in_flight == 2
    assert files_holding(tmp_path, ALICE.encode()) == []
    store.requeue(batch)  # the step failed: only bob's sample comes back
    assert [s.sample_id for s in store.of("bob")] == ["b1", "b2"] and store.in_flight == 0
    assert store.of(ALICE) == []
    await store.journal.close()
    again = await open_store(tmp_path)
    assert [s.sample_id for s in again.of("bob")] == ["b1", "b2"] and again.waiting == 2
    await again.journal.close()


async def test_a_forgotten_sample_in_flight_is_acked_later_without_error(tmp_path):
    store = await open_store(tmp_path)
    for s in [sample("a1", ALICE), sample("b1", "bob")]:
        await store.put(s)
    batch, _ = store.take_batch(2, current_version=0, max_staleness=4)
    got = await store.forget(ALICE)
    assert (got.waiting, got.in_flight) == (0, 1)
    assert await store.ack([s.sample_id for s in batch]) == 1  # only b1 was still in the journal
    assert store.in_flight == 0 and store.depth == 0
    again = await store.forget(ALICE)  # nothing left: a second forget is a no-op rewrite
    assert (again.waiting, again.in_flight) == (0, 0)
    await store.journal.close()
    assert await reopened(tmp_path) == []


async def test_puts_racing_a_forget_are_kept_and_the_forgotten_persons_are_not(tmp_path):
    store = await open_store(tmp_path)
    await store.put(sample("a0", ALICE))
    # all queued in one loop iteration: their appends are not yet written when forget runs
    racing = [store.put(sample(f"b{i}", "bob")) for i in range(5)] + [store.put(sample("a1", ALICE))]
    got = await asyncio.gather(*racing, store.forget(ALICE), store.put(sample("b5", "bob")))
    assert got[-2].waiting == 1
    assert [s.sample_id for s in store.of("bob")] == [f"b{i}" for i in range(6)] and store.of(ALICE) == []
    assert store.depth == 6 and files_holding(tmp_path, ALICE.encode()) == []
    await store.journal.close()
    assert [i for i, _ in await reopened(tmp_path)] == [f"b{i}" for i in range(6)]


async def test_a_forget_whose_rewrite_fails_still_takes_the_samples_out_of_training(tmp_path):
    store = await open_store(tmp_path)
    await store.put(sample("a1", ALICE))
    await store.put(sample("b1", "bob"))
    faults.arm("journal.rewrite.write", "enospc", at=1)
    with pytest.raises(JournalWriteError):
        await store.forget(ALICE)
    assert store.of(ALICE) == [] and store.waiting == 1
    got = await store.forget(ALICE)  # the caller's retry
    assert got.waiting == 0 and files_holding(tmp_path, ALICE.encode()) == []
    await store.journal.close()


# ---- quarantined spans ----------------------------------------------------------------------

def test_principal_key_is_the_json_encoding_of_the_name():
    assert principal_key("alice") == b'"principal":"alice"'
    assert principal_key('zo\u00eb "z"') == b'"principal":"zo\\u00eb \\"z\\""'
    assert principal_key('zo\u00eb "z"') in sample("x", 'zo\u00eb "z"').to_json()


def test_quarantine_files_naming_a_principal_are_found_and_deleted(tmp_path):
    q = tmp_path / "quarantine"
    q.mkdir()
    cut = encode_append("x", sample("x", "alice").to_json())
    files = {"a.bad": b"\x00junk" + cut[20:] + b"junk",               # a record cut in two, its key intact
             "b.bad": encode_append("y", sample("y", "bob").to_json()),
             "c.bad": encode_append("z", sample("z", "alicex").to_json()),  # another name with alice's prefix
             "d.bad": cut + encode_append("y", sample("y", "bob").to_json()),  # two people: each one's
             "e.bad": cut.replace(b"alice", b"alicf"),                 # the damage hit the name: nobody's
             "f.txt": cut}                                             # not a quarantine file
    for name, data in files.items():
        (q / name).write_bytes(data)
    assert [p.name for p in quarantined_for(tmp_path, "alice")] == ["a.bad", "d.bad"]
    assert [p.name for p in quarantined_for(tmp_path, "bob")] == ["b.bad", "d.bad"]
    assert quarantined_for(tmp_path / "nowhere", "alice") == []
    assert [p.name for p in forget_quarantined(tmp_path, "alice")] == ["a.bad", "d.bad"]
    assert sorted(p.name for p in q.iterdir()) == ["b.bad", "c.bad", "e.bad", "f.txt"]


async def test_store_forget_deletes_the_quarantined_span_of_a_damaged_record(tmp_path):
    store = await open_store(tmp_path)
    for s in [sample("b1", "bob"), sample("a1", ALICE), sample("b2", "bob")]:
        await store.put(s)
    await store.journal.close()
    path = tmp_path / segment_name(1)
    data = bytearray(path.read_bytes())
    data[data.index(b'"reward"', data.index(ALICE.encode())) + 2] ^= 0x01  # a bit flip in alice's record, away from her name
    path.write_bytes(bytes(data))
    store = await open_store(tmp_path)
    assert store.journal.quarantined_records == 1 and store.of(ALICE) == []
    assert [p.parent.name for p in quarantined_for(tmp_path, ALICE)] == ["quarantine"]
    got = await store.forget(ALICE)
    assert (got.waiting, got.quarantined) == (0, 1) and files_holding(tmp_path, ALICE.encode()) == []
    assert [s.sample_id for s in store.of("bob")] == ["b1", "b2"]
    await store.journal.close()
