"""A streamed reply's two halves (docs/ARCHITECTURE.md §2): `pump` reads the engine's chunks to their end and
turns them into server-sent events in an outbox; `deliver`, a task the handler owns, writes the outbox to the
client. A client that stops reading stalls only the writer: the engine's stream still ends and the request's
slot is released, and the rest is written under the connection's write deadline.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from aiohttp import web

from clawd import jsoncodec
from clawd.engine.client import Chunk, EngineError
from clawd.serving.errors import ApiError
from clawd.serving.reply import ReplyBuilder


async def pump(first: Chunk | None, chunks: AsyncIterator[Chunk], out: ReplyBuilder, outbox: asyncio.Queue,
               writer: asyncio.Task, *, include_usage: bool) -> bool:
    """The engine's chunks, from `first` to the end, as SSE events into `outbox`; True when the engine
    failed mid-stream (the client got an error event and [DONE]: `out.failed`)."""
    try:
        chunk = first
        while chunk is not None:
            deltas, logprobs = out.add(chunk)
            if logprobs and not deltas:
                deltas = [{}]  # log-probs of tokens whose text is still held back
            if deltas:  # one write per engine chunk, however many events it makes
                outbox.put_nowait((b"".join(out.sse(d, logprobs=logprobs if i == len(deltas) - 1 else None)
                                            for i, d in enumerate(deltas)), True))
            if writer.done():  # it ends early only when a write failed: the client left
                writer.result()
            chunk = await anext(chunks, None)
        if out.engine_finish == "abort":
            raise EngineError("the engine aborted the request")
        tail = [out.sse(piece) for piece in out.close()]
    except EngineError as exc:
        out.failed = True
        err = ApiError(502, f"The model engine failed mid-stream: {exc}", code="engine_error").body()
        outbox.put_nowait((b"data: " + jsoncodec.dumps(err) + b"\n\ndata: [DONE]\n\n", False))
        return True
    tail.append(out.sse({}, finish=out.finish_reason))
    if include_usage:
        tail.append(b"data: " + jsoncodec.dumps(out.usage_chunk(), finite=True) + b"\n\n")  # no floats
    tail.append(b"data: [DONE]\n\n")
    # Tokens the detokenizer held back to the end arrive in the tail: their first one is written there.
    outbox.put_nowait((b"".join(tail), bool(out.ids)))
    return False


async def deliver(resp: web.StreamResponse, outbox: asyncio.Queue, on_token: Callable[[], None] | None) -> None:
    """A streamed reply's writer: the parts as they come, until None; then the end of the response. Parts that
    are already waiting when it writes go out in the same write (one send, not one per token, when the engine
    runs ahead of the socket), and the last ones with the end of the response."""
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
