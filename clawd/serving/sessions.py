"""Sessions: group main chat turns into conversations and give each turn its next state.

Pure state machine (docs/ARCHITECTURE.md §4, §14 "Sessions"): no I/O, no clock reads (`now`
is passed in and must not go backwards), no randomness but the injected
`new_id`. A session is keyed by (principal, session_id). For requests without
an id it is found by stitching: each session keeps a few hashes of its
conversation (never the messages), indexed by (principal, hash), so resolving a
request costs O(its messages), never a scan of the sessions.

Hashes form a chain over a canonical form of messages:
H[0] = sha256(principal), H[k] = sha256(H[k-1] + canon(messages[k-1])).
A turn is remembered by its prompt hash H[n] and its reply hash (H[n] extended
by the reply clawd gave).

Lifecycle: `begin` when a main request arrives (may finalize the session's
pending turn), then `complete` (the new turn becomes pending) or `cancel`.
A session with a request in flight is never expired or evicted; it re-enters
the idle order when its last request ends.

Memory: a session keeps hashes and at most one pending turn, whose messages and
ids (`turn_bytes`) count against `max_bytes`; beyond it the least recently
active idle sessions holding a turn are closed (EVICTED), as beyond
`max_sessions`.
"""
from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from clawd import jsoncodec
from clawd.messages import content_parts, tool_arguments
from clawd.tokenizer import turn_bytes
from clawd.turns import (EVICTED, IDLE_TIMEOUT, MAX_TURNS, REGENERATED, SESSION_DONE,
                         SHUTDOWN, FinishedTurn, Turn)

Key = tuple[str, str]  # (principal, session_id)


# ---------------------------------------------------------------- canonical form

def canonical(message: dict[str, Any]) -> dict[str, Any]:
    """What counts when comparing conversations: ids, reasoning and formatting do not."""
    text, others = content_parts(message.get("content"))  # images etc. still tell conversations apart
    canon: dict[str, Any] = {"role": message.get("role"), "content": text.strip()}
    if others:
        canon["parts"] = others
    calls = message.get("tool_calls")
    if calls:
        canon["tool_calls"] = [
            [(c.get("function") or {}).get("name"), tool_arguments((c.get("function") or {}).get("arguments"))]
            for c in calls
        ]
    for name in ("tool_call_id", "name"):
        if message.get(name) is not None:
            canon[name] = message[name]
    return canon


def _encode(obj: Any) -> bytes:
    # Sorted keys, and what orjson would write otherwise (a NaN as null, a lone surrogate) written by `json`:
    # distinct messages stay distinct. Hashes live in memory only, so the encoding may change between versions.
    return jsoncodec.dumps(obj, sort_keys=True)


def root_hash(principal: str) -> bytes:
    return hashlib.sha256(_encode(["clawd-session", principal])).digest()


def extend(h: bytes, message: dict[str, Any]) -> bytes:
    return hashlib.sha256(h + _encode(canonical(message))).digest()


def prefix_hashes(principal: str, messages: list[dict[str, Any]]) -> list[bytes]:
    """H[0..n]: H[k] identifies messages[:k] of this principal."""
    hashes = [root_hash(principal)]
    for m in messages:
        hashes.append(extend(hashes[-1], m))
    return hashes


# ---------------------------------------------------------------- state

@dataclass(slots=True, eq=False)
class _Session:
    principal: str
    session_id: str
    last_active: float
    next_index: int = 0
    replies: list[tuple[int, bytes]] = field(default_factory=list)  # (turn index, reply hash), oldest first
    pending: Turn | None = None  # latest turn, still waiting for its next state
    pending_prompt: bytes = b""
    pending_reply: bytes = b""
    pending_bytes: int = 0  # turn_bytes of the pending turn
    inflight: int = 0
    closed: str | None = None  # why it closed
    replica: int | None = None  # the policy replica its requests go to (clawd.engine.replicas)

    @property
    def key(self) -> Key:
        return (self.principal, self.session_id)


@dataclass(frozen=True)
class Admission:
    key: Key
    session_id: str
    turn_index: int
    prompt_hash: bytes
    finished: list[FinishedTurn]  # turns finalized by this request (next state, regenerate, eviction)
    _session: _Session = field(repr=False, compare=False, default=None)  # type: ignore[assignment]


class SessionTable:
    def __init__(self, *, idle_timeout: float, max_turns: int, max_sessions: int,
                 new_id: Callable[[], str], max_bytes: int | None = None):
        self.idle_timeout = idle_timeout
        self.max_turns = max_turns
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes  # None: no byte budget
        self.retained_bytes = 0     # turn_bytes of all pending turns
        self.evicted_for_bytes = 0  # sessions closed to stay within max_bytes
        self.new_id = new_id
        self._sessions: dict[Key, _Session] = {}
        # sessions with no request in flight, least recently active first
        self._idle: OrderedDict[Key, _Session] = OrderedDict()
        # stitching indices, keyed by (principal, hash)
        self._replies: dict[tuple[str, bytes], tuple[_Session, int]] = {}
        self._prompts: dict[tuple[str, bytes], _Session] = {}
        self._pending = 0
        self._homed: Counter[int] = Counter()  # sessions per replica

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def pending_count(self) -> int:
        return self._pending

    def next_expiry(self) -> float | None:
        """Earliest time at which `expire` can close something (None: nothing idle)."""
        for s in self._idle.values():
            return s.last_active + self.idle_timeout
        return None

    def homed(self, replicas: int) -> list[int]:
        """Sessions homed on each of `replicas` replicas."""
        return [self._homed[i] for i in range(replicas)]

    @staticmethod
    def replica_of(admission: Admission) -> int | None:
        return admission._session.replica

    def set_replica(self, admission: Admission, replica: int) -> None:
        """Home the admitted request's session on `replica` (a new session, or one whose home left rotation)."""
        s = admission._session
        if s.replica is not None and s.closed is None:
            self._homed[s.replica] -= 1
        s.replica = replica
        if s.closed is None:
            self._homed[replica] += 1

    # ------------------------------------------------------------ requests

    def begin(self, principal: str, session_id: str | None, messages: list[dict[str, Any]],
              now: float) -> Admission:
        hashes = prefix_hashes(principal, messages)
        n = len(messages)
        finished: list[FinishedTurn] = []
        if session_id is not None:
            s = self._sessions.get((principal, session_id))
            if s is None:
                s = self._create(principal, session_id, now, finished)
            elif s.pending is not None:
                if hashes[n] == s.pending_prompt:
                    finished.append(self._regenerate(s, now))
                else:
                    next_state = _after_reply(messages, hashes, s.pending_reply)
                    finished.append(self._finalize(s, next_state, None, now))
        else:
            s = self._stitch(principal, messages, hashes, now, finished)
        self._touch_begin(s, now)
        return Admission(s.key, s.session_id, s.next_index, hashes[n], finished, s)

    def _stitch(self, principal: str, messages: list[dict[str, Any]], hashes: list[bytes],
                now: float, finished: list[FinishedTurn]) -> _Session:
        n = len(messages)
        older: tuple[_Session, int] | None = None
        for k in range(n - 1, 0, -1):  # longest prefix first
            hit = self._replies.get((principal, hashes[k]))
            if hit is None:
                continue
            s, _ = hit
            if s.replies[-1][1] == hashes[k]:  # the session's latest turn: a continuation
                if s.pending is not None:
                    finished.append(self._finalize(s, messages[k:], None, now))
                return s
            if older is None:
                older = hit
        s = self._prompts.get((principal, hashes[n]))
        if s is not None:  # the same prompt again
            finished.append(self._regenerate(s, now))
            return s
        if older is not None:  # history edited: a branch from an older turn
            s = older[0]
            if s.pending is not None:
                finished.append(self._finalize(s, None, REGENERATED, now, abandon=True))
            return s
        return self._create(principal, self.new_id(), now, finished)

    def complete(self, admission: Admission, turn: Turn, done: bool, now: float) -> list[FinishedTurn]:
        """The request's turn was generated: it becomes pending (or finishes at once)."""
        s = admission._session
        if (turn.principal, turn.session_id, turn.turn_index) != (*admission.key, admission.turn_index):
            raise ValueError("turn does not belong to this admission")
        self._touch_end(s, now)
        if s.closed is not None:  # closed while generating (shutdown, another request's done)
            return [FinishedTurn(turn, None, s.closed, now)]
        finished: list[FinishedTurn] = []
        if s.pending is not None:  # an interleaved request of this session finished first
            finished.append(self._finalize(s, None, REGENERATED, now, abandon=True))
        reply = extend(admission.prompt_hash, turn.reply)
        s.next_index = max(s.next_index, turn.turn_index + 1)
        s.replies.append((turn.turn_index, reply))
        self._replies[(s.principal, reply)] = (s, turn.turn_index)
        s.pending, s.pending_prompt, s.pending_reply = turn, admission.prompt_hash, reply
        s.pending_bytes = turn_bytes(turn)
        self.retained_bytes += s.pending_bytes
        self._prompts[(s.principal, admission.prompt_hash)] = s
        self._pending += 1
        if done:
            finished += self._close(s, SESSION_DONE, now)
        elif turn.turn_index + 1 >= self.max_turns:
            finished += self._close(s, MAX_TURNS, now)
        return finished + self._shed_bytes(now)

    def cancel(self, admission: Admission, now: float) -> None:
        """Generation failed or the client left: nothing becomes pending."""
        self._touch_end(admission._session, now)

    # ------------------------------------------------------------ closing

    def expire(self, now: float) -> list[FinishedTurn]:
        """Close sessions idle longer than idle_timeout; looks at the oldest only."""
        finished: list[FinishedTurn] = []
        while self._idle:
            s = next(iter(self._idle.values()))
            if now - s.last_active <= self.idle_timeout:
                break
            finished += self._close(s, IDLE_TIMEOUT, now)
        return finished

    def close_all(self, now: float, reason: str = SHUTDOWN, principal: str | None = None) -> list[FinishedTurn]:
        """Close every session (only `principal`'s, when given: clawctl forget)."""
        finished: list[FinishedTurn] = []
        for s in list(self._sessions.values()):
            if principal is None or s.principal == principal:
                finished += self._close(s, reason, now)
        return finished

    def pending_of(self, principal: str) -> list[Turn]:
        """The principal's turns still waiting for their next state (clawctl export)."""
        return [s.pending for s in self._sessions.values() if s.principal == principal and s.pending is not None]

    # ------------------------------------------------------------ internals

    def _create(self, principal: str, session_id: str, now: float,
                finished: list[FinishedTurn]) -> _Session:
        # Only idle sessions are evicted; in-flight ones may overshoot the cap
        # briefly (bounded by the server's concurrency limit).
        while len(self._sessions) >= self.max_sessions and self._idle:
            finished += self._close(next(iter(self._idle.values())), EVICTED, now)
        s = _Session(principal, session_id, now)
        self._sessions[s.key] = s
        return s

    def _shed_bytes(self, now: float) -> list[FinishedTurn]:
        """Close the least recently active idle sessions holding a turn until within max_bytes; in-flight
        ones are kept, so the table may overshoot by what they hold (bounded by the concurrency limit)."""
        excess = self.retained_bytes - self.max_bytes if self.max_bytes is not None else 0
        victims = []
        for s in self._idle.values():  # sessions without a pending turn free nothing: kept
            if excess <= 0:
                break
            if s.pending_bytes:
                victims.append(s)
                excess -= s.pending_bytes
        finished: list[FinishedTurn] = []
        for s in victims:
            finished += self._close(s, EVICTED, now)
        self.evicted_for_bytes += len(victims)
        return finished

    def _touch_begin(self, s: _Session, now: float) -> None:
        s.inflight += 1
        s.last_active = now
        self._idle.pop(s.key, None)

    def _touch_end(self, s: _Session, now: float) -> None:
        s.inflight -= 1
        s.last_active = now
        if s.inflight == 0 and s.closed is None:
            self._idle[s.key] = s  # appended: the most recently active

    def _regenerate(self, s: _Session, now: float) -> FinishedTurn:
        """The pending turn is asked again: abandon it; the new turn takes its index."""
        index = s.pending.turn_index
        ft = self._finalize(s, None, REGENERATED, now, abandon=True)
        s.next_index = index
        return ft

    def _finalize(self, s: _Session, next_state: list[dict[str, Any]] | None, reason: str | None,
                  now: float, abandon: bool = False) -> FinishedTurn:
        turn = s.pending
        if self._prompts.get((s.principal, s.pending_prompt)) is s:
            del self._prompts[(s.principal, s.pending_prompt)]
        if abandon:  # its reply is no longer part of the conversation
            s.replies.remove((turn.turn_index, s.pending_reply))
            self._unindex_reply(s, s.pending_reply)
        s.pending, s.pending_prompt, s.pending_reply = None, b"", b""
        self.retained_bytes -= s.pending_bytes
        s.pending_bytes = 0
        self._pending -= 1
        return FinishedTurn(turn, next_state, reason, now)

    def _unindex_reply(self, s: _Session, reply: bytes) -> None:
        hit = self._replies.get((s.principal, reply))
        if hit is not None and hit[0] is s:  # another session may own an identical history
            del self._replies[(s.principal, reply)]

    def _close(self, s: _Session, reason: str, now: float) -> list[FinishedTurn]:
        finished = [self._finalize(s, None, reason, now)] if s.pending is not None else []
        for _, reply in s.replies:
            self._unindex_reply(s, reply)
        s.replies.clear()
        s.closed = reason
        if s.replica is not None:
            self._homed[s.replica] -= 1
        del self._sessions[s.key]
        self._idle.pop(s.key, None)
        return finished


def _after_reply(messages: list[dict[str, Any]], hashes: list[bytes], reply: bytes) -> list[dict[str, Any]]:
    """Messages after clawd's reply; else after the last assistant message; else the last one."""
    for k in range(len(messages) - 1, 0, -1):
        if hashes[k] == reply:
            return messages[k:]
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is not None and last + 1 < len(messages):
        return messages[last + 1:]
    return messages[-1:]
