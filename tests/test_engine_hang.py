"""No engine call waits forever, and a hung engine is noticed: against the fake SGLang's hang mode (its scheduler
stuck, optionally its HTTP front end too) and the real CPU engine hung by a fault point. Deadlines are fractions
of a second, so each test takes seconds; the outer `asyncio.timeout`s only guard against a hang of the test."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
import urllib.request

import openai
import pytest

from clawd.config.loading import config_from_dict
from clawd.engine.client import EngineClient, EngineTimeout
from clawd.engine.supervisor import EngineState, EngineSupervisor

from .fake_sglang import FakeSGLang
from .harness import Daemon, wait_ready_async

PROMPT = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 40}, "rid": "r-1"}


async def _drain(stream) -> list[int]:
    ids = []
    async for chunk in stream:
        ids += chunk.ids
    return ids


async def test_a_stream_from_a_stuck_engine_ends_at_its_first_byte_deadline_and_frees_the_request():
    """SGLang sends a stream's headers at once, so headers are no sign of life: the first byte of the body must
    come within first_byte_timeout. The connection is dropped, so the engine aborts the request."""
    async with FakeSGLang() as fake:
        client = EngineClient(fake.url, first_byte_timeout=0.3, idle_timeout=5)
        await client.start()
        try:
            fake.stick()
            async with asyncio.timeout(5):
                with pytest.raises(EngineTimeout, match=r"no first byte in 0\.3s") as caught:
                    await _drain(client.stream(PROMPT))
                assert caught.value.status == 503 and caught.value.retry_after == 2
                assert client.stalls == 1
                while ("r-1", "disconnect") not in fake.aborted:
                    await asyncio.sleep(0.01)
            fake.unstick()
            assert len(await _drain(client.stream({**PROMPT, "rid": "r-2"}))) == 32
            assert client.stalls == 0  # an answer in between: the count starts again
        finally:
            await client.close()


async def test_a_stream_that_stops_mid_way_ends_at_its_idle_deadline():
    async with FakeSGLang(token_delay=0.02, incremental_streaming_output=True) as fake:
        client = EngineClient(fake.url, first_byte_timeout=5, idle_timeout=0.3, incremental_stream=True)
        await client.start()
        try:
            stream = client.stream(PROMPT)
            first = await anext(stream)
            fake.stick()
            got = list(first.ids)
            async with asyncio.timeout(5):
                with pytest.raises(EngineTimeout, match=r"nothing for 0\.3s mid-stream"):
                    async for chunk in stream:
                        got += chunk.ids
            assert 0 < len(got) < 32
        finally:
            await client.close()


async def test_a_stream_waiting_mid_way_ends_at_the_idle_deadline_not_the_first_bytes_and_at_once_when_abandoned():
    # A stream's reads share one timer, armed first for the first byte's deadline (long here): the idle one,
    # shorter, must still end a wait once the stream has started; and abandon must reach a wait under way.
    async with FakeSGLang(token_delay=0.02, incremental_streaming_output=True) as fake:
        client = EngineClient(fake.url, first_byte_timeout=30, idle_timeout=0.5, incremental_stream=True)
        await client.start()
        loop = asyncio.get_running_loop()
        try:
            stream = client.stream(PROMPT)
            await anext(stream)
            fake.stick()
            began = loop.time()
            with pytest.raises(EngineTimeout, match=r"nothing for 0\.5s mid-stream"):
                async for _ in stream:
                    pass
            assert loop.time() - began < 5  # not the first byte's 30 s
            assert client.stalls == 1 and client.quiet_for() == 0.0  # no wait left registered
            fake.unstick()

            slow = EngineClient(fake.url, first_byte_timeout=30, idle_timeout=30, incremental_stream=True)
            await slow.start()
            try:
                stream = slow.stream({**PROMPT, "rid": "r-2"})
                await anext(stream)
                fake.stick()
                rest = asyncio.create_task(_drain(stream))
                await _until(lambda: slow.quiet_for() > 0.1)  # waiting on the stuck engine
                slow.abandon("the policy engine is hung")
                with pytest.raises(EngineTimeout, match="abandoned: the policy engine is hung"):
                    await asyncio.wait_for(rest, 5)
                assert slow.stalls == 0 and slow.quiet_for() == 0.0
            finally:
                await slow.close()
        finally:
            fake.unstick()
            await client.close()


async def test_a_slow_consumer_is_not_an_idle_engine():
    """The idle deadline times the waits for the engine only: a reader that takes longer than it between chunks
    (a slow chat client) still gets the whole stream."""
    async with FakeSGLang(tokens=6, token_delay=0.05, incremental_streaming_output=True) as fake:
        client = EngineClient(fake.url, first_byte_timeout=5, idle_timeout=0.2, incremental_stream=True)
        await client.start()
        try:
            got = []
            async for chunk in client.stream(PROMPT):
                got += chunk.ids
                await asyncio.sleep(0.3)
            assert len(got) == 6
        finally:
            await client.close()


async def test_abandon_ends_a_non_streamed_call_that_only_request_timeout_bounds():
    """A non-streamed answer comes whole, so only request_timeout bounds it; the supervisor ends it sooner by
    abandoning the calls of an engine it found hung. Calls made afterwards go on as usual."""
    async with FakeSGLang() as fake:
        client = EngineClient(fake.url, first_byte_timeout=0.1, idle_timeout=0.1)
        await client.start()
        try:
            fake.stick()
            call = asyncio.create_task(client.generate(PROMPT))
            while fake.in_flight == 0:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # past both deadlines: they do not apply to it
            assert not call.done()
            client.abandon("the policy engine is hung")
            with pytest.raises(EngineTimeout, match="abandoned: the policy engine is hung"):
                await asyncio.wait_for(call, 5)
            assert client.stalls == 0  # an abandoned call is no new evidence
            fake.unstick()
            assert len((await client.generate({**PROMPT, "rid": "r-2"}))["output_ids"]) == 32
        finally:
            await client.close()


def _remote(fake: FakeSGLang, **engine) -> EngineSupervisor:
    keys = {"launch": "none", "url": fake.url, "health_interval": 0.1, "health_failures": 2,
            "first_byte_timeout": 0.2, "idle_timeout": 0.2, **engine}
    cfg = config_from_dict({"engine": keys})
    return EngineSupervisor(cfg, EngineClient(fake.url, first_byte_timeout=keys["first_byte_timeout"],
                                              idle_timeout=keys["idle_timeout"]), "policy")


async def _a_call_ends_when_found_hung(sup: EngineSupervisor, fake: FakeSGLang, reason: str) -> None:
    """On the stuck fake, a non-streamed call (only request_timeout, 600 s, bounds it) ends when the engine is
    found hung for `reason`; once unstuck, the engine counts as ready again."""
    call = asyncio.create_task(sup.client.generate(PROMPT))
    await _until(lambda: sup.state is EngineState.HUNG)
    assert reason in sup.hang_reason, sup.hang_reason
    with pytest.raises(EngineTimeout, match="abandoned"):
        await asyncio.wait_for(call, 5)
    fake.unstick()
    await _until(lambda: sup.is_ready)


async def _until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


async def _timed_out_call(client: EngineClient, rid: str) -> None:
    with pytest.raises(EngineTimeout):
        await _drain(client.stream({**PROMPT, "rid": rid}))


async def test_a_remote_engine_whose_scheduler_hangs_is_marked_hung_from_call_timeouts_and_recovers():
    """/model_info still answers (SGLang's front end does while its scheduler is stuck): health_failures calls
    in a row that time out mark the engine hung; it counts as ready again once a one-token generation answers."""
    async with FakeSGLang() as fake:
        sup = _remote(fake)
        await sup.client.start()
        task = asyncio.create_task(sup.run())
        try:
            await _until(lambda: sup.is_ready)
            fake.stick()
            await _timed_out_call(sup.client, "a")
            await asyncio.sleep(0.3)  # polls answer: one timed-out call is not a hang
            assert sup.is_ready
            await _timed_out_call(sup.client, "b")
            await _until(lambda: sup.state is EngineState.HUNG)
            assert sup.hangs == 1 and "2 engine calls in a row timed out" in sup.hang_reason
            await asyncio.sleep(0.5)  # /model_info answers, the scheduler does not: still hung
            assert sup.state is EngineState.HUNG
            fake.unstick()
            await _until(lambda: sup.is_ready)
            assert any(r.get("rid", "").startswith("clawd-probe-") for r in fake.requests)
            assert len(await _drain(sup.client.stream({**PROMPT, "rid": "c"}))) == 32
        finally:
            await sup.stop()
            task.cancel()
            await sup.client.close()


async def test_a_non_streamed_call_on_a_stuck_scheduler_is_ended_by_the_progress_check():
    """The front end answers and the call is non-streamed (its answer comes whole, so no byte deadline applies
    and only request_timeout, 600 s, bounds it): after health_interval x health_failures with no byte,
    /health_generate waits for scheduler output (0.3 s here), gets none and answers 503, so the engine is hung
    and the call is abandoned. A scheduler that is slow but moving answers the same check 200: not hung."""
    async with FakeSGLang(token_delay=0.05) as fake:
        fake.health_check_timeout = 0.3
        sup = _remote(fake, first_byte_timeout=2.0)
        await sup.client.start()
        task = asyncio.create_task(sup.run())
        try:
            await _until(lambda: sup.is_ready)
            t0 = time.monotonic()
            await sup.client.generate({**PROMPT, "rid": "slow"})  # 32 tokens at 0.05 s: no byte for 1.6 s
            assert time.monotonic() - t0 > 1.0 and sup.hangs == 0 and sup.is_ready
            fake.stick()
            await _a_call_ends_when_found_hung(sup, fake, "no progress: calls waited")
            assert sup.hangs == 1
        finally:
            await sup.stop()
            task.cancel()
            await sup.client.close()


async def test_a_remote_engine_that_stops_answering_is_marked_hung_and_its_calls_end_then_recovers():
    async with FakeSGLang() as fake:
        sup = _remote(fake)
        await sup.client.start()
        task = asyncio.create_task(sup.run())
        try:
            await _until(lambda: sup.is_ready)
            fake.stick(front_end=True)
            await _a_call_ends_when_found_hung(sup, fake, "2 liveness polls in a row failed")
        finally:
            await sup.stop()
            task.cancel()
            await sup.client.close()


async def test_a_publish_holding_the_engine_is_not_a_hang_but_a_publish_call_that_times_out_is():
    """Between pause and continue generation is held and the engine may be slow to answer: neither timed-out
    calls nor failed polls count then. A control call that runs past its own timeout is the evidence."""
    async with FakeSGLang() as fake:
        sup = _remote(fake)
        await sup.client.start()
        task = asyncio.create_task(sup.run())
        try:
            await _until(lambda: sup.is_ready)
            await sup.client.control("/pause_generation", {"mode": "retract"}, 5)
            for rid in "abc":  # held by the pause past their first-byte deadline
                await _timed_out_call(sup.client, rid)
            fake.stick(front_end=True)  # and the polls go unanswered for longer than health_failures of them
            await asyncio.sleep(2.5)
            assert sup.is_ready and sup.client.stalls == 0
            fake.unstick()
            await sup.client.control("/continue_generation", {}, 5)
            await asyncio.sleep(0.3)
            assert sup.is_ready and sup.hangs == 0
            # A publish that cannot finish: an update waits for a request that never ends (SGLang's writer lock).
            fake.hang_next()
            held = asyncio.create_task(sup.client.generate({**PROMPT, "rid": "held"}))
            await _until(lambda: fake.in_flight == 1)
            with pytest.raises(EngineTimeout, match="/update_weights_from_disk got no answer in 0.3s"):
                await sup.client.control("/update_weights_from_disk", {"model_path": "x"}, 0.3)
            await _until(lambda: sup.hangs == 1)  # and soon ready again: the fake answers the probe
            assert "a control call ran past its timeout" in sup.hang_reason
            with pytest.raises(EngineTimeout, match="abandoned"):
                await asyncio.wait_for(held, 5)
            await _until(lambda: sup.is_ready)  # the fake answers again: the probe passes
        finally:
            await sup.stop()
            task.cancel()
            await sup.client.close()


@pytest.mark.slow
async def test_a_chat_against_a_hung_engine_gets_a_503_not_a_wait(tiny_model, tmp_path):
    """Through the daemon: a streamed chat ends at first_byte_timeout with a 503 and Retry-After; once the
    engine counts as hung, chat is refused at once; a stream that stops mid-way ends with an error event.
    (Polls every second: the progress check, after 2 s of waiting with no byte, comes after the 1 s
    first-byte deadlines this test is about.)"""
    async with FakeSGLang(token_delay=0.05) as fake:
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 64},
                                   "engine": {"launch": "none", "url": fake.url, "health_interval": 1.0,
                                              "health_failures": 2, "first_byte_timeout": 1.0,
                                              "idle_timeout": 1.0}},
                        wait_ready=False)
        client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
        try:
            await wait_ready_async(daemon)
            fake.stick()
            for _ in range(2):
                with pytest.raises(openai.APIStatusError) as caught:
                    async with asyncio.timeout(10):
                        await client.chat.completions.create(**chat)
                assert caught.value.status_code == 503 and caught.value.response.headers["Retry-After"]
                assert "no first byte in 1s" in caught.value.message
            await _until(lambda: daemon.get("/ready")[0] == 503)
            assert daemon.get("/debug/process")[1]["engines"]["policy"]["state"] == "hung"
            with pytest.raises(openai.APIStatusError, match="not ready"):
                await client.chat.completions.create(**chat)
            fake.unstick()
            await wait_ready_async(daemon)
            # Mid-stream: the client already has a 200, so it gets an error event, not a hang.
            stream = await client.chat.completions.create(**chat)
            with pytest.raises(openai.APIError, match="mid-stream"):
                async with asyncio.timeout(10):
                    async for _ in stream:
                        fake.stick()
            fake.unstick()
            reply = await client.chat.completions.create(**{**chat, "stream": False})
            assert reply.choices[0].message.role == "assistant"
            await client.close()
        finally:
            assert daemon.stop() == 0
    assert len([line for line in daemon.lines if "is hung (2 engine calls in a row timed out" in line]) == 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_a_launched_engine_whose_step_never_returns_is_killed_and_restarted_and_serves_again(tiny_model, tmp_path,
                                                                                             monkeypatch):
    """The real CPU engine, its second prefill stuck by a fault point. Its HTTP loop still answers /model_info
    (the step runs on its compute thread), as SGLang's front end does while its scheduler is stuck, so the
    evidence is progress: the call waits with no byte, /health_generate sees no layer run in its wait (1 s
    here, SGLang's variable), and the engine is killed with its process group and restarted through the
    dead-engine path; the call that was waiting on it ends with a 503."""
    monkeypatch.setenv("CLAWD_FAULTS", "engine.local.prefill=hang@2")
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 4},
                               "engine": {"launch": "local", "restart_backoff_initial": 0.2, "health_interval": 0.2,
                                          "health_failures": 2, "first_byte_timeout": 5.0}})
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        first = daemon.get("/debug/process")[1]["engines"]["policy"]
        assert client.chat.completions.create(**chat).choices[0].message.role == "assistant"
        with pytest.raises(openai.APIStatusError) as caught:  # non-streamed: ended by the hang's discovery
            client.chat.completions.create(**chat)
        assert caught.value.status_code == 503 and "is hung" in caught.value.message
        daemon.wait_ready(60)
        after = daemon.get("/debug/process")[1]["engines"]["policy"]
        assert after["restarts"] == 1 and after["pid"] != first["pid"] and after["url"] == first["url"]
        assert not _alive(first["pid"])  # the daemon killed and reaped it
        assert client.chat.completions.create(**chat).choices[0].message.role == "assistant"
    finally:
        assert daemon.stop() == 0
    hung = [line for line in daemon.lines if "policy engine at" in line and "is hung" in line]
    assert len(hung) == 1 and "no progress" in hung[0] and "killing its process group" in hung[0]
    assert not [line for line in daemon.lines if "engine exited with" in line]  # one line says it all


@pytest.mark.slow
def test_a_launched_engine_busy_in_a_step_longer_than_the_liveness_window_is_not_hung(tiny_model, tmp_path,
                                                                                       monkeypatch):
    """Busy is not hung: a prefill that takes 2 s (a long prompt on a loaded machine), ten times the liveness
    window (0.2 s polls, 2 in a row). The engine answers its health checks during the step itself, the call
    completes, and nothing is restarted. Before the step left the HTTP loop, the polls went unanswered for the
    whole step and the engine was killed under its callers."""
    monkeypatch.setenv("CLAWD_FAULTS", "engine.local.prefill=slow@2")
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 4},
                               "engine": {"launch": "local", "health_interval": 0.2, "health_failures": 2}})
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        engine = daemon.get("/debug/process")[1]["engines"]["policy"]
        assert client.chat.completions.create(**chat).choices[0].message.role == "assistant"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            slow = pool.submit(client.chat.completions.create, **chat)
            answered = []  # the engine's liveness answer, each given 0.5 s, while the slow call runs
            while not slow.done():
                t0 = time.monotonic()
                with urllib.request.urlopen(engine["url"] + "/model_info", timeout=0.5) as resp:
                    answered.append((resp.status, slow.done(), time.monotonic() - t0))
                time.sleep(0.1)
            assert slow.result().choices[0].message.role == "assistant"
        during = [a for a in answered if not a[1]]
        assert len(during) >= 5 and all(status == 200 for status, _, _ in during), answered
        after = daemon.get("/debug/process")[1]["engines"]["policy"]
        assert after["restarts"] == 0 and after["hangs"] == 0 and after["pid"] == engine["pid"]
        assert after["state"] == "ready"
    finally:
        assert daemon.stop() == 0
    assert not [line for line in daemon.lines if "is hung" in line]
