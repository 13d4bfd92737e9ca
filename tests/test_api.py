"""Component tests: the real daemon process in front of a fake SGLang engine, driven by the openai client."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from tokenizers import Tokenizer

from clawd.engine.client import NEUTRAL_SAMPLING

from .fake_sglang import FakeSGLang
from .harness import Daemon, wait_ready_async


class Script:
    """What the fake engine 'generates': the next queued text, else a fixed answer."""

    def __init__(self, tiny_model):
        self.tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
        self.eos = self.tok.token_to_id("<|im_end|>")
        self.queue: list[str] = []

    def __call__(self, input_ids, sampling_params):
        text = self.queue.pop(0) if self.queue else "Otters hold hands while they sleep."
        return self.tok.encode(text, add_special_tokens=False).ids + [self.eos]

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


@pytest.fixture
async def stack(tiny_model, tmp_path):
    """A fake engine in this loop and a daemon subprocess pointed at it."""
    script = Script(tiny_model)
    async with FakeSGLang(responder=script, eos_id=script.eos) as fake:
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)},
                                   "engine": {"launch": "none", "url": fake.url, "health_interval": 0.2},
                                   "server": {"max_concurrent_requests": 4}},
                        wait_ready=False)
        await wait_ready_async(daemon)
        client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
        yield daemon, fake, script, client
        await client.close()
        assert daemon.stop() == 0


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


async def test_non_streamed_reply_is_decoded_from_engine_ids(stack):
    daemon, fake, script, client = stack
    reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
    assert reply.choices[0].message.content == "Otters hold hands while they sleep."
    assert reply.choices[0].finish_reason == "stop"
    sent = fake.requests[-1]
    sp = sent["sampling_params"]
    # Token in: the prompt is ids rendered with the chat template; explicit full-distribution sampling.
    assert script.decode(sent["input_ids"]).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert sent["return_logprob"] is True and isinstance(sent["rid"], str)
    assert (sp["temperature"], sp["top_p"], sp["top_k"]) == (1.0, 1.0, -1)
    # A trainable turn names every distribution-shaping field, so an engine's preferred params fill none.
    assert {k: sp[k] for k in NEUTRAL_SAMPLING} == NEUTRAL_SAMPLING == {
        "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
        "repetition_penalty": 1.0, "min_new_tokens": 0}
    assert script.eos in sp["stop_token_ids"]


async def test_streamed_reply_arrives_in_deltas(stack):
    daemon, fake, script, client = stack
    fake.token_delay = 0.01
    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Otters hold hands while they sleep."
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == len(script.tok.encode(text).ids) + 1


async def test_tool_call_round_trip(stack):
    daemon, fake, script, client = stack
    script.queue += ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                     "It is 21 degrees in Paris."]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL])
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert msg.content is None
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert script.decode(fake.requests[-1]["input_ids"]).count('"name": "get_weather"') == 1  # tools rendered

    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    second = await client.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL])
    assert second.choices[0].message.content == "It is 21 degrees in Paris."
    prompt = script.decode(fake.requests[-1]["input_ids"])
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt

    # The tool result is the first turn's next state: one session, stitched without headers.
    rec = await _records_after_next(daemon, client, messages + [second.choices[0].message.model_dump(exclude_none=True)])
    turns = [r for r in rec if r["messages"][0]["content"] == "Weather in Paris?"]
    assert [t["turn_index"] for t in turns] == [0, 1]
    assert turns[0]["next_state"] == [{"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    assert turns[0]["finish_reason"] == "tool_calls"
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert turns[0]["response_ids"] == script.tok.encode(call_text, add_special_tokens=False).ids + [script.eos]


async def _records_after_next(daemon, client, messages):
    await client.chat.completions.create(model="m", messages=messages + [{"role": "user", "content": "thanks"}])
    return daemon.records()


async def test_session_headers_and_exclusions(stack):
    daemon, fake, script, client = stack
    h = {"X-Session-Id": "s-1"}
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}], extra_headers=h)
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}], top_p=0.5,
                                         extra_headers=h)
    # A side turn is served and never recorded.
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "side"}],
                                         extra_headers={**h, "X-Turn-Type": "side"})
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "c"}],
                                         extra_headers={**h, "X-Clawd-No-Train": "1", "X-Session-Done": "1"})
    # The no_train turn is recorded without its words ([privacy] untrained_content): keyed by turn index.
    by_index = {r["turn_index"]: r for r in daemon.records() if r["session_id"] == "s-1"}
    recs = {"a": by_index[0], "b": by_index[1], "c": by_index[2]}
    assert len(by_index) == 3 and by_index[0]["messages"][-1]["content"] == "a"
    assert recs["a"]["next_state"] == [{"role": "user", "content": "b"}] and recs["a"]["reason"] is None
    assert recs["a"]["excluded"] is None
    assert recs["b"]["excluded"] == "sampling_params" and recs["b"]["next_state"] == [{"role": "user", "content": "c"}]
    assert fake.requests[-3]["sampling_params"]["top_p"] == 0.5  # served exactly as asked
    assert "min_p" not in fake.requests[-3]["sampling_params"]  # not trainable: the engine's defaults apply
    assert recs["c"]["excluded"] == "no_train" and recs["c"]["content"] == "withheld"
    assert recs["c"]["messages"] == [{"role": "user", "chars": 1}]
    assert recs["c"]["next_state"] is None and recs["c"]["reason"] == "session_done"


async def test_client_disconnect_aborts_the_generation(stack):
    daemon, fake, script, client = stack
    fake.token_delay = 0.05
    script.queue.append("word " * 200)
    async with aiohttp.ClientSession() as http:
        resp = await http.post(daemon.url + "/v1/chat/completions",
                               json={"messages": [{"role": "user", "content": "long"}], "stream": True})
        await resp.content.readline()  # the stream has started
        rid = fake.requests[-1]["rid"]
        resp.close()  # the client goes away mid-stream
    await fake.wait_for_abort(rid, timeout=10)
    assert {"rid": rid} in [{"rid": b.get("rid")} for b in fake.abort_requests]


async def test_non_streamed_disconnect_aborts_too(stack):
    daemon, fake, script, client = stack
    fake.hang_next()
    async with aiohttp.ClientSession() as http:
        task = asyncio.ensure_future(http.post(daemon.url + "/v1/chat/completions",
                                               json={"messages": [{"role": "user", "content": "x"}]}))
        while not fake.requests or fake.in_flight == 0:
            await asyncio.sleep(0.02)
        rid = fake.requests[-1]["rid"]
        task.cancel()
    await fake.wait_for_abort(rid, timeout=10)


@pytest.mark.slow
async def test_too_many_concurrent_requests_get_429(stack):
    daemon, fake, script, client = stack
    fake.hang_next(4)
    async with aiohttp.ClientSession() as http:
        body = {"messages": [{"role": "user", "content": "x"}]}
        hung = [asyncio.ensure_future(http.post(daemon.url + "/v1/chat/completions", json=body)) for _ in range(4)]
        while fake.in_flight < 4:
            await asyncio.sleep(0.02)
        async with http.post(daemon.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["type"] == "rate_limit_error"
        for t in hung:
            t.cancel()


async def test_engine_failures_are_502_or_503_with_retry_after(stack):
    daemon, fake, script, client = stack
    async with aiohttp.ClientSession() as http:
        body = {"messages": [{"role": "user", "content": "x"}]}
        fake.fail_next(500, {"error": "boom"})
        async with http.post(daemon.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 502 and "Retry-After" in resp.headers
            assert (await resp.json())["error"]["code"] == "engine_error"
        fake.drop_next()
        async with http.post(daemon.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status in (502, 503) and "Retry-After" in resp.headers
        # A stream whose engine fails before the first token is still a clean HTTP error.
        fake.fail_next(503, {"error": "overloaded"})
        async with http.post(daemon.url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 503 and "Retry-After" in resp.headers
        async with http.post(daemon.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200  # and the daemon recovers at once


async def test_engine_down_gives_503_then_recovers(tiny_model, tmp_path):
    script = Script(tiny_model)
    fake = FakeSGLang(responder=script, eos_id=script.eos)
    await fake.start()
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)},
                               "engine": {"launch": "none", "url": fake.url, "health_interval": 0.2}},
                    wait_ready=False)
    try:
        await wait_ready_async(daemon)
        port = fake.url.rsplit(":", 1)[1]
        await fake.close()
        async with aiohttp.ClientSession() as http:
            body = {"messages": [{"role": "user", "content": "x"}]}
            async with http.post(daemon.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"]
                assert (await resp.json())["error"]["type"] == "service_unavailable"
            async with http.get(daemon.url + "/ready") as resp:
                assert resp.status == 503
            fake = FakeSGLang(responder=script, eos_id=script.eos, port=int(port))
            await fake.start()
            await wait_ready_async(daemon)
            async with http.post(daemon.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
    finally:
        await fake.close()
        assert daemon.stop() == 0


async def test_api_keys(tiny_model, tmp_path):
    script = Script(tiny_model)
    async with FakeSGLang(responder=script, eos_id=script.eos) as fake:
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)},
                                   "engine": {"launch": "none", "url": fake.url},
                                   "auth": {"keys": [{"name": "alice", "key": "sk-alice-123456"}]}},
                        wait_ready=False)
        try:
            await wait_ready_async(daemon)
            bad = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="wrong-key-123", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
            await bad.close()
            async with aiohttp.ClientSession() as http:
                for headers in ({}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer "}):
                    async with http.post(daemon.url + "/v1/chat/completions", headers=headers,
                                         json={"messages": [{"role": "user", "content": "x"}]}) as resp:
                        assert resp.status == 401
                        assert (await resp.json())["error"]["type"] == "authentication_error"
            good = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="sk-alice-123456", max_retries=0)
            models = await good.models.list()
            assert [m.id for m in models.data] == [tiny_model.name]
            await good.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                               extra_headers={"X-Session-Done": "1"})
            await good.close()
            (rec,) = daemon.records()
            assert rec["principal"] == "alice"
            assert "sk-alice" not in json.dumps(rec)
        finally:
            assert daemon.stop() == 0


async def test_reasoning_and_logprobs(stack):
    from .fake_sglang import output_logprob
    daemon, fake, script, client = stack
    script.queue += ["<think>The user wants brevity.</think>Yes.", "<think>Again.</think>No."]
    reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Q"}],
                                                 logprobs=True)
    msg = reply.choices[0].message
    assert msg.content == "Yes."
    assert msg.model_extra["reasoning_content"] == "The user wants brevity."
    ids = script.tok.encode("<think>The user wants brevity.</think>Yes.", add_special_tokens=False).ids + [script.eos]
    assert [t.logprob for t in reply.choices[0].logprobs.content] == [output_logprob(i) for i in ids]

    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Q2"}],
                                                  stream=True, logprobs=True)
    chunks = [c async for c in stream]
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == ("Again.", "No.")
    streamed_lps = [t.logprob for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    ids = script.tok.encode("<think>Again.</think>No.", add_special_tokens=False).ids + [script.eos]
    assert streamed_lps == [output_logprob(i) for i in ids]


async def test_incremental_engine_streams(tiny_model, tmp_path):
    """An SGLang started with --incremental-streaming-output sends deltas; clawd reads them as such."""
    script = Script(tiny_model)
    async with FakeSGLang(responder=script, eos_id=script.eos, incremental_streaming_output=True) as fake:
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)},
                                   "engine": {"launch": "none", "url": fake.url,
                                              "incremental_streaming_output": True}}, wait_ready=False)
        try:
            await wait_ready_async(daemon)
            client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi"}], stream=True,
                extra_headers={"X-Session-Done": "1"})
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            assert text == "Otters hold hands while they sleep."
            await client.close()
        finally:
            assert daemon.stop() == 0
        (rec,) = daemon.records()
        expected = script.tok.encode(text, add_special_tokens=False).ids + [script.eos]
        assert rec["response_ids"] == expected and rec["excluded"] is None


async def test_engine_side_abort_is_an_error_not_an_answer(stack):
    daemon, fake, script, client = stack
    body = {"messages": [{"role": "user", "content": "x"}], "session_id": "aborted"}
    async with aiohttp.ClientSession() as http:
        for stream in (False, True):
            fake.hang_next()
            task = asyncio.ensure_future(http.post(daemon.url + "/v1/chat/completions",
                                                   json={**body, "stream": stream}))
            while fake.in_flight == 0:
                await asyncio.sleep(0.02)
            async with http.post(fake.url + "/abort_request", json={"abort_all": True}) as r:
                assert r.status == 200
            resp = await task
            # Aborted before its first token: nothing was sent, so a stream too gets a proper status.
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"]["code"] == "engine_aborted"
            resp.release()
        # Aborted after tokens went out: the stream ends with an error event, not a finish.
        fake.token_delay = 0.05
        script.queue.append("word " * 200)
        async with http.post(daemon.url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 200
            seen = b""
            while seen.count(b"\n\n") < 4:  # the role event, then content
                more = await asyncio.wait_for(resp.content.readany(), 10)
                assert more, seen
                seen += more
            async with http.post(fake.url + "/abort_request", json={"abort_all": True}) as r:
                assert r.status == 200
            events = [line for line in (seen + await resp.read()).decode().split("\n\n") if line]
            assert json.loads(events[-2][len("data: "):])["error"]["code"] == "engine_error"
            assert events[-1] == "data: [DONE]"
    # Counted as engine errors.
    assert daemon.get("/debug/process")[1]["chat"]["engine_errors"] == 3
