"""The sample store: the only way samples go in (put) and out (take_batch, ack) (docs/ARCHITECTURE.md §14).

    put(sample)        journal APPEND, then the sample waits; returning is "acknowledged"
    take_batch(n, ...) drops stale samples, then picks up to n under the fairness cap
    ack(ids)           after the consuming step is checkpointed: journal ACK + compaction
    replay()           on start: every sample not yet acked waits again, in put order
    forget(principal)  a person's samples leave the line and the disk (journal rewrite, quarantine)
    of(principal)      a person's samples held now (waiting and in flight), for export

Taken samples stay in the journal until acked, so a crash between take and ack
trains them again (at least once). Stale samples dropped by take_batch are
acked together with the next `ack` call (`await store.ack([])` writes them now).

Forgetting: the principal's waiting samples leave the line; those in flight (taken by a step that may
already use them) are marked so that neither `requeue` nor a later `ack` keeps them, and `forget`
reports how many; puts of theirs still writing are dropped when their append returns. Then the
journal is rewritten with only what the store still holds (no acked or dropped bytes either) and the
quarantined spans naming them are deleted. The samples leave memory even when the rewrite fails
(JournalWriteError): the caller reports it and forgets again, before a restart replays them.
"""
from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

from clawd.learning.journal import Journal
from clawd.learning.journal_files import forget_quarantined
from clawd.samples import Sample


def fair_pick(principals: list[str], n: int, share: float) -> list[int]:
    """Indices (ascending) of the samples a batch of n takes; `principals` is oldest first.

    cap = max(1, floor(share * n)) samples per principal. While at least
    ceil(1 / share) distinct principals are waiting the cap is hard and the
    batch may come out short. With fewer, the cap yields one step at a time
    (cap + 1, cap + 2, ...) until the batch fills or the samples run out.
    At every step the oldest eligible samples are taken first, so each raise
    of the cap gives each principal at most one more sample, oldest first.
    """
    if not 0 < share <= 1:
        raise ValueError(f"share {share} is outside (0, 1]")
    s = Fraction(share).limit_denominator(1_000_000)  # floor(0.29 * 100) must be 29, not 28
    cap = max(1, math.floor(s * n))
    hard = len(set(principals)) >= math.ceil(1 / s)
    n = min(n, len(principals))
    chosen: set[int] = set()
    taken: Counter[str] = Counter()
    while len(chosen) < n:
        for i, p in enumerate(principals):
            if len(chosen) == n:
                break
            if i not in chosen and taken[p] < cap:
                chosen.add(i)
                taken[p] += 1
        if hard:
            break
        cap += 1
    return sorted(chosen)


_ENCODE_SLICE = 64  # samples encoded between two yields to the loop in `forget` (a few ms of work)


@dataclass(frozen=True)
class Forgotten:
    waiting: int               # samples taken out of the line
    in_flight: int             # taken by a step (maybe trained by it): never requeued nor kept
    quarantined: int           # quarantine files deleted (spans that name the principal)
    journal_bytes_before: int  # every segment file, before and after the rewrite
    journal_bytes_after: int


def is_stale(sample: Sample, current_version: int, max_staleness: int) -> bool:
    return current_version - sample.policy_version > max_staleness


@dataclass(frozen=True)
class Selection:
    """One learner's part of the store, with adapters per principal (clawd.learning.lineages): the samples it
    trains (`has`), and how many of its own lineage's versions lie after a sample's up to the current one
    (`behind`): versions are numbered across lineages, so a plain difference would count the others'."""
    has: Callable[[Sample], bool]
    behind: Callable[[int, int], int]

    def stale(self, sample: Sample, current_version: int, max_staleness: int) -> bool:
        return self.behind(sample.policy_version, current_version) > max_staleness


class SampleStore:
    def __init__(self, journal: Journal, *, fair_share: float = 0.25, on_put: Callable[[Sample], None] | None = None):
        if not 0 < fair_share <= 1:
            raise ValueError(f"fair_share {fair_share} is outside (0, 1]")
        self.journal = journal
        self.fair_share = fair_share
        self._waiting: list[Sample] = []           # oldest first
        self._by_principal: Counter[str] = Counter()
        self._in_flight: dict[str, Sample] = {}    # taken, not yet acked
        self._putting: dict[str, Sample] = {}      # journal append not yet returned
        self._forgotten: set[str] = set()          # in flight or putting when forgotten: never kept
        self._drop_unacked: list[str] = []          # dropped as stale, ACK not yet written
        self._changed = asyncio.Event()
        self.put_total = 0
        self.taken_total = 0
        self.dropped_stale = 0
        self.acked_total = 0
        self.doomed_versions: set[int] = set()  # rejected or rolled back: their samples are never trained
        self.dropped_doomed = 0
        self.on_put = on_put  # a scored sample arrived (the behaviour monitors)

    # -- counts ----------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def depth(self) -> int:
        """Entries a restart would replay: waiting + in flight + dropped-not-yet-acked."""
        return self.journal.live

    def waiting_ids(self) -> set[str]:
        return {s.sample_id for s in self._waiting}

    def waiting_by_principal(self) -> dict[str, int]:
        return dict(self._by_principal)

    def waiting_of(self, principal: str) -> int:
        return self._by_principal.get(principal, 0)

    def fresh(self, current_version: int, max_staleness: int, of: Selection | None = None) -> int:
        """Waiting samples within `max_staleness` versions of `current_version` (of the selection's, if given)."""
        if of is None:
            return sum(not is_stale(s, current_version, max_staleness) for s in self._waiting)
        return sum(of.has(s) and not of.stale(s, current_version, max_staleness) for s in self._waiting)

    # -- in and out ----------------------------------------------------------------------

    async def replay(self) -> int:
        """Opens the journal and makes every sample not yet acked wait again, in put order."""
        loaded = []
        for sample_id, payload in self.journal.open():
            try:
                sample = Sample.from_json(payload)
            except (ValueError, TypeError) as e:  # CRC-checked bytes that do not parse: a format change
                raise ValueError(f"journal entry {sample_id!r} is not a readable sample: {e}") from e
            if sample.sample_id != sample_id:
                raise ValueError(f"journal entry {sample_id!r} holds sample {sample.sample_id!r}")
            loaded.append(sample)
        for sample in loaded:
            self._add(sample)
        return len(loaded)

    async def put(self, sample: Sample) -> None:
        """Returns once the sample's journal record is written; only then can a batch take it. A sample of a
        rejected or rolled-back version (`drop_versions`) is dropped instead: never trained."""
        if sample.policy_version in self.doomed_versions:
            self.dropped_doomed += 1
            return
        sid = sample.sample_id
        mine = self._putting.setdefault(sid, sample) is sample  # (a duplicate id fails in append)
        forgotten = False
        try:
            await self.journal.append(sid, sample.to_json())
        finally:
            if mine:
                del self._putting[sid]
                forgotten = sid in self._forgotten
                self._forgotten.discard(sid)
        if forgotten:  # its principal was forgotten meanwhile: the rewrite left it out
            return
        if self.on_put is not None:
            self.on_put(sample)
        self.put_total += 1
        self._add(sample)

    def take_batch(self, n: int, *, current_version: int, max_staleness: int,
                   of: Selection | None = None) -> tuple[list[Sample], list[Sample]]:
        """(batch, dropped_stale), of the selection's samples if given. Deferred samples keep waiting in their
        order."""
        fresh, stale = [], []
        for s in self._waiting:
            if of is not None and not of.has(s):
                continue  # another learner's: it keeps its place
            if of.stale(s, current_version, max_staleness) if of is not None else \
                    is_stale(s, current_version, max_staleness):
                stale.append(s)
            else:
                fresh.append(s)
        picked = set(fair_pick([s.principal for s in fresh], n, self.fair_share))
        batch = [s for i, s in enumerate(fresh) if i in picked]
        gone = {s.sample_id for s in batch} | {s.sample_id for s in stale}
        self._waiting = [s for s in self._waiting if s.sample_id not in gone]
        for s in batch + stale:
            self._by_principal[s.principal] -= 1
            if not self._by_principal[s.principal]:
                del self._by_principal[s.principal]
        self._in_flight.update((s.sample_id, s) for s in batch)
        self._drop_unacked.extend(s.sample_id for s in stale)
        self.taken_total += len(batch)
        self.dropped_stale += len(stale)
        return batch, stale

    def drop_trained(self, sample_ids: set[str]) -> int:
        """Waiting samples the surviving weights were already trained on (clawd.weights.checkpointed_samples):
        they leave the line now and are acked in the journal with the next `ack`."""
        gone = [s for s in self._waiting if s.sample_id in sample_ids]
        if gone:
            self._waiting = [s for s in self._waiting if s.sample_id not in sample_ids]
            for s in gone:
                self._by_principal[s.principal] -= 1
                if not self._by_principal[s.principal]:
                    del self._by_principal[s.principal]
            self._drop_unacked.extend(s.sample_id for s in gone)
        return len(gone)

    def drop_versions(self, versions: set[int]) -> int:
        """A rollback: samples produced by these versions leave the line (acked with the next `ack`), and any
        that scoring still delivers are dropped on arrival. How many left the line."""
        self.doomed_versions |= set(versions)
        gone = {s.sample_id for s in self._waiting if s.policy_version in self.doomed_versions}
        self.dropped_doomed += self.drop_trained(gone)
        return len(gone)

    def requeue(self, samples: list[Sample]) -> None:
        """A batch whose step failed goes back to the front of the line, in its order."""
        self.taken_total -= len(samples)
        for s in samples:
            self._in_flight.pop(s.sample_id, None)
        back = [s for s in samples if s.sample_id not in self._forgotten]  # forgotten ones never come back
        self._forgotten.difference_update(s.sample_id for s in samples)
        self._waiting = back + self._waiting
        for s in back:
            self._by_principal[s.principal] += 1
        self._changed.set()

    def exclude(self, samples: list[Sample]) -> None:
        """Taken samples that will never be trained (clawd.learning.limits: too long, or alone too big for the
        trainer's memory): out of flight now, acked in the journal with the next `ack`, as stale drops are."""
        self.taken_total -= len(samples)
        for s in samples:
            self._in_flight.pop(s.sample_id, None)
        self._drop_unacked.extend(s.sample_id for s in samples)

    async def ack(self, sample_ids) -> int:
        """After the step that consumed them is checkpointed. Also acks earlier stale drops."""
        drops, self._drop_unacked = self._drop_unacked, []
        ids = list(sample_ids) + drops
        try:
            acked = await self.journal.ack(ids) if ids else 0
        except BaseException:
            self._drop_unacked = drops + self._drop_unacked  # still to be acked
            raise
        for i in ids:
            self._in_flight.pop(i, None)
        self._forgotten.difference_update(ids)
        self.acked_total += acked
        self.journal.compact()
        return acked

    def of(self, principal: str) -> list[Sample]:
        """The principal's samples held now, waiting (in line order) then in flight; forgotten ones are not."""
        return [s for s in self._waiting if s.principal == principal] + \
            [s for i, s in self._in_flight.items() if s.principal == principal and i not in self._forgotten]

    def is_forgotten(self, sample_id: str) -> bool:
        """A sample in flight whose principal was forgotten (until its ack or requeue): write it nowhere."""
        return sample_id in self._forgotten

    async def forget(self, principal: str) -> Forgotten:
        """Every sample of `principal` leaves the store and the journal directory (see the module docstring).
        JournalWriteError when the rewrite fails: the samples are out of memory, the journal still has them."""
        # Encoding what is kept is most of the work (~1 s for 50 MB of samples): done on a snapshot in slices,
        # letting the loop serve between them (the daemon has no threads); what came or went meanwhile is
        # settled below, with no await until the rewrite.
        kept = [(i, s) for i, s in self._held() if s.principal != principal]
        encoded: dict[str, bytes] = {}
        for n, (i, s) in enumerate(kept, 1):
            encoded[i] = s.to_json()
            if n % _ENCODE_SLICE == 0:
                await asyncio.sleep(0)
        gone = sum(s.principal == principal for s in self._waiting)
        self._waiting = [s for s in self._waiting if s.principal != principal]
        self._by_principal.pop(principal, None)
        flying = [i for i, s in self._in_flight.items() if s.principal == principal and i not in self._forgotten]
        self._forgotten.update(flying)
        self._forgotten.update(i for i, s in self._putting.items() if s.principal == principal)
        # no await between this snapshot and the rewrite, which runs without yielding the loop
        done = await self.journal.rewrite([(i, encoded.get(i) or s.to_json()) for i, s in self._held()
                                           if i not in self._forgotten])
        self._drop_unacked = []  # left out of the rewrite: acked, in effect
        files = forget_quarantined(self.journal.directory, principal)
        return Forgotten(gone, len(flying), len(files), done.bytes_before, done.bytes_after)

    def _held(self) -> list[tuple[str, Sample]]:
        """Every sample the journal must keep live: in flight, waiting, and puts not yet written."""
        return [*self._in_flight.items(), *((s.sample_id, s) for s in self._waiting), *self._putting.items()]

    async def wait_for(self, n: int, *, current_version: int | None = None, max_staleness: int | None = None,
                       of: Selection | None = None) -> None:
        """Returns once n samples are waiting (n fresh ones when the version and staleness are given; of the
        selection's, if given).

        It counts samples, not what fairness lets one batch take: with enough
        principals the cap is hard, and waiting for a full fair batch could wait forever.
        """
        def enough() -> bool:
            if current_version is None or max_staleness is None:
                return (len(self._waiting) if of is None else sum(map(of.has, self._waiting))) >= n
            return self.fresh(current_version, max_staleness, of) >= n

        while not enough():
            self._changed.clear()
            await self._changed.wait()

    def _add(self, sample: Sample) -> None:
        self._waiting.append(sample)
        self._by_principal[sample.principal] += 1
        self._changed.set()
