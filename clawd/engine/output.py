"""An engine's output, carried into clawd's log with its secrets taken out (docs/ARCHITECTURE.md §10).

SGLang 0.5.23 logs its `server_args` at INFO as it starts (entrypoints/engine.py), `api_key` and
`admin_api_key` included in clear (it redacts only its watermark keys), and an engine used to write
straight to the stderr it inherited from clawd. So the engine's stdout and stderr are one pipe that the
daemon's loop reads (no thread: the daemon has none): each line has every secret clawd knows replaced
(`credentials.redact`, as the daemon's own log handler does) before it reaches clawd's stderr.

The pipe is enlarged to 1 MiB, so a loop that stalls holds seconds of an engine's output (SGLang writes a
few lines a second) before the engine would wait on a write; a line the sink refuses (a non-blocking
stderr that is full) is dropped and counted (`dropped`).
"""
from __future__ import annotations

import asyncio
import fcntl
import os
import sys
from typing import BinaryIO, TextIO

from clawd.credentials import redact

PIPE_BYTES = 1 << 20
READ_BYTES = 1 << 16


class EngineOutput:
    """The pump for one engine process: `start(pipe)` once, on the loop; it stops at the pipe's end."""

    def __init__(self, sink: TextIO | None = None):
        self.sink = sink
        self.dropped = 0  # lines the sink refused
        self.done = asyncio.Event()
        self._partial = b""

    def start(self, pipe: BinaryIO) -> "EngineOutput":
        self._pipe, self._fd = pipe, pipe.fileno()
        os.set_blocking(self._fd, False)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:  # above /proc/sys/fs/pipe-max-size for an unprivileged user: the default 64 KiB
            pass
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._readable)
        return self

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._loop.remove_reader(self._fd)
            self._pipe.close()
            self._emit(self._partial, end=True)
            self.done.set()
            return
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            self._emit(line)

    def _emit(self, raw: bytes, end: bool = False) -> None:
        if end and not raw:
            return
        sink = self.sink or sys.stderr
        try:
            sink.write(redact(raw.decode("utf-8", "replace")) + "\n")
            sink.flush()
        except (BlockingIOError, OSError, ValueError):
            self.dropped += 1
