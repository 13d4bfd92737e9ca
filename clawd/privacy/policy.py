"""What clawd keeps of a finished turn, decided in one place: consent, PII and the records.

At the edge from serving to scoring every finished turn passes through `Privacy.admit`:
  * consent: a turn of an API key marked `train = false` is excluded (reason "consent"), as a
    `no_train` turn is; a key marked `record = false` leaves no record at all;
  * PII (clawd.privacy.pii) in the turn's prompt or reply excludes it from training (reason "pii")
    when `[privacy] pii_training = "exclude"`: its tokens cannot be rewritten, only left out;
  * the turn record: an untrained turn's words are dropped (sizes stay) unless `untrained_content`;
    a turn with PII anywhere in it (its next state included) has each finding replaced by [EMAIL]
    and the like, and keeps no token ids, which would spell what was redacted.
The scorer asks `for_judge` for the view of a turn an external judge gets, and `judge_record` for the
judge record it writes. Scans are cached per message text: a conversation's earlier messages come
back with every turn, and are scanned once (the detector remembers texts by digest).

Detection is costly on some text (~1 µs a character of digit-dense text, more for phones), and the daemon
has one thread: `scan_turn(finished)` is a generator that detects every text of a turn in steps, with one phone
`Budget` for the turn, so that its caller (clawd.scoring.handover) can give the loop back between them;
`admit` then finds each text's findings remembered.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, Generator, Iterable, Iterator

from clawd.config.auth import ApiKey
from clawd.privacy.phones import Budget
from clawd.privacy.pii import Detector, json_strings, message_texts
from clawd.config.privacy import PrivacyConfig
from clawd.turns import NO_TRAIN, FinishedTurn, Turn

CONSENT = "consent"   # the turn's API key says train = false
PII = "pii"           # PII in the prompt or reply, with pii_training = "exclude"

_IDS = ("prompt_ids", "response_ids", "response_logprobs")


@dataclass
class PrivacyStats:
    scanned: int = 0                                   # turns scanned for PII
    with_pii: int = 0                                  # of which held some
    found: dict[str, int] = field(default_factory=dict)  # findings by category
    excluded: dict[str, int] = field(default_factory=dict)  # turns kept out of training: consent, pii
    redacted_records: int = 0                          # records written with findings replaced
    unrecorded: int = 0                                # turns of keys with record = false
    phones_unread: int = 0                             # possible phones reported unread: the turn's budget spent


class Privacy:
    def __init__(self, cfg: PrivacyConfig, keys: Iterable[ApiKey] = ()):
        self.cfg = cfg
        self.detector = Detector(categories=cfg.pii_categories) if cfg.pii_categories else None
        self.stats = PrivacyStats()
        self._keys: dict[str, ApiKey] = {}
        self.set_keys(keys)

    def set_keys(self, keys: Iterable[ApiKey]) -> None:
        """SIGHUP: a key's consent flags apply to its next finished turn."""
        self._keys = {k.name: k for k in keys}

    def trains(self, principal: str) -> bool:
        key = self._keys.get(principal)
        return key is None or key.train

    def records(self, principal: str) -> bool:
        key = self._keys.get(principal)
        return key is None or key.record

    # --- the edge from serving to scoring ---------------------------------------------------

    def scan_turn(self, finished: FinishedTurn) -> Generator[None, None, None]:
        """Detects every text `admit` will ask about, in steps (see the module's docstring)."""
        if self.detector is None:
            return
        budget = Budget()
        for text in _turn_texts(finished):
            yield from self.detector.steps(text, budget)
        self.stats.phones_unread += budget.unread

    def admit(self, finished: FinishedTurn) -> tuple[FinishedTurn, dict[str, Any] | None]:
        """(the turn as scoring gets it, its record or None). Counts what it decided."""
        turn = finished.turn
        trained = self.scan(turn.messages, [turn.reply])
        if turn.tools and self.detector is not None:  # the tool definitions are in the trained prompt too
            for category, n in self.detector.scan_json(turn.tools).items():
                trained[category] = trained.get(category, 0) + n
        later = self.scan(finished.next_state or [])
        found = {c: trained.get(c, 0) + later.get(c, 0) for c in {*trained, *later}}
        if found:
            self.stats.with_pii += 1
            for category, n in found.items():
                self.stats.found[category] = self.stats.found.get(category, 0) + n
        self.stats.scanned += self.detector is not None
        excluded = None
        if turn.excluded is None and not self.trains(turn.principal):
            excluded = CONSENT
        elif turn.excluded is None and trained and self.cfg.pii_training == "exclude":
            excluded = PII
        if excluded is not None:
            self.stats.excluded[excluded] = self.stats.excluded.get(excluded, 0) + 1
            finished = replace(finished, turn=replace(turn, excluded=excluded))
        if not self.records(turn.principal):
            self.stats.unrecorded += 1
            return finished, None
        return finished, self.turn_record(finished, found)

    def turn_record(self, finished: FinishedTurn, found: dict[str, int]) -> dict[str, Any]:
        record = finished.to_record()
        if finished.turn.excluded in (NO_TRAIN, CONSENT) and not self.cfg.untrained_content:
            return _without_words(record)
        if found and self.cfg.redact_records:
            self.stats.redacted_records += 1
            record.update(messages=self.redact(record["messages"]), reply=self.redact([record["reply"]])[0],
                          next_state=None if record["next_state"] is None else self.redact(record["next_state"]),
                          tools=None if record.get("tools") is None else self.detector.redact_json(record["tools"]),
                          pii=dict(sorted(found.items())), **{k: len(record[k]) for k in _IDS})
        return record

    # --- the judge ---------------------------------------------------------------------------

    def for_judge(self, turn: Turn, next_state: list[dict[str, Any]]) -> tuple[Turn, list[dict[str, Any]]]:
        """What an external judge is shown: the turn and its next state with PII replaced."""
        if not self.cfg.redact_judge or self.detector is None:
            return turn, next_state
        if not self.scan(turn.messages, [turn.reply], next_state):
            return turn, next_state
        return (replace(turn, messages=self.redact(turn.messages), reply=self.redact([turn.reply])[0]),
                self.redact(next_state))

    def judge_record(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """A judge record with PII replaced in the judge's raw answers and the hint it gave; None for a key
        with record = false."""
        if not self.records(record.get("principal", "")):
            return None
        if not self.cfg.redact_records or self.detector is None:
            return record
        out = dict(record)
        if out.get("raw"):
            out["raw"] = [None if t is None else self.detector.redact(t, self.detector.detect(t)) for t in out["raw"]]
        if isinstance(out.get("hint"), str):
            out["hint"] = self.detector.redact(out["hint"], self.detector.detect(out["hint"]))
        return out

    def feedback_record(self, record: dict[str, Any]) -> dict[str, Any] | None:
        """A feedback record (a user's rating of a reply) with PII replaced in its text; None for a key with
        record = false."""
        if not self.records(record.get("principal", "")):
            return None
        if not self.cfg.redact_records or self.detector is None or not isinstance(record.get("text"), str):
            return record
        return record | {"text": self.detector.redact(record["text"], self.detector.detect(record["text"]))}

    # --- scanning ------------------------------------------------------------------------------

    def scan(self, *message_lists: list[dict[str, Any]]) -> dict[str, int]:
        """Findings by category over the messages, each message's scan cached by its content."""
        total: dict[str, int] = {}
        if self.detector is None:
            return total
        for messages in message_lists:
            for message in messages:
                for category, n in self._scan_one(message).items():
                    total[category] = total.get(category, 0) + n
        return total

    def _scan_one(self, message: dict[str, Any]) -> dict[str, int]:
        return self.detector.scan_messages([message])  # the detector remembers the texts it scanned

    def redact(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.detector.redact_messages(messages) if self.detector is not None else copy.deepcopy(messages)


def _without_words(record: dict[str, Any]) -> dict[str, Any]:
    """An untrained turn's record: who, when, which version, how long; none of what was said."""
    def sizes(messages):
        return None if messages is None else [{"role": m.get("role"), "chars": len(str(m.get("content") or ""))}
                                               for m in messages]
    return record | {"messages": sizes(record["messages"]), "reply": sizes([record["reply"]])[0],
                     "next_state": sizes(record["next_state"]), "tools": None, "content": "withheld",
                     **{k: len(record[k]) for k in _IDS}}


def _turn_texts(finished: FinishedTurn) -> Iterator[str]:
    turn = finished.turn
    for message in (*turn.messages, turn.reply, *(finished.next_state or ())):
        yield from message_texts(message)
    if turn.tools:
        yield from json_strings(turn.tools)
