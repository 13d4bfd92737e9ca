"""What clawd does as an engine becomes ready, against the fake SGLang 0.5.23: it is told to continue (a
publish cut short may have left it paused), its input limit is read from /server_info and enforced with
clawd's own 400, control calls carry the admin key, and a staged supervisor waits for its turn."""
from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import openai
import pytest

from clawd.config.loading import config_from_dict
from clawd.engine.client import EngineClient, EngineError
from clawd.engine.supervisor import EngineState, EngineSupervisor

from .fake_sglang import FakeSGLang
from .harness import Daemon, wait_ready_async


def _supervisor(fake: FakeSGLang, **client_keys) -> EngineSupervisor:
    cfg = config_from_dict({"engine": {"launch": "none", "url": fake.url, "health_interval": 0.1}})
    return EngineSupervisor(cfg, EngineClient(fake.url, **client_keys), "policy")


async def _ready(supervisor: EngineSupervisor) -> asyncio.Task:
    await supervisor.client.start()
    task = asyncio.create_task(supervisor.run())
    await asyncio.wait_for(supervisor.ready.wait(), 10)
    return task


async def _stop(supervisor: EngineSupervisor, task: asyncio.Task) -> None:
    await supervisor.stop()
    task.cancel()
    await supervisor.client.close()


async def test_an_engine_left_paused_is_continued_and_its_input_limit_read_when_it_becomes_ready():
    async with FakeSGLang(context_length=2048) as fake:
        async with aiohttp.ClientSession() as http:  # a clawd that died between pause and continue
            async with http.post(fake.url + "/pause_generation", json={"mode": "retract"}) as resp:
                assert resp.status == 200
        assert fake.paused
        supervisor = _supervisor(fake)
        task = await _ready(supervisor)
        try:
            assert not fake.paused and ("/continue_generation", {}) in fake.calls
            assert supervisor.input_limit == fake.max_req_input_len == 2042
        finally:
            await _stop(supervisor, task)


async def test_a_staged_supervisor_waits_for_its_turn():
    async with FakeSGLang() as fake:
        turn = asyncio.Event()
        cfg = config_from_dict({"engine": {"launch": "none", "url": fake.url, "health_interval": 0.1}})
        supervisor = EngineSupervisor(cfg, EngineClient(fake.url), "reference", after=(turn,))
        await supervisor.client.start()
        task = asyncio.create_task(supervisor.run())
        try:
            await asyncio.sleep(0.5)
            assert supervisor.state is EngineState.STARTING and fake.calls == []  # not even a probe
            turn.set()
            await asyncio.wait_for(supervisor.ready.wait(), 10)
        finally:
            await _stop(supervisor, task)


async def test_control_calls_carry_the_admin_key_and_generation_the_api_key():
    async with FakeSGLang(api_key="sk-api-123456", admin_api_key="sk-admin-123456") as fake:
        both = EngineClient(fake.url, api_key="sk-api-123456", admin_api_key="sk-admin-123456")
        api_only = EngineClient(fake.url, api_key="sk-api-123456")
        for client in (both, api_only):
            await client.start()
        try:
            out = await both.generate({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}})
            assert len(out["output_ids"]) == 3
            await both.control("/pause_generation", {"mode": "retract"}, 5)
            await both.control("/continue_generation", {}, 5)
            await both.abort("no-such-rid")
            # The control: SGLang refuses the ordinary key on its control endpoints.
            await api_only.generate({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}})
            with pytest.raises(EngineError, match="answered 40[13]"):
                await api_only.control("/continue_generation", {}, 5)
        finally:
            for client in (both, api_only):
                await client.close()


async def test_a_prompt_over_the_engines_input_limit_gets_clawds_own_400(tiny_model, tmp_path):
    """The engine refuses prompts of max_req_input_len tokens or more, a few under its context: clawd answers
    them itself as context_length_exceeded, before the engine sees them, instead of an engine failure."""
    async with FakeSGLang(context_length=256) as fake:
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)},
                                   "engine": {"launch": "none", "url": fake.url, "health_interval": 0.2}},
                        wait_ready=False)
        try:
            await wait_ready_async(daemon)
            status, info = daemon.get("/debug/process")
            assert info["engines"]["policy"]["input_limit"] == fake.max_req_input_len == 250
            client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
            ok = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4)
            assert ok.choices[0].message is not None
            sent = len(fake.requests)
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="m", max_tokens=4,
                                                     messages=[{"role": "user", "content": "word " * 300}])
            assert caught.value.code == "context_length_exceeded" and "fewer than 250" in caught.value.message
            assert len(fake.requests) == sent  # the engine never saw it
            await client.close()
        finally:
            assert daemon.stop() == 0


@pytest.mark.slow
def test_a_launched_engine_gets_its_keys_from_a_private_file_and_clawd_uses_both(tiny_model, tmp_path):
    """The keys reach the CPU engine as SGLang's `--config` YAML (mode 0600), never on its command line;
    chat goes through with the API key, control calls (the continue at ready) with the admin key."""
    import json
    import os
    import stat
    keys = {"api_key": "sk-engine-api-1234", "admin_api_key": "sk-engine-admin-1234"}
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)}, "engine": keys})
    try:
        pid = daemon.get("/debug/process")[1]["engines"]["policy"]["pid"]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert not any(k.encode() in arg for k in keys.values() for arg in argv)
        path = argv[argv.index(b"--config") + 1].decode()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert json.loads(Path(path).read_text()) == {"api-key": keys["api_key"], "admin-api-key": keys["admin_api_key"]}
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        assert daemon.stop() == 0
    assert not [line for line in daemon.lines if "refused a control call" in line]


@pytest.mark.slow
@pytest.mark.parametrize("over", ["input_limit", "context"])
async def test_an_engine_without_a_known_limit_refusing_a_stream_gives_the_client_a_400(tiny_model, tmp_path, over):
    """Without /server_info clawd does not know the engine's limit; SGLang then refuses an over-long streamed
    prompt inside a 200 stream: an abort carrying status 400 (at the input limit), an error event carrying
    code 400 (at the context). Nothing was sent to the client yet: it gets a 400, not a broken stream."""
    from clawd.tokenizer import ChatTokenizer
    tok = ChatTokenizer(tiny_model)
    lengths = {k: len(tok.encode_chat([{"role": "user", "content": "word " * k}], None)) for k in range(400)}
    k = min(k for k, n in lengths.items() if n >= (250 if over == "input_limit" else 256))
    # At the input limit the prompt leaves room for max_tokens, so only the limit itself refuses it.
    assert (250 <= lengths[k] <= 256 - 4) if over == "input_limit" else lengths[k] >= 256
    async with FakeSGLang(context_length=256) as fake:
        fake.fail_next(404, {"detail": "Not Found"}, path="/server_info")
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "context_length": 1024},
                                   "engine": {"launch": "none", "url": fake.url, "health_interval": 0.2}},
                        wait_ready=False)
        try:
            await wait_ready_async(daemon)
            assert daemon.get("/debug/process")[1]["engines"]["policy"]["input_limit"] is None
            client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="m", max_tokens=4, stream=True,
                                                     messages=[{"role": "user", "content": "word " * k}])
            assert caught.value.code == "engine_rejected", caught.value.message
            await client.close()
        finally:
            assert daemon.stop() == 0
