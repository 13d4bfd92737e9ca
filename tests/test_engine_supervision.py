"""clawd supervises the CPU engine it launches: restarts it, and never leaves it orphaned."""
import os
import signal
import time

import openai
import pytest

from .harness import Daemon


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split(")")[1].split()[0] != "Z"


def _wait(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def daemon(tiny_model, tmp_path):
    d = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 4},
                          "engine": {"launch": "local", "restart_backoff_initial": 0.2}})
    yield d
    d.stop()


@pytest.mark.slow
def test_a_dead_engine_is_restarted_and_service_recovers(daemon):
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
    first = daemon.get("/debug/process")[1]
    os.kill(first["engines"]["policy"]["pid"], signal.SIGKILL)
    assert _wait(lambda: daemon.get("/ready")[0] == 503, 10)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 503 and info.value.response.headers["Retry-After"]
    assert _wait(lambda: daemon.get("/ready")[0] == 200, 60)
    after = daemon.get("/debug/process")[1]
    assert after["engines"]["policy"]["restarts"] == 1 and after["engines"]["policy"]["pid"] != first["engines"]["policy"]["pid"]
    assert after["engines"]["policy"]["url"] == first["engines"]["policy"]["url"]  # same port: clawd keeps the socket
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.role == "assistant"


@pytest.mark.slow
def test_sigkill_of_the_daemon_takes_the_engine_with_it(daemon):
    engine_pid = daemon.get("/debug/process")[1]["engines"]["policy"]["pid"]
    daemon.proc.kill()
    daemon.proc.wait()
    assert _wait(lambda: not _alive(engine_pid), 10)


@pytest.mark.slow
def test_sigterm_stops_daemon_and_engine_cleanly(daemon):
    engine_pid = daemon.get("/debug/process")[1]["engines"]["policy"]["pid"]
    assert daemon.stop() == 0
    assert not _alive(engine_pid)
