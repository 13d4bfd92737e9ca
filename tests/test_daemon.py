"""`daemon.run` in this process with its shutdown trigger injected: it serves, and one `request()` drains it."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import signal

import openai

from clawd.config.loading import config_from_dict
from clawd.daemon import Shutdown, run

from .fake_sglang import FakeSGLang


async def _listening(caplog, running: asyncio.Task) -> str:
    for _ in range(600):
        for record in caplog.records:
            if m := re.match(r"listening on (http://\S+)", record.getMessage()):
                return m.group(1)
        assert not running.done(), running
        await asyncio.sleep(0.05)
    raise TimeoutError("the daemon never listened")


async def test_run_serves_until_its_injected_trigger_then_drains(tiny_model, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="clawd")
    state = tmp_path / "state"
    async with FakeSGLang(tokens=4) as fake:
        cfg = config_from_dict({
            "server": {"port": 0}, "state": {"dir": str(state)}, "model": {"path": str(tiny_model)},
            "engine": {"launch": "none", "url": fake.url, "health_interval": 0.2},
            "scoring": {"mode": "rl"}, "judge": {"backend": "rules"}, "learner": {"enabled": False}})
        shutdown = Shutdown()
        running = asyncio.create_task(run(cfg, shutdown))
        url = await _listening(caplog, running)
        # The caller's trigger replaces the signals: run() installed no SIGTERM handler of its own.
        assert not asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for _ in range(100):  # the engine supervisor finds the fake ready within a health interval or two
            try:
                reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
                break
            except openai.APIStatusError as exc:
                assert exc.status_code == 503, exc
                await asyncio.sleep(0.1)
        await client.close()
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert not running.done()

        shutdown.request()
        assert await asyncio.wait_for(running, 60) == 0
    # The drain closed the live session: its turn went through the handover to the records.
    (turn,) = [json.loads(line) for path in (state / "records").glob("turns-*.jsonl")
               for line in path.read_text().splitlines()]
    assert turn["reason"] == "shutdown" and turn["next_state"] is None
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("stopping: draining requests") for m in messages) and messages[-1] == "stopped"
