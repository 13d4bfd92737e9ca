"""The engine client's own contract, against the fake SGLang server."""
from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.http_exceptions import LineTooLong

from clawd.engine.chunks import StreamChunks
from clawd.engine.client import EngineClient, EngineError, EngineRejected, EngineUnavailable
from clawd.engine.sse import LineSplitter
from clawd.engine import sse
from tests.fake_sglang import FakeSGLang
from tests.harness import serving


async def test_refuse_fails_new_calls_at_once_and_lets_calls_in_flight_finish():
    """A forced stop refuses new engine calls (a dead engine's socket would hold them) but must not strand a
    stream already reading: it ends when the engine ends it."""
    async with FakeSGLang(tokens=12, token_delay=0.01, incremental_streaming_output=True) as fake:
        client = EngineClient(fake.url, incremental_stream=True)
        await client.start()
        try:
            stream = client.stream({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 12}})
            first = await anext(stream)
            client.refuse("clawd is stopping")
            with pytest.raises(EngineUnavailable, match="clawd is stopping"):
                await client.generate({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
            ids = list(first.ids)
            async for chunk in stream:
                ids.extend(chunk.ids)
            assert len(ids) == 12
        finally:
            await client.close()
        with pytest.raises(EngineUnavailable, match="closed"):
            await client.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})


@contextlib.asynccontextmanager
async def engine_at(generate, **client):
    """An engine whose /generate is `generate`, and a started client of it: yields (url, client)."""
    app = web.Application()
    app.router.add_post("/generate", generate)
    async with serving(app) as url:
        engine = EngineClient(url, **client)
        await engine.start()
        try:
            yield url, engine
        finally:
            await engine.close()


async def test_a_cumulative_stream_line_longer_than_aiohttp_reads_is_read_whole():
    """SGLang's default cumulative chunks repeat the whole reply with its log-probs on each SSE line: a long
    reply is one line of megabytes, past aiohttp's line reader (which raises). clawd splits lines itself."""

    n = 60_000  # ~1.7 MB in the last line
    ids = [i % 4096 for i in range(n)]

    def event(upto: int, finish) -> bytes:
        meta = {"output_token_logprobs": [[-0.5, t, None] for t in ids[:upto]], "finish_reason": finish}
        return b"data: " + json.dumps({"output_ids": ids[:upto], "meta_info": meta}).encode() + b"\n\n"

    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(event(10, None))
        await resp.write(event(n, {"type": "length", "length": n}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async with engine_at(generate, incremental_stream=False) as (url, client):
        got, logprobs, finish = [], [], None
        async for chunk in client.stream({"input_ids": [1], "sampling_params": {"max_new_tokens": n}}):
            got += chunk.ids
            logprobs += chunk.logprobs
            finish = chunk.finish or finish
        assert got == ids and logprobs == [-0.5] * n and finish == {"type": "length", "length": n}
        # The control: aiohttp's own line iteration cannot read that line.
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/generate", json={}) as resp:
                with pytest.raises(LineTooLong):
                    async for _ in resp.content:
                        pass


async def test_a_client_with_a_priority_names_it_on_every_generate_unless_the_call_names_its_own():
    """The policy engines' client when they schedule by priority: live calls carry LIVE_PRIORITY, a rollout's
    call keeps its own; a client without one sends none."""
    async with FakeSGLang(tokens=2, incremental_streaming_output=True) as fake:
        for priority in (0, None):
            client = EngineClient(fake.url, incremental_stream=True, priority=priority)
            await client.start()
            try:
                await client.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
                await client.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "priority": -100})
                async for _ in client.stream({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}):
                    pass
            finally:
                await client.close()
        assert [r.get("priority", "none") for r in fake.requests] == [0, -100, 0, "none", -100, "none"]


def test_the_line_splitter_gives_each_chunk_the_lines_it_completes_whatever_the_cut():
    lines = LineSplitter(limit=16)
    assert lines.feed(b"data: {\"a\"") == []
    assert lines.feed(b": 1}\n\ndata: 2\n\nda") == [b'data: {"a": 1}', b"", b"data: 2", b""]
    assert lines.feed(b"ta: 3\r\n") == [b"data: 3"]
    assert lines.feed(b"tail") == [] and lines.end() == [b"tail"] and lines.end() == []
    with pytest.raises(sse.LineTooLong):
        LineSplitter(limit=16).feed(b"x" * 17)


async def test_the_events_of_one_read_come_as_one_chunk_and_the_last_says_the_end_came_with_it():
    # An engine that runs ahead (a burst in one read) costs one chunk, so one reply event and one write.
    async def generate(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        event = (b'data: {"output_ids": [%d], "meta_info": {"output_token_logprobs": [[-0.%d, %d, null]], '
                 b'"finish_reason": %s, "weight_version": "%d"}}\n\n')
        await resp.write(event % (1, 1, 1, b"null", 1) + event % (2, 2, 2, b"null", 2))  # one write: one read here
        await asyncio.sleep(0.2)
        await resp.write(event % (3, 3, 3, b'{"type": "stop"}', 3) + b"data: [DONE]\n\n")
        return resp

    async with engine_at(generate, incremental_stream=True) as (_, client):
        got = [c async for c in client.stream({"input_ids": [1]})]
    assert [(c.ids, c.logprobs, c.logprob_ids, c.more) for c in got] == [
        ([1, 2], [-0.1, -0.2], [1, 2], False), ([3], [-0.3], [3], True)]  # [DONE] came with the third
    assert got[0].meta["weight_version"] == "2" and got[0].finish is None and got[1].finish == {"type": "stop"}


def test_an_event_is_its_new_output_and_an_error_event_raises():
    def event(ids, top=False, finish=None):
        meta = {"output_token_logprobs": [[-i / 10, i, None] for i in ids], "finish_reason": finish}
        if top:
            meta["output_top_logprobs"] = [[[-i / 10, i, None], [-1.0, i + 100, None]] for i in ids]
        return {"output_ids": ids, "meta_info": meta}

    chunks = StreamChunks(incremental=False)  # cumulative: each event repeats what came before
    assert chunks.take() is None
    chunks.add(event([5, 6]))
    chunks.add(event([5, 6, 7], finish={"type": "length"}))  # the same read: one chunk, the last one's finish
    got = chunks.take()
    assert (got.ids, got.logprobs, got.logprob_ids, got.top_ids, got.finish) == (
        [5, 6, 7], [-0.5, -0.6, -0.7], [5, 6, 7], [], {"type": "length"})
    assert chunks.take() is None and chunks.seen == 3
    chunks.add(event([5, 6, 7, 8]))  # a later read: past the three already read
    assert chunks.take().ids == [8]

    chunks = StreamChunks(incremental=True)
    chunks.add(event([1], top=True))
    chunks.add(event([2, 3], top=True))
    got = chunks.take()
    assert (got.ids, got.logprob_ids, got.top_ids, got.finish) == ([1, 2, 3], [1, 2, 3], [[1, 101], [2, 102], [3, 103]],
                                                                  None)
    chunks.add(event([4]))
    with pytest.raises(EngineRejected, match="bad sampling"):
        chunks.add({"error": {"code": 400, "message": "bad sampling"}})
    assert chunks.take().ids == [4]  # what came before the error event is still there
    with pytest.raises(EngineError, match="engine stream error: boom") as caught:
        chunks.add({"error": {"message": "boom"}})
    assert not isinstance(caught.value, EngineRejected)
    with pytest.raises(EngineError, match="not a JSON object"):
        chunks.add([1, 2])
    assert chunks.take() is None
