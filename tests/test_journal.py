"""The sample journal: framing, replay, torn tails, bit flips, rotation, compaction, fsync policy, SIGKILL."""
import asyncio
import errno
import os
import random
import signal
import struct
import subprocess
import sys
import time
import traceback
import zlib
from pathlib import Path

import pytest

from clawd.learning.frames import ACK, APPEND, HEADER, RECORD_MAGIC, encode_ack, encode_append, scan_records
from clawd.learning.journal import Journal, JournalError, JournalWriteError, segment_name
from tests import journal_writer

WRITER = Path(__file__).with_name("journal_writer.py")


def segs(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("journal-*.seg"))


def reopen(d: Path, **kw) -> tuple[list[tuple[str, bytes]], Journal]:
    j = Journal(d, **kw)
    return j.open(), j


def model(records: list[bytes]) -> list[tuple[str, bytes]]:
    """What replaying exactly these framed records must give."""
    live: dict[str, bytes] = {}
    for kind, value in scan_records(HEADER + b"".join(records)).records:
        if kind == APPEND:
            live[value[0]] = value[1]
        else:
            for i in value:
                live.pop(i, None)
    return list(live.items())


# A small segment with both record kinds; payloads include empty and binary ones.
RECORDS = [encode_append("s1", b"alpha"), encode_append("s2", b""), encode_append("s3", bytes(range(40))),
           encode_ack(["s1"]), encode_append("s4", b"\x00\xff" * 7), encode_ack(["s2", "s3"]),
           encode_append("s5", "ünï".encode())]


def write_segment(d: Path, records: list[bytes], seq: int = 1) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    path = d / segment_name(seq)
    path.write_bytes(HEADER + b"".join(records))
    return path


def test_framing_is_magic_length_crc_type_payload():
    rec = encode_append("ab", b"xyz")
    body = bytes([APPEND]) + struct.pack("<H", 2) + b"ab" + b"xyz"
    length = struct.pack("<I", len(body))
    assert RECORD_MAGIC == b"\xffJR\xc1"
    assert rec == RECORD_MAGIC + length + struct.pack("<I", zlib.crc32(length + body)) + body
    assert rec == bytes.fromhex("ff4a52c1 08000000 26a35e07 01 0200 6162 78797a".replace(" ", ""))
    assert HEADER == b"CLAWDJNL" + struct.pack("<I", 2)
    assert scan_records(HEADER + rec + encode_ack(["ab"])).records == [(APPEND, ("ab", b"xyz")), (ACK, ["ab"])]


async def test_replay_returns_unacked_entries_in_append_order(tmp_path):
    j = Journal(tmp_path)
    assert j.open() == []
    await asyncio.gather(*(j.append(f"g{i}", b"%d" % i) for i in range(5)))  # one group commit
    for i in range(5):
        await j.append(f"q{i}", b"q")
    assert await j.ack(["g1", "q0", "nope", "g1"]) == 2
    await j.close()
    entries, j2 = reopen(tmp_path)
    assert [k for k, _ in entries] == ["g0", "g2", "g3", "g4", "q1", "q2", "q3", "q4"]
    assert dict(entries)["g3"] == b"3" and j2.live == 8
    await j2.close()


async def test_duplicate_ids_refused_unknown_acks_write_nothing(tmp_path):
    j = Journal(tmp_path)
    j.open()
    await j.append("a", b"")
    with pytest.raises(ValueError, match="already"):
        await j.append("a", b"")
    records = j.records_written
    assert await j.ack(["zzz"]) == 0 and j.records_written == records
    await j.ack(["a"])
    await j.append("a", b"again")  # an acked id may come back
    await j.close()
    assert reopen(tmp_path)[0] == [("a", b"again")]


@pytest.mark.parametrize("last", [encode_append("s6", b"the last one" * 3), encode_ack(["s4", "s5"])])
async def test_truncation_at_every_byte_of_last_record_recovers_the_records_before_it(tmp_path, last):
    body = b"".join(RECORDS)
    start = len(HEADER) + len(body)
    for cut in range(len(last)):
        d = tmp_path / f"cut{cut}"
        path = write_segment(d, RECORDS + [last[:cut]])
        entries, j = reopen(d)
        assert entries == model(RECORDS), cut
        assert path.stat().st_size == start and j.truncations == (1 if cut else 0)
        await j.append("after", b"x")  # appending continues where the good records end
        await j.close()
        assert reopen(d)[0] == model(RECORDS) + [("after", b"x")]
    whole, _ = reopen(write_segment(tmp_path / "whole", RECORDS + [last]).parent)
    assert whole == model(RECORDS + [last])


def test_every_single_bit_flip_in_a_segment_loses_only_the_record_it_hits(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # ~1,000 replays; durability is not under test here
    clean = HEADER + b"".join(RECORDS)
    starts = [len(HEADER)]
    for r in RECORDS:
        starts.append(starts[-1] + len(r))
    d = tmp_path / "j"
    path = write_segment(d, RECORDS)
    outcomes = {"header": 0, "quarantined": 0, "torn": 0}
    for byte in range(len(clean)):
        for bit in {byte % 8, 7}:  # every bit position somewhere, and each byte's top bit (a huge length)
            data = bytearray(clean)
            data[byte] ^= 1 << bit
            path.write_bytes(data)
            j = Journal(d)
            if byte < len(HEADER):
                with pytest.raises(JournalError, match="magic|format version"):
                    j.open()
                outcomes["header"] += 1
                continue
            k = max(i for i, s in enumerate(starts[:-1]) if s <= byte)  # the damaged record
            others = RECORDS[:k] + RECORDS[k + 1:]
            assert j.open() == model(others), (byte, bit)
            assert path.read_bytes() == HEADER + b"".join(others), (byte, bit)
            # a flipped length that reaches past the end of the last record reads as a torn tail
            torn = j.truncations == 1
            assert (j.quarantined_records, j.quarantined_bytes) == ((0, 0) if torn else (1, len(RECORDS[k])))
            blob = bytes(data[starts[k]:starts[k + 1]])
            assert torn or (d / "quarantine" / f"{path.name}-{starts[k]}-{zlib.crc32(blob):08x}.bad").read_bytes() == blob
            asyncio.run(j.close())
            outcomes["torn" if torn else "quarantined"] += 1
    # torn: the 6 flips that raise the last record's length past the end of the file
    assert outcomes == {"header": 23, "quarantined": 360, "torn": 6}


async def test_damage_in_an_earlier_segment_is_quarantined_and_start_goes_on(tmp_path):
    first = write_segment(tmp_path, RECORDS[:3], seq=1)
    write_segment(tmp_path, RECORDS[3:], seq=2)
    data = bytearray(first.read_bytes())
    offset = len(HEADER) + len(RECORDS[0])
    data[offset + 13] ^= 0x10  # inside the second record's body
    first.write_bytes(data)
    entries, j = reopen(tmp_path)
    assert entries == model(RECORDS[:1] + RECORDS[2:])
    assert (j.quarantined_records, j.quarantined_bytes) == (1, len(RECORDS[1]))
    blob = bytes(data[offset:offset + len(RECORDS[1])])
    assert (tmp_path / "quarantine" / f"{first.name}-{offset}-{zlib.crc32(blob):08x}.bad").read_bytes() == blob
    assert first.read_bytes() == HEADER + RECORDS[0] + RECORDS[2]  # rewritten without the span
    await j.close()
    entries, j = reopen(tmp_path)  # the damage is gone: nothing is quarantined twice
    assert entries == model(RECORDS[:1] + RECORDS[2:]) and j.quarantined_records == 0
    await j.close()


def test_format_version_and_magic_are_checked(tmp_path):
    path = write_segment(tmp_path, RECORDS)
    path.write_bytes(b"CLAWDJNL" + struct.pack("<I", 3) + b"".join(RECORDS))
    with pytest.raises(JournalError, match=r"format version 3 is not one of \(1, 2\)"):
        Journal(tmp_path).open()
    path.write_bytes(b"NOTAJRNL" + struct.pack("<I", 1))
    with pytest.raises(JournalError, match="bad magic"):
        Journal(tmp_path).open()


async def test_torn_header_of_last_segment_is_rewritten_and_stale_tmp_removed(tmp_path):
    write_segment(tmp_path, RECORDS[:2], seq=1)
    (tmp_path / segment_name(2)).write_bytes(HEADER[:5])
    (tmp_path / (segment_name(3) + ".tmp")).write_bytes(HEADER)
    entries, j = reopen(tmp_path)
    assert entries == model(RECORDS[:2]) and j.truncations == 1
    await j.append("n", b"")
    await j.close()
    assert segs(tmp_path) == [segment_name(1), segment_name(2)]
    assert reopen(tmp_path)[0] == model(RECORDS[:2]) + [("n", b"")]


async def test_one_writer_at_a_time(tmp_path):
    j = Journal(tmp_path)
    j.open()
    with pytest.raises(JournalError, match="in use"):
        Journal(tmp_path).open()
    await j.close()
    Journal(tmp_path).open()


async def test_rotation_keeps_order_and_segment_size(tmp_path):
    j = Journal(tmp_path, segment_bytes=300)
    j.open()
    for i in range(40):
        await j.append(f"e{i:02d}", bytes(20))
    await j.close()
    names = segs(tmp_path)
    assert len(names) > 3 and names[0] == segment_name(1)
    assert all((tmp_path / n).stat().st_size <= 300 for n in names)
    entries, j2 = reopen(tmp_path, segment_bytes=300)
    assert [k for k, _ in entries] == [f"e{i:02d}" for i in range(40)]
    await j2.close()


async def test_a_batch_larger_than_a_segment_gets_a_segment_of_its_own(tmp_path):
    j = Journal(tmp_path, segment_bytes=1)  # every group commit starts a new segment
    j.open()
    await asyncio.gather(*(j.append(f"x{i}", bytes(50)) for i in range(3)))
    await j.append("y", b"")
    await j.close()
    assert segs(tmp_path) == [segment_name(1), segment_name(2)]


async def test_compaction_deletes_only_fully_acked_segments_whose_acks_are_moot(tmp_path):
    j = Journal(tmp_path, segment_bytes=1)  # one group commit per segment: seq = commit number
    j.open()
    await asyncio.gather(j.append("a1", b"1"), j.append("a2", b"2"))   # seg 1
    await asyncio.gather(j.append("b1", b"3"), j.ack(["a1"]))          # seg 2: its ACK points into seg 1
    await j.ack(["b1"])                                                 # seg 3 (active)
    assert j.compact() == []  # seg 1 has a2 live; seg 2 must keep the ACK of a1 while seg 1 exists
    assert segs(tmp_path) == [segment_name(s) for s in (1, 2, 3)]
    await j.append("c1", b"4")                                          # seg 4 (active)
    assert [k for k, _ in await reopen_copy(tmp_path)] == ["a2", "c1"]
    await j.ack(["a2"])                                                 # seg 5 (active)
    removed = j.compact()
    assert [p.name for p in removed] == [segment_name(s) for s in (1, 2, 3)]
    assert segs(tmp_path) == [segment_name(4), segment_name(5)] and j.live == 1
    await j.ack(["c1"])                                                 # seg 6
    assert [p.name for p in j.compact()] == [segment_name(4), segment_name(5)]  # never the active one
    await j.append("d1", b"5")
    await j.close()
    entries, j2 = reopen(tmp_path)
    assert entries == [("d1", b"5")] and j2.segments == [6, 7]
    await j2.close()


async def reopen_copy(d: Path) -> list[tuple[str, bytes]]:
    """Replays a copy of a journal another Journal holds open."""
    copy = d.parent / (d.name + "-copy")
    copy.mkdir()
    for name in segs(d):
        (copy / name).write_bytes((d / name).read_bytes())
    entries, j = reopen(copy)
    await j.close()
    return entries


async def test_fsync_always_once_per_group_commit(tmp_path, monkeypatch):
    j = Journal(tmp_path, fsync="always")
    j.open()
    writes = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, b: writes.append(len(b)) or real_write(fd, b))
    base = j.fsyncs
    await asyncio.gather(*(j.append(f"g{i}", b"x") for i in range(10)))
    assert (j.fsyncs - base, len(writes)) == (1, 1)
    for i in range(5):
        await j.append(f"s{i}", b"x")
    await j.ack(["g0", "g1"])
    assert (j.fsyncs - base, len(writes), j.records_written) == (7, 7, 16)
    await j.close()
    assert j.fsyncs - base == 7  # nothing dirty left


async def test_fsync_interval_batches_fsyncs_on_a_loop_timer(tmp_path):
    lazy = Journal(tmp_path / "lazy", fsync_interval=3600)
    lazy.open()
    base = lazy.fsyncs
    for i in range(10):
        await lazy.append(f"s{i}", b"x")
    assert lazy.fsyncs == base  # written, not yet synced
    await lazy.close()  # close syncs what the timer has not
    assert lazy.fsyncs == base + 1

    j = Journal(tmp_path / "quick", fsync_interval=0.01)
    j.open()
    base = j.fsyncs
    await asyncio.gather(*(j.append(f"s{i}", b"x") for i in range(10)))
    await asyncio.sleep(0.2)
    assert j.fsyncs == base + 1
    await asyncio.sleep(0.05)
    assert j.fsyncs == base + 1  # nothing dirty, no timer
    await j.close()
    assert j.fsyncs == base + 1


async def test_a_failed_write_fails_its_appends_and_leaves_the_file_clean(tmp_path, monkeypatch):
    j = Journal(tmp_path)
    j.open()
    await j.append("ok", b"1")
    size = (tmp_path / segment_name(1)).stat().st_size
    real_write = os.write

    def full(fd, b):
        real_write(fd, bytes(b)[:7])  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(JournalWriteError, match="No space") as err:
        await asyncio.gather(j.append("lost1", b"2"), j.append("lost2", b"3"))
    assert err.value.errno == errno.ENOSPC and isinstance(err.value, OSError) and j.write_failures == 1
    monkeypatch.setattr(os, "write", real_write)
    assert (tmp_path / segment_name(1)).stat().st_size == size
    await j.append("lost1", b"retry")  # the failed id is not taken
    await j.close()
    assert reopen(tmp_path)[0] == [("ok", b"1"), ("lost1", b"retry")]


async def test_stats_for_metrics(tmp_path):
    j = Journal(tmp_path)
    j.open()
    await j.append("a", b"abc")
    s = j.stats()
    assert (s["records"], s["bytes"], s["live"], s["segments"], s["truncations"]) == \
        (1, len(encode_append("a", b"abc")), 1, 1, 0)
    await j.close()


def fork_writer(directory: Path, seed: str, fsync: str) -> tuple[int, int]:
    """A writer subprocess, forked (not exec'd: importing asyncio would dominate the test). (pid, output fd)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 70
        try:
            os.close(r)
            asyncio.run(journal_writer.run(str(directory), seed, fsync, w))
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def read_until(fd: int, buf: bytes, stop: bytes | None) -> bytes:
    while stop is None or stop not in buf:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        buf += chunk
    return buf


@pytest.mark.slow
def test_sigkilled_writer_loses_no_acknowledged_entry(tmp_path):
    """≥ 200 SIGKILLs at random points: every acknowledged append is replayed, every acknowledged ack holds.

    One directory throughout: each writer replays what the killed ones left, acks some of it, rotates
    (2 KiB segments) and compacts, so kills also land in rotation, compaction and replay.
    """
    rng = random.Random(1234)
    d = tmp_path / "j"
    seen = {"A": set(), "k": set(), "K": set()}  # appended, ack started, ack returned
    truncations = 0
    for round_ in range(200):
        pid, fd = fork_writer(d, str(round_), "always" if round_ % 4 == 0 else "interval")
        out = b""
        if rng.random() < 0.1:
            time.sleep(rng.uniform(0, 0.01))  # sometimes during start-up and replay
        else:
            out = read_until(fd, out, b"\n")
            assert out.startswith(b"ready\n"), out
            lines = rng.randrange(5, 60)  # counted in lines, not seconds: the same work on a loaded machine
            while out.count(b"\n") < lines:
                chunk = os.read(fd, 1 << 16)
                assert chunk, out[-300:]  # the writer died on its own
                out += chunk
            time.sleep(rng.uniform(0, 0.002))  # then somewhere in the next write, fsync or rotation
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        out = read_until(fd, out, None)
        os.close(fd)
        for line in out.decode().split("\n")[:-1]:  # a line cut by the kill has no newline
            kind, _, entry_id = line.partition(" ")
            if kind in seen:
                seen[kind].add(entry_id)
        entries, j = reopen(d)
        live = {k for k, _ in entries}
        lost = seen["A"] - seen["k"] - live
        assert not lost, (round_, sorted(lost)[:5])
        assert not seen["K"] & live, (round_, sorted(seen["K"] & live)[:5])
        truncations += j.truncations
        assert j.quarantined_records == 0, round_  # a kill leaves torn tails, never damage
        asyncio.run(j.close())
    assert len(seen["A"]) > 2000 and len(seen["K"]) > 500 and len(segs(d)) > 1
    print(f"200 kills, {len(seen['A'])} appends, {len(seen['K'])} acks, {truncations} torn tails")


def test_writer_script_runs_standalone(tmp_path):
    p = subprocess.Popen([sys.executable, "-S", str(WRITER), str(tmp_path), "7", "always"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline() == b"ready\n", p.stderr.read().decode()
    while not p.stdout.readline().startswith(b"A "):
        pass
    p.kill()
    p.wait()
    p.stdout.close(), p.stderr.close()
    assert reopen(tmp_path)[0]


async def test_a_closed_journal_refuses_writes(tmp_path):
    j = Journal(tmp_path)
    j.open()
    await j.append("a", b"")
    await j.close()
    with pytest.raises(JournalError, match="not open"):
        await j.append("b", b"")
    with pytest.raises(JournalError, match="not open"):
        await j.ack(["a"])
    assert reopen(tmp_path)[0] == [("a", b"")]
