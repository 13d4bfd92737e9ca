"""`bin/clawctl` against a live daemon: pause keeps serving but makes no samples, `pause --serving`
refuses chat with 503 + Retry-After, resume, status, and the pause state across a restart."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from .harness import ROOT, Daemon
from .load import free_port


def clawctl(daemon: Daemon, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "bin/clawctl"), "--config", str(daemon.config_path), *args],
                          capture_output=True, text=True, env=env, timeout=30, cwd=daemon.tmp)


def status(daemon: Daemon) -> dict:
    done = clawctl(daemon, "status", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def thanked_conversation(client: openai.OpenAI, text: str) -> None:
    messages = [{"role": "user", "content": text}]
    reply = client.chat.completions.create(model="m", messages=messages)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Thanks!"}]
    client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Session-Done": "1"})


def settle(daemon: Daemon, samples: int, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        snap = status(daemon)
        if snap["scoring"]["pending"] == 0 and snap["queue"]["journal_live"] == samples:
            return snap
        assert time.monotonic() < deadline, snap
        time.sleep(0.1)


@pytest.mark.slow
def test_pause_resume_and_status_against_a_live_daemon(tiny_model, tmp_path):
    sections = {"model": {"path": str(tiny_model), "max_tokens_cap": 4}, "engine": {"launch": "local"}}
    daemon = Daemon(tmp_path, sections)
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
        thanked_conversation(client, "one")
        snap = settle(daemon, samples=1)
        assert snap["mode"] == "rl" and snap["paused"]["learning"] is False and snap["policy"]["version"] == 0
        assert snap["engines"]["policy"]["state"] == "ready" and snap["scoring"]["votes"] == {"+1": 1}
        assert snap["rates"]["requests_per_min"] == 2 and snap["rates"]["turns_per_min"] == 2
        assert snap["learner"] is None and snap["trainer"] is None and snap["journal"]["size_bytes"] > 0

        done = clawctl(daemon, "pause", "--reason", "audit")
        assert done.returncode == 0 and "learning" in done.stdout
        thanked_conversation(client, "two")  # served and recorded, but no sample
        snap = settle(daemon, samples=1)
        assert snap["paused"]["learning"] is True and snap["paused"]["serving"] is False
        assert [(p["reason"], p["detail"]) for p in snap["paused"]["reasons"]] == [("operator", "audit")]
        assert snap["scoring"]["not_learned_while_paused"] == 2
        assert "paused" in clawctl(daemon, "status").stdout.lower()

        assert clawctl(daemon, "pause", "--serving").returncode == 0
        request = urllib.request.Request(daemon.url + "/v1/chat/completions", method="POST",
                                         data=json.dumps({"model": "m", "messages": [
                                             {"role": "user", "content": "three"}]}).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=10)
            raise AssertionError("served while paused")
        except urllib.error.HTTPError as exc:
            assert exc.code == 503 and int(exc.headers["Retry-After"]) > 0
            assert json.loads(exc.read())["error"]["code"] == "paused"
        assert daemon.get("/health")[0] == 200

        assert clawctl(daemon, "resume").returncode == 0
        thanked_conversation(client, "four")
        assert settle(daemon, samples=2)["paused"]["learning"] is False
        assert clawctl(daemon, "pause").returncode == 0  # left paused: kept across the restart
    finally:
        assert daemon.stop() == 0
    assert len(daemon.samples()) == 2
    assert [t["messages"][0]["content"] for t in daemon.records()] == ["one", "one", "two", "two", "four", "four"]

    # The restarts only read the pause state back: no engine is launched for them (it would cost ~5 s of
    # CPU each to load); the daemon answers status while its engine is unreachable.
    no_engine = {**sections, "engine": {"launch": "none", "url": f"http://127.0.0.1:{free_port()}"}}
    again = Daemon(tmp_path, no_engine, wait_ready=False)
    try:
        assert status(again)["paused"]["learning"] is True
    finally:
        assert again.stop() == 0
    unpaused = Daemon(tmp_path, {**no_engine, "admin": {"start_paused": False}}, wait_ready=False)
    try:
        assert status(unpaused)["paused"]["learning"] is False
    finally:
        assert unpaused.stop() == 0
    done = clawctl(unpaused, "status")
    assert done.returncode == 3, (done.stdout, done.stderr)  # nothing listens any more
