"""The engine client's own contract, against the fake SGLang server."""
from __future__ import annotations

import pytest

from clawd.engine.client import EngineClient, EngineUnavailable
from tests.fake_sglang import FakeSGLang


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
