"""The sample journal: append-only segments of framed records (docs/ARCHITECTURE.md §7, §14).

The frames themselves (encoding, the resynchronising scan) are pure functions in
`clawd.learning.frames`. It stores (id, bytes) entries and acks of ids in `journal-<16-digit seq>.seg`
files, oldest first, beside `journal.lock` (one writer) and `quarantine/` (damage set aside).

    header    = b"CLAWDJNL" + u32 format version                          (little-endian)
    v2 record = RECORD_MAGIC + u32 length + u32 CRC32(length field + body) + body
    v1 record = u32 length + u32 CRC32(body) + body      (read only: an older release wrote it)
    body      = u8 type + payload; APPEND (1): u16 id length + id (UTF-8) + entry payload;
                ACK (2): u32 count + count × (u16 id length + id);  `length` = len(body)
                BASE (3): nothing; only as a segment's first record (format 2): every earlier
                segment is superseded (written by `rewrite`, see `clawd.learning.journal_files`)

Replay (`open`) returns the appended-and-not-acked entries in append order. A format-1 segment
is read by its own rules and never appended to (`open` starts a format-2 one after it).
  * Segments older than the newest one that starts with a BASE record are deleted first, unread.
  * A torn tail (the LAST segment ends inside a record, or in zero bytes: a crash mid-write)
    is cut off with a warning: not damage. A torn header is rewritten.
  * Any other bad record (bad magic, impossible length, CRC mismatch, a cut record in an
    earlier segment) starts a damaged span, in ANY segment. Format 2 resynchronises: the span
    ends where RECORD_MAGIC starts a record whose CRC checks, so every good record after it is
    kept; a format-1 span runs to the segment's end. Each span is copied (fsynced) to
    `quarantine/<segment>-<offset>-<crc32>.bad` BEFORE the segment is rewritten without it (format 1:
    truncated), counted in `quarantined_records` (one per span) and `quarantined_bytes`, and
    logged in ONE warning. Start goes on: a lost ACK trains a sample again (at least once), a
    lost APPEND is a lost sample, counted. If the copy fails the segment is left as it is.
  * A bad segment magic or an unknown format version is not record damage: `JournalError`.

Group commit: records queued in one loop iteration go out in one os.write (and, with "always",
one fsync) in a loop callback; `append`/`ack` return once their bytes are in the file. With
"interval" a loop timer fsyncs `fsync_interval` after the first unsynced write: SIGKILL loses
no returned append (page cache), power loss at most the last interval. When the write, fsync or
rotation of a commit raises OSError, its callers get `JournalWriteError` (an OSError with that
errno, and a JournalError), the segment is cut back to its last complete record (if that fails,
replay skips the partial bytes as damage) and the next append works once there is room. A failed
interval fsync writes the bytes since the last good one again in place before the next try.

A write that would take the active segment past `segment_bytes` goes to a new one. Compaction
deletes whole segments: those with no live APPEND, not active, whose ACKs point into no segment
still there (deleting it would resurrect those entries). `rewrite` replaces the whole journal
with the live entries its caller names, leaving no other byte on disk (forgetting a person).
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import struct
from pathlib import Path

from clawd import faults
from clawd.learning.frames import (ACK, APPEND, BASE, FORMAT_VERSION, HEADER, HEADER_V1, MAGIC, VERSIONS, Scan, encode_ack,
                                   encode_append, scan_records)
from clawd.learning.journal_files import (SEGMENT_RE, Rewritten, delete_segments, journal_bytes, quarantine_path,
                                          segment_name, set_aside, starts_with_base, write_all, write_base_segment,
                                          write_file)

log = logging.getLogger("clawd.journal")


class JournalError(Exception):
    """Not record damage: a bad segment magic, an unknown format version, a held lock."""


class JournalUnreadable(JournalError):
    """A segment clawd will not read at all (bad magic, unknown format): the operator must look."""


class JournalWriteError(JournalError, OSError):
    """A group commit failed; `errno` is the OSError's (ENOSPC, EIO). Nothing of it is in the file."""


# ---- the journal ---------------------------------------------------------------

class Journal:
    def __init__(self, directory: Path | str, *, fsync: str = "interval", fsync_interval: float = 0.1,
                 segment_bytes: int = 64 << 20):
        if fsync not in ("interval", "always"):
            raise ValueError(f"fsync must be 'interval' or 'always', not {fsync!r}")
        if fsync_interval <= 0 or segment_bytes <= 0:
            raise ValueError("fsync_interval and segment_bytes must be positive")
        self.directory = Path(directory)  # the daemon checks this filesystem's free space before writes
        self.fsync_mode = fsync
        self.fsync_interval = fsync_interval
        self.segment_bytes = segment_bytes
        # metrics; truncations: torn tails cut at replay; quarantined_*: damaged spans set aside at
        # replay (one record per span) and their bytes; quarantine_failures: spans left in place;
        # write_failures: group commits whose callers got JournalWriteError
        self.bytes_written = self.records_written = self.fsyncs = self.truncations = 0
        self.quarantined_records = self.quarantined_bytes = self.quarantine_failures = 0
        self.write_failures = self.fsync_failures = 0
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
        self._active = self._size = 0
        # written to the active segment since its last good fsync: (offset, bytes), to write again
        # in place when an fsync fails (the kernel may have dropped those pages)
        self._unsynced: list[tuple[int, bytes]] = []
        self._rewrite = False
        self._base: int | None = None      # the segment that starts with BASE (see `rewrite`)
        self._superseded: list[int] = []   # older segments whose deletion failed: compaction retries

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def segments(self) -> list[int]:
        return sorted(self._seg_live)

    def stats(self) -> dict[str, int]:
        names = ("truncations", "quarantined_records", "quarantined_bytes", "quarantine_failures",
                 "write_failures", "fsync_failures")
        return {"bytes": self.bytes_written, "records": self.records_written, "fsyncs": self.fsyncs,
                "live": self.live, "segments": len(self._seg_live)} | {n: getattr(self, n) for n in names}

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
        self._live, self._seg_live, self._seg_refs, self._superseded = {}, {}, {}, []
        for stale in self.directory.glob("journal-*.seg.tmp"):  # a rotation or rewrite cut short
            stale.unlink()
        seqs = sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := SEGMENT_RE.fullmatch(p.name)))
        self._base = next((s for s in reversed(seqs) if starts_with_base(self.directory / segment_name(s))), None)
        if self._base is not None and seqs[0] < self._base:  # a rewrite cut short after its new segment
            log.warning("journal: segments before %s are superseded by it; deleting them", segment_name(self._base))
            self._superseded = delete_segments(self.directory, [s for s in seqs if s < self._base])
            seqs = [s for s in seqs if s >= self._base]
        entries: dict[str, bytes] = {}
        version = FORMAT_VERSION
        for k, seq in enumerate(seqs):
            version = self._replay_segment(seq, last=k == len(seqs) - 1, entries=entries)
        self._known = set(self._live)
        if seqs and version == FORMAT_VERSION:
            self._open_active(seqs[-1])
        else:  # nothing yet, or an older format that is never appended to
            self._create_segment(seqs[-1] + 1 if seqs else 1)
        if self._size > len(HEADER) and self._size >= self.segment_bytes:
            self._rotate()
        return entries

    async def append(self, entry_id: str, payload: bytes) -> None:
        """Returns once the record is in the file (and fsynced, with fsync="always"); JournalWriteError
        (ENOSPC, EIO) when its group commit failed: then the id is free again and the journal usable."""
        self._check_writable()
        if entry_id in self._known:
            raise ValueError(f"entry {entry_id!r} is already in the journal")
        record = encode_append(entry_id, payload)
        self._known.add(entry_id)
        await self._submit(record, APPEND, entry_id)

    async def ack(self, ids) -> int:
        """Marks entries consumed; unknown or already-acked ids are skipped. Returns how many were live.
        JournalWriteError as for `append`: the ids stay live."""
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
        if self._superseded:  # left by a rewrite or replay whose deletion failed
            left = delete_segments(self.directory, self._superseded)
            removed += [self.directory / segment_name(s) for s in self._superseded if s not in left]
            self._superseded = left
        for seq in self.segments:
            if seq == self._active or self._seg_live[seq] > 0 or any(r in self._seg_live for r in self._seg_refs[seq]):
                continue
            if seq == self._base and self._superseded:  # its BASE record keeps them from replaying
                continue
            path = self.directory / segment_name(seq)
            path.unlink()
            del self._seg_live[seq], self._seg_refs[seq]
            removed.append(path)
            log.info("compacted %s", path.name)
        return removed

    async def rewrite(self, entries) -> Rewritten:
        """Replaces the whole journal with exactly `entries` [(id, payload)], in that order: no other byte
        (acked, dropped, forgotten entries) stays in a segment (crash safety: `clawd.learning.journal_files`).
        Appends and acks still queued are written first, then the rewrite runs without yielding the loop;
        an id not live by then (never appended, acked) is skipped, so the caller names every entry it keeps,
        its appends in flight included. JournalWriteError (ENOSPC, EIO) when the queued records or the new
        segment cannot be written: the old journal stays whole and usable."""
        self._check_writable()
        if self._pending and (err := self._flush()) is not None:
            raise JournalWriteError(getattr(err, "errno", None), f"queued journal records failed: {err!r}") from err
        kept = {i: bytes(p) for i, p in entries if i in self._live}
        before, seq = journal_bytes(self.directory), self._active + 1
        try:
            fd, size = write_base_segment(self.directory, seq, kept.items())
        except OSError as e:
            self.write_failures += 1
            log.error("journal rewrite failed, the journal is unchanged: %r", e)
            raise JournalWriteError(e.errno, f"journal rewrite failed: {e.strerror or e}") from e
        old = sorted(set(self._seg_live) | set(self._superseded))
        if self._sync_timer is not None:  # what it would sync is superseded
            self._sync_timer.cancel()
            self._sync_timer = None
        os.close(self._fd)
        self._fd, self._active, self._size, self._base = fd, seq, size, seq
        self._unsynced, self._rewrite = [], False
        self._live = dict.fromkeys(kept, seq)
        self._known = set(kept)
        self._seg_live, self._seg_refs = {seq: len(kept)}, {seq: set()}
        self.fsyncs += 2
        self.bytes_written += size
        self.records_written += len(kept) + 1
        self._superseded = delete_segments(self.directory, old)
        log.info("journal rewritten to %s: %d entries kept, %d segments superseded", segment_name(seq),
                 len(kept), len(old))
        return Rewritten(len(kept), before, journal_bytes(self.directory), len(self._superseded))

    async def close(self) -> None:
        """Writes what is queued, fsyncs, and unlocks the directory; JournalWriteError if that fsync fails."""
        if self._lock_fd is None:
            return
        try:
            if self._pending:
                self._flush()
            if self._sync_timer is not None:
                self._sync_timer.cancel()
                self._sync_timer = None
            if self._unsynced:
                try:
                    self._sync()
                except OSError as e:
                    raise JournalWriteError(e.errno, f"final journal fsync failed: {e.strerror or e}") from e
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

    def _replay_segment(self, seq: int, *, last: bool, entries: dict[str, bytes]) -> int:
        """Indexes one segment, setting its damage aside; returns its format version."""
        path = self.directory / segment_name(seq)
        data = path.read_bytes()
        version = FORMAT_VERSION
        if len(data) < len(HEADER) and last and (HEADER.startswith(data) or HEADER_V1.startswith(data)):
            log.warning("%s: torn header (%d bytes), rewriting it", path, len(data))
            self._truncate(path, 0)
            data = b""
        elif data[:len(MAGIC)] != MAGIC:
            raise JournalUnreadable(f"{path}: not a clawd journal segment (bad magic)")
        else:
            version = struct.unpack_from("<I", data, len(MAGIC))[0] if len(data) >= len(HEADER) else None
            if version not in VERSIONS:
                raise JournalUnreadable(f"{path}: journal format version {version} is not one of {VERSIONS}")
        scan = scan_records(data, version)
        self._mend(path, data, scan, version, last)
        self._seg_live[seq], self._seg_refs[seq] = 0, set()
        for kind, value in scan.records:
            if kind == BASE:  # its older segments were deleted before replay began
                continue
            self._index(seq, kind, value[0] if kind == APPEND else value)
            if kind == APPEND:
                entries[value[0]] = value[1]
            else:
                for i in value:
                    entries.pop(i, None)
        return version

    def _mend(self, path: Path, data: bytes, scan: Scan, version: int, last: bool) -> None:
        """Cuts a torn tail; copies each damaged span to quarantine, then cuts the spans out."""
        spans = list(scan.damaged)
        if scan.torn is not None and last:
            log.warning("%s: torn tail at offset %d; cutting %d bytes (the %d records before it are kept)",
                        path, scan.torn, len(data) - scan.torn, len(scan.records))
            self._truncate(path, scan.torn)
        elif scan.torn is not None:  # rotation fsyncs a segment before the next: a cut here is damage
            spans.append((scan.torn, len(data) - scan.torn, "truncated record"))
        saved = True
        for offset, length, reason in spans:
            self.quarantined_records += 1
            self.quarantined_bytes += length
            target = quarantine_path(path, offset, data[offset:offset + length])
            try:
                set_aside(target, data[offset:offset + length])
            except OSError as e:  # the segment stays as it is, so the bytes are not lost
                saved = False
                self.quarantine_failures += 1
                log.error("%s: %s at offset %d: cannot copy its %d bytes to %s (%s); left in place, skipped",
                          path, reason, offset, length, target, e)
            else:
                log.warning("%s: %s at offset %d: %d bytes moved to %s; the records around them are kept",
                            path, reason, offset, length, target.relative_to(self.directory))
        if not spans or not saved:
            return  # (a failed copy: the next start meets the spans again)
        try:
            if version == FORMAT_VERSION:
                write_file(path, data[:len(HEADER)] + b"".join(data[s:e] for s, e in scan.kept))
            else:  # format 1: a single span, from the first bad record to the end
                self._truncate(path, spans[0][0])
        except OSError as e:
            log.error("%s: cannot cut its damaged spans out (%s); the next start skips them again", path, e)

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
            if entry_id in self._live:  # a retried append after a failed cut, or a hand edit: the newest wins
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
        self._unsynced, self._rewrite = [], False
        if self._size == 0:  # its torn header was cut away during replay
            write_all(self._fd, HEADER)
            self._size = len(HEADER)
            os.fsync(self._fd)
            self.fsyncs += 1

    def _create_segment(self, seq: int) -> None:
        # a segment file either has its whole header or does not exist
        faults.point("journal.rotate")
        path = self.directory / segment_name(seq)
        write_file(path, HEADER)
        self.fsyncs += 2
        old = self._fd
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._seg_live[seq], self._seg_refs[seq] = 0, set()
        self._active = seq
        self._size = len(HEADER)
        self._unsynced, self._rewrite = [], False
        if old is not None:
            os.close(old)

    def _rotate(self) -> None:
        if self._unsynced:
            self._sync()
        self._create_segment(self._active + 1)  # the old segment stays active if this fails
        log.info("journal rotated to %s", segment_name(self._active))

    # -- writing -----------------------------------------------------------------------

    def _check_writable(self) -> None:
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

    def _flush(self) -> Exception | None:
        """The single flusher: everything queued since the last call, one write (and one fsync). The error
        its callers got, if any."""
        self._flush_scheduled = False
        batch, self._pending = self._pending, []
        if not batch:
            return None
        data = b"".join(record for record, _, _, _ in batch)
        try:
            self._write_batch(data)
        except Exception as e:  # handed to every caller in the batch, so none waits for ever
            self.write_failures += 1
            log.error("journal write of %d records failed: %r", len(batch), e)
            for _, kind, value, fut in batch:
                (self._known.discard if kind == APPEND else self._known.update)(value)  # undo _submit's callers
                if not fut.done():
                    err = (JournalWriteError(e.errno, f"journal write failed: {e.strerror or e}")
                           if isinstance(e, OSError) else JournalError(f"journal write failed: {e!r}"))
                    err.__cause__ = e
                    fut.set_exception(err)
            return e
        for _, kind, value, fut in batch:
            self._index(self._active, kind, value)
            if not fut.done():  # a cancelled caller's record is written all the same
                fut.set_result(None)
        self.bytes_written += len(data)
        self.records_written += len(batch)
        return None

    def _write_batch(self, data: bytes) -> None:
        if self._size > len(HEADER) and self._size + len(data) > self.segment_bytes:
            self._rotate()
        start = self._size
        try:
            faults.point("journal.write")
            write_all(self._fd, data)
            self._size += len(data)
            self._unsynced.append((start, data))
            if self.fsync_mode == "always":
                self._sync()
        except OSError:
            if self._unsynced and self._unsynced[-1][0] == start:
                self._unsynced.pop()  # its callers are told it failed: it must not come back
            try:  # leave no partial batch for the next write to follow
                os.ftruncate(self._fd, start)
                self._size = start
            except OSError as e:
                log.error("journal: cannot cut %s back to %d bytes (%s); replay will skip what is left",
                          segment_name(self._active), start, e)
                self._size = os.fstat(self._fd).st_size
            raise
        if self._unsynced and self._sync_timer is None:
            self._sync_timer = asyncio.get_running_loop().call_later(self.fsync_interval, self._timed_sync)

    def _timed_sync(self) -> None:
        self._sync_timer = None
        if self._unsynced and self._fd is not None:
            try:
                self._sync()
            except OSError as e:
                log.error("journal fsync failed: %s; writing the %d unsynced records again in %.3gs",
                          e, len(self._unsynced), self.fsync_interval)
                self._sync_timer = asyncio.get_running_loop().call_later(self.fsync_interval, self._timed_sync)

    def _sync(self) -> None:
        if self._rewrite:  # a failed fsync came before: the unsynced records once more, at their offsets
            fd = os.open(self.directory / segment_name(self._active), os.O_WRONLY)
            try:
                for offset, data in self._unsynced:
                    write_all(fd, data, offset)
            finally:
                os.close(fd)
        try:
            faults.point("journal.fsync")
            os.fsync(self._fd)
        except OSError:
            self.fsync_failures += 1
            self._rewrite = True
            raise
        self.fsyncs += 1
        self._rewrite, self._unsynced = False, []
