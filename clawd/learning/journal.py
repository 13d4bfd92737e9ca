"""The sample journal: append-only segments of framed records (docs/ARCHITECTURE.md §7, §14).

Payload-agnostic: it stores (id, bytes) entries and acknowledgements of ids.

Directory layout: `journal-<16-digit seq>.seg` files, oldest first, plus
`journal.lock` (one writer at a time). A segment is a 12-byte header then records:

    header  = b"CLAWDJNL" + u32 format version                    (little-endian)
    record  = u32 length + u32 CRC32(body) + body,   body = u8 type + payload
    APPEND  (type 1): u16 id length + id (UTF-8) + entry payload
    ACK     (type 2): u32 count + count × (u16 id length + id)

`length` is len(body). Replay (`open`) returns the appended-and-not-acked
entries in append order. Damage is handled by where it sits:
  * in the LAST segment (a torn write after a crash, or any bad record there),
    the segment is truncated at the first bad record with a warning; records
    before it are kept. A header that is only a prefix of a valid one is rewritten.
  * in an EARLIER segment it raises `JournalCorrupt(path, offset)` and the
    daemon refuses to start: dropping its tail could drop ACKs and APPENDs
    silently. The operator decides (e.g. `truncate -s OFFSET PATH`).
  * a bad magic or an unknown format version raises `JournalError` anywhere.

Group commit: records queued in one loop iteration are written by one
os.write (and, with fsync="always", one fsync) in a callback on the loop;
`append`/`ack` return once their bytes are in the file. With "interval", a
loop timer fsyncs the dirty segment `fsync_interval` after its first unsynced
write. No threads: SIGKILL cannot lose a returned append (the bytes are in
the page cache); power loss can lose at most the last interval.

Rotation: a write that would take the active segment past `segment_bytes`
goes to a new one (a single group commit larger than that gets a segment of its own).
Compaction deletes whole segments, never rewriting: a segment goes when every
APPEND in it is acked, it is not the active one, and every segment its ACKs
point into is already gone (else deleting it would resurrect those entries).
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("clawd.journal")

MAGIC = b"CLAWDJNL"
FORMAT_VERSION = 1
HEADER = MAGIC + struct.pack("<I", FORMAT_VERSION)
FRAME = struct.Struct("<II")         # length, crc32
APPEND, ACK = 1, 2
MAX_BODY = 1 << 30                   # a larger length field is damage, not data
SEGMENT_RE = re.compile(r"journal-(\d{16})\.seg")


class JournalError(Exception):
    pass


class JournalCorrupt(JournalError):
    def __init__(self, path: Path, offset: int, reason: str):
        super().__init__(f"{path}: corrupt record at offset {offset}: {reason}")
        self.path, self.offset, self.reason = path, offset, reason


# ---- pure encoding -----------------------------------------------------------

def _encode_id(entry_id: str) -> bytes:
    raw = entry_id.encode()
    if not 0 < len(raw) <= 0xFFFF:
        raise ValueError(f"entry id must be 1..65535 UTF-8 bytes, got {len(raw)}")
    return struct.pack("<H", len(raw)) + raw


def frame(body: bytes) -> bytes:
    return FRAME.pack(len(body), zlib.crc32(body)) + body


def encode_append(entry_id: str, payload: bytes) -> bytes:
    return frame(bytes([APPEND]) + _encode_id(entry_id) + bytes(payload))


def encode_ack(ids: list[str]) -> bytes:
    return frame(bytes([ACK]) + struct.pack("<I", len(ids)) + b"".join(_encode_id(i) for i in ids))


def _decode_id(body: bytes, at: int) -> tuple[str, int]:
    if at + 2 > len(body):
        raise ValueError("id length past the end of the record")
    (n,) = struct.unpack_from("<H", body, at)
    if n == 0 or at + 2 + n > len(body):
        raise ValueError("bad id length")
    return body[at + 2:at + 2 + n].decode(), at + 2 + n


def decode_body(body: bytes) -> tuple[int, object]:
    """(APPEND, (id, payload)) or (ACK, [ids]); ValueError when the body does not parse."""
    kind = body[0]
    if kind == APPEND:
        entry_id, at = _decode_id(body, 1)
        return APPEND, (entry_id, body[at:])
    if kind == ACK:
        if len(body) < 5:
            raise ValueError("short ACK record")
        (count,) = struct.unpack_from("<I", body, 1)
        ids, at = [], 5
        for _ in range(count):
            entry_id, at = _decode_id(body, at)
            ids.append(entry_id)
        if at != len(body):
            raise ValueError("trailing bytes in ACK record")
        return ACK, ids
    raise ValueError(f"unknown record type {kind}")


@dataclass(frozen=True)
class Scan:
    records: list          # [(type, value)] of the good records, in file order
    good_end: int          # offset just after the last good record
    problem: str | None    # why scanning stopped before the end of the data, or None


def scan_records(data: bytes, start: int = len(HEADER)) -> Scan:
    """Decode records from `start` until the end or the first damaged one."""
    records, at = [], start
    while at < len(data):
        if at + FRAME.size > len(data):
            return Scan(records, at, "truncated frame header")
        length, crc = FRAME.unpack_from(data, at)
        if not 0 < length <= MAX_BODY:
            return Scan(records, at, f"bad length {length}")
        body = data[at + FRAME.size:at + FRAME.size + length]
        if len(body) < length:
            return Scan(records, at, f"truncated record ({len(body)} of {length} bytes)")
        if zlib.crc32(body) != crc:
            return Scan(records, at, "CRC mismatch")
        try:
            records.append(decode_body(body))
        except (ValueError, UnicodeDecodeError) as e:  # CRC passed, so this is a format bug: still stop here
            return Scan(records, at, f"undecodable record: {e}")
        at += FRAME.size + length
    return Scan(records, at, None)


def segment_name(seq: int) -> str:
    return f"journal-{seq:016d}.seg"


# ---- the journal ---------------------------------------------------------------

class Journal:
    def __init__(self, directory: Path | str, *, fsync: str = "interval", fsync_interval: float = 0.1,
                 segment_bytes: int = 64 << 20):
        if fsync not in ("interval", "always"):
            raise ValueError(f"fsync must be 'interval' or 'always', not {fsync!r}")
        if fsync_interval <= 0 or segment_bytes <= 0:
            raise ValueError("fsync_interval and segment_bytes must be positive")
        self.directory = Path(directory)
        self.fsync_mode = fsync
        self.fsync_interval = fsync_interval
        self.segment_bytes = segment_bytes
        # metrics
        self.bytes_written = 0
        self.records_written = 0
        self.fsyncs = 0
        self.truncations = 0
        # index: id -> segment seq of its APPEND; per segment: live APPEND count and
        # the segments its ACK records point into
        self._live: dict[str, int] = {}
        self._seg_live: dict[int, int] = {}
        self._seg_refs: dict[int, set[int]] = {}
        self._known: set[str] = set()     # live plus queued-not-yet-written, for duplicate/unknown checks
        self._pending: list[tuple[bytes, int, object, asyncio.Future]] = []
        self._flush_scheduled = False
        self._sync_timer: asyncio.TimerHandle | None = None
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._active = 0
        self._size = 0
        self._dirty = False
        self._broken: BaseException | None = None

    # -- public ------------------------------------------------------------------

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def segments(self) -> list[int]:
        return sorted(self._seg_live)

    def stats(self) -> dict[str, int]:
        return {"bytes": self.bytes_written, "records": self.records_written, "fsyncs": self.fsyncs,
                "truncations": self.truncations, "live": self.live, "segments": len(self._seg_live)}

    def open(self) -> list[tuple[str, bytes]]:
        """Lock the directory, replay every segment, and get ready to append."""
        if self._lock_fd is not None:
            raise JournalError("journal already open")
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            entries = self._replay()
        except BaseException:
            self._release()
            raise
        return list(entries.items())

    def _replay(self) -> dict[str, bytes]:
        self._live, self._seg_live, self._seg_refs, self._broken = {}, {}, {}, None
        for stale in self.directory.glob("journal-*.seg.tmp"):  # a rotation cut short
            stale.unlink()
        seqs = sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := SEGMENT_RE.fullmatch(p.name)))
        entries: dict[str, bytes] = {}
        for k, seq in enumerate(seqs):
            self._replay_segment(seq, last=k == len(seqs) - 1, entries=entries)
        self._known = set(self._live)
        if seqs:
            self._open_active(seqs[-1])
        else:
            self._create_segment(1)
        if self._size > len(HEADER) and self._size >= self.segment_bytes:
            self._rotate()
        return entries

    async def append(self, entry_id: str, payload: bytes) -> None:
        """Returns once the record is in the file (and fsynced, with fsync="always")."""
        self._check_writable()
        if entry_id in self._known:
            raise ValueError(f"entry {entry_id!r} is already in the journal")
        record = encode_append(entry_id, payload)
        self._known.add(entry_id)
        await self._submit(record, APPEND, entry_id)

    async def ack(self, ids) -> int:
        """Marks entries consumed; unknown or already-acked ids are skipped. Returns how many were live."""
        self._check_writable()
        ids = [i for i in dict.fromkeys(ids) if i in self._known]
        if not ids:
            return 0
        record = encode_ack(ids)
        self._known.difference_update(ids)
        await self._submit(record, ACK, ids)
        return len(ids)

    def compact(self) -> list[Path]:
        """Deletes whole segments that hold nothing live (see the module docstring). Returns them."""
        removed = []
        for seq in self.segments:
            if seq == self._active or self._seg_live[seq] > 0:
                continue
            if any(r in self._seg_live for r in self._seg_refs[seq]):
                continue
            path = self.directory / segment_name(seq)
            path.unlink()
            del self._seg_live[seq], self._seg_refs[seq]
            removed.append(path)
            log.info("compacted %s", path.name)
        return removed

    async def close(self) -> None:
        """Writes what is queued, fsyncs, and unlocks the directory."""
        if self._lock_fd is None:
            return
        try:
            if self._pending:
                self._flush()
            if self._sync_timer is not None:
                self._sync_timer.cancel()
                self._sync_timer = None
            if self._dirty and self._broken is None:
                self._fsync()
        finally:
            self._release()

    # -- replay --------------------------------------------------------------------

    def _lock(self) -> None:
        fd = os.open(self.directory / "journal.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JournalError(f"{self.directory} is in use by another process") from None
        self._lock_fd = fd

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        os.close(self._lock_fd)
        self._lock_fd = None

    def _replay_segment(self, seq: int, *, last: bool, entries: dict[str, bytes]) -> None:
        path = self.directory / segment_name(seq)
        data = path.read_bytes()
        if data[:len(HEADER)] != HEADER:
            if last and len(data) < len(HEADER) and HEADER.startswith(data):
                log.warning("%s: torn header (%d bytes), rewriting it", path, len(data))
                self._truncate(path, 0)
                data = b""
            elif data[:len(MAGIC)] != MAGIC:
                raise JournalError(f"{path}: not a clawd journal segment (bad magic)")
            else:
                version = struct.unpack_from("<I", data, len(MAGIC))[0] if len(data) >= len(HEADER) else None
                raise JournalError(f"{path}: journal format version {version} is not {FORMAT_VERSION}")
        scan = scan_records(data) if data else Scan([], 0, None)
        if scan.problem is not None:
            if not last:
                raise JournalCorrupt(path, scan.good_end, scan.problem)
            log.warning("%s: %s at offset %d; truncating %d bytes (the %d records before it are kept)",
                        path, scan.problem, scan.good_end, len(data) - scan.good_end, len(scan.records))
            self._truncate(path, scan.good_end)
        self._seg_live[seq] = 0
        self._seg_refs[seq] = set()
        for kind, value in scan.records:
            self._index(seq, kind, value[0] if kind == APPEND else value)
            if kind == APPEND:
                entries[value[0]] = value[1]
            else:
                for i in value:
                    entries.pop(i, None)

    def _truncate(self, path: Path, size: int) -> None:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, size)
            os.fsync(fd)
            self.fsyncs += 1
        finally:
            os.close(fd)
        self.truncations += 1

    def _index(self, seq: int, kind: int, value) -> None:
        """value: the id of an APPEND, the ids of an ACK."""
        if kind == APPEND:
            entry_id = value
            if entry_id in self._live:  # only a hand-edited journal gets here; the newest wins
                self._seg_live[self._live[entry_id]] -= 1
            self._live[entry_id] = seq
            self._seg_live[seq] += 1
        else:
            for entry_id in value:
                home = self._live.pop(entry_id, None)
                if home is not None:  # else its segment was compacted already
                    self._seg_live[home] -= 1
                    if home != seq:
                        self._seg_refs[seq].add(home)

    # -- segments --------------------------------------------------------------------

    def _open_active(self, seq: int) -> None:
        path = self.directory / segment_name(seq)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._active = seq
        self._size = os.fstat(self._fd).st_size
        if self._size == 0:  # its torn header was cut away during replay
            self._write_all(HEADER)
            self._size = len(HEADER)
            self._fsync()

    def _create_segment(self, seq: int) -> None:
        # header to a temporary name, fsync, rename, fsync the directory: a segment
        # file either has its whole header or does not exist
        path = self.directory / segment_name(seq)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            self._write_all(HEADER, fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        dfd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.fsyncs += 2
        old = self._fd
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._seg_live[seq] = 0
        self._seg_refs[seq] = set()
        self._active = seq
        self._size = len(HEADER)
        if old is not None:
            os.close(old)

    def _rotate(self) -> None:
        if self._dirty:
            self._fsync()
        self._create_segment(self._active + 1)  # the old segment stays active if this fails
        log.info("journal rotated to %s", segment_name(self._active))

    # -- writing -----------------------------------------------------------------------

    def _check_writable(self) -> None:
        if self._broken is not None:
            raise JournalError("journal is unusable after a failed write or fsync") from self._broken
        if self._fd is None:
            raise JournalError("journal is not open")

    async def _submit(self, record: bytes, kind: int, value) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending.append((record, kind, value, fut))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        await fut

    def _flush(self) -> None:
        """The single flusher: everything queued since the last call, one write (and one fsync)."""
        self._flush_scheduled = False
        batch, self._pending = self._pending, []
        if not batch:
            return
        data = b"".join(record for record, _, _, _ in batch)
        try:
            self._write_batch(data)
        except Exception as e:  # handed to every caller in the batch, so none waits for ever
            log.error("journal write of %d records failed: %r", len(batch), e)
            for _, kind, value, fut in batch:  # undo what _submit's callers assumed
                if kind == APPEND:
                    self._known.discard(value)
                else:
                    self._known.update(value)
                if not fut.done():
                    fut.set_exception(JournalError(f"journal write failed: {e}"))
            return
        for _, kind, value, fut in batch:
            self._index(self._active, kind, value)
            if not fut.done():  # a cancelled caller's record is written all the same
                fut.set_result(None)
        self.bytes_written += len(data)
        self.records_written += len(batch)

    def _write_batch(self, data: bytes) -> None:
        if self._size > len(HEADER) and self._size + len(data) > self.segment_bytes:
            self._rotate()
        try:
            self._write_all(data)
        except OSError:
            try:  # leave no half batch behind for the next write to follow
                os.ftruncate(self._fd, self._size)
            except OSError as e:
                self._broken = e
            raise
        self._size += len(data)
        self._dirty = True
        if self.fsync_mode == "always":
            self._fsync()
        elif self._sync_timer is None:
            self._sync_timer = asyncio.get_running_loop().call_later(self.fsync_interval, self._timed_sync)

    def _write_all(self, data: bytes, fd: int | None = None) -> None:
        fd = self._fd if fd is None else fd
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    def _timed_sync(self) -> None:
        self._sync_timer = None
        if self._dirty and self._fd is not None:
            try:
                self._fsync()
            except OSError as e:
                log.error("journal fsync failed: %s; refusing further writes", e)
                self._broken = e

    def _fsync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as e:  # after a failed fsync the page cache may have dropped our bytes
            self._broken = e
            raise
        self.fsyncs += 1
        self._dirty = False
