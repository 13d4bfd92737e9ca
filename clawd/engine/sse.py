"""The lines of a streamed engine answer (server-sent events), read in chunks of any size: an I/O-free splitter."""
from __future__ import annotations

# One SSE line may hold a whole reply: SGLang's default (cumulative) chunks repeat everything so far with
# its log-probs, about 30 bytes a token. aiohttp's line reader raises LineTooLong past 512 KiB (3.14);
# clawd splits lines itself, up to this bound.
MAX_SSE_LINE = 64 * 1024 * 1024


class LineTooLong(ValueError):
    """A line past MAX_SSE_LINE bytes."""


class LineSplitter:
    """A response body's stripped lines, whatever its chunking: `feed` gives the lines each chunk of bytes
    completes (a long line is joined once), `end` the unterminated rest. All the lines of one network read come
    out together, so a reader knows which of them the engine sent at once."""

    def __init__(self, limit: int = MAX_SSE_LINE):
        self.limit = limit
        self._parts: list[bytes] = []  # the current line's pieces, so far without a newline
        self._size = 0

    def feed(self, data: bytes) -> list[bytes]:
        if b"\n" not in data:
            self._parts.append(data)
            self._size += len(data)
            if self._size > self.limit:
                raise LineTooLong(f"engine sent a stream line over {self.limit} bytes")
            return []
        first, *lines, rest = data.split(b"\n")
        if self._parts:
            first = b"".join([*self._parts, first])
        self._parts, self._size = [rest], len(rest)
        return [first.strip(), *(line.strip() for line in lines)]

    def end(self) -> list[bytes]:
        rest, self._parts, self._size = b"".join(self._parts).strip(), [], 0
        return [rest] if rest else []
