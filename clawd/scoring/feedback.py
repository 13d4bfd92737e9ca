"""Explicit feedback: a user's rating (+1 / -1) of one of clawd's replies, with an optional text, beside the
judge (docs/ARCHITECTURE.md §5, *Explicit feedback*). Pure: no I/O, no clock (times are passed in).

A rating names a reply by its id (`chatcmpl-…`). Every main turn served is registered here (`served`), so a
rating is matched whatever stage its turn is at: waiting in its session for the next message, waiting for its
PII scan, being judged. A reply is known only to the principal whose turn it was; anyone else, a side turn
(never recorded), or a reply older than the newest `max_replies` is told it is unknown, the same answer for
each, so one principal cannot learn which ids another was served.

A rating counts for training until its turn is scored: the scorer `take`s it when it decides (the judge's
vote and hint are known by then), and a later rating replaces an earlier one until that moment. It then
replaces the judge's vote (`"replace"`) or joins the votes as one more (`"join"`); its text, once cut to what
corrects (`rules.guidance`) and accepted as a hint (`judging.accept_hint`), is the hint the teacher reads in
place of the judge's. A turn the judge cannot score (nothing followed it, or no valid vote) trains on the
rating alone. A rating that arrives after its turn was scored (trained, or excluded), or on a turn that could
never train (no_train, consent, sampling params), is recorded and counted, never trained.

Judge calibration: each turn with both a judge verdict and a rating is a pair, counted per policy version and
per principal (`Calibration`): the judge's +1 / 0 / -1 / none against the rating. Agreement is the share of
the judge's ±1 verdicts that the rating confirms, with a Wilson 95 % interval; an alarm stands while a scope
with at least `min_pairs` such verdicts has an interval wholly below `alarm_below` (the gate's rule: a dip the
interval does not confirm is not an alarm).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from clawd.scoring.judging import accept_hint, majority
from clawd.scoring.rules import guidance

RATINGS = ("replace", "join")

# What became of a rating (the API's answer, the records' and the metrics' label).
PENDING = "pending"              # its turn is not scored yet: it will count
LATE = "late"                    # its turn was already scored: recorded, counted, not trained
NOT_TRAINABLE = "not_trainable"  # its turn could never train (no_train, consent, ...): recorded, not trained
RATING_STATUSES = (PENDING, LATE, NOT_TRAINABLE)

JUDGE_LABELS = ("+1", "0", "-1", "none")  # a pair's judge side; "none": no valid vote, or nothing to judge


@dataclass(frozen=True)
class Rating:
    principal: str
    reply_id: str
    rating: int          # +1 or -1
    text: str | None
    received: float


@dataclass(slots=True)  # one per remembered reply: max_replies of them
class _Reply:
    """One registered main turn: whose, under which version, and what became of it."""
    principal: str
    version: int
    session_id: str
    turn_index: int
    excluded: str | None          # why it can never train (known at serve time)
    rating: Rating | None = None  # the latest rating, while the turn is not scored
    scored: bool = False
    judge: int | None = None      # the judge's majority once scored (None: no valid vote or none asked)
    judged: bool = False          # whether a judge was asked at all (a turn with no next state: not)


class UnknownReply(LookupError):
    """No reply of this principal's with that id is remembered."""


def feedback_hint(text: str | None) -> str | None:
    """The hint a rating's text gives the teacher: what it says after its leading rejections ("No, too long:
    answer in one line." -> "answer in one line."), if `accept_hint` keeps it; else None."""
    return accept_hint(guidance(text)) if text else None


def with_rating(policy: str, votes: Sequence[int | None], judge_hint: str | None,
                rating: Rating | None) -> tuple[int | None, str | None]:
    """(the RL vote, the hint) a turn is decided on. Without a rating: the judge's majority and hint. With one:
    "replace" -> the rating is the vote; "join" -> the majority of the judge's votes and the rating (a tie: 0).
    The rating's text, when it gives a hint, is the hint; else the judge's stays."""
    if policy not in RATINGS:
        raise ValueError(f"ratings policy {policy!r} is not one of {RATINGS}")
    if rating is None:
        return majority(votes), judge_hint
    vote = rating.rating if policy == "replace" else majority((*votes, rating.rating))
    return vote, feedback_hint(rating.text) or judge_hint


def wilson(agree: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of agree/n (n > 0)."""
    p = agree / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _label(judge: int | None) -> str:
    return {1: "+1", 0: "0", -1: "-1"}.get(judge, "none")


@dataclass
class Confusion:
    """Pairs of (judge verdict, rating): counts[judge label][rating label]."""
    counts: dict[str, dict[str, int]] = field(
        default_factory=lambda: {j: {"+1": 0, "-1": 0} for j in JUDGE_LABELS})

    def add(self, judge: int | None, rating: int) -> None:
        self.counts[_label(judge)]["+1" if rating > 0 else "-1"] += 1

    @property
    def pairs(self) -> int:
        return sum(sum(row.values()) for row in self.counts.values())

    @property
    def scored(self) -> int:
        """Pairs where the judge said ±1: what agreement is measured on."""
        return sum(self.counts[j][r] for j in ("+1", "-1") for r in ("+1", "-1"))

    @property
    def agreed(self) -> int:
        return self.counts["+1"]["+1"] + self.counts["-1"]["-1"]

    def summary(self, min_pairs: int, alarm_below: float) -> dict:
        n = self.scored
        rate = self.agreed / n if n else None
        low, high = wilson(self.agreed, n) if n else (None, None)
        return {"pairs": self.pairs, "judged": n, "agreed": self.agreed, "agreement": rate,
                "interval": None if low is None else [round(low, 4), round(high, 4)],
                "alarm": bool(n >= min_pairs and high is not None and high < alarm_below),
                "counts": {j: dict(row) for j, row in self.counts.items()}}


class Calibration:
    """The judge's agreement with ratings, overall, per policy version and per principal (the newest
    `max_scopes` of each kept)."""

    def __init__(self, *, min_pairs: int, alarm_below: float, max_scopes: int = 256,
                 on_alarm: Callable[[dict], None] = lambda alarm: None):
        """on_alarm: told of each alarm as it is raised (the log)."""
        self.min_pairs, self.alarm_below, self.max_scopes = min_pairs, alarm_below, max_scopes
        self.on_alarm = on_alarm
        self.overall = Confusion()
        self.versions: OrderedDict[int, Confusion] = OrderedDict()
        self.principals: OrderedDict[str, Confusion] = OrderedDict()
        self._raised: set[tuple[str, object]] = set()

    def add(self, version: int, principal: str, judge: int | None, rating: int) -> None:
        self.overall.add(judge, rating)
        for table, key in ((self.versions, version), (self.principals, principal)):
            if key not in table:
                table[key] = Confusion()
                while len(table) > self.max_scopes:
                    table.popitem(last=False)
            table.move_to_end(key)
            table[key].add(judge, rating)
        for scope, key, confusion in (("all", "all", self.overall), ("version", version, self.versions[version]),
                                      ("principal", principal, self.principals[principal])):
            s = confusion.summary(self.min_pairs, self.alarm_below)
            if s["alarm"] and (scope, key) not in self._raised:
                self._raised.add((scope, key))
                self.on_alarm({"scope": scope, "key": key, "agreement": s["agreement"], "interval": s["interval"],
                               "judged": s["judged"]})
            elif not s["alarm"]:
                self._raised.discard((scope, key))

    def forget(self, principal: str) -> None:
        """Their own scope goes; their pairs stay in the overall and per-version counts (numbers, no words)."""
        self.principals.pop(principal, None)
        self._raised.discard(("principal", principal))

    def alarms(self) -> list[dict]:
        out = []
        for scope, table in (("all", {"all": self.overall}), ("version", self.versions),
                             ("principal", self.principals)):
            for key, confusion in table.items():
                s = confusion.summary(self.min_pairs, self.alarm_below)
                if s["alarm"]:
                    out.append({"scope": scope, "key": key, "agreement": s["agreement"], "interval": s["interval"],
                                "judged": s["judged"]})
        return out

    def snapshot(self) -> dict:
        summary = lambda c: c.summary(self.min_pairs, self.alarm_below)  # noqa: E731
        return {"min_pairs": self.min_pairs, "alarm_below": self.alarm_below, "all": summary(self.overall),
                "versions": {str(v): summary(c) for v, c in self.versions.items()},
                "principals": {p: summary(c) for p, c in self.principals.items()},
                "alarms": self.alarms()}


@dataclass
class FeedbackStats:
    received: dict[str, int] = field(default_factory=lambda: {s: 0 for s in RATING_STATUSES})
    unknown: int = 0       # ratings naming no reply of theirs that is remembered
    trained: int = 0       # ratings a sample was decided on (the sample itself may still be excluded)
    alone: int = 0         # of which the judge had nothing to say (no next state, or no valid vote)
    unused: int = 0        # pending ratings whose turn was never scored (learning paused, pushed out, excluded)


class Ratings:
    """The registry of main turns served, and the ratings waiting for them. Bounded: the newest `max_replies`
    replies are remembered; a pending rating whose reply is pushed out is counted, not trained."""

    def __init__(self, *, policy: str = "replace", max_replies: int = 100_000, min_pairs: int = 20,
                 alarm_below: float = 0.6, on_alarm: Callable[[dict], None] = lambda alarm: None):
        if policy not in RATINGS:
            raise ValueError(f"ratings policy {policy!r} is not one of {RATINGS}")
        self.policy = policy
        self.max_replies = max_replies
        self._replies: OrderedDict[str, _Reply] = OrderedDict()
        self.calibration = Calibration(min_pairs=min_pairs, alarm_below=alarm_below, on_alarm=on_alarm)
        self.stats = FeedbackStats()

    def __len__(self) -> int:
        return len(self._replies)

    def served(self, reply_id: str, *, principal: str, version: int, session_id: str, turn_index: int,
               excluded: str | None) -> None:
        """A main turn was served (called as it is captured)."""
        self._replies[reply_id] = _Reply(principal, version, session_id, turn_index, excluded)
        while len(self._replies) > self.max_replies:
            _, old = self._replies.popitem(last=False)
            if old.rating is not None and not old.scored:
                self.stats.unused += 1

    def rate(self, rating: Rating) -> tuple[str, dict]:
        """Takes a rating: (its status, the reply's place: session, turn index, version). Raises UnknownReply
        for a reply that is not this principal's or not remembered."""
        reply = self._replies.get(rating.reply_id)
        if reply is None or reply.principal != rating.principal:
            self.stats.unknown += 1
            raise UnknownReply(rating.reply_id)
        if reply.excluded is not None:
            status = NOT_TRAINABLE
        elif reply.scored:
            status = LATE
            if reply.judged:  # the judge's verdict is known: a pair all the same
                self.calibration.add(reply.version, reply.principal, reply.judge, rating.rating)
        else:
            status = PENDING
            reply.rating = rating  # a later rating replaces an earlier one while the turn waits
        self.stats.received[status] += 1
        where = {"session_id": reply.session_id, "turn_index": reply.turn_index, "version": reply.version}
        return status, where

    def waiting(self, reply_id: str) -> bool:
        """Whether a rating waits for this reply (a turn with nothing after it is scored only then)."""
        reply = self._replies.get(reply_id)
        return reply is not None and reply.rating is not None and not reply.scored

    def take(self, reply_id: str) -> Rating | None:
        """The rating a turn is decided on, as the scorer decides; later ones are late."""
        reply = self._replies.get(reply_id)
        if reply is None or reply.scored:
            return None
        reply.scored = True
        rating, reply.rating = reply.rating, None
        return rating

    def scored(self, reply_id: str, *, judged: bool, judge: int | None, rating: Rating | None) -> None:
        """The scorer's decision on a turn: the judge's verdict (judged: whether it was asked), and the rating it
        used. A judge verdict beside a rating is a calibration pair."""
        reply = self._replies.get(reply_id)
        if reply is not None:
            reply.scored, reply.judged, reply.judge = True, judged, judge
        if rating is not None:
            self.stats.trained += 1
            if not judged or judge is None:
                self.stats.alone += 1
            if judged:
                version = reply.version if reply is not None else 0
                self.calibration.add(version, rating.principal, judge, rating.rating)

    def passed_over(self, reply_id: str, excluded: str | None = None) -> None:
        """A turn that will never be scored (learning paused; `excluded`: why it cannot train, such as consent):
        a rating that waited for it, or comes later, is recorded and not trained."""
        reply = self._replies.get(reply_id)
        if reply is not None and not reply.scored:
            if reply.rating is not None:
                self.stats.unused += 1
            reply.scored, reply.rating = True, None
            reply.excluded = reply.excluded or excluded

    def forget(self, principal: str) -> int:
        """Drops the principal's replies and ratings (clawctl forget); returns how many replies went."""
        mine = [rid for rid, reply in self._replies.items() if reply.principal == principal]
        for rid in mine:
            del self._replies[rid]
        self.calibration.forget(principal)
        return len(mine)

    def pending_of(self, principal: str) -> list[Rating]:
        """Their ratings waiting for a turn to be scored (clawctl export)."""
        return [r.rating for r in self._replies.values() if r.principal == principal and r.rating is not None]
