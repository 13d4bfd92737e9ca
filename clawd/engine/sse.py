"""The lines of a streamed engine answer (server-sent events), read in chunks of any size."""
from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable

# One SSE line may hold a whole reply: SGLang's default (cumulative) chunks repeat everything so far with
# its log-probs, about 30 bytes a token. aiohttp's line reader raises LineTooLong past 512 KiB (3.14);
# clawd splits lines itself, up to this bound.
MAX_SSE_LINE = 64 * 1024 * 1024


class LineTooLong(ValueError):
    """A line past MAX_SSE_LINE bytes."""


async def sse_lines(read: Callable[[], Awaitable[bytes]]) -> AsyncIterator[bytes]:
    """The stripped lines of a response body, read in chunks of any size (a long line is joined once);
    `read` returns the next bytes, b"" at the end."""
    parts: list[bytes] = []  # the current line's pieces, so far without a newline
    size = 0
    while chunk := await read():
        if b"\n" not in chunk:
            parts.append(chunk)
            size += len(chunk)
            if size > MAX_SSE_LINE:
                raise LineTooLong(f"engine sent a stream line over {MAX_SSE_LINE} bytes")
            continue
        first, *lines, rest = chunk.split(b"\n")
        yield b"".join([*parts, first]).strip()
        for line in lines:
            yield line.strip()
        parts, size = [rest], len(rest)
    if size:
        yield b"".join(parts).strip()
