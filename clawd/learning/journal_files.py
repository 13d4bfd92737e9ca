"""The journal's files below the `Journal` class: segment names, whole-file writes, the steps of a
rewrite, and finding quarantined spans by principal (docs/ARCHITECTURE.md §7).

Rewrite (`Journal.rewrite`, used to forget a person): the journal's whole content is replaced by a
given list of live entries, so that no other byte (acked, dropped or forgotten entries) stays on disk.

    1. the new segment `journal-<active + 1>.seg` is written under a `.tmp` name: HEADER, a BASE
       record, then one APPEND per kept entry; fsynced; renamed into place; the directory fsynced
    2. the older segments are deleted (oldest first), then the directory is fsynced

BASE means "every segment before this one is superseded". Replay looks for the newest segment
that starts with a good BASE record and deletes every older one BEFORE reading anything (so no
superseded byte is replayed, nor copied to quarantine). A crash before the rename leaves a `.tmp`
that replay deletes: the old journal, whole. A crash after it, even between two deletions: the new
one, whole. A forgotten entry never comes back beside the new state and a kept one is never lost.
A failed write, fsync or rename (ENOSPC, EIO) removes the `.tmp` (or the renamed segment, if the
directory fsync failed) and the old journal goes on as it was. A superseded segment that cannot be
deleted is retried by every compaction, which keeps the BASE segment until it is gone. Damage that
hits the BASE record itself in the window between step 1 and step 2 would let the old segments
replay; outside that window there are no old segments left.

Quarantined spans (`quarantine/*.bad`, see `clawd.learning.journal`) are damaged bytes and cannot be
attributed exactly: a span belongs to a principal when its bytes hold the key/value pair a sample of
theirs is stored with, `"principal":<name as json.dumps writes it>` (clawd.samples.Sample.to_json).
A span holding several people's records belongs to each of them; forgetting one deletes it whole.
A span whose damage hit those very bytes names nobody.
"""
from __future__ import annotations

import json
import logging
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from clawd import faults
from clawd.learning.frames import HEADER, base_of, encode_append, encode_base
from clawd.weights import fsync

log = logging.getLogger("clawd.journal")

SEGMENT_RE = re.compile(r"journal-(\d{16})\.seg")
QUARANTINE = "quarantine"


def segment_name(seq: int) -> str:
    return f"journal-{seq:016d}.seg"


@dataclass(frozen=True)
class Rewritten:
    kept: int            # entries in the new segment
    bytes_before: int    # of every segment file, before and after
    bytes_after: int
    left: int = 0        # superseded segments that could not be deleted yet (compaction retries)


def write_all(fd: int, data, offset: int | None = None) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        view, offset = view[n:], None if offset is None else offset + n


def write_file(path: Path, data: bytes) -> None:
    """Whole or not at all: a temporary name, fsync, rename, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync(path.parent)


def journal_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if SEGMENT_RE.fullmatch(p.name))


def starts_with_base(path: Path) -> bool:
    """Whether a segment's first record is a good BASE record (replay's first look)."""
    with open(path, "rb") as f:
        return base_of(f.read(len(HEADER) + len(encode_base())))


def write_base_segment(directory: Path, seq: int, entries) -> tuple[int, int]:
    """Step 1 of a rewrite: (an O_APPEND fd of the new segment, its size). OSError: nothing is left of it."""
    path = directory / segment_name(seq)
    tmp = path.with_name(path.name + ".tmp")
    data = HEADER + encode_base() + b"".join(encode_append(i, p) for i, p in entries)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    written = tmp
    try:
        faults.point("journal.rewrite.write")
        write_all(fd, data)
        faults.point("journal.rewrite.fsync")
        os.fsync(fd)
        faults.point("journal.rewrite.rename")
        os.rename(tmp, path)
        written = path  # from here a crash leaves the new journal
        faults.point("journal.rewrite.dirsync")
        fsync(directory)
    except BaseException:
        os.close(fd)
        try:  # the old journal must stay the whole journal
            written.unlink(missing_ok=True)
        except OSError as e:
            log.error("journal rewrite: cannot remove %s (%s)", written, e)
        raise
    return fd, len(data)


def delete_segments(directory: Path, seqs) -> list[int]:
    """Step 2 of a rewrite (and replay's cleanup): deletes superseded segments; returns those left."""
    left = []
    for seq in sorted(seqs):
        try:
            faults.point("journal.rewrite.delete")
            (directory / segment_name(seq)).unlink(missing_ok=True)
        except OSError as e:  # still superseded by the BASE segment: only its bytes linger
            log.error("cannot delete superseded journal segment %s (%s); compaction retries", segment_name(seq), e)
            left.append(seq)
    try:
        fsync(directory)
    except OSError as e:  # the deletions stand in the directory; the BASE segment covers a lost one
        log.error("fsync of %s after deleting superseded segments failed: %s", directory, e)
    return left


# ---- quarantine ----------------------------------------------------------------------

def quarantine_path(segment: Path, offset: int, blob: bytes) -> Path:
    """Where a damaged span goes (its CRC in the name: a later span at the same offset differs)."""
    return segment.parent / QUARANTINE / f"{segment.name}-{offset}-{zlib.crc32(blob):08x}.bad"


def set_aside(target: Path, blob: bytes) -> None:
    if not target.parent.is_dir():
        target.parent.mkdir()
        fsync(target.parent.parent)
    write_file(target, blob)


def principal_key(principal: str) -> bytes:
    """The bytes every stored sample of `principal` holds (Sample.to_json's encoding)."""
    return b'"principal":' + json.dumps(principal).encode()


def quarantined_for(directory: Path, principal: str) -> list[Path]:
    """The quarantine files of a journal directory whose bytes name `principal` (for export), sorted."""
    key = principal_key(principal)
    return sorted(p for p in (Path(directory) / QUARANTINE).glob("*.bad") if key in p.read_bytes())


def forget_quarantined(directory: Path, principal: str) -> list[Path]:
    """Deletes the quarantine files naming `principal` (see the module docstring); returns them."""
    paths = quarantined_for(directory, principal)
    for path in paths:
        path.unlink()
    if paths:
        fsync(paths[0].parent)
    return paths
