"""Deployment code off the daemon's loop: a worker process that runs a deployment's checkers, environments and
tools, one call at a time, each under a time limit (docs/ARCHITECTURE.md §19).

A deployment names its code by path ("package.module:function"); the daemon never imports it. The worker is
spawned (multiprocessing, `spawn` context, as the trainer is) and speaks the trainer's frame format
(clawd.trainer.wire) over a socket pair:

    call{id, target, args}  ->  result{id, value}      (the function's return value, JSON)
                            ->  raised{id, error}      (its exception, as "Type: message")

A call that outlives its limit gets the worker killed (SIGKILL: a checker stuck in C code or in a loop
that ignores signals is cut all the same) and raises `CallFailed("timeout")`; a worker that dies raises
`CallFailed("died")`. Either way the next call starts a fresh worker, so one bad item costs its own call.
The worker dies with the daemon (clawd.lifetime.die_with_spawner).
"""
from __future__ import annotations

import asyncio
import importlib
import json
import logging
import multiprocessing
import os
import signal
import socket
from multiprocessing.connection import Connection
from typing import Any

from clawd.lifetime import die_with_spawner
from clawd.trainer.wire import frame_header, message_frames, read_message, recv_message

log = logging.getLogger("clawd.rollouts")


class CallFailed(Exception):
    """A deployment call that returned nothing: `kind` is "raised" (its own exception, `error`), "timeout" or
    "died" (the worker was lost with it), or "bad_target" (not a "module:function" the worker could import)."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


def import_target(target: str):
    """The function a "module:function" path names (imported in the worker only)."""
    module, sep, name = target.partition(":")
    if not (sep and module and name):
        raise ValueError(f"{target!r} is not \"module:function\"")
    function = getattr(importlib.import_module(module), name)
    if not callable(function):
        raise ValueError(f"{target} is not callable")
    return function


def _send(conn: Connection, msg: dict) -> None:
    frames = list(message_frames(msg))  # all encoded first: a value JSON cannot hold fails before a byte goes
    for frame in frames:
        conn.send_bytes(frame)


def _call(targets: dict[str, Any], msg: dict) -> dict:
    call_id, target = msg.get("id"), msg.get("target", "")
    try:
        if target not in targets:
            targets[target] = import_target(target)
    except Exception as exc:  # an unimportable target is the deployment's mistake, said as such
        return {"type": "bad_target", "id": call_id, "error": f"{type(exc).__name__}: {exc}"}
    try:
        value = targets[target](*[json.loads(arg) for arg in msg.get("args", [])])
        list(message_frames({"value": value}))  # JSON, or the call's own failure below
        return {"type": "result", "id": call_id, "value": value}
    except Exception as exc:  # the call's own failure is its answer, not the worker's end
        return {"type": "raised", "id": call_id, "error": f"{type(exc).__name__}: {exc}"}


def work(conn: Connection) -> None:
    """The worker's loop: ready, then one reply per call until the daemon closes its end."""
    die_with_spawner()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which stops us
    targets: dict[str, Any] = {}
    _send(conn, {"type": "ready", "pid": os.getpid()})
    while True:
        try:
            msg = recv_message(conn)
        except EOFError:
            return
        _send(conn, _call(targets, msg))


class DeploymentWorker:
    """The daemon's end: `await call(target, *args, timeout=...)`, one call at a time (callers queue)."""

    def __init__(self, name: str = "clawd-rollouts-worker", start_timeout: float = 60.0):
        self.name, self.start_timeout = name, start_timeout
        self._lock = asyncio.Lock()
        self._process: multiprocessing.Process | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._next_id = 0
        self.started = 0       # workers started: the first, then one after each timeout or death
        self.timeouts = 0      # calls cut at their limit

    @property
    def restarts(self) -> int:
        return max(self.started - 1, 0)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def call(self, target: str, *args: Any, timeout: float) -> Any:
        """`target(*args)` in the worker; its return value, or CallFailed. Arguments and value are JSON."""
        async with self._lock:
            if self._process is None or not self._process.is_alive():
                await self._start()
            self._next_id += 1
            call_id = self._next_id
            for frame in message_frames({"type": "call", "id": call_id, "target": target, "args": list(args)}):
                self._writer.write(frame_header(len(frame)) + frame)
            try:
                reply = await asyncio.wait_for(self._reply(), timeout)
            except TimeoutError:
                self.timeouts += 1
                log.warning("%s: %s took over %ss: worker %s killed", self.name, target, timeout, self.pid)
                await self._kill()
                raise CallFailed("timeout", f"{target} took over {timeout}s") from None
            if reply is None:
                await self._kill()
                raise CallFailed("died", f"the worker died running {target}")
            if reply.get("id") != call_id:  # cannot happen with one call at a time; never trust a stray reply
                await self._kill()
                raise CallFailed("died", f"the worker answered call {reply.get('id')}, not {call_id}")
            if reply["type"] == "result":
                return reply.get("value")
            raise CallFailed(reply["type"], reply.get("error", ""))

    async def _reply(self) -> dict | None:
        await self._writer.drain()
        try:
            return await read_message(self._reader)
        except (ConnectionError, ValueError) as exc:  # torn frames: the worker died mid-reply
            log.warning("%s: worker %s: %s", self.name, self.pid, exc)
            return None

    async def _start(self) -> None:
        await self._kill()  # a worker found dead: reaped first
        self.started += 1
        ours, theirs = socket.socketpair()
        child_conn = Connection(theirs.detach())
        process = multiprocessing.get_context("spawn").Process(target=work, args=(child_conn,), name=self.name,
                                                               daemon=False)
        try:
            process.start()
        except BaseException:
            ours.close()
            raise
        finally:
            child_conn.close()  # only the worker holds its end: its death ends our stream
        self._process = process
        self._reader, self._writer = await asyncio.open_unix_connection(sock=ours)
        try:
            ready = await asyncio.wait_for(read_message(self._reader), self.start_timeout)
        except (TimeoutError, ConnectionError, ValueError) as exc:
            await self._kill()
            raise CallFailed("died", f"the worker did not start: {type(exc).__name__}: {exc}") from None
        if ready is None or ready.get("type") != "ready":
            await self._kill()
            raise CallFailed("died", f"the worker did not start: {ready!r:.200}")

    async def _kill(self) -> None:
        process, self._process = self._process, None
        if self._writer is not None:
            self._writer.close()
            self._writer = self._reader = None
        if process is None:
            return
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
        while process.exitcode is None:  # reaped without blocking the loop: it is gone within milliseconds
            await asyncio.sleep(0.01)
        process.join(0)

    async def close(self) -> None:
        async with self._lock:
            await self._kill()
