"""The daemon's side of the trainer process: one event loop, no threads, no torch. The link and its
supervisor share the file: the supervisor's restarts are the link's life seen from outside, and read best
beside it.

`TrainerLink` is one child's life: spawn (multiprocessing, `spawn` context, target `clawd.trainer.child.main`),
the `ready` handshake, requests whose replies come back in order, the child's exit noticed through its
process sentinel registered with the loop, and stop. The socket pair is read and written with asyncio
streams: a 20 MB batch blocks the loop neither going nor coming back (the format: `clawd.trainer.wire`).

`TrainerSupervisor` keeps one child alive: `run()` restarts it with exponential backoff (its
handler resumes from the last checkpoint) and `train()` sends the same batch again after a
restart, under a version above the new child's newest. After `attempts` it raises; the caller
still holds the samples, nothing is dropped silently. Every reply's `state` (the trainer's step,
newest version and owed writes; `clawd.trainer.wire`) is kept as `link.state`.

What the real trainer is spawned with is `clawd.trainer.options`. The handler is the child's business: a
link given no factory runs `clawd.trainer.worker.lineages.handler_for`, imported in the child only.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import itertools
import logging
import multiprocessing
import os
import signal
import socket
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Sequence

from clawd.samples import Sample
from clawd.trainer import child
from clawd.trainer.catalogue import (Checkpoint, Checkpointed, Ping, PublishWeights, Ready, Restore, Train, Trained,
                                     WaitWritten, message, read_reply)
from clawd.trainer.errors import (HandlerError, TrainerDied, TrainerError, TrainerProtocolError, TrainerTimeout,
                                  TrainerUnavailable, TrainFailed)
from clawd.trainer.wire import (ProtocolError, answers, encode_message, frame_header, message_frames, read_message,
                                retitled)

log = logging.getLogger("clawd.trainer")

_STREAM_LIMIT = 1 << 20  # the stream pauses the socket once twice this is buffered unread
_GRACE = 1.0             # for the last bytes (or the exit) that follow the other one
_BACKOFF_RESET = 60.0    # a child that lived this long earns a fresh backoff


async def _wait(event: asyncio.Event, timeout: float | None) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except TimeoutError:
        return False


# ---- one child ------------------------------------------------------------------------------

class TrainerLink:
    def __init__(self, options: dict, *, factory: child.Factory | None = None, ready_timeout: float = 120.0):
        self.options = options  # passed to the child: `log_level`, and whatever the handler reads
        self.factory = factory  # None: the real trainer
        self.ready_timeout = ready_timeout
        self.ready: Ready | None = None
        self.state: dict | None = None  # the last reply's `state` (of the shared lineage, with several)
        self.states: dict[str, dict] = {}  # adapters per principal: each lineage's, as its last reply gave it
        self.exitcode: int | None = None
        self.stats: collections.Counter = collections.Counter()  # frames_in, bytes_in, frames_out, bytes_out
        self._process = None
        self._pid: int | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: collections.deque = collections.deque()  # (request head, future), in send order
        self._tasks: list[asyncio.Task] = []
        self._exited = asyncio.Event()  # the sentinel fired and the child is reaped
        self._eof = asyncio.Event()     # the reader stopped: end of stream or a bad message
        self._closed = asyncio.Event()  # both, and every waiting request settled
        self._doomed = False            # kill() or stop() was called
        self._exit_grace = _GRACE       # from its end of stream to its exit; a stopping child's teardown may be slow
        self._pings = itertools.count(1)

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def alive(self) -> bool:
        """Ready and still answering: no exit, no end of stream, no kill or stop under way."""
        return self.ready is not None and not (self._doomed or self._exited.is_set() or self._eof.is_set())

    async def start(self) -> Ready:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        child_conn = Connection(theirs.detach())
        process = multiprocessing.get_context("spawn").Process(
            target=child.main, args=(child_conn, self.factory, self.options), name="clawd-trainer", daemon=False)
        # Variables a secret was read from (a judge's key, say) are not the trainer's to see, not even in
        # /proc/<pid>/environ before the child could drop them: out of the environment around the exec, then
        # back (a SIGHUP reads them again). The daemon is one thread: nothing else sees the gap.
        hidden = {name: os.environ.pop(name) for name, value in self.options.get("env", {}).items()
                  if value is None and name in os.environ}
        try:
            process.start()  # fork+exec and a small pickle down a pipe: no helper thread
        except BaseException:
            ours.close()
            raise
        finally:
            os.environ.update(hidden)
            child_conn.close()  # only the child may hold its end, or its death would not end our stream
        self._process, self._pid = process, process.pid
        atexit.register(self._kill_at_exit)
        loop.add_reader(process.sentinel, self._on_exit)
        handshake = loop.create_future()
        self._pending.append(({"type": "start"}, handshake))
        try:
            reader, self._writer = await asyncio.open_unix_connection(sock=ours, limit=_STREAM_LIMIT)
        except BaseException:
            ours.close()
            self.kill()
            raise
        self._tasks = [asyncio.create_task(self._typed(reader)), asyncio.create_task(self._settle())]
        try:
            reply = await asyncio.wait_for(handshake, self.ready_timeout)
        except TimeoutError:
            self.kill()
            await self._closed.wait()
            raise TrainerTimeout(f"trainer {self._pid} not ready within {self.ready_timeout}s") from None
        except TrainerError:
            await self._closed.wait()
            raise
        except BaseException:  # cancelled: leave no child behind
            self.kill()
            raise
        if reply["type"] == "error":
            await self._closed.wait()  # it exits 1 after saying why
            raise TrainerError(f"trainer failed to start: {reply['message']}")
        self.ready = read_reply(reply)
        self.states = dict(reply.get("lineages") or {})
        log.info("trainer %d ready at step %d, holding version %d (newest %d)", self._pid, self.ready.step,
                 self.ready.weights_version, self.ready.version)
        return self.ready

    async def request(self, msg: dict, timeout: float | None = None, *, frames: list[bytes] | None = None) -> dict:
        """Send `msg` (or its pre-encoded `frames`) and return the reply, an `error` reply included.

        The timeout counts from the send and includes the requests sent before this one (the child
        answers in order). On timeout the child is killed: a late reply would answer the wrong request."""
        if frames is None:
            frames = await encode_message(msg)
        if not self.alive:
            raise TrainerDied(f"trainer {self._pid} is not alive (exit code {self.exitcode})")
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((msg, fut))
        self._write(frames)
        try:
            return await asyncio.wait_for(self._drain_then(fut), timeout)
        except TimeoutError:
            log.error("trainer %d: no reply to %s within %ss; killing it", self._pid, msg["type"], timeout)
            self.kill()
            raise TrainerTimeout(f"no reply to {msg['type']} within {timeout}s") from None

    async def ping(self, timeout: float = 10.0) -> float:
        """Round-trip seconds. Meant for an idle child: a ping waits behind a train step."""
        started = time.monotonic()
        await self.request(message(Ping(next(self._pings))), timeout)
        return time.monotonic() - started

    async def checkpoint(self, timeout: float | None = None, lineage: str | None = None) -> Checkpointed:
        return await self.ask(Checkpoint(), timeout, lineage)

    async def publish(self, version: int, timeout: float | None = None, lineage: str | None = None) -> str:
        return (await self.ask(PublishWeights(version), timeout, lineage)).weights_dir

    async def restore(self, version: int, timeout: float | None = None, lineage: str | None = None) -> int:
        return (await self.ask(Restore(version), timeout, lineage)).step

    async def ask(self, request, timeout: float | None, lineage: str | None = None):
        """A request of the catalogue (`clawd.trainer.catalogue`), for `lineage` (adapters per principal; None: the
        shared one); its reply, typed. An error reply raises."""
        msg = message(request)
        reply = await self.request(msg if lineage is None else {**msg, "lineage": lineage}, timeout)
        if reply["type"] == "error":
            raise HandlerError.of(reply)
        return read_reply(reply)

    async def stop(self, timeout: float = 30.0) -> int | None:
        """Ask the child to exit after its current message; SIGTERM, then SIGKILL, if it does not."""
        if self._process is None:
            return None
        if not self._exited.is_set():
            self._doomed = True
            self._exit_grace = timeout  # torch's teardown after the socket closes can take seconds under load
            if self._writer is not None and not self._eof.is_set() and not self._writer.is_closing():
                self._write(message_frames({"type": "shutdown"}))
            if not await _wait(self._closed, timeout):
                log.warning("trainer %d did not stop within %ss; terminating it", self._pid, timeout)
                self._signal(signal.SIGTERM)
                if not await _wait(self._closed, 5.0):
                    self.kill()
        await self._closed.wait()
        return self.exitcode

    @property
    def buffered_out(self) -> int:
        """Bytes written to the stream that the child has not taken yet."""
        return self._writer.transport.get_write_buffer_size() if self._writer is not None else 0

    def kill(self) -> None:
        self._doomed = True
        self._signal(signal.SIGKILL)

    async def wait_closed(self) -> None:
        await self._closed.wait()

    # -- internals

    def _signal(self, sig: int) -> None:
        if self._pid is not None and not self._exited.is_set():  # not reaped yet, so the pid is still ours
            os.kill(self._pid, sig)

    def _kill_at_exit(self) -> None:
        # multiprocessing joins non-daemonic children at exit; a live trainer would hang it.
        self._signal(signal.SIGKILL)

    def _write(self, frames) -> None:
        for frame in frames:
            self._writer.write(frame_header(len(frame)))
            self._writer.write(frame)
            self.stats["frames_out"] += 1
            self.stats["bytes_out"] += len(frame)

    async def _drain_then(self, fut: asyncio.Future) -> dict:
        try:
            await self._writer.drain()
        except ConnectionError:
            pass  # the child is gone; `fut` fails with TrainerDied once that is settled
        return await fut

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        self._process.join()  # the sentinel says it has exited: this only reaps
        self.exitcode = self._process.exitcode
        self._process.close()
        atexit.unregister(self._kill_at_exit)
        self._exited.set()

    async def _typed(self, reader: asyncio.StreamReader) -> None:
        try:
            while (msg := await read_message(reader, self.stats)) is not None:
                self._deliver(msg)
        except (ProtocolError, TrainerProtocolError, ValueError, ConnectionError) as exc:  # ValueError: bad JSON
            log.error("trainer %d: %s; killing it", self._pid, exc)
            self.kill()
        finally:
            self._eof.set()

    def _deliver(self, reply: dict) -> None:
        if not self._pending:
            raise TrainerProtocolError(f"unsolicited {reply['type']!r}")
        request, fut = self._pending.popleft()
        if not answers(request, reply):
            err = TrainerProtocolError(f"{reply['type']!r} does not answer {request['type']!r}")
            if not fut.done():
                fut.set_exception(err)
            raise err
        if isinstance(reply.get("state"), dict):
            if (key := reply["state"].get("lineage")) is None:
                self.state = reply["state"]
            else:
                self.states[key] = reply["state"]
        if not fut.done():  # a cancelled request's reply is dropped; the order holds
            fut.set_result(reply)

    async def _settle(self) -> None:
        """Once the child has exited and its stream ended, fail whatever still waits for a reply."""
        waits = [asyncio.create_task(self._exited.wait()), asyncio.create_task(self._eof.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if not self._exited.is_set():  # it closed its end yet lives: it can no longer be talked to
            if not await _wait(self._exited, self._exit_grace):
                self.kill()
            await self._exited.wait()
        if not await _wait(self._eof, _GRACE):  # a grandchild may hold the socket open
            self._tasks[0].cancel()
        self._writer.close()
        died = TrainerDied(f"trainer {self._pid} exited with code {self.exitcode}")
        while self._pending:
            _, fut = self._pending.popleft()
            if not fut.done():
                fut.set_exception(died)
        if self.exitcode != 0:
            log.error("trainer %d exited with code %s", self._pid, self.exitcode)
        self._closed.set()


# ---- a child kept alive -----------------------------------------------------------------------

class TrainerSupervisor:
    def __init__(self, options: dict, *, factory: child.Factory | None = None, ready_timeout: float = 120.0,
                 backoff_initial: float = 1.0, backoff_max: float = 60.0, attempts: int = 3,
                 wait_ready: float | None = 600.0):
        self.options = options
        self.factory = factory
        self.ready_timeout = ready_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.attempts = attempts      # sends of one batch before `train` gives it back
        self.wait_ready = wait_ready  # how long `train` waits for a live child
        self.restarts = 0
        self.link: TrainerLink | None = None
        self._ready = asyncio.Event()
        self._stop = asyncio.Event()
        self._finished = asyncio.Event()
        self._running = False
        self._held = False  # hold_restarts: the daemon drains

    @property
    def alive(self) -> bool:
        return self.link is not None and self.link.alive

    @property
    def pid(self) -> int | None:
        return self.link.pid if self.alive else None

    @property
    def ready(self) -> Ready | None:
        """The live child's handshake, or None while there is none."""
        return self.link.ready if self.alive else None

    @property
    def state(self) -> dict | None:
        """The live child's state as its last reply gave it, or None while there is none."""
        return self.link.state if self.alive else None

    @property
    def version(self) -> int:
        """The newest weights version the trainer has published (as its last reply said): new ones go above."""
        link = self.link
        if link is None or link.ready is None:
            return 0
        return link.state["version"] if link.state is not None else link.ready.version

    async def run(self) -> None:
        """The long-lived task: start the child, wait for its end, restart it with backoff."""
        self._running = True
        backoff = self.backoff_initial
        try:
            while not self._stop.is_set():
                link = self.link = TrainerLink(self.options, factory=self.factory, ready_timeout=self.ready_timeout)
                started = time.monotonic()
                try:
                    await link.start()
                except (TrainerError, OSError) as exc:  # OSError: the spawn itself failed
                    log.error("trainer start failed: %s", exc)
                else:
                    if self._stop.is_set():  # stop() came while it was starting
                        await link.stop()
                        break
                    self._ready.set()
                    await link.wait_closed()
                if self._stop.is_set():
                    break
                if self._held:  # the daemon drains: callers waiting for a child give up, as at a stop
                    log.warning("trainer down (exit code %s) while clawd drains: not restarted", link.exitcode)
                    self._stop.set()
                    self._ready.set()
                    break
                self.restarts += 1
                if time.monotonic() - started > _BACKOFF_RESET:
                    backoff = self.backoff_initial
                log.error("trainer down (exit code %s); restarting in %.2fs (restart %d)", link.exitcode,
                          backoff, self.restarts)
                if await _wait(self._stop, backoff):
                    break
                backoff = min(backoff * 2, self.backoff_max)
        finally:
            self._finished.set()

    def version_of(self, lineage: str | None) -> int:
        """`version` of one lineage (adapters per principal): 0 for one the live child does not hold yet."""
        if lineage is None:
            return self.version
        state = self.link.states.get(lineage) if self.link is not None else None
        return state["version"] if state is not None else 0

    async def train(self, batch_id: str, version: int, samples: Sequence[Sample], *,
                    timeout: float | None = None, deferred: bool = False, lineage: str | None = None,
                    renumber: Callable[[int], int] = lambda version: version) -> Trained:
        """One training step on `samples`, producing weights `version`; retried across restarts. `deferred`: its
        directory is written off the critical path (`written` waits for it). `lineage`: the principal's adapter
        it trains (adapters per principal; None: the shared one). `renumber`: the caller's allotter of numbers, for
        the new one a retry needs when a restarted child already holds `version`."""
        msg = message(Train(batch_id, version, list(samples), deferred))
        if lineage is not None:
            msg["lineage"] = lineage
        frames = await encode_message(msg)  # once: every attempt sends the same samples
        head = {k: v for k, v in msg.items() if k != "samples"}
        last: TrainerError | None = None
        for attempt in range(1, self.attempts + 1):
            link = await self._live_link()
            if (held := self.version_of(lineage)) >= head["version"]:  # a restarted child may have published it
                head = {**head, "version": renumber(held + 1)}
                frames = [retitled(frames[0], version=head["version"]), *frames[1:]]
            try:
                reply = await link.request(head, timeout, frames=frames)
            except (TrainerDied, TrainerTimeout, TrainerProtocolError) as exc:
                last = exc  # run() restarts the child; the batch goes again
                log.warning("batch %s, attempt %d/%d: %s", batch_id, attempt, self.attempts, exc)
                continue
            if reply["type"] == "trained":
                return read_reply(reply)
            last = HandlerError.of(reply, batch_id)
            if not last.retryable:
                raise last
            log.warning("batch %s, attempt %d/%d: %s", batch_id, attempt, self.attempts, last)
            if attempt < self.attempts:
                await asyncio.sleep(self.backoff_initial)
        raise TrainFailed(f"batch {batch_id} failed {self.attempts} attempts; last: {last}",
                          attempts=self.attempts) from last

    async def checkpoint(self, timeout: float | None = None, lineage: str | None = None) -> Checkpointed:
        return await (await self._live_link()).checkpoint(timeout, lineage)

    async def publish(self, version: int, timeout: float | None = None, lineage: str | None = None) -> str:
        """The trainer's weights as a new version; its directory. Its state then says if a checkpoint is owed."""
        return await (await self._live_link()).publish(version, timeout, lineage)

    async def written(self, version: int, timeout: float | None = None, lineage: str | None = None) -> str:
        """`version`'s directory once the trainer's deferred write of it is on disk (at once when none is
        pending: whether it exists is the caller's to check)."""
        return (await self.ask(WaitWritten(version), timeout, lineage))[1].weights_dir

    async def restore(self, version: int, timeout: float | None = None, lineage: str | None = None) -> int:
        """A rollback: the trainer back on `version`'s checkpoint (weights and optimizer); its step."""
        return await (await self._live_link()).restore(version, timeout, lineage)

    async def ask(self, request, timeout: float | None = None, lineage: str | None = None) -> tuple[int | None, Any]:
        """Any other request of the catalogue (the weight-update group's); the pid of the child that answered
        (its groups die with it) and its reply, typed. An error reply raises HandlerError."""
        link = await self._live_link()
        return link.pid, await link.ask(request, timeout, lineage)

    async def ready_info(self) -> Ready:
        """The live child's handshake (waits for one, like `train`)."""
        return (await self._live_link()).ready

    async def ping(self, timeout: float = 10.0) -> float:
        return await (await self._live_link()).ping(timeout)

    async def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._ready.set()  # wakes `train` callers waiting for a child, to give up
        if self.link is not None:
            await self.link.stop(timeout)
        if self._running:
            await self._finished.wait()

    def hold_restarts(self) -> None:
        """The daemon drains: a child that exits from now on is not restarted (the one running finishes its step
        and checkpoints as `stop` asks)."""
        self._held = True

    def kill(self) -> None:
        """At once, for a forced stop: no checkpoint, no restart."""
        self._stop.set()
        self._ready.set()
        if self.link is not None:
            self.link.kill()

    async def _live_link(self) -> TrainerLink:
        try:
            async with asyncio.timeout(self.wait_ready):
                while True:
                    if self._stop.is_set():
                        raise TrainerUnavailable("the trainer is stopping")
                    if self.link is not None and self.link.alive:
                        return self.link
                    self._ready.clear()  # run() sets it again once a new child is ready
                    await self._ready.wait()
        except TimeoutError:
            raise TrainerUnavailable(f"no live trainer within {self.wait_ready}s") from None
