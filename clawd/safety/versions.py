"""Policy versions as first-class records: state/versions.jsonl (docs/ARCHITECTURE.md §17).

One JSON line per change of a version's record; the last line of a version is its record. A record:

    version      the number the engine serves it under (never reused)
    parent       the version it was trained from (a rollback's: the version it restores)
    created      unix time of the first line
    status       candidate    written, not yet serving everyone (its gate is running)
                 serving      serves everyone now
                 retired      served, then replaced by a newer version the normal way
                 rejected     failed its gate: it never served everyone (or, on one full-weight engine,
                              served only while its gate ran and was rolled back at once)
                 rolled_back  served, then rolled back (a monitor or the operator)
    steps        the trainer steps that made it from its parent
    samples      how many samples those steps trained on
    principals   {pseudonym: samples} of those steps (a version's ancestors add theirs: `lineage`): each
                 principal as a keyed pseudonym (`pseudonym`), never the name, which is often an e-mail
                 address and would outlive a forget here; `clawctl forget NAME` finds their versions by it
    gate         the gate's verdict on it (clawd.safety.gate), or null
    monitors     its live monitors' last summary and alarms (clawd.safety.monitors), or null
    detail       why its status is what it is, for the operator
    restored_from  a rollback's version: the version whose checkpoint it serves again

The file is appended (and fsynced) on every change and rewritten compacted, atomically, when it holds
four times more lines than versions. A torn last line (a crash while appending) is dropped; any other
unreadable line is logged and skipped, so a damaged history never stops the daemon.

The pseudonym key is `principal.key` beside the file (32 random bytes, 0600, made once). A history written
before pseudonyms (a file and no key) has its names replaced, and is rewritten, when it is loaded.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

log = logging.getLogger("clawd.versions")

CANDIDATE, SERVING, RETIRED, REJECTED, ROLLED_BACK = "candidate", "serving", "retired", "rejected", "rolled_back"
STATUSES = (CANDIDATE, SERVING, RETIRED, REJECTED, ROLLED_BACK)
GOOD = frozenset({SERVING, RETIRED})  # versions that served cleanly: baselines and rollback targets


@dataclass(frozen=True)
class Version:
    version: int
    parent: int | None
    created: float
    status: str
    steps: tuple[int, ...] = ()
    samples: int = 0
    principals: dict[str, int] = field(default_factory=dict)
    gate: dict | None = None
    monitors: dict | None = None
    detail: str = ""
    restored_from: int | None = None

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"unknown version status {self.status!r}")

    def to_json(self) -> dict:
        return {**asdict(self), "steps": list(self.steps)}

    @classmethod
    def from_json(cls, raw: dict) -> Version:
        return cls(**{**raw, "steps": tuple(raw.get("steps", ()))})


class Versions:
    """The history, in memory and in `path`. Only the daemon's event loop writes it."""

    def __init__(self, path: Path, *, key_path: Path | None = None, numbered_with: Callable[[], int] | None = None):
        """key_path: the pseudonym key (default: `principal.key` beside `path`); numbered_with: the newest version
        recorded elsewhere (adapters per principal: each lineage has its own history, and numbers are never
        reused across them)."""
        self.path = Path(path)
        self.records: dict[int, Version] = {}
        self._lines = 0
        self._numbered_with = numbered_with
        self._key_path = Path(key_path) if key_path is not None else self.path.with_name("principal.key")
        named = self.path.exists() and not self._key_path.exists()  # written before pseudonyms
        self._key = self._pseudonym_key()
        self._load()
        if named and any(v.principals for v in self.records.values()):
            for record in list(self.records.values()):
                self.records[record.version] = replace(record, principals=self._hide(record.principals))
            self._compact()
            log.info("%s: principal names replaced by their pseudonyms", self.path)

    def pseudonym(self, principal: str) -> str:
        """The name a principal has in the history: an HMAC of it under this state directory's key."""
        return "p-" + hmac.new(self._key, principal.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:16]

    def _hide(self, principals: dict[str, int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, n in principals.items():
            key = self.pseudonym(name)
            out[key] = out.get(key, 0) + n
        return out

    def _pseudonym_key(self) -> bytes:
        try:
            return self._key_path.read_bytes()
        except FileNotFoundError:
            pass
        self._key_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self._key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:  # made meanwhile (another reader of the same state)
            return self._key_path.read_bytes()
        try:
            os.write(fd, secrets.token_bytes(32))
            os.fsync(fd)
        finally:
            os.close(fd)
        return self._key_path.read_bytes()

    @property
    def key_path(self) -> Path:
        """The pseudonym key's file (a lineage's history shares the shared one's key)."""
        return self._key_path

    def __iter__(self):
        return iter(sorted(self.records.values(), key=lambda v: v.version))

    def __len__(self) -> int:
        return len(self.records)

    def get(self, version: int) -> Version | None:
        return self.records.get(version)

    @property
    def newest(self) -> int:
        """The highest version ever recorded (0 without one), here or in the histories numbered with it: a new
        version goes above it."""
        return max(self.recorded_newest, self._numbered_with() if self._numbered_with is not None else 0)

    @property
    def recorded_newest(self) -> int:
        """The highest version recorded in this history alone (0 without one)."""
        return max(self.records, default=0)

    def numbers(self) -> list[int]:
        """Every version recorded here, ascending (a lineage's own, for its staleness)."""
        return sorted(self.records)

    def serving(self) -> Version | None:
        found = [v for v in self.records.values() if v.status == SERVING]
        return max(found, key=lambda v: v.version) if found else None

    def servable(self, version: int, gated: bool) -> bool:
        """Whether a restart may serve `version`: it served cleanly, or (without a gate, nothing would check it)
        it is a candidate whose publish a stop cut short; never a rejected or rolled-back one."""
        record = self.records.get(version)
        return record is None or record.status in GOOD or (not gated and record.status == CANDIDATE)

    def good(self) -> list[Version]:
        """Versions that served cleanly, oldest first: baselines and rollback targets."""
        return [v for v in self if v.status in GOOD]

    def lineage(self, version: int) -> list[int]:
        """`version` and its ancestors through their parents, newest first."""
        out, seen = [], set()
        current: int | None = version
        while current is not None and current not in seen:
            seen.add(current)
            out.append(current)
            record = self.records.get(current)
            current = None if record is None else record.parent
        return out

    def add(self, record: Version) -> Version:
        """Record a new version; its `principals` are given by name and kept as pseudonyms."""
        if record.version in self.records:
            raise ValueError(f"v{record.version} is already recorded: versions are never reused")
        return self._write(replace(record, principals=self._hide(record.principals)))

    def update(self, version: int, **changes) -> Version:
        """Change fields of a recorded version (an unknown version is recorded from the changes); `principals`
        given by name."""
        if "principals" in changes:
            changes["principals"] = self._hide(changes["principals"])
        record = self.records.get(version)
        if record is None:
            record = Version(version=version, parent=changes.pop("parent", None), created=time.time(),
                             status=changes.pop("status", SERVING))
        return self._write(replace(record, **changes))

    def promote(self, version: int, detail: str = "") -> None:
        """`version` serves everyone: the one that served before is retired."""
        for record in list(self.records.values()):
            if record.status == SERVING and record.version != version:
                self.update(record.version, status=RETIRED, detail=f"replaced by v{version}")
        record = self.records.get(version)
        self.update(version, status=SERVING, detail=detail or (record.detail if record is not None else ""))

    def snapshot(self, last: int = 50) -> list[dict]:
        return [v.to_json() for v in list(self)[-last:]]

    # --- the file ---------------------------------------------------------------------------

    def _write(self, record: Version) -> Version:
        self.records[record.version] = record
        line = (json.dumps(record.to_json(), separators=(",", ":"), allow_nan=False) + "\n").encode()
        try:
            if self._lines > 4 * max(len(self.records), 16):
                self._compact()
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    os.write(fd, line)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self._lines += 1
        except OSError as exc:  # a full disk: the record holds in memory, the next write tries again
            log.error("could not write %s (%s): v%d's record is kept in memory", self.path, exc, record.version)
        return record

    def _compact(self) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w") as f:
            for record in self:
                f.write(json.dumps(record.to_json(), separators=(",", ":"), allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._lines = len(self.records)

    def _load(self) -> None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        if raw and not raw.endswith(b"\n"):  # appends must not join a torn last line
            with open(self.path, "rb+") as f:
                f.truncate(raw.rfind(b"\n") + 1)
        chunks = raw.split(b"\n")
        for n, chunk in enumerate(chunks, 1):
            if not chunk.strip():
                continue
            try:
                record = Version.from_json(json.loads(chunk))
            except (ValueError, TypeError) as exc:
                if n == len(chunks):  # torn by a crash while appending
                    log.warning("%s: dropping a torn last line", self.path)
                else:
                    log.error("%s: line %d is unreadable (%s); skipped", self.path, n, exc)
                continue
            self.records[record.version] = record
            self._lines += 1
