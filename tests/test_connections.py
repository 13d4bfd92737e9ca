"""Stalled and hostile clients: they hold connections, never request slots, and not for long; the log stays
quiet. The chat API (`make_app`) runs in this loop behind `TrackedSite`, wired as the daemon wires it, in
front of a fake chat service; the last tests run the whole daemon in-process. Clients are raw sockets, so
they can stop anywhere in a request."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import struct
import subprocess
import sys
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from tokenizers import Tokenizer

from clawd.config.loading import config_from_dict
from clawd.daemon import Shutdown, run
from clawd.serving import connections as conns_module
from clawd.serving.api import CONNECTIONS, ADMISSION, make_app
from clawd.serving.connections import OTHER_FILES, QuietLog, ServerLog, TrackedSite

from .fake_sglang import FakeSGLang
from .harness import ROOT

CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
SLACK = 5.0  # how much later than a deadline a loaded test machine may see its effect


class FakeChat:
    """The chat service's face to the API: a fixed reply, or (stream) a reply that waits for `release`."""
    model_name, context_length = "m", 2048

    def __init__(self):
        self.release = asyncio.Event()
        self.cancelled = 0
        self.big = 0  # whole replies larger than any socket buffer, handed to aiohttp to write

    async def complete(self, req, principal, request, release=lambda: None):
        if not req.stream and req.messages[0]["content"] == "big":
            self.big += 1
            return web.json_response({"object": "chat.completion", "pad": "x" * (16 << 20)})
        if not req.stream:
            return web.json_response({"object": "chat.completion"})
        resp = web.StreamResponse()
        await resp.prepare(request)
        if req.messages[0]["content"] == "flood":  # until the client stops reading
            try:
                while True:
                    await resp.write(b"data: " + b"x" * 65536 + b"\n\n")
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        await resp.write(b"data: {}\n\n")
        await self.release.wait()
        await resp.write_eof(b"data: [DONE]\n\n")
        return resp


@asynccontextmanager
async def serving(**server):
    """The API on a TrackedSite with the daemon's runner options; yields (port, connections, chat)."""
    cfg = config_from_dict({"server": {"port": 0, **server}})
    chat = FakeChat()
    app = make_app(cfg, chat)
    connections = app[CONNECTIONS]
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1, **connections.runner_options())
    await runner.setup()
    site = TrackedSite(runner, connections, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1], connections, chat
    finally:
        chat.release.set()
        await runner.cleanup()


async def connect(port: int):
    return await asyncio.open_connection("127.0.0.1", port)


def chat_request(body: bytes = BODY, length: int | None = None, close: bool = False) -> bytes:
    head = CHAT + b"Content-Length: %d\r\n" % (len(body) if length is None else length)
    return head + (b"Connection: close\r\n" if close else b"") + b"\r\n" + body


async def response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length."""
    status_line = await reader.readline()
    assert status_line, "the connection closed without a response"
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return int(status_line.split()[1]), headers, body


async def closed(reader: asyncio.StreamReader, within: float) -> bool:
    """True once the server closes the connection (EOF or reset) within `within` seconds."""
    try:
        return await asyncio.wait_for(reader.read(), within) == b""
    except ConnectionResetError:
        return True


async def until(predicate, what: str, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


# ---- pure parts -------------------------------------------------------------------------------------

def test_quiet_log_says_one_line_per_kind_per_interval_with_the_count(caplog):
    caplog.set_level(logging.INFO, logger="quiet")
    now = [100.0]
    quiet = QuietLog(logging.getLogger("quiet"), interval=60, clock=lambda: now[0])
    quiet.note("hang-up", "a")           # the first of a spell: at once
    for t, detail in ((101, "b"), (130, "c"), (159.9, "d")):
        now[0] = t
        quiet.note("hang-up", detail)    # counted
    quiet.note("unparsed", "x")          # another kind has its own interval
    now[0] = 160.0
    quiet.note("hang-up", "e")           # the interval is over: the count since the last line
    assert [r.getMessage() for r in caplog.records] == [
        "a [1 hang-up since the last such line]", "x [1 unparsed since the last such line]",
        "e [4 hang-up since the last such line]"]


def test_open_file_limit_is_raised_and_the_cap_fits_under_the_hard_limit():
    # In a child whose limits this test sets (a process may lower its own hard limit), so the figures
    # are exact whatever this machine's limits are, and this process's stay as they were.
    code = ("import resource\n"
            "from clawd.serving.connections import raise_open_file_limit\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))\n"
            "print(raise_open_file_limit(4096 - OTHER), resource.getrlimit(resource.RLIMIT_NOFILE),\n"
            "      raise_open_file_limit(4096))\n").replace("OTHER", str(OTHER_FILES))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    # The cap that fits; the soft limit raised to the hard one; too low a hard limit lowers the cap.
    assert done.stdout.split() == [str(4096 - OTHER_FILES), "(4096,", "4096)", str(4096 - OTHER_FILES)]


def test_server_log_quiets_what_clients_cause_and_keeps_the_rest(caplog):
    caplog.set_level(logging.DEBUG)
    now = [0.0]
    server_log = ServerLog(QuietLog(logging.getLogger("quiet"), interval=60, clock=lambda: now[0]))
    for _ in range(3):  # aiohttp's calls for a request it cannot parse (web_protocol handle_error)
        server_log.exception("Error handling request from %s", "10.0.0.1",
                             exc_info=BadHttpMessage("Invalid header\n\n  b'x'\n   ^"))
    server_log.exception("Error handling request from %s", "10.0.0.1", exc_info=ConnectionResetError("gone"))
    try:
        raise ValueError("a bug")
    except ValueError as exc:
        server_log.exception("Error handling request from %s", "10.0.0.1", exc_info=exc)
    assert [(r.name, r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records] == [
        ("quiet", "INFO", "unparsable HTTP request: BadHttpMessage 'Invalid header' [1 unparsed since the last "
                          "such line]", False),
        ("aiohttp.server", "DEBUG", "client hung up: gone", False),
        ("aiohttp.server", "ERROR", "Error handling request from 10.0.0.1", True)]


# ---- aiohttp facts the tracker relies on ---------------------------------------------------------------

async def test_runner_options_reach_aiohttps_request_handler_and_the_site_is_the_runners():
    # web.Server.__call__ falls back to default options when RequestHandler rejects one: pin that ours land.
    cfg = config_from_dict({"server": {"keepalive_timeout": 7.5}})
    app = make_app(cfg, FakeChat())
    runner = web.AppRunner(app, **app[CONNECTIONS].runner_options())
    await runner.setup()
    try:
        handler = runner.server()
        assert handler.keepalive_timeout == 7.5 and isinstance(handler.logger, ServerLog)
        site = TrackedSite(runner, app[CONNECTIONS], "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]  # BaseSite's registration: the runner sees the listener
        _, writer = await connect(port)
        writer.close()
    finally:
        await runner.cleanup()
    with pytest.raises(OSError):  # cleanup stopped the listener
        await connect(port)


# ---- stalls -------------------------------------------------------------------------------------------

async def test_stalled_uploads_hold_no_slot_and_get_408_within_body_timeout():
    async with serving(body_timeout=1.5, header_timeout=10) as (port, connections, chat):
        stalled = []
        for _ in range(70):  # more than max_concurrent_requests (64): each sends headers and half a body
            reader, writer = await connect(port)
            writer.write(chat_request(BODY[:len(BODY) // 2], length=len(BODY)))
            stalled.append((reader, writer))
        await until(lambda: connections.phases()["body"] == 70, "70 requests waiting for their bodies")
        reader, writer = await connect(port)
        writer.write(chat_request(close=True))
        status, _, body = await response(reader)
        assert status == 200, body  # not 429: the stalled ones hold no slot
        writer.close()
        for reader, writer in stalled:
            status, headers, body = await asyncio.wait_for(response(reader), 1.5 + SLACK)
            assert status == 408 and headers["connection"] == "close"
            assert json.loads(body)["error"]["type"] == "timeout_error"
            assert await closed(reader, SLACK)
            writer.close()


async def test_a_body_still_arriving_when_the_drain_begins_is_turned_away_at_once():
    """aiohttp stops reading every connection once its shutdown starts, so a body still arriving when the drain
    begins can never arrive: its request is answered 503 shutting_down with Retry-After at once, not 408 after
    body_timeout, and it does not hold the drain. (The daemon's drain: close the gate, then clean the runner up.)"""
    cfg = config_from_dict({"server": {"port": 0, "body_timeout": 30}})
    app = make_app(cfg, FakeChat())
    connections = app[CONNECTIONS]
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=30, **connections.runner_options())
    await runner.setup()
    await TrackedSite(runner, connections, "127.0.0.1", 0).start()
    reader, writer = await connect(runner.addresses[0][1])
    half = len(BODY) // 2
    writer.write(chat_request(BODY[:half], length=len(BODY)))
    await until(lambda: connections.phases()["body"] == 1, "the request waiting for its body")
    loop = asyncio.get_running_loop()
    began = loop.time()
    app[ADMISSION].close()
    drain = asyncio.create_task(runner.cleanup())
    await asyncio.sleep(0.1)
    writer.write(BODY[half:])  # too late: nothing more is read
    status, headers, body = await asyncio.wait_for(response(reader), SLACK)
    assert status == 503 and headers["retry-after"] == "5" and headers["connection"] == "close", (status, body)
    assert json.loads(body)["error"]["code"] == "shutting_down"
    await asyncio.wait_for(drain, SLACK)
    assert loop.time() - began < SLACK
    writer.close()


async def test_half_a_header_line_is_closed_after_header_timeout():
    async with serving(header_timeout=0.5, keepalive_timeout=30) as (port, connections, chat):
        reader, writer = await connect(port)
        writer.write(b"GET /hea")
        await until(lambda: connections.phases()["headers"] == 1, "the first byte")
        assert await closed(reader, 0.5 + SLACK)
        writer.close()
        # On a kept-alive connection the deadline runs again from the next request's first byte.
        reader, writer = await connect(port)
        writer.write(chat_request())
        assert (await response(reader))[0] == 200
        await until(lambda: connections.phases() == {"idle": 1, "headers": 0, "body": 0, "active": 0},
                    "the connection idle after its request")
        writer.write(b"GET /health HTTP/1.1\r\nHo")
        assert await closed(reader, 0.5 + SLACK)
        writer.close()
        assert connections.closed == {"header_timeout": 2}


async def test_idle_keepalive_connection_is_closed_after_keepalive_timeout():
    async with serving(keepalive_timeout=0.5, header_timeout=30) as (port, connections, chat):
        reader, writer = await connect(port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert (await response(reader))[0] == 200
        assert await closed(reader, 0.5 + SLACK)
        writer.close()
        assert connections.closed == {}  # aiohttp's keep-alive timer closed it, not a deadline of clawd's


async def test_at_the_cap_a_new_connection_evicts_the_longest_waiting_one():
    async with serving(max_connections=3, peer_connection_share=1.0) as (port, connections, chat):
        streaming_r, streaming_w = await connect(port)  # the oldest connection, but an active reply
        streaming_w.write(chat_request(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                   "stream": True}).encode()))
        assert await streaming_r.readuntil(b"data: {}\n\n")
        half_r, half_w = await connect(port)
        half_w.write(b"GET /heal")  # waiting for its headers the longest
        await until(lambda: connections.phases()["headers"] == 1, "the half header")
        idle_r, idle_w = await connect(port)
        await until(lambda: connections.open == 3, "three connections")

        new_r, new_w = await connect(port)  # the 4th: the half-header connection makes room
        assert await closed(half_r, SLACK)
        new_w.write(chat_request())
        assert (await response(new_r))[0] == 200
        assert connections.closed == {"evicted": 1}

        chat.release.set()  # the active reply was never touched
        assert (await streaming_r.readuntil(b"data: [DONE]\n\n")).endswith(b"[DONE]\n\n")
        for w in (streaming_w, half_w, idle_w, new_w):
            w.close()


async def test_when_every_connection_is_active_a_new_one_is_refused():
    async with serving(max_connections=1, peer_connection_share=1.0) as (port, connections, chat):
        reader, writer = await connect(port)
        writer.write(chat_request(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                              "stream": True}).encode()))
        await reader.readuntil(b"data: {}\n\n")
        refused_r, refused_w = await connect(port)
        assert await closed(refused_r, SLACK)
        assert connections.closed == {"refused": 1}
        chat.release.set()
        await reader.readuntil(b"data: [DONE]\n\n")
        writer.close()
        refused_w.close()


async def test_one_peer_holds_at_most_its_share_of_the_cap_and_evicts_its_own_connections_first():
    async with serving(max_connections=8, peer_connection_share=0.5) as (port, connections, chat):
        other_r, other_w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        await until(lambda: connections.open == 1, "the other peer's connection")
        ours = []
        for i in range(4):  # 127.0.0.1's share: 4 of the 8
            ours.append(await connect(port))
            await until(lambda: connections.open == 2 + i, "our connection")
        new_r, new_w = await connect(port)  # a fifth: our own oldest makes room, though the cap is not reached
        assert await closed(ours[0][0], SLACK)
        new_w.write(chat_request())
        assert (await response(new_r))[0] == 200
        assert connections.closed == {"peer_share": 1} and connections.open == 5
        other_w.write(chat_request())  # the other peer's idle connection was never touched
        assert (await response(other_r))[0] == 200
        for _, w in (*ours, (other_r, other_w), (new_r, new_w)):
            w.close()


async def test_a_peer_whose_share_is_all_active_is_refused_a_new_connection():
    async with serving(max_connections=4, peer_connection_share=0.5) as (port, connections, chat):
        streams = []
        for _ in range(2):
            r, w = await connect(port)
            w.write(chat_request(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                             "stream": True}).encode()))
            await r.readuntil(b"data: {}\n\n")
            streams.append((r, w))
        refused_r, refused_w = await connect(port)
        assert await closed(refused_r, SLACK)
        assert connections.closed == {"peer_share": 1}
        other_r, other_w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        other_w.write(chat_request())
        assert (await response(other_r))[0] == 200  # another peer still gets in
        chat.release.set()
        for r, w in streams:
            await r.readuntil(b"data: [DONE]\n\n")
            w.close()
        refused_w.close()
        other_w.close()


async def test_a_reply_the_client_stops_reading_is_cut_after_write_timeout():
    async with serving() as (port, connections, chat):
        connections.write_timeout = 0.5
        reader, writer = await connect(port)
        writer.write(chat_request(json.dumps({"messages": [{"role": "user", "content": "flood"}],
                                              "stream": True}).encode()))
        await reader.readuntil(b"data: ")  # then reads no more
        await until(lambda: chat.cancelled == 1, "the handler cancelled", timeout=SLACK + 30)
        assert connections.closed == {"write_timeout": 1} and connections.open == 0
        writer.close()


async def test_a_whole_reply_the_client_does_not_read_holds_no_slot():
    # aiohttp writes a returned Response after the handler, and so the request slot's release, is done.
    async with serving(max_concurrent_requests=1, write_timeout=2.0) as (port, connections, chat):
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connecting: it fixes the window
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, chat_request(json.dumps({"messages": [{"role": "user", "content": "big"}]})
                                                   .encode()))
        await until(lambda: chat.big == 1, "the big reply handed over")
        reader, writer = await connect(port)
        writer.write(chat_request(close=True))
        assert (await response(reader))[0] == 200  # the only slot is free while the big reply is written
        assert connections.closed == {}
        writer.close()
        await until(lambda: connections.closed == {"write_timeout": 1}, "the stalled reply cut", timeout=2.0 + SLACK)
        sock.close()


# ---- the whole daemon: quiet logs ---------------------------------------------------------------------

async def _metric(port: int, name: str) -> float:
    reader, writer = await connect(port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    _, _, body = await response(reader)
    writer.close()
    values = [float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines() if line.startswith(name + " ")]
    return values[0] if values else 0.0


@asynccontextmanager
async def daemon(tiny_model, tmp_path, caplog, engine_url: str, **tables):
    """The whole daemon in this loop, in front of `engine_url`; yields its port once it is ready."""
    caplog.set_level(logging.DEBUG)
    config = {"server": {"port": 0}, "state": {"dir": str(tmp_path / "state")}, "model": {"path": str(tiny_model)},
              "engine": {"launch": "none", "url": engine_url, "health_interval": 0.2},
              "scoring": {"mode": "rl"}, "judge": {"backend": "rules"}, "learner": {"enabled": False}}
    cfg = config_from_dict({name: {**config.get(name, {}), **table} for name, table in {**config, **tables}.items()})
    shutdown = Shutdown()
    running = asyncio.create_task(run(cfg, shutdown))
    try:
        await until(lambda: any(re.match(r"listening on http://", r.getMessage()) for r in caplog.records)
                    or running.done(), "the daemon to listen", timeout=60)
        assert not running.done(), running
        port = int(next(m.group(1) for r in caplog.records
                        if (m := re.match(r"listening on http://\S+:(\d+)", r.getMessage()))))
        while True:  # the engine supervisor finds the fake ready within a health interval or two
            reader, writer = await connect(port)
            writer.write(b"GET /ready HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            ready = (await response(reader))[0] == 200
            writer.close()
            if ready:
                break
            await asyncio.sleep(0.1)
        yield port
    finally:
        shutdown.request()
        assert await asyncio.wait_for(running, 60) == 0


async def test_hang_ups_and_garbage_are_counted_and_logged_quietly(tiny_model, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(conns_module, "QUIET", QuietLog(logging.getLogger("clawd.http")))
    async with FakeSGLang(tokens=400, token_delay=0.01) as fake, daemon(tiny_model, tmp_path, caplog, fake.url) as port:
        start = len(caplog.records)

        # A client that hangs up mid-stream.
        reader, writer = await connect(port)
        writer.write(chat_request(json.dumps({"messages": [{"role": "user", "content": "long"}],
                                              "stream": True}).encode()))
        await reader.readuntil(b"data: ")
        writer.transport.abort()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while await _metric(port, "clawd_aborted_requests_total") < 1:
            assert loop.time() < deadline, "the hang-up was never counted"
            await asyncio.sleep(0.05)
        await fake.wait_for_abort(fake.requests[-1]["rid"], timeout=10)

        # 1000 request lines aiohttp cannot parse: a scanner's probes, TLS on the HTTP port, bad headers.
        probes = [b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", b"HELLO\x00 WORLD\r\n\r\n",
                  b"GET / HTTP/1.1\r\nBad\x01Header: x\r\n\r\n", b"GET /\x7f HTTP/9.9\r\n\r\n"]

        async def probe(i: int) -> None:
            r, w = await connect(port)
            w.write(probes[i % len(probes)])
            assert (await response(r))[0] == 400
            w.close()

        for batch in range(0, 1000, 50):
            await asyncio.gather(*(probe(i) for i in range(batch, batch + 50)))
        unparsed = await _metric(port, 'clawd_http_requests_total{route="unparsed",status="400"}')

    records = caplog.records[start:]
    assert [r for r in records if r.exc_info] == []  # no traceback, whatever the level
    noisy = [r.getMessage() for r in records
             if r.levelno >= logging.INFO and r.name in ("clawd.http", "aiohttp.server")]
    assert [m for m in noisy if "hang-up" in m] == [
        f"client hung up mid-reply (rid={fake.requests[-1]['rid']} stream=True) [1 hang-up since the last such line]"]
    assert len([m for m in noisy if "unparsed" in m]) == 1, noisy  # the first; the rest a minute later
    assert unparsed == 1000


# ---- the whole daemon: slow readers -------------------------------------------------------------------

async def _metric_reaches(port: int, name: str, value: float, within: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while (now := await _metric(port, name)) < value:
        assert loop.time() < deadline, f"{name} is {now}, not {value}, after {within:g}s"
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_clients_that_stop_reading_hold_connections_not_request_slots(tiny_model, tmp_path, caplog):
    # Replies far larger than the socket buffers (a Linux loopback takes about 2 MB of a reply nobody reads):
    # 12,000 of the model's longest token with log-probs, one engine event each, make about 5 MB of events (the
    # tokens of one engine read share a reply event: the engine paces them so that most reads hold one).
    tokens, write_timeout = 12000, 6.0
    cut = 'clawd_connections_closed_total{reason="write_timeout"}'
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    longest = max(range(tok.get_vocab_size()), key=lambda i: len(tok.decode([i])))
    script = [longest] * (tokens - 1) + [eos]
    async with FakeSGLang(lambda ids, sp: script, eos_id=eos, incremental_streaming_output=True,
                          token_delay=0.0001) as fake, \
            daemon(tiny_model, tmp_path, caplog, fake.url, model={"context_length": 16384},
                   engine={"incremental_streaming_output": True},
                   server={"max_concurrent_requests": 2, "write_timeout": write_timeout}) as port:
        loop = asyncio.get_running_loop()
        body = json.dumps({"messages": [{"role": "user", "content": "long"}], "stream": True, "logprobs": True,
                           "max_tokens": tokens}).encode()
        stalled = []
        try:
            for _ in range(2):  # as many as there are request slots: each takes one, and never reads its reply
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connecting: it fixes the window
                sock.setblocking(False)
                stalled.append(sock)
                await loop.sock_connect(sock, ("127.0.0.1", port))
                await loop.sock_sendall(sock, chat_request(body))
            await until(lambda: len(fake.requests) == 2 and fake.in_flight == 0, "both replies generated", timeout=60)
            while True:  # a 429 only until the handlers have read the engine's last chunks
                reader, writer = await connect(port)
                writer.write(chat_request(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 8}).encode(), close=True))
                status, _, answer = await response(reader)
                writer.close()
                assert await _metric(port, cut) == 0, "the stalled readers were cut before a slot was free"
                if status != 429:
                    break
                await asyncio.sleep(0.05)
            assert status == 200, answer
            assert [r for r in caplog.records if r.name == "clawd.chat" and "stream=True" in r.getMessage()] == [], \
                "a stalled reply was written whole: make the replies longer than the socket buffers"
            # Their replies stalled on the way: each connection is cut once its writes stay paused for write_timeout.
            await _metric_reaches(port, cut, 2, write_timeout + SLACK)
            await _metric_reaches(port, "clawd_aborted_requests_total", 2, SLACK)  # the replies never arrived whole
            assert [r for r in caplog.records if r.exc_info] == []  # no traceback: cut, cancelled, quietly
        finally:
            for sock in stalled:
                sock.close()


# ---- request slots per API key -------------------------------------------------------------------

def test_over_share_keeps_the_last_slots_for_other_keys():
    from clawd.serving.api import AdmissionGate, over_share

    gate = AdmissionGate()
    gate.in_flight, gate.held = 3, {"a": 3}
    #               key   slots share keys  -> must wait
    assert over_share(gate, "a", 4, 0.25, 2) is True     # holds 3 >= reserve 1, 1 free <= 1
    assert over_share(gate, "b", 4, 0.25, 2) is False    # holds none: takes the kept slot
    assert over_share(gate, "a", 5, 0.25, 2) is False    # 2 free > reserve 1: alone it gets the rest
    assert over_share(gate, "a", 4, 0.25, 1) is False    # one key: nobody to keep slots for
    assert over_share(gate, "a", 4, 1.0, 2) is False     # share 1: off
    assert over_share(gate, None, 4, 0.25, 2) is False   # no keys: one anonymous crowd
    gate.in_flight, gate.held = 10, {"a": 10}
    assert over_share(gate, "a", 64, 0.25, 3) is False and over_share(gate, "a", 13, 0.25, 3) is True  # reserve 3


async def test_one_busy_key_leaves_the_kept_slots_to_another_key():
    keys = {"keys": [{"name": "a", "key": "sk-a-1234567"}, {"name": "b", "key": "sk-b-1234567"}]}
    cfg = config_from_dict({"server": {"port": 0, "max_concurrent_requests": 4, "principal_request_share": 0.25},
                            "auth": keys})
    chat = FakeChat()
    app = make_app(cfg, chat)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1, **app[CONNECTIONS].runner_options())
    await runner.setup()
    await TrackedSite(runner, app[CONNECTIONS], "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    stream = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode()

    async def ask(key: str, body: bytes = stream):
        r, w = await connect(port)
        head = CHAT + f"Authorization: Bearer sk-{key}-1234567\r\n".encode()
        w.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return r, w

    try:
        held = []
        for _ in range(3):  # key a takes 3 of 4: the last is kept for another key
            r, w = await ask("a")
            await r.readuntil(b"data: {}\n\n")
            held.append((r, w))
        r, w = await ask("a")
        status, _, body = await response(r)
        assert status == 429 and json.loads(body)["error"]["code"] == "key_share_exceeded"
        w.close()
        r, w = await ask("b")  # key b gets the slot kept for it
        await r.readuntil(b"data: {}\n\n")
        held.append((r, w))
        assert app[ADMISSION].held == {"a": 3, "b": 1}
    finally:
        chat.release.set()
        for r, w in held:
            await r.readuntil(b"data: [DONE]\n\n")
            w.close()
        await runner.cleanup()
    assert app[ADMISSION].held == {} and app[ADMISSION].in_flight == 0


async def test_a_client_that_leaves_mid_body_leaves_no_traceback(caplog):
    """The body is read in a task of its own (it races the drain): a client that reset its connection
    mid-body failed that task as the handler was cancelled, and asyncio logged "Task exception was never
    retrieved" with a traceback, once per such client (bench/abuse.py counted 40 in its stalled phase)."""
    import gc

    async with serving(body_timeout=30) as (port, connections, chat):
        for _ in range(5):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(chat_request(length=len(BODY) + 100))  # 100 bytes short: the body is still arriving
            await until(lambda: connections.phases()["body"] == 1, "the handler waiting for the body")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # a reset
            await until(lambda: connections.open == 0, "the connection gone")
        await asyncio.sleep(0.1)
        gc.collect()
        await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text and "Traceback" not in caplog.text
