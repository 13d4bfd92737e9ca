"""Several policy replicas behind one front: which replica serves a request (docs/ARCHITECTURE.md §13).

The decisions are pure (`choose`, `retryable`, `behind`) and `Replicas` only keeps counts and reads the
supervisors' state; no I/O happens here except in `Balanced`, the judge's and teacher's view of the
policy engine.

- A session's requests go to its home replica (prefix-cache reuse, one weight version per session where
  possible) while that replica is in rotation and not draining; while it drains for a swap they go to
  the least loaded other one, and come home after.
- A new session, a side turn, a judge or teacher call goes to the least loaded replica in rotation: fewest
  requests in flight, then fewest sessions, then the lowest index. A replica being swapped onto new weights
  (`draining`) takes new work only when no other one can.
- A replica is in rotation while its supervisor says ready, it is not waiting to be realigned after a failed
  swap, it serves no version older than the policy's, and no connection error was seen on it since its
  supervisor's last good answer. A session whose home left rotation is re-homed on its next request.
- A request that failed before any byte went to the client, on a connection error, a dead engine or a 5xx,
  is retried once on another replica in rotation; never a 400, a timeout (the engine may still be working
  on it, and the hang detector owns that case), nor anything after a byte was sent.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from clawd import faults
from clawd.engine.client import (EngineDisconnected, EngineError, EngineRejected, EngineTimeout,
                                 EngineUnavailable)
from clawd.served import Policy

log = logging.getLogger("clawd.engine")


@dataclass(frozen=True)
class Load:
    """The router's view of one replica."""
    usable: bool          # in rotation
    in_flight: int = 0    # requests it is serving now
    sessions: int = 0     # sessions homed on it
    draining: bool = False  # being swapped onto new weights: new work goes elsewhere if it can


def choose(loads: Sequence[Load], home: int | None = None, exclude: frozenset[int] = frozenset()) -> int | None:
    """The replica for one request: its session's home while usable and not draining, else the least loaded
    usable one (in flight, then sessions, then index), a draining one only if nothing else is usable; None if
    none is. A session does not wait out its home's swap (the engine is paused through it)."""
    usable = [i for i, load in enumerate(loads) if load.usable and i not in exclude]
    settled = [i for i in usable if not loads[i].draining] or usable
    if home in settled:
        return home
    return min(settled, key=lambda i: (loads[i].in_flight, loads[i].sessions, i), default=None)


def retryable(exc: BaseException, sent: bool, attempts: int) -> bool:
    """Whether a failed engine call may be tried again on another replica: only the first attempt, only
    before any byte reached the client, only a failure of the engine rather than of the request or a
    deadline (a timed-out call may still run on its engine)."""
    if sent or attempts > 1 or not isinstance(exc, EngineError):
        return False
    if isinstance(exc, (EngineRejected, EngineTimeout)):
        return False
    return isinstance(exc, EngineUnavailable) or exc.status >= 500


def behind(served: str | None, policy: Policy) -> bool:
    """Whether a replica serving weight_version `served` is older than the policy. On the base model
    (no published directory) any version will do: a remote engine names its own ("default")."""
    if policy.weights_dir is None:
        return False
    try:
        return int(served) < int(policy.weight_version)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return served != policy.weight_version


@dataclass
class Counts:
    """What `Replicas` counts per replica (status and metrics show them)."""
    in_flight: int = 0
    failures: int = 0       # connection errors and dead engines seen by requests
    retried_away: int = 0   # requests that failed here and were retried on another replica
    swap_failures: int = 0  # rolling-publish swaps that failed (the replica was then realigned)
    suspect_since: int | None = None  # the supervisor's `answers` at the last failure: out until it answers again
    draining: bool = False
    canary: bool = False  # holds a candidate the gate is evaluating: out of rotation, no chat reaches it


class Replicas:
    """The policy replicas: their supervisors, in index order, and the router's counts."""

    def __init__(self, supervisors: Sequence, policy: Policy | None = None):
        self.supervisors = list(supervisors)
        self.policy = policy if policy is not None else Policy()
        self.counts = [Counts() for _ in self.supervisors]
        self.rehomed = 0  # sessions moved off a replica that left rotation

    def __len__(self) -> int:
        return len(self.supervisors)

    def client(self, i: int):
        return self.supervisors[i].client

    def version(self, i: int) -> str | None:
        """The weight version replica i last reported (polls, publishes; its adapter's in LoRA mode)."""
        sup = self.supervisors[i]
        if hasattr(sup, "served_version"):
            return sup.served_version
        return (getattr(sup, "info", None) or {}).get("weight_version")

    def usable(self, i: int) -> bool:
        sup, counts = self.supervisors[i], self.counts[i]
        if not sup.is_ready or getattr(sup, "needs_realign", False) or counts.canary:
            return False
        if counts.suspect_since is not None:
            if sup.answers <= counts.suspect_since:
                return False
            counts.suspect_since = None
        return not behind(self.version(i), self.policy)

    @property
    def any_usable(self) -> bool:
        return any(self.usable(i) for i in range(len(self)))

    @property
    def input_limit(self) -> int | None:
        """The smallest input limit any replica reported (they run one model, so they agree)."""
        limits = [s.input_limit for s in self.supervisors if s.input_limit is not None]
        return min(limits) if limits else None

    def loads(self, sessions: Sequence[int] = ()) -> list[Load]:
        return [Load(self.usable(i), c.in_flight, sessions[i] if i < len(sessions) else 0, c.draining)
                for i, c in enumerate(self.counts)]

    def choose(self, home: int | None = None, sessions: Sequence[int] = (),
               exclude: frozenset[int] = frozenset()) -> int | None:
        return choose(self.loads(sessions), home, exclude)

    def begin(self, i: int) -> None:
        self.counts[i].in_flight += 1

    def end(self, i: int) -> None:
        self.counts[i].in_flight -= 1

    def failed(self, i: int, exc: BaseException) -> None:
        """A request found replica i broken (refused, reset, died): out of rotation until its supervisor
        has a good answer from it again, unless no other replica is in rotation (then its supervisor alone
        decides, as with one engine). An engine that answered (busy, 500) stays in rotation."""
        if not isinstance(exc, (EngineUnavailable, EngineDisconnected)):
            return
        sup, counts = self.supervisors[i], self.counts[i]
        counts.failures += 1
        if any(self.usable(j) for j in range(len(self)) if j != i):
            counts.suspect_since = sup.answers
        if isinstance(exc, EngineUnavailable):
            sup.mark_unreachable()  # a remote engine is down until its watcher reaches it again

    def snapshot(self, sessions: Sequence[int] = ()) -> list[dict]:
        out = []
        for i, (sup, c) in enumerate(zip(self.supervisors, self.counts)):
            out.append({"index": i, "url": sup.client.url, "state": sup.state.value, "in_rotation": self.usable(i),
                        "weight_version": self.version(i), "in_flight": c.in_flight,
                        "sessions": sessions[i] if i < len(sessions) else 0, "failures": c.failures,
                        "retried_away": c.retried_away, "swap_failures": c.swap_failures,
                        "draining": c.draining, "needs_realign": bool(getattr(sup, "needs_realign", False))})
        return out


class Attempt:
    """One request's tries: the replica it is on (whose in-flight count it holds) and how many it took.
    `home` is its session's replica; `rehome` is told each replica the request moves its session to."""

    def __init__(self, replicas: Replicas, home: int | None = None, sessions: Sequence[int] = (),
                 rehome: Callable[[int], None] | None = None, anywhere: bool = False):
        self.replicas, self.home, self.sessions, self.rehome = replicas, home, sessions, rehome
        self.anywhere = anywhere  # with none in rotation, the first try goes to the least busy replica anyway
        self.replica: int | None = None
        self.attempts = 0
        self._held: int | None = None

    def next(self, exclude: int | None = None) -> int | None:
        """Moves to the replica for the next try; None when none is left."""
        skip = frozenset(() if exclude is None else (exclude,))
        i = self.replicas.choose(self.home, self.sessions, skip)
        if i is None and self.anywhere and self.attempts == 0:
            i = min(range(len(self.replicas)), key=lambda j: (self.replicas.counts[j].in_flight, j))
        if i is None:
            return None
        # A session moves for good only when its home left rotation or failed it; a home that is merely
        # draining for a swap gets the session back on its next request (sessions stay spread).
        if self.rehome is not None and i != self.home and not self._home_draining(skip):
            if self.home is not None:
                self.replicas.rehomed += 1
            self.rehome(i)
            self.home = i
        self.end()
        self.replicas.begin(i)
        self._held = self.replica = i
        self.attempts += 1
        return i

    def _home_draining(self, skip: frozenset[int]) -> bool:
        home = self.home
        return (home is not None and home not in skip and 0 <= home < len(self.replicas)
                and self.replicas.usable(home) and self.replicas.counts[home].draining)

    def end(self) -> None:
        if self._held is not None:
            self.replicas.end(self._held)
            self._held = None

    async def run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The engine client's `method` (its name: "generate", "open_stream") on this request's replica;
        a failure that `retryable` allows is tried once more on another replica in rotation. The loop is this
        object's: nothing is called back but the client. The fault point "engine.retry" makes that second try fail as
        if the other replica failed too (a test's control)."""
        while True:
            i = self.replica if self.replica is not None else self.next()
            if i is None:
                raise EngineUnavailable("no policy replica is in rotation")
            try:
                return await getattr(self.replicas.client(i), method)(*args, **kwargs)
            except EngineError as exc:
                self.replicas.failed(i, exc)
                if not retryable(exc, False, self.attempts) or not self._again(i, exc):
                    raise

    def _again(self, failed: int, exc: EngineError) -> bool:
        try:
            faults.point("engine.retry")
        except OSError as injected:
            log.warning("policy replica %d failed (%s); its retry failed by fault injection: %s", failed, exc,
                        injected)
            return False
        if self.next(exclude=failed) is None:
            return False
        self.replicas.counts[failed].retried_away += 1
        log.warning("policy replica %d failed before answering (%s); retrying on replica %d", failed, exc,
                    self.replica)
        return True


class Balanced:
    """The policy engine as the judge and teacher see it: each call goes to the least loaded replica in
    rotation, and one that fails there before answering is tried once on another. With none in rotation
    the call is still sent (as to a lone engine: a starting one answers once up; the judge's own retries
    and deadlines bound it)."""

    def __init__(self, replicas: Replicas, adapters=None):
        self.replicas = replicas
        self.adapters = adapters  # LoRA mode: calls carry the policy's adapter (None: the base, the reference)

    async def generate(self, payload: dict, timeout: float | None = None) -> dict:
        adapter = self.adapters.begin() if self.adapters is not None else None
        if adapter is not None:
            payload = {**payload, "lora_path": adapter}
        attempt = Attempt(self.replicas, anywhere=True)
        try:
            return await attempt.run("generate", payload, timeout=timeout)
        finally:
            attempt.end()
            if self.adapters is not None:
                self.adapters.end(adapter)
