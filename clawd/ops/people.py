"""Everything clawd holds about one person: `clawctl export PRINCIPAL DIR` and `clawctl forget PRINCIPAL`.

A principal's data lives in these places: the turn, judge and feedback records (their ratings of replies), the
replies they may still rate and the ratings waiting for their turns (the scorer's registry), the samples waiting
in the store (and in the journal under it), the turns being scored, the live sessions (turns waiting for their
next message), the batches of rejected versions kept for inspection (state/rejected/), the damaged journal
spans set aside at replay (journal/quarantine/) that name them, exports of them still staged
(state/exports/), temporary files a crash left mid-rewrite, and the reply texts the behaviour monitors
keep in memory. `export` copies their part of it into a staging directory under the state directory (the
daemon may write nowhere else under systemd), with a manifest: from a damaged span only their whole
records, never the span. clawctl copies that to the operator's DIR and has the staging removed.
`forget` deletes all of it, rewrites the journal without their bytes, and names the versions already
trained on their samples (from the version lineage), so that the operator can roll back to before them:
weights cannot unlearn. Both are logged with who asked, when and what counts, never the content.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawd.learning.journal_files import quarantined_for
from clawd.learning.lineages import Lineages
from clawd.learning.store import SampleStore
from clawd.records import RecordWriter
from clawd.safety.monitors import Monitors
from clawd.safety.versions import Versions
from clawd.samples import Sample
from clawd.scoring.handover import TurnHandover
from clawd.scoring.scorer import Scorer
from clawd.serving.sessions import SessionTable
from clawd.turns import FinishedTurn

log = logging.getLogger("clawd.privacy")

EXPORTS = "exports"          # state_dir/exports/<name>: staged exports, removed by clawctl or retention
FORGOTTEN = "forget"         # the reason a forgotten principal's live sessions are closed with
MANIFEST = "manifest.json"


@dataclass
class Holdings:
    """Where a principal's data is; the daemon's stages, read and trimmed here."""
    state_dir: Path
    turn_records: RecordWriter
    judge_records: RecordWriter
    store: SampleStore
    scorer: Scorer
    sessions: SessionTable
    versions: Versions
    monitors: Monitors | None = None  # the behaviour monitors' kept reply texts
    handover: TurnHandover | None = None  # finished turns waiting for their PII scan
    feedback_records: RecordWriter | None = None  # their ratings of replies
    lineages: Lineages | None = None  # adapters per principal: their own adapter, its versions and checkpoints

    async def export(self, principal: str, asked_by: str) -> dict[str, Any]:
        """Write everything about `principal` under state_dir/exports/; returns the manifest (with its path)."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        # absolute: clawctl, which copies it, may run in another directory than the daemon
        out = (Path(self.state_dir) / EXPORTS / f"{_safe(principal)}-{stamp}-{os.urandom(3).hex()}").absolute()
        out.mkdir(parents=True)
        # Whose it is, first: a forget finds an export that failed half way too.
        (out / MANIFEST).write_text(json.dumps({"principal": principal, "complete": False}) + "\n")
        files = {
            "turns.jsonl": await _read(self.turn_records.select(principal)),
            "judge.jsonl": await _read(self.judge_records.select(principal)),
            "feedback.jsonl": await _read(self.feedback_records.select(principal)) if self.feedback_records else [],
            "ratings_waiting.jsonl": [_line(dataclasses.asdict(r)) for r in self.scorer.ratings.pending_of(principal)],
            "samples.jsonl": [s.to_json().decode() + "\n" for s in self.store.of(principal)],
            "scoring.jsonl": [_line(f.to_record()) for f in self.scorer.pending_of(principal)],
            "sessions.jsonl": [_line(FinishedTurn(t, None, None, t.created).to_record())
                               for t in self.sessions.pending_of(principal)],
            "rejected.jsonl": [line for _, line in self._rejected(principal)],
        }
        manifest: dict[str, Any] = {"principal": principal, "created": time.time(), "asked_by": asked_by,
                                    "files": {}, "versions_trained_on": self.trained_on(principal)}
        for name, lines in files.items():
            data = "".join(lines).encode()
            (out / name).write_bytes(data)
            manifest["files"][name] = {"lines": len(lines), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        # Damaged journal spans set aside at replay: only this principal's whole records, never the span (it may
        # hold other people's samples); what is too damaged to attribute is counted, not copied.
        lines, unread = [], 0
        for path in quarantined_for(self.store.journal.directory, principal):
            found, left = _records_of(path.read_bytes(), principal)
            lines += found
            unread += left
        if lines or unread:
            data = "".join(lines).encode()
            (out / "quarantine.jsonl").write_bytes(data)
            manifest["files"]["quarantine.jsonl"] = {"lines": len(lines), "bytes": len(data),
                                                     "sha256": hashlib.sha256(data).hexdigest(),
                                                     "unattributed_bytes": unread}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        log.warning("export of principal %r asked by %s: %s into %s", principal, asked_by,
                    _counts(manifest["files"]), out)
        return {"path": str(out), **manifest}

    async def forget(self, principal: str, asked_by: str) -> dict[str, Any]:
        """Delete everything about `principal`; returns what went and the versions trained on them."""
        closed = self.sessions.close_all(time.time(), FORGOTTEN, principal=principal)  # never handed over
        scanning = 0 if self.handover is None else self.handover.forget(principal)  # before any await
        temporaries = self._drop_temporaries()  # first: a rewrite below must not open a stale one
        scoring = await self.scorer.forget(principal)
        samples = dataclasses.asdict(await self.store.forget(principal))  # the journal rewritten without them
        removed = {
            "session_turns": len(closed),
            "turns_being_scored": scoring,
            "turns_being_scanned": scanning,
            "samples_waiting": samples["waiting"],
            "samples_in_flight": samples["in_flight"],
            "quarantined_spans": samples["quarantined"],
            "turn_records": await self.turn_records.remove(principal),
            "judge_records": await self.judge_records.remove(principal),
            "feedback_records": await self.feedback_records.remove(principal) if self.feedback_records else 0,
            "replies_rated_or_rateable": self.scorer.ratings.forget(principal),  # ids, ratings waiting, calibration
            "rejected_samples": self._drop_rejected(principal),
            "exports": self._drop_exports(principal),
            "temporary_files": temporaries,
            "monitor_texts": 0 if self.monitors is None else self.monitors.forget_principal(principal),
        }
        # Their own adapter (adapters per principal): its learner stopped, its versions, checkpoints and directory
        # deleted, its adapter unloaded once no request carries it; they are served the shared one from now on.
        removed["own_adapter_versions"] = 0
        if self.lineages is not None and (own := await self.lineages.forget(principal, 60.0)) is not None:
            removed["own_adapter_versions"] = own["versions"]
        trained_on = self.trained_on(principal)
        log.warning("forget of principal %r asked by %s: removed %s; versions already trained on their samples: "
                    "%s", principal, asked_by, json.dumps(removed, sort_keys=True),
                    ", ".join(f"v{v}" for v in trained_on) or "none")
        return {"principal": principal, "removed": removed, "versions_trained_on": trained_on,
                "journal_bytes": {"before": samples["journal_bytes_before"], "after": samples["journal_bytes_after"]},
                "serving": self._serving_trained(trained_on)}

    def trained_on(self, principal: str) -> list[int]:
        """Versions whose own steps trained on the principal's samples (a descendant inherits them: the
        operator rolls back to before the oldest)."""
        pseudonym = self.versions.pseudonym(principal)
        return [v.version for v in self.versions if pseudonym in v.principals]

    def _serving_trained(self, trained_on: list[int]) -> bool:
        """Whether the version serving descends from one trained on them."""
        serving = max((v.version for v in self.versions if v.status == "serving"), default=None)
        if serving is None:
            return False
        return bool(set(trained_on) & set(self.versions.lineage(serving)))

    def _rejected(self, principal: str):
        for path in sorted((Path(self.state_dir) / "rejected").glob("*.samples.jsonl")):
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
                if _sample_principal(line) == principal:
                    yield path, line

    def _drop_rejected(self, principal: str) -> int:
        gone = 0
        for path in sorted((Path(self.state_dir) / "rejected").glob("*.samples.jsonl")):
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
            kept = [line for line in lines if _sample_principal(line) != principal]
            if len(kept) != len(lines):
                gone += len(lines) - len(kept)
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text("".join(kept), encoding="utf-8")
                os.replace(tmp, path)
        return gone


    def _drop_exports(self, principal: str) -> int:
        """Exports of `principal` still staged (clawctl failed before taking its copy) or left half written."""
        gone = 0
        for path in sorted((Path(self.state_dir) / EXPORTS).glob("*")):
            try:
                theirs = json.loads((path / MANIFEST).read_text()).get("principal") == principal
            except (OSError, ValueError):  # no manifest yet: its name says whose
                theirs = path.name.startswith(f"{_safe(principal)}-")
            if theirs and path.is_dir():
                shutil.rmtree(path)
                gone += 1
        return gone

    def _drop_temporaries(self) -> int:
        """Temporary files a crash or a full disk left mid-rewrite (copies of records, anyone's): never read."""
        dirs = {self.turn_records.directory, self.judge_records.directory, Path(self.state_dir) / "rejected"}
        stale = [p for d in dirs for p in Path(d).glob("*.tmp") if p.is_file()]
        for path in stale:
            path.unlink()
        return len(stale)


def _records_of(data: bytes, principal: str) -> tuple[list[str], int]:
    """(the whole sample records of `principal` in a damaged journal span, as lines; the bytes of the span that
    no whole record accounts for)."""
    text, decoder = data.decode("utf-8", errors="replace"), json.JSONDecoder()
    out, covered, at = [], 0, text.find('{"v":')
    while at >= 0:
        try:
            obj, end = decoder.raw_decode(text, at)
        except ValueError:
            at = text.find('{"v":', at + 1)
            continue
        covered += end - at
        sample = obj.get("sample") if isinstance(obj, dict) else None
        if isinstance(sample, dict) and sample.get("principal") == principal:
            out.append(text[at:end] + "\n")
        at = text.find('{"v":', end)
    return out, max(0, len(text) - covered)


async def _read(lines) -> list[str]:
    """All of a records generator, letting the loop serve every few thousand lines: records may be large,
    and the daemon has no threads to read them on. A line appended meanwhile is read or not."""
    out = []
    for n, line in enumerate(lines, 1):
        out.append(line)
        if n % 2048 == 0:
            await asyncio.sleep(0)
    return out


def remove_export(state_dir: Path, path: str) -> None:
    """clawctl, once it has copied an export: the staging directory goes. Only a directory directly under
    state_dir/exports/ is removed (the path comes from the admin socket)."""
    exports = (Path(state_dir) / EXPORTS).resolve()
    target = Path(path).resolve()
    if target.parent != exports or not (target / MANIFEST).is_file():
        raise ValueError(f"{path} is not an export of this clawd")
    shutil.rmtree(target)


def _sample_principal(line: str) -> str | None:
    try:
        return Sample.from_json(line.encode()).principal
    except ValueError:  # a torn line: attributed as the records do
        return None


def _safe(principal: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", principal)[:48] or "_"


def _line(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"


def _counts(files: dict) -> str:
    return ", ".join(f"{name} {meta.get('lines', meta['bytes'])}" for name, meta in files.items())
