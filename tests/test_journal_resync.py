"""The journal's resynchronising reader, quarantine, format-1 segments and failed writes (fault points)."""
import asyncio
import errno
import logging
import os
import struct
import zlib
from pathlib import Path

import pytest

from clawd import faults
from clawd.learning.frames import ACK, APPEND, HEADER, MAGIC, RECORD_MAGIC, encode_ack, encode_append
from clawd.learning.journal import Journal, JournalWriteError, segment_name

IDS = [f"e{i:03d}" for i in range(100)]


@pytest.fixture(autouse=True)
def disarmed():
    faults.reset()
    yield
    faults.reset()


def records() -> list[bytes]:
    return [encode_append(i, f"payload {i}".encode() * 3) for i in IDS]


def starts_of(recs: list[bytes]) -> list[int]:
    out = [len(HEADER)]
    for r in recs:
        out.append(out[-1] + len(r))
    return out


def write_segment(d: Path, data: bytes, seq: int = 1) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    path = d / segment_name(seq)
    path.write_bytes(data)
    return path


def expected(ids) -> list[tuple[str, bytes]]:
    return [(i, f"payload {i}".encode() * 3) for i in ids]


async def replay(d: Path, **kw) -> tuple[list, Journal]:
    j = Journal(d, **kw)
    entries = j.open()
    return entries, j


async def entries_of(d: Path) -> list[tuple[str, bytes]]:
    entries, j = await replay(d)
    await j.close()
    return entries


def quarantined(d: Path, segment: str, offset: int) -> bytes:
    """The bytes set aside from `segment` at `offset`; the file name ends in their CRC32."""
    (path,) = (d / "quarantine").glob(f"{segment}-{offset}-*.bad")
    blob = path.read_bytes()
    assert path.name == f"{segment}-{offset}-{zlib.crc32(blob):08x}.bad"
    return blob


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "clawd.journal" and r.levelno == logging.WARNING]


# ---- damage in the middle -------------------------------------------------------

async def test_a_bit_flip_mid_segment_loses_exactly_that_record(tmp_path, caplog):
    recs = records()
    starts = starts_of(recs)
    data = bytearray(HEADER + b"".join(recs))
    data[starts[50] + 20] ^= 0x04  # inside record 50's body
    path = write_segment(tmp_path, bytes(data))
    caplog.set_level(logging.WARNING, "clawd.journal")
    entries, j = await replay(tmp_path)
    assert entries == expected(IDS[:50] + IDS[51:])
    assert (j.quarantined_records, j.quarantined_bytes) == (1, len(recs[50]))
    assert (j.stats()["quarantined_records"], j.stats()["quarantined_bytes"]) == (1, len(recs[50]))
    blob = bytes(data[starts[50]:starts[51]])
    assert quarantined(tmp_path, segment_name(1), starts[50]) == blob
    assert warnings_of(caplog) == [f"{path}: CRC mismatch at offset {starts[50]}: {len(recs[50])} bytes moved to "
                                   f"quarantine/{path.name}-{starts[50]}-{zlib.crc32(blob):08x}.bad; "
                                   "the records around them are kept"]
    assert path.read_bytes() == HEADER + b"".join(recs[:50] + recs[51:])  # rewritten without the span
    await j.append("new", b"n")
    await j.close()
    entries, j = await replay(tmp_path)
    assert entries == expected(IDS[:50] + IDS[51:]) + [("new", b"n")] and j.quarantined_records == 0
    await j.close()


@pytest.mark.parametrize("flip", [(0, 0x01), (0, 0x80), (1, 0x10), (3, 0x40)])  # (byte of the length, bit)
async def test_a_flipped_length_field_loses_only_its_record(tmp_path, flip):
    recs = records()
    starts = starts_of(recs)
    data = bytearray(HEADER + b"".join(recs))
    data[starts[50] + len(RECORD_MAGIC) + flip[0]] ^= flip[1]  # length smaller, larger, huge
    write_segment(tmp_path, bytes(data))
    entries, j = await replay(tmp_path)
    assert entries == expected(IDS[:50] + IDS[51:])
    assert (j.quarantined_records, j.quarantined_bytes) == (1, len(recs[50]))
    await j.close()


async def test_garbage_between_records_is_quarantined_and_no_record_lost(tmp_path):
    recs = records()
    garbage = b"junk" + RECORD_MAGIC + b"\x10\x00\x00\x00" + b"not a crc" + RECORD_MAGIC[:2] + b"\x00" * 7
    data = HEADER + b"".join(recs[:10]) + garbage + b"".join(recs[10:])
    path = write_segment(tmp_path, data)
    entries, j = await replay(tmp_path)
    assert entries == expected(IDS)
    assert (j.quarantined_records, j.quarantined_bytes) == (1, len(garbage))
    offset = starts_of(recs)[10]
    assert quarantined(tmp_path, path.name, offset) == garbage
    assert path.read_bytes() == HEADER + b"".join(recs)
    await j.close()


async def test_two_damaged_spans_are_two_quarantined_records(tmp_path, caplog):
    recs = records()
    starts = starts_of(recs)
    data = bytearray(HEADER + b"".join(recs))
    data[starts[3] + 1] ^= 0xFF   # record 3's magic
    data[starts[98] + 9] ^= 0x01  # record 98's CRC
    write_segment(tmp_path, bytes(data))
    caplog.set_level(logging.WARNING, "clawd.journal")
    entries, j = await replay(tmp_path)
    assert entries == expected(IDS[:3] + IDS[4:98] + IDS[99:])
    assert j.quarantined_records == 2 and len(warnings_of(caplog)) == 2
    assert len(list((tmp_path / "quarantine").iterdir())) == 2
    assert quarantined(tmp_path, segment_name(1), starts[3]) == bytes(data[starts[3]:starts[4]])
    assert quarantined(tmp_path, segment_name(1), starts[98]) == bytes(data[starts[98]:starts[99]])
    await j.close()


async def test_damage_in_an_earlier_segment_is_quarantined_and_the_rest_replays(tmp_path):
    recs = [encode_append("a1", b"1"), encode_append("a2", b"2"), encode_ack(["a1", "a2"]), encode_append("a3", b"3")]
    starts = starts_of(recs)
    data = bytearray(HEADER + b"".join(recs))
    data[starts[2] + 14] ^= 0x01  # the ACK: its entries come back (they are trained again: at least once)
    write_segment(tmp_path, bytes(data), seq=1)
    write_segment(tmp_path, HEADER + encode_append("b1", b"4") + encode_ack(["a3"]), seq=2)
    entries, j = await replay(tmp_path)
    assert entries == [("a1", b"1"), ("a2", b"2"), ("b1", b"4")]
    assert j.quarantined_records == 1 and j.segments == [1, 2]
    await j.append("c", b"")  # the last segment is still the active one
    await j.close()
    assert (tmp_path / segment_name(1)).read_bytes() == HEADER + b"".join(recs[:2] + recs[3:])
    assert sorted(p.name for p in tmp_path.glob("journal-*.seg")) == [segment_name(1), segment_name(2)]


async def test_a_cut_record_in_an_earlier_segment_is_damage_not_a_torn_tail(tmp_path):
    recs = records()[:3]
    write_segment(tmp_path, HEADER + b"".join(recs) + recs[0][:9], seq=1)
    write_segment(tmp_path, HEADER, seq=2)
    entries, j = await replay(tmp_path)
    assert entries == expected(IDS[:3]) and (j.quarantined_records, j.quarantined_bytes, j.truncations) == (1, 9, 0)
    await j.close()


# ---- torn tails -------------------------------------------------------------------

@pytest.mark.parametrize("tail", [b"cut", b"zeros"])
async def test_a_torn_tail_is_cut_not_quarantined(tmp_path, tail):
    recs = records()[:5]
    extra = recs[4][:len(recs[4]) - 3] if tail == b"cut" else bytes(4096)
    path = write_segment(tmp_path, HEADER + b"".join(recs[:4]) + extra)
    entries, j = await replay(tmp_path)
    assert entries == expected(IDS[:4])
    assert (j.truncations, j.quarantined_records) == (1, 0) and not (tmp_path / "quarantine").exists()
    assert path.read_bytes() == HEADER + b"".join(recs[:4])
    await j.close()


# ---- format 1 ---------------------------------------------------------------------

def v1_frame(body: bytes) -> bytes:
    """The format-1 layout, spelled out here so the test pins what the older release wrote."""
    return struct.pack("<II", len(body), zlib.crc32(body)) + body


def v1_append(entry_id: str, payload: bytes) -> bytes:
    return v1_frame(bytes([APPEND]) + struct.pack("<H", len(entry_id)) + entry_id.encode() + payload)


def v1_ack(ids: list[str]) -> bytes:
    return v1_frame(bytes([ACK]) + struct.pack("<I", len(ids))
                    + b"".join(struct.pack("<H", len(i)) + i.encode() for i in ids))


V1_HEADER = MAGIC + struct.pack("<I", 1)


async def test_format_1_segments_replay_and_new_writes_go_to_a_format_2_segment(tmp_path):
    write_segment(tmp_path, V1_HEADER + v1_append("old1", b"x") + v1_append("old2", b"y"), seq=7)
    write_segment(tmp_path, V1_HEADER + v1_ack(["old1"]) + v1_append("old3", b"z"), seq=8)
    entries, j = await replay(tmp_path)
    assert entries == [("old2", b"y"), ("old3", b"z")] and j.quarantined_records == 0
    assert j.segments == [7, 8, 9]
    await j.append("new", b"n")
    await j.ack(["old2"])
    await j.close()
    assert (tmp_path / segment_name(9)).read_bytes() == HEADER + encode_append("new", b"n") + encode_ack(["old2"])
    entries, j = await replay(tmp_path)
    assert entries == [("old3", b"z"), ("new", b"n")]
    await j.close()


async def test_format_1_damage_quarantines_the_rest_of_its_segment(tmp_path):
    recs = [v1_append("a", b"1"), v1_append("b", b"2"), v1_append("c", b"3")]
    data = bytearray(V1_HEADER + b"".join(recs))
    bad_at = len(V1_HEADER) + len(recs[0])
    data[bad_at + 9] ^= 0x02  # record b: format 1 cannot find c again
    first = write_segment(tmp_path, bytes(data), seq=1)
    write_segment(tmp_path, V1_HEADER + v1_append("d", b"4") + v1_append("e", b"5")[:6], seq=2)  # torn tail
    entries, j = await replay(tmp_path)
    assert entries == [("a", b"1"), ("d", b"4")]
    assert (j.quarantined_records, j.quarantined_bytes, j.truncations) == (1, len(data) - bad_at, 2)
    assert quarantined(tmp_path, first.name, bad_at) == bytes(data[bad_at:])
    assert first.read_bytes() == V1_HEADER + recs[0]
    await j.close()


# ---- failed writes ----------------------------------------------------------------

async def test_enospc_at_write_fails_that_commit_only_and_the_journal_goes_on(tmp_path):
    j = Journal(tmp_path, fsync="always")
    j.open()
    faults.arm("journal.write", "enospc", at=3)
    ok = []
    for i in range(2):
        await j.append(f"s{i}", b"x")
        ok.append(f"s{i}")
    results = await asyncio.gather(*(j.append(f"g{i}", b"x") for i in range(3)), return_exceptions=True)
    assert [type(r) for r in results] == [JournalWriteError] * 3  # one group commit, all its callers told
    assert all(r.errno == errno.ENOSPC and isinstance(r, OSError) for r in results)
    assert j.write_failures == 1 and faults.passes("journal.write") == 3
    size = (tmp_path / segment_name(1)).stat().st_size
    assert size == len(HEADER) + sum(len(encode_append(i, b"x")) for i in ok)
    for i in range(3):  # the disk has room again; the failed ids are free
        await j.append(f"g{i}", b"again")
    assert await j.ack(["s0"]) == 1
    await j.close()
    entries, j2 = await replay(tmp_path)
    assert entries == [("s1", b"x"), ("g0", b"again"), ("g1", b"again"), ("g2", b"again")]
    assert j2.quarantined_records == 0
    await j2.close()


async def test_a_failed_ack_leaves_its_ids_live(tmp_path):
    j = Journal(tmp_path)
    j.open()
    await j.append("a", b"")
    faults.arm("journal.write", "eio", at=1)
    with pytest.raises(JournalWriteError) as err:
        await j.ack(["a"])
    assert err.value.errno == errno.EIO
    assert await j.ack(["a"]) == 1
    await j.close()


async def test_a_failed_fsync_with_always_fails_its_commit_and_cuts_it_back(tmp_path):
    j = Journal(tmp_path, fsync="always")
    j.open()
    await j.append("a", b"1")
    size = (tmp_path / segment_name(1)).stat().st_size
    faults.arm("journal.fsync", "eio", at=1)
    with pytest.raises(JournalWriteError) as err:
        await j.append("b", b"2")
    assert err.value.errno == errno.EIO and j.fsync_failures == 1
    assert (tmp_path / segment_name(1)).stat().st_size == size  # its callers were told: it must not come back
    await j.append("c", b"3")
    await j.close()
    assert (await entries_of(tmp_path)) == [("a", b"1"), ("c", b"3")]


async def test_a_failed_interval_fsync_writes_the_records_again_and_retries(tmp_path, monkeypatch):
    j = Journal(tmp_path, fsync="interval", fsync_interval=0.005)
    j.open()
    pwrites = []
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, b, at: pwrites.append((bytes(b), at)) or real_pwrite(fd, b, at))
    faults.arm("journal.fsync", "eio", at=1)
    base = j.fsyncs
    await asyncio.gather(j.append("a", b"1"), j.append("b", b"2"))
    for _ in range(400):  # the timer fails once, then succeeds
        if j.fsyncs > base:
            break
        await asyncio.sleep(0.005)
    assert (j.fsync_failures, j.fsyncs - base) == (1, 1)
    assert pwrites == [(encode_append("a", b"1") + encode_append("b", b"2"), len(HEADER))]
    await j.append("c", b"3")
    await j.close()
    assert (await entries_of(tmp_path)) == [("a", b"1"), ("b", b"2"), ("c", b"3")]


async def test_a_failed_rotation_fails_its_commit_and_the_next_one_rotates(tmp_path):
    j = Journal(tmp_path, segment_bytes=120)
    j.open()
    faults.arm("journal.rotate", "enospc", at=1)
    await j.append("a", bytes(60))
    with pytest.raises(JournalWriteError) as err:
        await j.append("b", bytes(60))
    assert err.value.errno == errno.ENOSPC and j.segments == [1]
    await j.append("b", bytes(60))
    assert j.segments == [1, 2]
    await j.close()
    assert [k for k, _ in (await entries_of(tmp_path))] == ["a", "b"]


async def test_a_partial_write_that_cannot_be_cut_back_is_skipped_at_replay(tmp_path, monkeypatch):
    j = Journal(tmp_path)
    j.open()
    await j.append("a", b"1")
    real_write = os.write

    def full(fd, b):
        real_write(fd, bytes(b)[:7])
        raise OSError(errno.ENOSPC, "No space left on device")

    def no_truncate(fd, size):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(os, "write", full)
    monkeypatch.setattr(os, "ftruncate", no_truncate)
    with pytest.raises(JournalWriteError):
        await j.append("b", b"2")
    monkeypatch.undo()
    await j.append("c", b"3")
    await j.close()
    entries, j2 = await replay(tmp_path)
    assert entries == [("a", b"1"), ("c", b"3")]
    assert (j2.quarantined_records, j2.quarantined_bytes) == (1, 7)
    await j2.close()


async def test_when_the_quarantine_cannot_be_written_the_segment_is_left_as_it_is(tmp_path):
    recs = records()[:5]
    data = bytearray(HEADER + b"".join(recs))
    data[starts_of(recs)[2] + 15] ^= 0x01
    path = write_segment(tmp_path, bytes(data))
    (tmp_path / "quarantine").write_bytes(b"")  # a file in the way: mkdir fails
    entries, j = await replay(tmp_path)
    assert entries == expected(IDS[:2] + IDS[3:5])
    assert (j.quarantined_records, j.quarantine_failures) == (1, 1)
    assert path.read_bytes()[:len(data)] == data
    await j.append("new", b"n")  # written after the damage: resynchronisation finds it
    await j.close()
    (tmp_path / "quarantine").unlink()
    entries, j = await replay(tmp_path)
    assert entries == expected(IDS[:2] + IDS[3:5]) + [("new", b"n")]
    assert (j.quarantined_records, j.quarantine_failures) == (1, 0)
    await j.close()


async def test_a_later_span_at_the_same_offset_does_not_overwrite_the_first(tmp_path):
    recs = records()[:6]
    starts = starts_of(recs)
    path = write_segment(tmp_path, HEADER + b"".join(recs))
    for _ in range(2):  # the same offset twice: the rewrite moved record 3 to where record 2 was
        data = bytearray(path.read_bytes())
        data[starts[2] + 16] ^= 0x08
        path.write_bytes(data)
        _, j = await replay(tmp_path)
        await j.close()
    assert len(list((tmp_path / "quarantine").glob(f"{path.name}-{starts[2]}-*.bad"))) == 2
    assert (await entries_of(tmp_path)) == expected([IDS[0], IDS[1], IDS[4], IDS[5]])


async def test_a_failed_final_fsync_is_raised_by_close_and_the_lock_released(tmp_path):
    j = Journal(tmp_path, fsync_interval=3600)
    j.open()
    await j.append("a", b"1")
    faults.arm("journal.fsync", "eio", at=1)
    with pytest.raises(JournalWriteError) as err:
        await j.close()
    assert err.value.errno == errno.EIO
    entries, j2 = await replay(tmp_path)  # the bytes are in the page cache; the lock is free
    assert entries == [("a", b"1")]
    await j2.close()


def test_a_journal_clawd_will_not_read_exits_3_which_systemd_does_not_restart(tmp_path, tiny_model):
    import subprocess
    import sys

    from clawd.tools.tomlfile import to_toml
    from tests.harness import ROOT

    state = tmp_path / "state"
    (state / "journal").mkdir(parents=True)
    (state / "journal" / "journal-0000000000000001.seg").write_bytes(b"NOTCLAWD" + b"\0" * 64)
    config = tmp_path / "clawd.toml"
    config.write_text(to_toml({"state": {"dir": str(state)}, "model": {"path": str(tiny_model)},
                               "server": {"port": 0}, "learner": {"enabled": False},
                               "scoring": {"mode": "rl"}, "judge": {"backend": "rules"}}))
    done = subprocess.run([sys.executable, "-m", "clawd", "--config", str(config)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert "bad magic" in done.stderr and "not restarted" in done.stderr
