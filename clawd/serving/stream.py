"""A streamed reply's two halves (docs/ARCHITECTURE.md §2): `pump` reads the engine's chunks to their end and
turns them into server-sent events; a `Sender` writes them to the client. A client that stops reading stalls
only the writer: the engine's stream still ends and the request's slot is released, and the rest is written
under the connection's write deadline.

While the client keeps up, the handler writes each event itself: nothing waits in the socket's buffer, so a
write no larger than the transport's high-water mark cannot wait either, and a token costs no hand-off to another
task. The first time a part finds bytes still buffered (a slow reader, or a burst the socket did not take) or is
larger than that, the Sender starts a writer task, and from then on every part goes through its queue, in order;
the handler never waits on the client.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from aiohttp import web

from clawd import jsoncodec
from clawd.engine.chunks import Chunk
from clawd.engine.client import EngineError
from clawd.serving.errors import ApiError
from clawd.serving.reply import ReplyBuilder


class Sender:
    """Writes a streamed reply's parts in order (see the module's docstring); `on_token` is called once, when
    the client has been sent its first token."""

    def __init__(self, resp: web.StreamResponse, transport: asyncio.Transport | None,
                 on_token: Callable[[], None] | None):
        self.resp, self.transport, self.on_token = resp, transport, on_token
        self.outbox: asyncio.Queue[tuple[bytes, bool] | None] | None = None  # once a part had to wait
        self.writer: asyncio.Task | None = None
        self.high = transport.get_write_buffer_limits()[1] if transport is not None else 0

    def _direct(self, size: int) -> bool:
        """No writer yet, nothing buffered, and a part no larger than the transport's high-water mark: a write now
        cannot wait (aiohttp's drain waits only while the transport is paused, which takes more than that many
        bytes buffered). A larger part (a burst of many tokens) could, so it goes to the writer."""
        if self.outbox is not None:
            return False
        transport = self.transport
        if (transport is not None and not transport.is_closing() and not transport.get_write_buffer_size()
                and size <= self.high):
            return True
        self.outbox = asyncio.Queue()
        self.writer = asyncio.create_task(deliver(self.resp, self.outbox, self.on_token))
        return False

    async def send(self, data: bytes, token: bool) -> None:
        if self._direct(len(data)):
            await self.resp.write(data)
            if token and self.on_token is not None:
                self.on_token()
                self.on_token = None
            return
        self.outbox.put_nowait((data, token))
        if self.writer.done():  # it ends early only when a write failed: the client left
            self.writer.result()

    async def end(self, data: bytes, token: bool) -> None:
        """The last part, then the end of the response; returns once it is written."""
        if self._direct(len(data)):
            await self.resp.write_eof(data)
            if token and self.on_token is not None:
                self.on_token()
            return
        self.outbox.put_nowait((data, token))
        self.outbox.put_nowait(None)
        await self.writer  # a failed write (the client left) raises here

    def cancel(self) -> asyncio.Task | None:
        """This request is ending another way (cancelled): the writer goes with it; the task to wait for."""
        if self.writer is not None and not self.writer.done():
            self.writer.cancel()
        return self.writer


async def pump(first: Chunk | None, chunks: AsyncIterator[Chunk], out: ReplyBuilder, send: Sender, *,
               include_usage: bool) -> tuple[bytes, bool]:
    """The engine's chunks, from `first` to the end, as SSE events to `send`; returns the reply's last part and
    whether it carries a token. When the engine failed mid-stream (`out.failed`), that part is an error event and
    [DONE]; else the text the detokenizer held back, the finish, the usage when asked for, and [DONE]."""
    events: list[bytes] = []  # a chunk's events (a chunk is one engine read); held when the end came with it
    try:
        chunk = first
        while chunk is not None:
            deltas, logprobs = out.add(chunk)
            if logprobs and not deltas:
                deltas = [{}]  # log-probs of tokens whose text is still held back
            for i, delta in enumerate(deltas):
                events.append(out.sse(delta, logprobs=logprobs if i == len(deltas) - 1 else None))
            if events and not chunk.more:
                await send.send(b"".join(events), True)
                events.clear()
            chunk = await anext(chunks, None)
        if out.engine_finish == "abort":
            raise EngineError("the engine aborted the request")
        events += [out.sse(piece) for piece in out.close()]
    except EngineError as exc:
        out.failed = True
        err = ApiError(502, f"The model engine failed mid-stream: {exc}", code="engine_error").body()
        tokens = bool(events)  # token events of the engine's last read, not yet written
        events.append(b"data: " + jsoncodec.dumps(err) + b"\n\ndata: [DONE]\n\n")
        return b"".join(events), tokens
    events.append(out.sse({}, finish=out.finish_reason))
    if include_usage:
        events.append(b"data: " + jsoncodec.dumps(out.usage_chunk(), finite=True) + b"\n\n")  # no floats
    events.append(b"data: [DONE]\n\n")
    # Tokens the detokenizer held back to the end arrive in the tail: their first one is written there.
    return b"".join(events), bool(out.ids)


async def deliver(resp: web.StreamResponse, outbox: asyncio.Queue, on_token: Callable[[], None] | None) -> None:
    """A streamed reply's writer task: the parts as they come, until None; then the end of the response. Parts
    that are already waiting when it writes go out in the same write (one send, not one per token, when the
    engine runs ahead of the socket), and the last ones with the end of the response."""
    end = False
    while not end:
        part = await outbox.get()
        if part is None:
            break
        data, token = [part[0]], part[1]
        while not outbox.empty():
            more = outbox.get_nowait()
            if more is None:
                end = True
                break
            data.append(more[0])
            token = token or more[1]
        joined = data[0] if len(data) == 1 else b"".join(data)
        if end:
            await resp.write_eof(joined)
        else:
            await resp.write(joined)
        if token and on_token is not None:  # once: the client has its first token
            on_token()
            on_token = None
    if not end:
        await resp.write_eof()
