"""Chat load for the fault tests: a few threads holding thanked conversations through the official openai client.

Each user thread repeats one conversation shape until stopped:

    1. a question, answered whole (non-streaming, so the reply can be sent back verbatim);
    2. the reply and "Thanks, that's perfect." with X-Session-Done, streamed.

Step 2 is the next state of step 1, so the rules judge votes +1 on it and
scoring writes a +1 sample; step 2 itself closes the session (no sample). Every
request leaves one `Outcome`, so a test can tell what was answered, refused or
broken, and when. Each request uses its own connection (`Connection: close`):
a pooled keep-alive connection closed by the server under a new request would be
an error of the test's making, not the daemon's.
"""
from __future__ import annotations

import errno
import itertools
import json
import os
import re
import socket
import struct
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import openai

THANKS = "Thanks, that's perfect."

OK = "ok"                  # a 200 answered in full (a stream that ended with a finish_reason)
REFUSED = "refused"        # the connection was refused: nothing listened on the port
NO_RESPONSE = "no_response"  # connected, but the connection failed before any HTTP status came back
STATUS = "status"          # an HTTP error status (see `status`, `code`, `retry_after`)
BROKEN = "broken"          # a 200 whose body failed or ended early: the one outcome a drain must never give


@dataclass(frozen=True)
class Outcome:
    user: int
    stream: bool
    started: float          # time.monotonic() before the call
    ended: float
    kind: str               # one of the constants above
    status: int | None = None
    code: str | None = None
    retry_after: str | None = None
    completion_id: str | None = None
    error: str | None = None


def _refused(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ConnectionRefusedError) or getattr(exc, "errno", None) == errno.ECONNREFUSED:
            return True
        if "Connection refused" in str(exc) or "[Errno 111]" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class ChatLoad:
    """`users` threads sending conversations to `base_url` (ending in /v1) until `stop()`.

    `pause_after_error` keeps a thread from spinning while nothing listens.
    `max_tokens` None leaves the daemon's cap in charge.
    """

    def __init__(self, base_url: str, *, users: int = 3, max_tokens: int | None = None,
                 pause_after_error: float = 0.1, timeout: float = 120.0, tag: str = "load"):
        self.base_url = base_url
        self.users = users
        self.max_tokens = max_tokens
        self.pause_after_error = pause_after_error
        self.timeout = timeout
        self.tag = tag
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- control

    def start(self) -> "ChatLoad":
        self._threads = [threading.Thread(target=self._user, args=(n,), daemon=True, name=f"chat-user-{n}")
                         for n in range(self.users)]
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 120.0) -> None:
        """Stops starting requests and waits for the ones in flight to end."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise TimeoutError(f"load threads still running after {timeout}s: {alive}")

    def __enter__(self) -> "ChatLoad":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- results

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def counts(self) -> Counter:
        return Counter(o.kind for o in self.snapshot())

    def wait_for(self, predicate, timeout: float) -> bool:
        """Polls predicate(outcomes) until true or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.snapshot()):
                return True
            time.sleep(0.05)
        return False

    # -- the users

    def _user(self, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            messages = [{"role": "user", "content": f"{self.tag}: user {n}, question {i}."}]
            first, reply = self._call(n, messages, stream=False)
            if first.kind != OK or self._stop.is_set():
                if first.kind != OK:
                    time.sleep(self.pause_after_error)
                continue
            messages += [reply, {"role": "user", "content": THANKS}]
            if self._call(n, messages, stream=True, done=True)[0].kind != OK:
                time.sleep(self.pause_after_error)

    def _record(self, outcome: Outcome) -> Outcome:
        with self._lock:
            self.outcomes.append(outcome)
        return outcome

    def _call(self, n: int, messages: list, *, stream: bool, done: bool = False) -> tuple[Outcome, dict | None]:
        """The outcome, and the assistant message of a whole (non-streamed) answer."""
        headers = {"Connection": "close"}
        if done:
            headers["X-Session-Done"] = "1"
        extra = {} if self.max_tokens is None else {"max_tokens": self.max_tokens}
        started = time.monotonic()
        answered = False  # an HTTP status came back
        client = openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=self.timeout)
        try:
            if not stream:
                reply = client.chat.completions.create(model="m", messages=messages, extra_headers=headers, **extra)
                answered = True
                message = reply.choices[0].message.model_dump(exclude_none=True)
                outcome = Outcome(n, False, started, time.monotonic(), OK, 200, completion_id=reply.id)
                return self._record(outcome), message
            chunks = client.chat.completions.create(model="m", messages=messages, stream=True,
                                                    extra_headers=headers, **extra)
            answered = True
            finished, completion_id = False, None
            for chunk in chunks:
                completion_id = chunk.id
                finished = finished or any(c.finish_reason for c in chunk.choices)
            kind = OK if finished else BROKEN
            return self._record(Outcome(n, True, started, time.monotonic(), kind, 200, completion_id=completion_id,
                                        error=None if finished else "stream ended without a finish_reason")), None
        except openai.APIStatusError as exc:
            body = exc.body if isinstance(exc.body, dict) else {}
            return self._record(Outcome(n, stream, started, time.monotonic(), STATUS, exc.status_code,
                                        code=body.get("code"), retry_after=exc.response.headers.get("Retry-After"),
                                        error=str(exc)[:300])), None
        except Exception as exc:  # what went wrong is the data here: classified, never dropped
            if answered:
                kind = BROKEN
            else:
                kind = REFUSED if _refused(exc) else NO_RESPONSE
            return self._record(Outcome(n, stream, started, time.monotonic(), kind, 200 if answered else None,
                                        error=f"{type(exc).__name__}: {exc}"[:300])), None
        finally:
            client.close()


def thanked_conversation(base_url: str, question: str, *, timeout: float = 120.0) -> tuple[str, str]:
    """One question and a thank-you that closes the session: the question's turn becomes one +1 sample.
    Returns the two completion ids."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=timeout)
    try:
        messages = [{"role": "user", "content": question}]
        reply = client.chat.completions.create(model="m", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": THANKS}]
        thanks = client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Session-Done": "1"})
        return reply.id, thanks.id
    finally:
        client.close()


# ---- what a fault leaves behind: the journal on disk, records, processes, ports ---------------------------------

# The journal's on-disk format (clawd/learning/journal.py docstring), read here independently of clawd's reader so the
# tests do not check the daemon with its own code.
_MAGIC = b"CLAWDJNL"
_RECORD_MAGIC = b"\xffJR\xc1"  # format 2's record magic (format 1 has none)
_SEGMENT = re.compile(r"journal-(\d{16})\.seg")


@dataclass(frozen=True)
class JournalScan:
    appended: tuple[str, ...]   # APPEND ids in file order, over every segment
    acked: frozenset            # ids named by ACK records
    live: tuple[str, ...]       # appended and not acked, in append order: what a start replays
    segments: int
    bad_tail_bytes: int         # bytes after the last good record of the last segment (a torn write)
    problem: str | None         # why reading stopped early, when it did


def read_journal(directory: Path) -> JournalScan:
    """Every record of every segment; damage is only tolerated at the end of the last segment."""
    paths = sorted(p for p in Path(directory).iterdir() if _SEGMENT.fullmatch(p.name))
    appended, acked, bad, problem = [], set(), 0, None
    for k, path in enumerate(paths):
        data = path.read_bytes()
        version = struct.unpack_from("<I", data, 8)[0] if len(data) >= 12 else None
        if data[:8] != _MAGIC[:len(data[:8])] or version not in (1, 2, None) or (version is None and k < len(paths) - 1):
            raise AssertionError(f"{path}: bad segment header {data[:12]!r}")
        # Format 1: u32 length + u32 CRC32(body) + body; 2: record magic + u32 length + u32 CRC32(length + body) + body.
        head = 8 if version == 1 else 12
        at = 12
        while at < len(data):
            why = None
            if at + head > len(data):
                why = "truncated frame header"
            elif version == 2 and data[at:at + 4] != _RECORD_MAGIC:
                why = "no record magic"
            else:
                length, crc = struct.unpack_from("<II", data, at + head - 8)
                body = data[at + head:at + head + length]
                covered = body if version == 1 else data[at + 4:at + 8] + body
                if length == 0 or len(body) < length:
                    why = f"truncated record (length {length}, {len(body)} bytes there)"
                elif zlib.crc32(covered) != crc:
                    why = "CRC mismatch"
            if why is not None:
                if k < len(paths) - 1:
                    raise AssertionError(f"{path}: {why} at offset {at} in a segment that is not the last")
                bad, problem = len(data) - at, f"{path.name}: {why} at offset {at}"
                break
            kind, ids = body[0], []
            if kind == 1:
                (n,) = struct.unpack_from("<H", body, 1)
                appended.append(body[3:3 + n].decode())
            elif kind == 2:
                (count,) = struct.unpack_from("<I", body, 1)
                pos = 5
                for _ in range(count):
                    (n,) = struct.unpack_from("<H", body, pos)
                    ids.append(body[pos + 2:pos + 2 + n].decode())
                    pos += 2 + n
                acked.update(ids)
            else:
                raise AssertionError(f"{path}: unknown record type {kind} at offset {at}")
            at += head + length
    live = tuple(i for i in dict.fromkeys(appended) if i not in acked)
    return JournalScan(tuple(appended), frozenset(acked), live, len(paths), bad, problem)


def read_records(state: Path, kind: str) -> list[dict]:
    """state/records/<kind>-*.jsonl; a line cut short by a kill is skipped (only the last line of a file can be)."""
    out = []
    for path in sorted((Path(state) / "records").glob(f"{kind}-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def witnessed_samples(state: Path) -> set[str]:
    """Sample ids that scoring reported as written: the judge record naming a sample is written (and flushed to
    the kernel) only after `SampleStore.put` returned, i.e. after the journal APPEND was written (and fsynced)."""
    return {r["sample_id"] for r in read_records(state, "judge") if r.get("emitted") and r.get("sample_id")}


def newest_checkpoint(state: Path) -> dict | None:
    """state.json of the newest checkpoint with its `complete` marker (the one the trainer resumes from)."""
    done = []
    for path in (Path(state) / "checkpoints").glob("ckpt-*"):
        m = re.fullmatch(r"ckpt-(\d{8,})", path.name)
        if m and (path / "complete").is_file():
            done.append((int(m.group(1)), path))
    return json.loads((max(done)[1] / "state.json").read_text()) if done else None


def expected_weight_version(state: Path) -> str:
    """The weight_version a (re)started daemon must serve: its newest complete checkpoint's version when that
    version's directory is still published, else the base model's "0" (clawd/weights.py restored_weights)."""
    ckpt = newest_checkpoint(state)
    if ckpt is None or ckpt["version"] <= 0:
        return "0"
    published = Path(state) / "weights" / f"v{ckpt['version']:06d}" / "config.json"
    return str(ckpt["version"]) if published.is_file() else "0"


def _state(pid: int) -> str | None:
    """The process state letter, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def alive(pid: int) -> bool:
    """Running (a zombie has exited: it only waits for a parent to reap it)."""
    return _state(pid) not in (None, "Z")


def tagged_processes(name: str, value: str) -> dict[int, str]:
    """Live processes whose environment holds name=value, with their command lines.

    A test sets the variable in its own os.environ before starting the daemon; the daemon's children inherit
    it (the engine's env is os.environ plus a little, the trainer is spawned with the daemon's environ), so
    every process of one daemon's tree carries it, however it was started. /proc/PID/environ is the
    environment at exec, so the test process itself never matches."""
    needle = f"{name}={value}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if alive(int(entry)):
            found[int(entry)] = cmd
    return found


def port_free(port: int) -> bool:
    """Nothing listens on or holds 127.0.0.1:port (a TIME_WAIT left by closed connections does not count)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        sock.close()


# free_port() numbers come from below the kernel's ephemeral range, which every bind to port 0 draws
# from, so no daemon, engine or client socket of another test can be handed one between our pick and its
# use; each pytest-xdist worker (or other process, by pid) picks from its own block, so two workers never
# pick the same number.
PORT_BASE, PORT_BLOCK = 10_000, 200
_picked = itertools.count()


def _port_block() -> range:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    blocks = (low - PORT_BASE) // PORT_BLOCK
    if blocks < 2:
        return range(0)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = blocks // 2  # the lower half for xdist workers (gw0, gw1, ...), the upper half by pid
    slot = int(worker[2:]) % workers if worker.startswith("gw") else workers + os.getpid() % (blocks - workers)
    return range(PORT_BASE + slot * PORT_BLOCK, PORT_BASE + (slot + 1) * PORT_BLOCK)


def free_port() -> int:
    """A port on 127.0.0.1 that nothing holds now and that no bind to port 0 will take later (on a machine
    whose ephemeral range leaves no room below it, one the kernel gives, as before)."""
    block = _port_block()
    if not block:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    for _ in range(len(block)):
        port = block[next(_picked) % len(block)]
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {block}")


def wait_until(predicate, timeout: float, interval: float = 0.05):
    """predicate()'s first true value, polled until timeout; None when it never came."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


# ---- publishes under load (tests/test_zero_downtime.py and bench/swap.py) ------------------------

def publishing_user(n: int, url: str, stop: threading.Event, out: list[dict], max_tokens: int | None = None) -> None:
    """One closed-loop user: odd conversations are a non-streamed turn thanked in a streamed one (a +1
    sample, so a training step and a publish), even ones a single streamed turn; every conversation ends
    with `X-Session-Done`. Each request leaves a record: start, end, first streamed chunk, ok or error."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    limit = {} if max_tokens is None else {"max_tokens": max_tokens}
    i = 0
    while not stop.is_set():
        i += 1
        messages = [{"role": "user", "content": f"User {n}, question {i}."}]
        for streamed in ((False, True) if i % 2 else (True,)):
            rec = {"user": n, "stream": streamed, "start": time.time(), "ok": True}
            try:
                if streamed:
                    chunks = client.chat.completions.create(model="m", messages=messages, stream=True,
                                                            extra_headers={"X-Session-Done": "1"}, **limit)
                    finished = False
                    for chunk in chunks:
                        rec.setdefault("first", time.time())
                        finished |= bool(chunk.choices and chunk.choices[0].finish_reason)
                    if not finished:
                        raise RuntimeError("the stream ended without a finish_reason")
                else:
                    reply = client.chat.completions.create(model="m", messages=messages, **limit)
                    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                                 {"role": "user", "content": THANKS}]
            except Exception as exc:  # any failure at all is what the callers count
                rec.update(ok=False, error=repr(exc))
            rec["end"] = time.time()
            rec["wait"] = rec.get("first", rec["end"]) - rec["start"]
            out.append(rec)  # list.append is atomic under the GIL
            if not rec["ok"]:
                break


def load_until_published(daemon, users: int, publishes: int, timeout: float,
                         max_tokens: int | None = None) -> tuple[list[dict], dict]:
    """`users` publishing users talk to `daemon` until its learner has made `publishes` publishes (or
    `timeout` seconds pass); then they stop. Returns every request's record and the learner's counters
    after the last request ended. The caller stops the daemon."""
    requests: list[dict] = []
    stop = threading.Event()
    threads = [threading.Thread(target=publishing_user, args=(n, daemon.url, stop, requests, max_tokens),
                                daemon=True) for n in range(users)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and daemon.get("/debug/process")[1]["learner"]["publishes"] < publishes:
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    return requests, daemon.get("/debug/process")[1]["learner"]


# --- publish windows from the daemon's log -----------------------------------------------------

PUBLISHED = re.compile(r"clawd.learner: published v(\d+) in ([0-9.]+)s, intake held ([0-9.]+)s")


def log_time(line: str) -> float:
    """A daemon or engine log line's time (logging's asctime: local time, ms) as a Unix time."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def publish_windows(lines: list[str]) -> list[dict]:
    """Each publish from the learner's line (its timestamp is the publish's end), with the hold the
    CPU engine logged inside it (`generation paused` to `generation continued`). The engine's lines
    reach the daemon's stderr by another path, so they are matched by time, not by order."""
    pubs, holds, paused = [], [], None
    for line in lines:
        if "clawd.engine.cpu: generation paused" in line:
            paused = log_time(line)
        elif "clawd.engine.cpu: generation continued" in line and paused is not None:
            holds.append((paused, log_time(line)))
            paused = None
        elif m := PUBLISHED.search(line):
            end, took = log_time(line), float(m.group(2))
            pubs.append({"version": int(m.group(1)), "publish_s": took, "intake_held_s": float(m.group(3)),
                         "start": end - took, "end": end})
    previous = float("-inf")
    for p in pubs:
        # The last hold to end by the publish's line, and begun after the previous publish's line: the line
        # comes after the version is promoted (a synced write), so under load it trails the publish's end
        # (by 236-329 ms in one run) and end - publish_s is no bound on when the hold began; the learner
        # publishes one version at a time, so the previous line precedes this publish. asctime is to the ms.
        a, b = next(((a, b) for a, b in reversed(holds) if b <= p["end"] + 0.001), (None, None))
        if a is None or a <= previous:
            a = b = None
        p.update(hold_start=a, hold_end=b)
        previous = p["end"]
    return pubs
