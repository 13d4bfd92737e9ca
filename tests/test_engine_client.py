"""The engine client's own contract, against the fake SGLang server."""
from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp.http_exceptions import LineTooLong

from clawd.engine.client import EngineClient, EngineUnavailable
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


async def test_a_cumulative_stream_line_longer_than_aiohttp_reads_is_read_whole():
    """SGLang's default cumulative chunks repeat the whole reply with its log-probs on each SSE line: a long
    reply is one line of megabytes, past aiohttp's line reader (which raises). clawd splits lines itself."""
    from aiohttp import web

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

    app = web.Application()
    app.router.add_post("/generate", generate)
    async with serving(app) as url:
        client = EngineClient(url, incremental_stream=False)
        await client.start()
        try:
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
        finally:
            await client.close()


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
