"""An engine's output, carried into clawd's log with its secrets taken out (docs/ARCHITECTURE.md §10).

SGLang 0.5.23 logs its `server_args` at INFO as it starts (entrypoints/engine.py), `api_key` and
`admin_api_key` included in clear (it redacts only its watermark keys), and an engine used to write
straight to the stderr it inherited from clawd. So the engine's stdout and stderr are one pipe that clawd
reads: each line has every secret clawd knows replaced (`credentials.redact`, as the daemon's own log
handler does) before it reaches clawd's stderr.

Threads, not the event loop: a daemon loop that stalls, or a sink that blocks (a full journald), must never
block the engine on a write to its pipe. A reader thread drains the pipe at once into a bounded queue; a
writer thread empties the queue into the sink; when the queue is full, lines are dropped and counted
(`dropped`), and the sink is told how many once there is room again.
"""
from __future__ import annotations

import queue
import sys
import threading
from typing import BinaryIO, TextIO

from clawd.credentials import redact

MAX_QUEUED_LINES = 10_000
THREAD_PREFIX = "engine-output-"  # the daemon's only threads besides the main one: two per launched engine
_END = None


class EngineOutput:
    """The pump for one engine process: `start(pipe)` once, `join()` after the process ended. Lines pass
    through `credentials.redact`: every secret clawd loaded (the engine keys among them) is hidden."""

    def __init__(self, name: str = "engine", sink: TextIO | None = None, max_lines: int = MAX_QUEUED_LINES):
        self.name = name
        self.sink = sink
        self.dropped = 0  # lines lost because the sink fell behind (the engine never waits for it)
        self._lines: queue.Queue[str | None] = queue.Queue(max_lines)
        self._threads: list[threading.Thread] = []

    def start(self, pipe: BinaryIO) -> "EngineOutput":
        for target, args, role in ((self._read, (pipe,), "read"), (self._write, (), "write")):
            thread = threading.Thread(target=target, args=args, daemon=True, name=f"{THREAD_PREFIX}{self.name}-{role}")
            thread.start()
            self._threads.append(thread)
        return self

    def join(self, timeout: float = 5.0) -> None:
        for thread in self._threads:
            thread.join(timeout)

    def _read(self, pipe: BinaryIO) -> None:
        try:
            for raw in iter(pipe.readline, b""):
                line = redact(raw.decode("utf-8", "replace"))
                try:
                    self._lines.put_nowait(line if line.endswith("\n") else line + "\n")
                except queue.Full:
                    self.dropped += 1
        finally:
            pipe.close()
            self._lines.put(_END)  # blocks only until the writer makes room: the pipe is already drained

    def _write(self) -> None:
        sink = self.sink or sys.stderr
        told = 0
        while True:
            line = self._lines.get()
            if missed := self.dropped - told:  # read once: the reader may drop more while this write waits
                sink.write(f"[clawd: {missed} line(s) of the engine's output dropped: the log could not keep up]\n")
                told += missed
            if line is _END:
                break
            sink.write(line)
            sink.flush()
        sink.flush()
