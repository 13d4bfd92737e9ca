"""Connections: a stalled or hostile client holds a connection, never a request slot, and not for long.

aiohttp bounds an idle keep-alive connection (`keepalive_timeout`) but has no deadline for a request's
headers or body, no cap on connections, and logs a traceback for every request it cannot parse. Here:

- `Connections` sees every connection: `TrackedSite` hands the event loop a protocol factory that wraps
  each of aiohttp's `RequestHandler`s in `_Tracked`, which notes the bytes as they arrive, and the
  `middleware` notes when a request reaches clawd. Each connection is in one phase: idle (no byte of a
  request yet), headers (bytes arrived, the request has not reached clawd: closed after
  `header_timeout`), body (a request whose body is still arriving: the chat handler answers 408 after
  `body_timeout`, and the connection is closed shortly after if the client is still stalled there), or
  active (the request is being handled, its reply written). A reply the client stops reading is bounded
  on the write side: aiohttp waits for a paused transport with no deadline, so a connection whose writes
  stay paused for `write_timeout` is closed (the handler is cancelled, its request slot freed).
- At `max_connections` open, a new connection closes the longest-waiting one that is not active; if every
  connection is active the new one is closed instead (a reply being written is worth more than a
  connection that has sent nothing yet). One peer address may hold at most `peer_connection_share` of the
  cap (connections come before any header names a principal): past it, its own longest-waiting
  connection is closed for the new one, or the new one when all of its are active, so one host that opens
  thousands of connections cannot push everyone else's out.
- `QuietLog`: what a scanner or a flaky client can cause (unparsable requests, hang-ups, stalls) is logged
  in at most one line per kind per minute, saying how many happened since the last such line.
- `raise_open_file_limit`: the soft RLIMIT_NOFILE raised to the hard limit at start, so the cap, not the
  kernel, decides when a connection is refused.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.http_exceptions import HttpProcessingError

from clawd.config.server import ServerConfig

RequestHandler = web.RequestHandler  # aiohttp's protocol for one connection

log = logging.getLogger("clawd.http")

IDLE, HEADERS, BODY, ACTIVE = "idle", "headers", "body", "active"
WAITING = (IDLE, HEADERS, BODY)  # the phases a connection can be evicted from
# Descriptors clawd needs besides client connections: engine and judge connection pools, subprocess
# pipes, the journal, record files, the admin socket, the model's files while loading.
OTHER_FILES = 1024
# After a late body's 408, a client still stalled is cut this much later (the 408 goes out first).
BODY_GRACE = 1.0



@dataclass
class _Kind:
    count: int = 0          # events since the last line
    last_line: float | None = None
    detail: str = ""        # the latest event's own words
    level: int = logging.INFO
    scheduled: Any = None   # the loop a flush is scheduled on


class QuietLog:
    """At most one line per kind per `interval` seconds. The first event of a quiet spell is logged at
    once; the ones after it are counted and logged as one line when the interval is over."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.logger, self.interval, self.clock = logger, interval, clock
        self._kinds: dict[str, _Kind] = {}

    def note(self, kind: str, detail: str, level: int = logging.INFO) -> None:
        k = self._kinds.setdefault(kind, _Kind())
        k.count += 1
        k.detail, k.level = detail, level
        now = self.clock()
        if k.last_line is None or now - k.last_line >= self.interval:
            self._line(kind, now)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test): the next event after the interval carries the count
            return
        if k.scheduled is not loop:
            k.scheduled = loop
            loop.call_later(k.last_line + self.interval - now, self._flush, kind)

    def _flush(self, kind: str) -> None:
        k = self._kinds[kind]
        k.scheduled = None
        if k.count:
            self._line(kind, self.clock())

    def _line(self, kind: str, now: float) -> None:
        k = self._kinds[kind]
        self.logger.log(k.level, "%s [%d %s since the last such line]", k.detail, k.count, kind)
        k.count, k.last_line = 0, now


QUIET = QuietLog(log)


def note_hangup(what: str) -> None:
    """A client that left before its reply was written whole: one quiet line, never a traceback."""
    QUIET.note("hang-up", f"client hung up mid-reply ({what})")


class ServerLog(logging.LoggerAdapter):
    """aiohttp's server logger (the RequestHandler `logger` option). A request aiohttp cannot parse is the
    client's doing: a quiet line, no traceback; a client gone while a reply was written (the chat
    handler notes those) a debug line. Anything else (a handler's own exception: a bug) is logged as
    aiohttp would."""

    def __init__(self, quiet: QuietLog | None = None):
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self.quiet = quiet or QUIET

    def log(self, level: int, msg: object, *args: Any, exc_info: Any = None, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1] if exc_info is True else None
        if isinstance(exc, web.RequestPayloadError) and isinstance(exc.__cause__, HttpProcessingError):
            exc = exc.__cause__  # a body that does not decode, met again by aiohttp's read of its rest
        if isinstance(exc, HttpProcessingError):
            first = next((line.strip() for line in str(exc.message).splitlines() if line.strip()), "")
            self.quiet.note("unparsed", f"unparsable HTTP request: {type(exc).__name__} {first[:80]!r}")
        elif isinstance(exc, ConnectionError):  # the handler saw it first and noted the hang-up
            self.logger.debug("client hung up: %s", exc)
        else:
            super().log(level, msg, *args, exc_info=exc_info, **kwargs)


class _Conn:
    __slots__ = ("handler", "transport", "phase", "since", "timer", "write_timer", "in_handler", "body_pending",
                 "next_bytes", "peer")

    def __init__(self, handler: RequestHandler, transport: asyncio.Transport, now: float):
        self.handler, self.transport = handler, transport
        peer = transport.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, (tuple, list)) and peer else str(peer)
        self.phase, self.since, self.timer, self.write_timer = IDLE, now, None, None
        self.in_handler = self.body_pending = self.next_bytes = False


class Connections:
    """The open connections, their phases and deadlines, and the cap (see the module docstring)."""

    def __init__(self, server: ServerConfig, *, quiet: QuietLog | None = None):
        self.header_timeout, self.body_timeout = server.header_timeout, server.body_timeout
        self.keepalive_timeout, self.write_timeout = server.keepalive_timeout, server.write_timeout
        self.cap = server.max_connections
        self.peer_cap = max(1, int(server.max_connections * server.peer_connection_share))
        self._per_peer: dict[str, int] = {}
        self.quiet = quiet or QUIET
        self.on_close: Callable[[str], None] = lambda reason: None  # metrics: a connection clawd closed
        self.closed: dict[str, int] = {}
        self._conns: dict[RequestHandler, _Conn] = {}
        # One dict per phase, in the order connections entered it: the first is the longest there.
        self._phases: dict[str, dict[RequestHandler, _Conn]] = {p: {} for p in (*WAITING, ACTIVE)}

    @property
    def open(self) -> int:
        return len(self._conns)

    def phases(self) -> dict[str, int]:
        return {phase: len(conns) for phase, conns in self._phases.items()}

    def runner_options(self) -> dict:
        """AppRunner options: aiohttp closes an idle keep-alive connection itself; its log goes quiet."""
        return {"keepalive_timeout": self.keepalive_timeout, "logger": ServerLog(self.quiet)}

    def protocol_factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        """The loop's protocol factory: aiohttp's (the `web.Server` is one), each protocol wrapped."""
        return lambda: _Tracked(self, server())

    # ---- events ----------------------------------------------------------------------------

    def _opened(self, handler: RequestHandler, transport: asyncio.Transport) -> bool:
        conn = _Conn(handler, transport, self._now())
        if self.peer_cap < self.cap and self._per_peer.get(conn.peer, 0) >= self.peer_cap:
            victim = self._longest_waiting(conn.peer)
            if victim is None:
                self._count("peer_share", f"refused a connection from {conn.peer}: all its {self.peer_cap} open "
                            "connections (its share) are busy", logging.WARNING)
                transport.abort()
                return False
            self._close(victim, "peer_share", f"closed the longest-waiting connection of {conn.peer} to take its "
                        f"new one: it holds its share, {self.peer_cap} open", logging.WARNING)
        if len(self._conns) >= self.cap:
            victim = self._longest_waiting()
            if victim is None:
                self._count("refused", f"refused a connection: all {self.cap} open connections are busy",
                            logging.WARNING)
                transport.abort()
                return False
            self._close(victim, "evicted", f"closed the longest-waiting connection ({victim.phase} for "
                        f"{self._now() - victim.since:.1f}s) to take a new one: {self.cap} open", logging.WARNING)
        self._conns[handler] = conn
        self._per_peer[conn.peer] = self._per_peer.get(conn.peer, 0) + 1
        self._phases[IDLE][handler] = conn
        return True

    def _received(self, handler: RequestHandler) -> None:
        conn = self._conns.get(handler)
        if conn is not None and not conn.body_pending and not conn.next_bytes:
            # Bytes after a request's whole body: the next request (held back while one is handled).
            conn.next_bytes = True
            self._update(conn)

    def _lost(self, handler: RequestHandler) -> None:
        conn = self._conns.pop(handler, None)
        if conn is not None:
            self._forget(conn)

    def _writing_paused(self, handler: RequestHandler, paused: bool) -> None:
        conn = self._conns.get(handler)
        if conn is None:
            return
        if conn.write_timer is not None:
            conn.write_timer.cancel()
            conn.write_timer = None
        if paused:
            conn.write_timer = asyncio.get_running_loop().call_later(self.write_timeout, self._write_stalled, conn)

    def _write_stalled(self, conn: _Conn) -> None:
        conn.write_timer = None
        if conn.handler in self._conns:
            self._close(conn, "write_timeout", f"closed a connection that took no byte of its reply for "
                        f"{self.write_timeout:g}s")

    def _body_done(self, conn: _Conn) -> None:
        conn.body_pending = False
        if conn.handler in self._conns:
            self._update(conn)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Outermost: a request has reached clawd, its headers whole."""
        conn = self._conns.get(request.protocol)
        if conn is None:  # a request through some other listener (a test client)
            return await handler(request)
        conn.in_handler, conn.next_bytes = True, False
        conn.body_pending = not request.content.is_eof()
        if conn.body_pending:
            request.content.on_eof(lambda: self._body_done(conn))
        self._update(conn)
        try:
            return await handler(request)
        finally:
            conn.in_handler = False
            if conn.handler in self._conns:
                self._update(conn)

    # ---- phases, deadlines, the cap ------------------------------------------------------------

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def _update(self, conn: _Conn) -> None:
        if conn.body_pending:
            phase = BODY
        elif conn.in_handler:
            phase = ACTIVE
        else:
            phase = HEADERS if conn.next_bytes else IDLE
        if phase == conn.phase:
            return
        self._phases[conn.phase].pop(conn.handler, None)
        conn.phase, conn.since = phase, self._now()
        self._phases[phase][conn.handler] = conn
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        # Idle is aiohttp's keepalive_timeout; active is bounded by the handler (and the write side).
        limit = {HEADERS: self.header_timeout, BODY: self.body_timeout + BODY_GRACE}.get(phase)
        if limit is not None:
            conn.timer = asyncio.get_running_loop().call_at(conn.since + limit, self._expire, conn, phase)

    def _expire(self, conn: _Conn, phase: str) -> None:
        conn.timer = None
        if conn.handler in self._conns and conn.phase == phase:
            what, limit = ("header", self.header_timeout) if phase == HEADERS else ("body", self.body_timeout)
            self._close(conn, f"{what}_timeout", f"closed a connection whose request {what} did not arrive "
                        f"within {limit:g}s")

    def _longest_waiting(self, peer: str | None = None) -> _Conn | None:
        """The connection waiting longest (not active), of `peer` alone when one is named."""
        if peer is None:
            heads = [next(iter(conns.values())) for phase, conns in self._phases.items() if phase in WAITING and conns]
        else:
            heads = [next((c for c in conns.values() if c.peer == peer), None) for phase, conns in self._phases.items()
                     if phase in WAITING]
        return min(filter(None, heads), key=lambda c: c.since, default=None)

    def _close(self, conn: _Conn, reason: str, detail: str, level: int = logging.INFO) -> None:
        self._count(reason, detail, level)
        self._conns.pop(conn.handler, None)
        self._forget(conn)
        # abort, not close: a stalled reader's unsent bytes must not keep the descriptor open.
        conn.transport.abort()

    def _forget(self, conn: _Conn) -> None:
        """What the tracker holds of a connection that left `_conns`."""
        left = self._per_peer.get(conn.peer, 0) - 1
        if left > 0:
            self._per_peer[conn.peer] = left
        else:
            self._per_peer.pop(conn.peer, None)
        self._phases[conn.phase].pop(conn.handler, None)
        for timer in (conn.timer, conn.write_timer):
            if timer is not None:
                timer.cancel()
        conn.timer = conn.write_timer = None

    def _count(self, reason: str, detail: str, level: int = logging.INFO) -> None:
        self.closed[reason] = self.closed.get(reason, 0) + 1
        self.on_close(reason)
        self.quiet.note(reason, detail, level)


class _Tracked(asyncio.Protocol):
    """aiohttp's protocol for one connection, seen by `Connections` on the way in."""

    def __init__(self, connections: Connections, handler: RequestHandler):
        self.connections, self.handler = connections, handler
        self.started = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.connections._opened(self.handler, transport):
            self.started = True
            self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.connections._received(self.handler)
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections._lost(self.handler)
        if self.started:
            self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self.connections._writing_paused(self.handler, True)
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.connections._writing_paused(self.handler, False)
        self.handler.resume_writing()


class TrackedSite(web.BaseSite):
    """A TCP listener like `web.TCPSite`, whose connections `Connections` sees. It registers with the
    runner like any site (BaseSite.start), so `runner.addresses` lists it and `runner.cleanup()` stops it."""

    def __init__(self, runner: web.BaseRunner, connections: Connections, host: str, port: int, *,
                 backlog: int = 128):
        super().__init__(runner, backlog=backlog)
        self.connections, self.host, self.port = connections, host, port

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None  # BaseSite refuses a runner not set up
        self._server = await asyncio.get_running_loop().create_server(
            self.connections.protocol_factory(server), self.host, self.port, backlog=self._backlog)


def raise_open_file_limit(max_connections: int) -> int:
    """Raise the soft open-file limit to the hard one; the connection cap that fits under it.

    A hard limit below max_connections + OTHER_FILES lowers the cap (with a warning) rather than
    refusing to start: the cap still keeps clawd from running out of descriptors, and a container or
    developer machine with a low hard limit still runs. Raise LimitNOFILE= to serve the configured cap."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + OTHER_FILES
    target = max(soft, need) if hard == resource.RLIM_INFINITY else hard
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # above the kernel's nr_open: keep what we have
            log.warning("could not raise the open-file limit to %d: %s", target, exc)
    cap = min(max_connections, max(1, soft - OTHER_FILES))
    if cap < max_connections:
        log.warning("open-file limit %d (hard %s) leaves room for %d connections, not server.max_connections "
                    "= %d: serving at most %d (raise LimitNOFILE= to at least %d)", soft,
                    "unlimited" if hard == resource.RLIM_INFINITY else hard, cap, max_connections, cap, need)
    else:
        log.info("open-file limit %d: room for server.max_connections = %d", soft, max_connections)
    return cap
