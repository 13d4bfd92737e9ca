"""Signals (docs/ARCHITECTURE.md §8): SIGTERM drains and exits 0 with nothing lost; a second SIGTERM exits promptly."""
from __future__ import annotations

import re
import signal
import socket
import threading
import time
import uuid

import openai
import pytest

from clawd.tools.tomlfile import merged

from .harness import Daemon
from .load import (BROKEN, NO_RESPONSE, OK, REFUSED, STATUS, ChatLoad, alive, expected_weight_version,
                   newest_checkpoint, read_journal, tagged_processes, thanked_conversation, wait_until,
                   witnessed_samples)

LIFE = "CLAWD_TEST_LIFE"  # set in the daemon's environment: every process of its tree carries it
TIDY = re.compile(r"truncat|torn|corrupt|JournalError|Traceback|stopping without a final checkpoint"
                  r"|trainer \d+ exited with code|engine exited with")
# The CPU engine's two end-of-text ids in the tiny model; banning them makes a reply run to max_tokens.
NO_EOS = {"4087": -100, "4089": -100}
# A request started this long before SIGTERM has surely connected and been accepted by then (the client's own
# set-up takes milliseconds); one started later may connect after the listener closed.
SETTLE = 0.5


class LongStream(threading.Thread):
    """One streaming request that runs to max_tokens (end of text banned); `started` once the first chunk is in."""

    def __init__(self, base_url: str, max_tokens: int):
        super().__init__(daemon=True, name="long-stream")
        self.base_url, self.max_tokens = base_url, max_tokens
        self.started = threading.Event()
        self.finish_reason = self.error = self.completion_id = None
        self.chunks = 0

    def run(self) -> None:
        client = openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=300)
        try:
            stream = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Tell me a long story."}], stream=True,
                max_tokens=self.max_tokens, logit_bias=NO_EOS, extra_headers={"X-Session-Done": "1"})
            for chunk in stream:
                self.completion_id = chunk.id
                self.chunks += 1
                self.started.set()
                for choice in chunk.choices:
                    self.finish_reason = choice.finish_reason or self.finish_reason
        except Exception as exc:  # reported by the test
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.started.set()
            client.close()


def _learning(tiny_model, **sections) -> dict:
    base = {"model": {"path": str(tiny_model), "max_tokens_cap": 2000},
            "engine": {"launch": "local"},
            "learner": {"enabled": True, "rollout_batch_size": 2, "min_batch_size": 1},
            # every other publish checkpoints: the checkpoint at shutdown is then the learner's own doing
            "train": {"checkpoint_every": 2, "optimizer": {"lr": 1e-4}}}
    return merged(base, sections)


@pytest.mark.slow
def test_sigterm_under_load_completes_in_flight_and_exits_clean(tiny_model, tmp_path, monkeypatch):
    """SIGTERM while three users chat (their thank-you turns streamed), a long stream is mid-way and the learner
    trains. Every request started before the signal (SETTLE earlier, so that it has surely connected) completes
    in full, and so does every request the daemon answered at all: the completions it logged are exactly those
    its clients received whole. Requests started later are answered in full, refused at connect (the listener
    is closed) or answered 503 shutting_down with Retry-After, and are counted apart; none breaks mid-answer or
    is cut before its status line. The daemon exits 0 within drain_timeout
    plus a margin; its whole process tree (engine, trainer) is gone; every sample scoring wrote is in the
    journal, every trained one is checkpointed and acked (checkpoint_every = 2, so the last checkpoint is the
    learner's stop), the journal ends on a whole record, and a restart replays exactly the unacked samples,
    with no truncation, on the newest published version."""
    drain = 30.0
    tag = uuid.uuid4().hex
    monkeypatch.setenv(LIFE, tag)
    daemon = Daemon(tmp_path, _learning(tiny_model, server={"drain_timeout": drain}))
    base = daemon.url + "/v1"
    load = ChatLoad(base, users=3, max_tokens=6, tag="sigterm")
    long = LongStream(base, max_tokens=300)
    try:
        daemon.wait_for(r"trainer \d+ ready", 120)
        load.start()
        assert wait_until(lambda: daemon.get("/debug/process")[1]["learner"]["steps"] >= 3, 120), \
            daemon.get("/debug/process")[1]
        long.start()
        assert long.started.wait(60) and long.error is None, long.error
        tree = tagged_processes(LIFE, tag)
        trainer = int(re.search(r"trainer (\d+) ready", daemon.wait_for(r"trainer \d+ ready")).group(1))
        engine = daemon.get("/debug/process")[1]["engines"]["policy"]["pid"]
        assert {daemon.proc.pid, trainer, engine} <= set(tree), tree

        sigterm = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        code = daemon.proc.wait(drain + 15)
        took = time.monotonic() - sigterm
        load.stop()
        long.join(30)
    finally:
        load.stop()
        _reap(daemon)
    daemon._reader.join(5)
    outcomes = load.snapshot()
    kinds = {k: sum(o.kind == k for o in outcomes) for k in (OK, REFUSED, STATUS, NO_RESPONSE, BROKEN)}
    print(f"\nexit {code} {took:.1f}s after SIGTERM; outcomes {kinds}; long stream {long.chunks} chunks, "
          f"{long.finish_reason}")
    assert code == 0 and took < drain + 10

    # In flight at the signal: completed in full.
    assert long.error is None and long.finish_reason == "length", (long.error, long.finish_reason)
    before = [o for o in outcomes if o.started < sigterm - SETTLE]
    assert before and all(o.kind == OK for o in before), [o for o in before if o.kind != OK]
    # Started about then or after: answered in full, refused at connect (the listener is closed), or 503
    # shutting_down with Retry-After (accepted, then turned away). Nothing else.
    after = [o for o in outcomes if o.started >= sigterm - SETTLE]
    turned_away = [o for o in after if o.kind == STATUS]
    assert all(o.status == 503 and o.code == "shutting_down" and o.retry_after for o in turned_away), turned_away
    assert all(o.kind in (OK, REFUSED, STATUS) for o in after), [o for o in after if o.kind in (NO_RESPONSE, BROKEN)]
    # What the daemon answered, its clients received whole (and nothing else).
    logged = set(re.findall(r"chat id=(\S+) ", "".join(daemon.lines)))
    received = {o.completion_id for o in outcomes if o.kind == OK} | {long.completion_id}
    assert logged == received, (logged - received, received - logged)

    # The process tree is gone.
    assert wait_until(lambda: not tagged_processes(LIFE, tag), 5), tagged_processes(LIFE, tag)
    assert not alive(trainer) and not alive(engine)
    assert any(line.rstrip().endswith("clawd: stopped") for line in daemon.lines), daemon.lines[-3:]
    assert not [line for line in daemon.lines if TIDY.search(line)]

    # The journal: every written sample, every trained one acked after a checkpoint, a clean end.
    scan = read_journal(daemon.state / "journal")
    witnessed = witnessed_samples(daemon.state)
    assert scan.bad_tail_bytes == 0 and scan.problem is None
    assert set(scan.appended) == witnessed and len(scan.appended) == len(witnessed)
    published = [int(v) for v in re.findall(r"published v(\d+) ", "".join(daemon.lines))]
    ckpt = newest_checkpoint(daemon.state)
    assert ckpt["step"] == len(published) and ckpt["version"] == published[-1]  # the last step, checkpointed
    # full batches of 2, every trained sample acked, and so is every stale one dropped on the way
    stale = sum(int(n) for n in re.findall(r"dropped (\d+) stale sample", "".join(daemon.lines)))
    assert len(scan.acked) == 2 * ckpt["step"] + stale
    assert expected_weight_version(daemon.state) == str(published[-1])

    monkeypatch.setenv(LIFE, tag + "-restart")
    again = Daemon(tmp_path, _learning(tiny_model, learner={"enabled": False}), wait_ready=False)
    try:
        replay = again.wait_for(r"journal: \d+ sample\(s\) waiting from before", 10)
        launch = again.wait_for(r"starting policy engine: ", 10)
    finally:
        assert again.stop() == 0
    assert int(re.search(r"journal: (\d+) sample", replay).group(1)) == len(scan.live)
    assert f"--weight-version {published[-1]} " in launch
    assert not [line for line in again.lines if TIDY.search(line)]


class SecondSignalCrash(AssertionError):
    """The daemon exited promptly once its drain was cut, but not cleanly (an exit code other than 0, a traceback)."""


def _reap(daemon: Daemon) -> None:
    """A daemon the test left running (it failed) is killed, so no process outlives the test."""
    if daemon.proc.poll() is None:
        daemon.proc.kill()
        daemon.proc.wait()


def _assert_exited_cleanly(daemon: Daemon, code: int) -> None:
    crash = [line for line in daemon.lines if "Traceback" in line or "Unhandled" in line]
    if code != 0 or crash:
        raise SecondSignalCrash(f"exit code {code}; {''.join(crash[-3:])}")


@pytest.mark.slow
def test_second_sigterm_exits_promptly(tiny_model, tmp_path, monkeypatch):
    """With a stream in flight that would take about a minute (drain_timeout 120 s), a second SIGTERM during
    the drain makes the daemon exit within 5 s, and cleanly: the stream ends with an error event, exit code 0
    and no traceback (daemon.run returns 0
    on that path). Its children are gone, the journal ends on a whole record, and a restart replays every
    sample written (none was trained: the learner is off) with no truncation."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv(LIFE, tag)
    sections = {"model": {"path": str(tiny_model), "max_tokens_cap": 2000}, "engine": {"launch": "local"},
                "server": {"drain_timeout": 120.0}}
    daemon = Daemon(tmp_path, sections)
    long = LongStream(daemon.url + "/v1", max_tokens=1900)
    try:
        for i in range(2):
            thanked_conversation(daemon.url + "/v1", f"Question {i}?")
        assert wait_until(lambda: daemon.get("/debug/process")[1]["queue"]["journal_live"] == 2, 30)
        long.start()
        assert long.started.wait(60) and long.error is None, long.error
        daemon.proc.send_signal(signal.SIGTERM)
        daemon.wait_for(r"stopping: draining", 10)
        time.sleep(0.5)  # well into the drain, which the stream would hold for about a minute
        assert daemon.proc.poll() is None and long.is_alive()
        second = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        code = daemon.proc.wait(10)
        took = time.monotonic() - second
    finally:
        _reap(daemon)
        long.join(30)
    daemon._reader.join(5)
    print(f"\nexit {code} {took:.1f}s after the second SIGTERM; the stream: {long.error or long.finish_reason}")
    assert took < 5
    assert long.finish_reason != "length"  # cut, not finished
    # and cut cleanly: the stream's last event is an error the client can read, not a broken connection
    assert long.error is not None and "failed mid-stream" in long.error, long.error
    assert wait_until(lambda: not tagged_processes(LIFE, tag), 5), tagged_processes(LIFE, tag)

    scan = read_journal(daemon.state / "journal")
    assert scan.bad_tail_bytes == 0 and scan.problem is None
    assert len(scan.live) == 2 and set(scan.appended) == witnessed_samples(daemon.state)
    again = Daemon(tmp_path, sections, wait_ready=False)
    try:
        replay = again.wait_for(r"journal: \d+ sample\(s\) waiting from before", 10)
    finally:
        assert again.stop() == 0
    assert int(re.search(r"journal: (\d+) sample", replay).group(1)) == 2
    assert not [line for line in again.lines if TIDY.search(line)]

    _assert_exited_cleanly(daemon, code)


def _stalled_request(daemon: Daemon) -> socket.socket:
    """A client that sent its headers and part of its body, then stalls."""
    stalled = socket.create_connection(("127.0.0.1", int(daemon.url.rsplit(":", 1)[1])))
    body = b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}]}'
    stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % (len(body) + 100) + body)
    time.sleep(0.5)  # the handler is reading the body
    return stalled


@pytest.mark.slow
def test_a_request_still_sending_its_body_at_sigterm_is_turned_away_and_does_not_hold_the_drain(tiny_model, tmp_path):
    """Once the drain begins aiohttp reads no more of any connection, so a stalled upload can never finish: it
    is answered 503 shutting_down with Retry-After at once, and the daemon exits 0 promptly although its
    drain_timeout is 120 s, with no traceback."""
    drain = 120.0
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)}, "engine": {"launch": "local"},
                               "server": {"drain_timeout": drain}})
    stalled = _stalled_request(daemon)
    try:
        stalled.settimeout(10)
        sigterm = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        answer = b""
        while chunk := stalled.recv(65536):
            answer += chunk
        code = daemon.proc.wait(10)
        took = time.monotonic() - sigterm
    finally:
        stalled.close()
        _reap(daemon)
    daemon._reader.join(5)
    head, _, body = answer.partition(b"\r\n\r\n")
    print(f"\nexit {code} {took:.1f}s after SIGTERM; the stalled request: {head.splitlines()[:1]}")
    assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 5" in head, answer
    assert b'"code": "shutting_down"' in body or b'"code":"shutting_down"' in body, body
    assert took < 10
    _assert_exited_cleanly(daemon, code)

