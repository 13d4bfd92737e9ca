"""The admin socket that `bin/clawctl` talks to (docs/ARCHITECTURE.md §8).

One JSON object on one line in, one JSON line out, then the server closes:

    → {"cmd": "pause", "serving": true}
    ← {"ok": true, "result": {...}}  or  {"ok": false, "error": {"code": N, "message": "..."}}

Error codes:

    1  MALFORMED      not JSON, not an object, no "cmd" string, line over MAX_LINE bytes,
                      or no line within the read timeout
    2  UNKNOWN        no such command
    3  BAD_ARGUMENT   the command refused one of its arguments
    4  DENIED         the peer is not root, clawd's own uid, or in the admin group
    5  INTERNAL       the command failed; the traceback is in clawd's log

Who may connect is decided by the peer's credentials (SO_PEERCRED), not by the
socket file's mode: the mode (0660) is only a first fence.
"""
from __future__ import annotations

import asyncio
import grp
import json
import logging
import os
import pwd
import socket
import stat
import struct
from pathlib import Path
from typing import Awaitable, Callable, Mapping

log = logging.getLogger("clawd.admin")

MALFORMED, UNKNOWN, BAD_ARGUMENT, DENIED, INTERNAL = 1, 2, 3, 4, 5
MAX_LINE = 64 * 1024
READ_TIMEOUT = 5.0  # seconds a client may take to send its line


class AdminError(Exception):
    """Raised by a command handler (or the parser): becomes an error reply."""

    def __init__(self, code: int, message: str):
        super().__init__(code, message)
        self.code = code
        self.message = message


class AdminSocketError(RuntimeError):
    """The socket cannot be set up (taken by a live clawd, not a socket, unknown group...)."""


Command = Callable[[dict], Awaitable[dict]]


def parse_request(line: bytes) -> dict:
    """A request line → the request object, or AdminError(MALFORMED)."""
    try:
        request = json.loads(line)
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." nested too deep
        raise AdminError(MALFORMED, f"request is not JSON ({exc})") from None
    if not isinstance(request, dict):
        raise AdminError(MALFORMED, f"request must be a JSON object, not {type(request).__name__}")
    if not isinstance(request.get("cmd"), str):
        raise AdminError(MALFORMED, 'request has no "cmd" string')
    return request


def encode_result(result: dict) -> bytes:
    return json.dumps({"ok": True, "result": result}).encode() + b"\n"


def encode_error(code: int, message: str) -> bytes:
    return json.dumps({"ok": False, "error": {"code": code, "message": message}}).encode() + b"\n"


def decode_reply(line: bytes) -> dict:
    """A reply line → its result; AdminError for an error reply; ValueError for anything else."""
    reply = json.loads(line)
    if isinstance(reply, dict) and reply.get("ok") is True and isinstance(reply.get("result"), dict):
        return reply["result"]
    error = reply.get("error") if isinstance(reply, dict) and reply.get("ok") is False else None
    if isinstance(error, dict) and isinstance(error.get("code"), int) and isinstance(error.get("message"), str):
        raise AdminError(error["code"], error["message"])
    raise ValueError(f"not an admin reply: {line[:200]!r}")


def argument(request: dict, name: str, kind: type, default=None):
    """request[name] when present and of `kind` (else `default`); AdminError(BAD_ARGUMENT) otherwise."""
    value = request.get(name, default)
    if value is default or (isinstance(value, kind) and (kind is bool or not isinstance(value, bool))):
        return value
    raise AdminError(BAD_ARGUMENT, f"{name} must be {kind.__name__}, not {type(value).__name__}")


def _user_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def peer_allowed(uid: int, gid: int, *, own_uid: int, group: grp.struct_group | None) -> bool:
    """Root, clawd's own uid, or (a group configured) a peer whose gid or user's groups include it."""
    if uid in (0, own_uid):
        return True
    if group is None:
        return False
    if gid == group.gr_gid:
        return True
    try:
        user = pwd.getpwuid(uid)
    except KeyError:  # a uid with no passwd entry can only be in the group by its gid
        return False
    return user.pw_gid == group.gr_gid or user.pw_name in group.gr_mem


class AdminServer:
    read_timeout = READ_TIMEOUT

    def __init__(self, path: Path, commands: Mapping[str, Command], *, group: str = ""):
        self.path = Path(path)
        self.commands = dict(commands)
        self.group = group
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task] = set()
        self._inode: tuple[int, int] | None = None  # (st_dev, st_ino) of the file we bound
        self._closing = False

    async def start(self) -> None:
        group = self._lookup_group()
        self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        await self._clear_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # No await while the umask is narrowed: it is process-wide. The file is never
            # connectable by others, even before the chmod.
            old = os.umask(0o177)
            try:
                sock.bind(str(self.path))
            finally:
                os.umask(old)
            st = os.stat(self.path)
            self._inode = (st.st_dev, st.st_ino)
            if group is not None:
                try:
                    os.chown(self.path, -1, group.gr_gid)
                except OSError as exc:
                    raise AdminSocketError(f"{self.path}: cannot give the socket to group {self.group}: "
                                           f"{exc.strerror}") from None
            os.chmod(self.path, 0o660)
            self._server = await asyncio.start_unix_server(self._serve, sock=sock, limit=MAX_LINE)
        except BaseException:
            sock.close()
            self._unlink_if_ours()
            raise
        log.info("admin socket at %s%s", self.path, f" (group {self.group})" if self.group else "")

    async def close(self) -> None:
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task in self._conns:
            task.cancel()
        if self._conns:
            await asyncio.wait(self._conns)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        self._unlink_if_ours()

    def _lookup_group(self) -> grp.struct_group | None:
        if not self.group:
            return None
        try:
            return grp.getgrnam(self.group)
        except KeyError:
            raise AdminSocketError(f"admin.group: no group named {self.group!r} on this host") from None

    def _current_group(self) -> grp.struct_group | None:
        """Membership is read per connection, so adding an operator to the group needs no restart."""
        try:
            return self._lookup_group()
        except AdminSocketError as exc:  # deleted since start: only root and clawd's uid get in
            log.warning("%s", exc)
            return None

    async def _clear_stale(self) -> None:
        """A file left by a killed clawd is removed; a live clawd's socket is never taken over."""
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise AdminSocketError(f"{self.path}: exists and is not a socket; not replacing it")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(self.path)), 2.0)
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale admin socket %s", self.path)
            self.path.unlink(missing_ok=True)
            return
        except (OSError, TimeoutError) as exc:  # EACCES, a hung listener: someone holds it
            raise AdminSocketError(f"{self.path}: in use ({exc!r}); is another clawd running?") from None
        writer.close()
        raise AdminSocketError(f"{self.path}: another clawd is answering on it")

    def _unlink_if_ours(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._inode:
            self.path.unlink()
        self._inode = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        try:
            if not self._closing:
                writer.write(await self._reply(reader, writer))
                await writer.drain()
        except ConnectionError as exc:  # the client left before its reply: nobody to tell
            log.debug("admin client went away: %r", exc)
        except Exception:
            log.exception("admin connection failed")
        finally:
            self._conns.discard(task)
            writer.close()

    async def _reply(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        pid, uid, gid = struct.unpack("3i", writer.get_extra_info("socket").getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        # The line is read even from a refused peer, so it gets its reply instead of EPIPE.
        line, problem = b"", None
        try:
            async with asyncio.timeout(self.read_timeout):
                line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:  # EOF without a newline: take what came
            line = exc.partial
        except asyncio.LimitOverrunError:
            problem = f"request line longer than {MAX_LINE} bytes"
        except TimeoutError:
            problem = f"no request line within {self.read_timeout:g}s"
        own_uid = os.getuid()
        if not peer_allowed(uid, gid, own_uid=own_uid, group=self._current_group()):
            log.warning("admin socket: refused uid %d (pid %d, gid %d)", uid, pid, gid)
            return encode_error(DENIED, f"uid {uid} may not use this socket (root, uid {own_uid}"
                                        f"{f', or group {self.group}' if self.group else ''} only)")
        if problem is not None:
            return encode_error(MALFORMED, problem)
        if not line:  # connected and left without a word (another clawd's liveness probe)
            return b""
        return await self._dispatch(line, {"uid": uid, "pid": pid, "user": _user_name(uid)})

    async def _dispatch(self, line: bytes, peer: dict | None = None) -> bytes:
        cmd = "?"
        try:
            request = parse_request(line)
            cmd = request["cmd"]
            request["peer"] = peer  # who asked, from SO_PEERCRED (the audit lines of export and forget)
            handler = self.commands.get(cmd)
            if handler is None:
                raise AdminError(UNKNOWN, f"unknown command {cmd!r} (known: {', '.join(sorted(self.commands))})")
            result = await handler(request)
            if not isinstance(result, dict):
                raise TypeError(f"{cmd} returned {type(result).__name__}, not a dict")
            return encode_result(result)
        except AdminError as exc:
            return encode_error(exc.code, exc.message)
        except Exception as exc:
            log.exception("admin command %r failed", cmd)
            return encode_error(INTERNAL, f"{cmd} failed: {exc!r} (see clawd's log)")
