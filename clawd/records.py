"""Turn records: one JSONL line per finished main turn, a file per UTC day.

Records are for people (audit, debugging, datasets), not for durability: the
sample journal owns that. Lines are appended from the event loop with one
write each, without fsync. Files older than `retention_days` are deleted at rotation and by the
retention sweep (`prune`, clawd.privacy.retention), mode 0600 whatever the umask. Records never hold API
keys or headers: a `Turn` has none to give; what else they hold is clawd.privacy.policy's to decide.
`select` and `remove` read and rewrite them per principal (clawctl export / forget); `remove` yields the
loop every few thousand lines (a forget over a GB of records must not stall serving), and lines written
meanwhile are held and appended once the files are replaced.

A write that fails (a full disk) never reaches the caller, which is a chat request or a
scoring task: the line is cut back out of the file (no torn line is left for the next to
join), counted in `failed`, logged at most once a minute, and handed to `on_error` (the
daemon pauses learning for the disk). Serving goes on without its record.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterator

from clawd import faults, jsoncodec
from clawd.turns import FinishedTurn

log = logging.getLogger("clawd.records")

_LINES_PER_SLICE = 2000  # of a rewrite between two yields of the loop: a few ms of JSON decoding


class RecordWriter:
    def __init__(self, directory: Path, *, kind: str = "turns", retention_days: int = 30,
                 on_error: Callable[[OSError], None] | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.kind = kind
        self.retention_days = retention_days
        self._day: str | None = None
        self._fd: int | None = None
        self.written = 0
        self.failed = 0
        self.on_error = on_error
        self._logged_at = float("-inf")
        self._held: list[tuple[dict, float]] | None = None  # written while `remove` rewrites: appended after
        self._rewriting = asyncio.Lock()  # two forgets at once: the second waits (one list of held lines)

    def path_for(self, day: str) -> Path:
        return self.directory / f"{self.kind}-{day}.jsonl"

    def write(self, record: dict, now: float | None = None) -> bool:
        """Append one line; False when it could not be written (see the module's docstring)."""
        now = time.time() if now is None else now
        if self._held is not None:
            self._held.append((record, now))
            return True
        line = jsoncodec.dumps(record) + b"\n"  # compact UTF-8, as json.dumps(ensure_ascii=False) writes it
        start = None
        try:
            day = time.strftime("%Y-%m-%d", time.gmtime(now))
            if day != self._day:
                self._rotate(day, now)
            start = os.lseek(self._fd, 0, os.SEEK_END)
            faults.point("records.write")
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            self._failed(exc, start)
            return False
        self.written += 1
        return True

    def _failed(self, exc: OSError, start: int | None) -> None:
        self.failed += 1
        if start is not None:
            try:
                os.ftruncate(self._fd, start)
            except OSError:  # the part written stays; a reader skips a line that is not JSON
                pass
        if time.monotonic() - self._logged_at >= 60:
            self._logged_at = time.monotonic()
            log.error("%s records: a write failed (%s); %d line(s) lost so far, serving goes on",
                      self.kind, exc.strerror or exc, self.failed)
        if self.on_error is not None:
            self.on_error(exc)

    def write_turn(self, finished: FinishedTurn) -> None:
        self.write(finished.to_record(), finished.finished)

    def _rotate(self, day: str, now: float) -> None:
        self.close()
        self._fd = os.open(self.path_for(day), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._day = day
        self.prune(now)

    def files(self) -> list[Path]:
        """This kind's record files, oldest day first."""
        return sorted(self.directory.glob(f"{self.kind}-*.jsonl"))

    def prune(self, now: float | None = None) -> list[Path]:
        """Delete the files of days older than `retention_days`; returns them."""
        now = time.time() if now is None else now
        cutoff = time.strftime("%Y-%m-%d", time.gmtime(now - self.retention_days * 86400))
        removed = []
        for path in self.files():
            if path.stem[len(self.kind) + 1:] < cutoff:
                log.info("deleting %s (older than %d days)", path, self.retention_days)
                path.unlink(missing_ok=True)
                removed.append(path)
        return removed

    def select(self, principal: str) -> Iterator[str]:
        """Every line (as written, newline included) of this principal's records."""
        for path in self.files():
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if _belongs(line, principal):
                        yield line

    async def remove(self, principal: str) -> int:
        """Rewrite every file without this principal's lines; returns how many went. Each file is replaced
        whole (a temporary file, fsynced, renamed over it), so a crash leaves the old file or the new one.
        The open file is closed first: the next write opens the new one."""
        async with self._rewriting:
            self.close()
            self._held = []
            removed = 0
            try:
                for path in self.files():
                    removed += await self._rewrite(path, principal)
            finally:
                held, self._held = self._held, None
                for record, now in held:  # in the order written; theirs, written during the forget, go too
                    if record.get("principal") != principal:
                        self.write(record, now)
            return removed

    async def _rewrite(self, path: Path, principal: str) -> int:
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)  # one a crash left keeps its mode: made afresh, it is 0600
        removed = 0
        try:
            with open(path, encoding="utf-8", errors="replace") as src, \
                    open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "w",
                         encoding="utf-8") as out:
                for n, line in enumerate(src, 1):
                    if _belongs(line, principal):
                        removed += 1
                    else:
                        out.write(line)
                    if n % _LINES_PER_SLICE == 0:
                        await asyncio.sleep(0)
                if removed:
                    out.flush()
                    os.fsync(out.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if removed:
            os.replace(tmp, path)
        else:
            tmp.unlink()
        return removed

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._day = None


def _belongs(line: str, principal: str) -> bool:
    """Whether one record line is this principal's. A torn line (not JSON) is theirs when it holds their
    "principal" field as `write` encodes it: what cannot be attributed is not kept against their wish."""
    try:
        record = json.loads(line)
    except ValueError:
        return '"principal":' + json.dumps(principal, ensure_ascii=False) in line
    return isinstance(record, dict) and record.get("principal") == principal
