"""The journal's record frames: encoding, decoding and the resynchronising scan (pure, no I/O).

The format is described in `clawd.learning.journal`'s docstring; the reader here and the writer
there must agree byte for byte, which `tests/test_journal.py` pins with exact bytes.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

MAGIC = b"CLAWDJNL"
FORMAT_VERSION = 2
VERSIONS = (1, 2)                    # readable; only FORMAT_VERSION is written
HEADER = MAGIC + struct.pack("<I", FORMAT_VERSION)
HEADER_V1 = MAGIC + struct.pack("<I", 1)
# 0xFF and 0xC1 never occur in UTF-8 (the JSON payloads), and no proper suffix is a prefix
RECORD_MAGIC = b"\xffJR\xc1"
FRAME = struct.Struct("<4sII")       # record magic, length, crc32(length field + body)
FRAME_V1 = struct.Struct("<II")      # length, crc32(body)
APPEND, ACK, BASE = 1, 2, 3            # BASE: a segment's first record only (Journal.rewrite)
MAX_BODY = 1 << 30                   # a larger length field is damage, not data

def _encode_id(entry_id: str) -> bytes:
    raw = entry_id.encode()
    if not 0 < len(raw) <= 0xFFFF:
        raise ValueError(f"entry id must be 1..65535 UTF-8 bytes, got {len(raw)}")
    return struct.pack("<H", len(raw)) + raw


def _crc(length_field: bytes, body) -> int:
    return zlib.crc32(body, zlib.crc32(length_field))


def frame(body: bytes) -> bytes:
    length = struct.pack("<I", len(body))
    return RECORD_MAGIC + length + struct.pack("<I", _crc(length, body)) + body


def encode_append(entry_id: str, payload: bytes) -> bytes:
    return frame(bytes([APPEND]) + _encode_id(entry_id) + bytes(payload))


def encode_ack(ids: list[str]) -> bytes:
    return frame(bytes([ACK]) + struct.pack("<I", len(ids)) + b"".join(_encode_id(i) for i in ids))


def encode_base() -> bytes:
    return frame(bytes([BASE]))


def base_of(prefix: bytes) -> bool:
    """Whether a segment's first bytes are a format-2 header and a good BASE record."""
    if prefix[:len(HEADER)] != HEADER:
        return False
    got = _record(prefix, len(HEADER), FORMAT_VERSION)
    return not isinstance(got, str) and got[1][0] == BASE


def _decode_id(body: bytes, at: int) -> tuple[str, int]:
    if at + 2 > len(body):
        raise ValueError("id length past the end of the record")
    (n,) = struct.unpack_from("<H", body, at)
    if n == 0 or at + 2 + n > len(body):
        raise ValueError("bad id length")
    return body[at + 2:at + 2 + n].decode(), at + 2 + n


def decode_body(body: bytes) -> tuple[int, object]:
    """(APPEND, (id, payload)), (ACK, [ids]) or (BASE, None); ValueError when the body does not parse."""
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
    if kind == BASE:
        if len(body) != 1:
            raise ValueError("trailing bytes in BASE record")
        return BASE, None
    raise ValueError(f"unknown record type {kind}")


@dataclass(frozen=True)
class Scan:
    records: list            # [(type, value)] of the good records, in file order
    kept: list               # [(start, end)] byte range of each good record
    damaged: list            # [(offset, length, reason)] of each damaged span
    torn: int | None = None  # where a torn tail starts (the file ends inside a record, or in zeros)


def _record(data: bytes, at: int, version: int) -> tuple[int, tuple] | str:
    """(end, decoded body) of the record at `at`, or why there is none ("truncated...": cut by the end)."""
    if version == 2:
        head = data[at:at + len(RECORD_MAGIC)]
        if head != RECORD_MAGIC:
            return "truncated frame header" if RECORD_MAGIC.startswith(head) and len(head) < 4 else "bad record magic"
    fmt = FRAME if version == 2 else FRAME_V1
    if at + fmt.size > len(data):
        return "truncated frame header"
    length, crc = fmt.unpack_from(data, at)[-2:]
    if not 0 < length <= MAX_BODY:
        return f"bad length {length}"
    end = at + fmt.size + length
    if end > len(data):
        return f"truncated record ({len(data) - at - fmt.size} of {length} bytes)"
    body = data[at + fmt.size:end]
    if (_crc(data[at + 4:at + 8], body) if version == 2 else zlib.crc32(body)) != crc:
        return "CRC mismatch"
    try:
        decoded = decode_body(body)
    except (ValueError, UnicodeDecodeError) as e:  # CRC passed: a writer bug, still not data
        return f"undecodable record: {e}"
    if decoded[0] == BASE and (version != 2 or at != len(HEADER)):  # it speaks for whole segments only
        return "BASE record past a segment's start"
    return end, decoded


def _resync(data: bytes, at: int) -> int | None:
    """The first offset >= at where RECORD_MAGIC starts a good format-2 record."""
    at = data.find(RECORD_MAGIC, at)
    while at != -1 and isinstance(_record(data, at, 2), str):
        at = data.find(RECORD_MAGIC, at + 1)
    return None if at == -1 else at


def scan_records(data: bytes, version: int | None = None) -> Scan:
    """Decodes a whole segment (header included; `version` defaults to the header's)."""
    if version is None:
        version = struct.unpack_from("<I", data, len(MAGIC))[0]
    records, kept, damaged, at = [], [], [], len(HEADER)
    while at < len(data):
        got = _record(data, at, version)
        if not isinstance(got, str):
            records.append(got[1])
            kept.append((at, got[0]))
            at = got[0]
            continue
        after = _resync(data, at + 1) if version == 2 else None  # format 1 has no magic to look for
        if after is None and (got.startswith("truncated") or not data[at:].strip(b"\0")):
            return Scan(records, kept, damaged, at)
        damaged.append((at, (after or len(data)) - at, got))
        at = after or len(data)
    return Scan(records, kept, damaged)
