"""The whole loop in the real daemon: chat → rules judge → journal → trainer child → publish → engine swap."""
from __future__ import annotations

import time

import openai
import pytest

from .harness import Daemon


def _wait(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    return None


@pytest.mark.slow
def test_judged_turns_are_trained_and_the_engine_serves_the_new_version(tiny_model, tmp_path):
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 6},
                               "engine": {"launch": "local"},
                               "learner": {"enabled": True, "rollout_batch_size": 2, "min_batch_size": 1},
                               "train": {"checkpoint_every": 1,
                                         "optimizer": {"lr": 1e-3}}})  # acked at once (default: 10th)
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
        for i in range(2):
            messages = [{"role": "user", "content": f"Tell me fact {i}."}]
            reply = client.chat.completions.create(model="m", messages=messages)
            assert reply.system_fingerprint == "clawd-v0"
            # one thanked, one corrected: rewards that all agreed would centre to 0 and take no step
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "Thanks, great answer!" if i == 0 else "No, that's wrong."}]
            client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Session-Done": "1"})

        learner = _wait(lambda: (lambda l: l if l["publishes"] >= 1 else None)(
            daemon.get("/debug/process")[1]["learner"]), 120)
        assert learner, daemon.get("/debug/process")[1]
        assert learner["steps"] == 1 and learner["samples_trained"] == 2
        assert daemon.get("/debug/process")[1]["policy"]["version"] == 1
        assert daemon.get("/ready")[1]["policy_version"] == 1

        # Serving goes on, on the new weights; the turn carries the version that served it.
        again = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}],
                                               extra_headers={"X-Session-Done": "1"})
        assert again.system_fingerprint == "clawd-v1"  # clients can tell which policy answered
        queue = daemon.get("/debug/process")[1]["queue"]
        assert (queue["waiting"], queue["journal_live"]) == (0, 0)  # acked after checkpoint
    finally:
        assert daemon.stop() == 0
    turns = daemon.records()
    assert [t["policy_version"] for t in turns if t["messages"][0]["content"] == "again"] == [1]
    assert [t["weight_version"] for t in turns if t["messages"][0]["content"] == "again"] == ["1"]
    assert (daemon.state / "weights" / "v000001" / "config.json").exists()
    assert any((daemon.state / "checkpoints").iterdir())
    assert daemon.samples() == []  # consumed and compacted: nothing to replay
