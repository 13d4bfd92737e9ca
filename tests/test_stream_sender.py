"""A streamed reply's Sender (clawd.serving.stream) on a real aiohttp server and raw-socket clients: a client
that keeps up is written to by the handler itself, with no writer task; one that stops reading makes it hand
every later part to a writer, in order, and the handler's sends never wait on it."""
from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from clawd.serving.stream import Sender

PARTS = 64
SLOW_PART = b"x" * 65536  # past the transport's high-water mark in a few parts: the socket stops taking them


async def serve(part: bytes):
    """An app whose one handler sends PARTS numbered parts through a Sender; yields (port, what it saw)."""
    seen: dict = {"tokens": 0}

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        sender = Sender(resp, request.transport, lambda: seen.__setitem__("tokens", seen["tokens"] + 1))
        loop = asyncio.get_running_loop()
        started = loop.time()
        for i in range(PARTS):
            await sender.send(b"%d:" % i + part + b"\n", True)
        seen["send_seconds"] = loop.time() - started  # the handler's sends, whatever the client does
        seen["writer"] = sender.writer is not None
        seen["sent"].set()
        await sender.end(b"end\n", False)
        seen["ended"] = True
        return resp

    seen["sent"] = asyncio.Event()
    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1], seen


async def body_of(reader: asyncio.StreamReader) -> bytes:
    """A chunked response's body, whole."""
    while await reader.readline() not in (b"\r\n", b""):
        pass
    body = b""
    while (size := int((await reader.readline()).strip(), 16)) > 0:
        body += await reader.readexactly(size)
        await reader.readline()
    return body


async def test_a_client_that_keeps_up_is_written_to_by_the_handler_itself():
    runner, port, seen = await serve(b"token")
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        body = await body_of(reader)
        assert body == b"".join(b"%d:token\n" % i for i in range(PARTS)) + b"end\n"
        assert seen["writer"] is False and seen["ended"]
        assert seen["tokens"] == 1  # the first token's callback, once
        writer.close()
    finally:
        await runner.cleanup()


async def test_a_client_that_stops_reading_gets_a_writer_and_the_sends_never_wait():
    runner, port, seen = await serve(SLOW_PART)
    try:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: it fixes the window
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(sock, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        # 4 MiB the client does not read: without a writer the handler's sends would wait on the client.
        await asyncio.wait_for(seen["sent"].wait(), 10)
        assert seen["writer"] is True
        assert "ended" not in seen  # the rest is the writer's, still waiting for the client
        reader, writer = await asyncio.open_connection(sock=sock)
        body = await asyncio.wait_for(body_of(reader), 30)
        assert body == b"".join(b"%d:" % i + SLOW_PART + b"\n" for i in range(PARTS)) + b"end\n"  # in order
        await asyncio.sleep(0.05)
        assert seen["ended"] and seen["tokens"] == 1
        writer.close()
    finally:
        await runner.cleanup()
