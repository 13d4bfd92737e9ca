"""What the learner still owes before its next step: a small state object, I/O-free, so that each transition
is tested alone (tests/test_recovery.py); the learner (clawd.learning.learner) makes the calls it names.

A step leaves a candidate to gate and publish; a failed write leaves the trainer owing it (`owed` in its
state: "publish" before "checkpoint"); a restarted trainer holds its checkpoint's weights, which the engine
must serve, and the samples trained since that checkpoint wait to be trained again; a rollback sorts the
samples not yet acknowledged. Until all of that is settled no new step starts.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

from clawd.samples import Sample
from clawd.safety.versions import CANDIDATE, REJECTED, ROLLED_BACK


class Next(enum.Enum):
    """What to settle next, in this order: the trainer's owed writes come before anything reads them."""
    DELIVER = "deliver"        # gate and publish the candidate (its gate or its publish failed before)
    PUBLISH = "publish"        # ask the trainer to write its weights as a new version (the write failed before)
    SERVE = "serve"            # move the engine onto `unpublished`
    CHECKPOINT = "checkpoint"  # ask the trainer for the checkpoint it owes, then acknowledge


class Held(enum.Enum):
    """What a (re)started trainer's weights need, beside the version serving."""
    NOTHING = "nothing"        # they are what serves, or a version rolled back (`recover` rolls back again)
    GATE = "gate"              # a candidate that never passed the gate: it is gated before it serves
    SERVE = "serve"            # a newer published version: served as it is
    RENUMBER = "renumber"      # older (checkpoint_every > 1) or its directory is gone: written as a new version


def held_needs(version: int, status: str | None, serving: int, published: bool, gated: bool) -> Held:
    """A restarted trainer holds `version` (its record's `status`, None when unrecorded), `serving` serves;
    `published`: its directory is complete on disk; `gated`: versions pass a gate before they serve."""
    if version == serving or status in (REJECTED, ROLLED_BACK):
        return Held.NOTHING
    if version > serving and published:
        return Held.GATE if status == CANDIDATE and gated else Held.SERVE
    return Held.RENUMBER


@dataclass
class Recovery:
    unacked: list[Sample] = field(default_factory=list)  # trained, not yet covered by a checkpoint
    trainer_pid: int | None = None                        # the child whose state `unacked` is in
    candidate: tuple[str, int] | None = None              # (weights_dir, version) trained, not promoted or rejected
    unpublished: tuple[str, int] | None = None            # (weights_dir, version) the engine should serve
    writing: int | None = None                            # the candidate the trainer writes off the critical path
    recovered: bool = False                               # what the last stop left half-decided is settled

    def next(self, owed: list[str]) -> Next | None:
        """The next thing to settle given the trainer's `owed` writes; None: ready for a step."""
        if self.candidate is not None and not owed:
            return Next.DELIVER
        if owed and owed[0] == "publish":
            return Next.PUBLISH
        if self.unpublished is not None:
            return Next.SERVE
        if owed:
            return Next.CHECKPOINT
        return None

    def stepped(self, batch: list[Sample], weights: tuple[str, int] | None, writing: int | None) -> None:
        """A step trained `batch`; `weights`: the candidate it wrote (None: skipped), `writing`: the version
        whose directory the trainer still writes."""
        self.unacked += batch
        if weights is not None:
            self.candidate = weights
            self.writing = weights[1] if writing == weights[1] else None

    def decided(self) -> None:
        """The candidate was promoted, rejected, or doomed by a rollback waiting: it is owed no more."""
        self.candidate = self.writing = None

    def acknowledged(self) -> list[Sample]:
        """A checkpoint holds every step so far: these samples leave the journal (put back by `unacknowledged`
        when that write fails)."""
        done, self.unacked = self.unacked, []
        return done

    def unacknowledged(self, samples: list[Sample]) -> None:
        self.unacked = samples + self.unacked

    def restarted(self, pid: int, kept: Callable[[], set[str]]) -> list[Sample]:
        """A trainer child `pid` is up: if it replaced the one `unacked` was trained in, the samples its
        checkpoint does not hold (`kept()`: the ids it does) are returned to be trained again; those it holds
        stay to be acknowledged, never trained twice. Idempotent for the same pid."""
        again: list[Sample] = []
        if pid != self.trainer_pid:
            if self.trainer_pid is not None and self.unacked:
                ids = kept()
                again = [s for s in self.unacked if s.sample_id not in ids]
                self.unacked = [s for s in self.unacked if s.sample_id in ids]
            self.trainer_pid = pid
        return again

    def lost(self, published: Callable[[str], bool]) -> int | None:
        """After a restart: the candidate whose directory the dead child was still writing is gone with it
        (`published(dir)` False). Its version, forgotten here; None when nothing was lost."""
        if self.candidate is None or self.candidate[1] != self.writing or published(self.candidate[0]):
            return None
        version, self.candidate, self.writing = self.candidate[1], None, None
        return version

    def rolled_back(self, kept: list[Sample], dropped: list[Sample]) -> None:
        """A rollback sorted `unacked` (clawd.learning.rollback.sort_unacked): `kept` are in the target's weights
        and `dropped` made a doomed version; both are acknowledged with the next checkpoint, never trained
        again. Those to train again went back to the store."""
        self.unacked = kept + dropped
