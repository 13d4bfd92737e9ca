"""A streamed reply's Sender (clawd.serving.stream) on a real aiohttp server and raw-socket clients: a client
that keeps up is written to by the handler itself, with no writer task; one that stops reading makes it hand
every later part to a writer, in order, and the handler's sends never wait on it."""
from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from clawd.serving.stream import Sender

PARTS = 256
SLOW_PART = b"x" * 16384  # under the transport's high-water mark (64 KiB): the socket's buffer fills part by part


async def serve(part: bytes, parts: int = PARTS):
    """An app whose one handler sends `parts` numbered parts through a Sender; returns (runner, port, what it
    saw)."""
    seen: dict = {"tokens": 0}

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        sender = Sender(resp, request.transport, lambda: seen.__setitem__("tokens", seen["tokens"] + 1))
        loop = asyncio.get_running_loop()
        started = loop.time()
        for i in range(parts):
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


async def test_a_part_past_the_high_water_mark_goes_to_a_writer_even_for_a_client_that_keeps_up():
    # Written directly, a part larger than the high-water mark could pause the transport and make aiohttp's write
    # wait on the client: a burst of many tokens at once (a real daemon test caught the handler held that way).
    big = b"y" * (256 << 10)
    runner, port, seen = await serve(big, parts=2)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert await body_of(reader) == b"0:" + big + b"\n1:" + big + b"\nend\n"
        assert seen["writer"] is True and seen["tokens"] == 1
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


class Recorder:
    """A Sender's face to pump: what it was handed, write by write."""

    def __init__(self):
        self.writes: list[tuple[bytes, bool]] = []

    async def send(self, data: bytes, token: bool) -> None:
        self.writes.append((data, token))


async def test_pump_writes_once_per_engine_read_and_the_last_with_the_tail(tiny_model):
    import json

    from clawd.engine.chunks import Chunk
    from clawd.served import Policy
    from clawd.serving.reply import ReplyBuilder
    from clawd.serving.request import Limits, parse_chat_request
    from clawd.serving.stream import pump
    from clawd.tokenizer import ChatTokenizer

    tok = ChatTokenizer(tiny_model)
    req = parse_chat_request(json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode(),
                             {}, Limits(max_messages=10, max_message_chars=100))
    out = ReplyBuilder(req, "r1", tok=tok, model="m", policy=Policy(version=1, weight_version="1"), replicas=None,
                       tool_parser="none", reasoning_parser="none")
    ids = tok.encode(" one two three four five")

    def chunk(first: int, upto: int, more: bool = False, finish=None) -> Chunk:  # one engine read's tokens
        return Chunk(ids=ids[first:upto], logprobs=[-0.1] * (upto - first), logprob_ids=ids[first:upto],
                     finish=finish, meta={}, more=more)

    async def rest():
        for c in (chunk(1, 3), chunk(3, 5, more=True, finish={"type": "stop"})):
            yield c

    sent = Recorder()
    last, token = await pump(chunk(0, 1), rest(), out, sent, include_usage=False)
    events = [[e for e in data.split(b"\n\n") if e] for data, _ in sent.writes]
    assert [len(e) for e in events] == [1, 1]  # a write per read, one event for each read's tokens
    assert all(t for _, t in sent.writes) and token
    # The last read's tokens came with the stream's end ([DONE]): they go with the tail, one write for the end.
    assert last.count(b"chat.completion.chunk") == 1 + 1 and last.endswith(b"data: [DONE]\n\n")
    text = b"".join(d for d, _ in sent.writes) + last
    assert "".join(json.loads(e[6:])["choices"][0]["delta"].get("content", "")
                   for e in text.split(b"\n\n") if e.startswith(b"data: {")) == tok.tokenizer.decode(ids)
