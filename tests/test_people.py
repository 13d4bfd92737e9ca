"""A person's data in a damaged journal span (clawd.ops.people): an export takes their whole records out of it,
never the span, which may hold other people's samples; what no whole record accounts for is only counted."""
from __future__ import annotations

import json

from clawd.ops.people import _records_of


def record(principal: str, text: str) -> str:
    return json.dumps({"v": 1, "sample": {"principal": principal, "session_id": text}}, separators=(",", ":"))


def test_a_damaged_span_gives_the_principals_whole_records_only():
    alice, bob, torn = record("alice", "otters"), record("bob", "seals"), record("alice", "cut")[:25]
    span = (b"\x00\x00\x01\x2a" + alice.encode() + b"\xff\xfe" + bob.encode() + b"\x00\x07" + torn.encode()
            + b"garbage" + alice.replace("otters", "again").encode())
    found, unattributed = _records_of(span, "alice")
    assert found == [alice + "\n", alice.replace("otters", "again") + "\n"]
    whole = len(alice) + len(bob) + len(alice.replace("otters", "again"))
    assert unattributed == len(span.decode("utf-8", errors="replace")) - whole  # frames, the torn one, the garbage
    assert _records_of(span, "bob") == ([bob + "\n"], unattributed) and _records_of(span, "carol") == ([], unattributed)
