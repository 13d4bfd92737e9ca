"""Active rollouts in a running daemon: groups drawn beside live chat on the real CPU engine (the tiny model),
scored by a deployment checker in the worker, journaled with their source and trained by the real trainer."""
import json
import time
import urllib.request

import openai
import pytest

from clawd.ops.ctl import main as ctl

from .harness import Daemon


def wait(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_a_daemon_draws_rollout_groups_beside_live_chat_and_trains_them(tiny_model, tmp_path):
    rollout_set = tmp_path / "set.jsonl"
    rollout_set.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": f"Say {i}."}],
                                               "check": {"callable": "tests.rollout_targets:odd_length"}}) + "\n"
                                   for i in range(3)))
    daemon = Daemon(tmp_path, {
        "model": {"path": str(tiny_model), "max_tokens_cap": 8}, "engine": {"launch": "local"},
        "learner": {"enabled": True, "rollout_batch_size": 4, "min_batch_size": 1, "rollout_timeout": 1.0},
        "rollouts": {"enabled": True, "set": str(rollout_set), "samples_per_prompt": 4, "max_new_tokens": 6,
                     "concurrency": 2, "live_headroom": 4},
        "train": {"checkpoint_every": 1000}, "auth": {"trust_user_field": True}})
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert reply.choices[0].message.content is not None  # live chat is served beside the rollouts
        deadline, status = time.monotonic() + 120, {}
        while time.monotonic() < deadline:
            status = daemon.get("/debug/process")[1]
            if status["rollouts"]["samples"] >= 4 and status["learner"]["samples_trained"] >= 4:
                break
            time.sleep(0.5)
        rollouts = status["rollouts"]
        # every sample trained is a rollout's: the one live turn waits for its user's next message to be judged
        assert status["scoring"]["samples"] == 0 and status["learner"]["samples_trained"] >= 4, (rollouts, status)
        assert status["learner"]["steps"] >= 1 and rollouts["groups"] >= 1 and rollouts["checker_failures"] == 0
        assert rollouts["answers"] == 4 * rollouts["groups"] and rollouts["worker"]["pid"]

        # clawctl: pause holds the source (no group starts), status says so, resume lets it go on
        socket = str(daemon.state / "clawd.sock")
        assert ctl(["--socket", socket, "rollouts", "pause"]) == 0
        paused = daemon.get("/debug/process")[1]["rollouts"]
        time.sleep(1.5)
        held = daemon.get("/debug/process")[1]["rollouts"]
        assert not held["running"] and held["groups"] <= paused["groups"] + 1  # one in progress may finish
        assert ctl(["--socket", socket, "--json", "rollouts"]) == 0
        assert ctl(["--socket", socket, "rollouts", "resume"]) == 0
        assert wait(lambda: daemon.get("/debug/process")[1]["rollouts"]["groups"] > held["groups"], 60)
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        for name in ("clawd_rollouts_running 1.0", "clawd_rollout_groups_total",
                     'clawd_rollout_failures_total{kind="checker"} 0.0', 'clawd_rollout_waits_total{for="live"}'):
            assert name in metrics, name
        # the rollouts' principal is no person's: not forgotten, not posed as by a client
        assert ctl(["--socket", socket, "forget", "@rollouts/set"]) == 1
        with pytest.raises(openai.BadRequestError, match="reserved"):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           user="@rollouts/set")
    finally:
        assert daemon.stop() == 0
    journaled = [s for s in daemon.samples() if s.source == "set"]  # not yet trained (others were acknowledged)
    assert all(s.principal == "@rollouts/set" and s.advantage is not None for s in journaled)
    lines = "".join(daemon.lines)
    assert "Traceback" not in lines
    groups = [json.loads(line) for path in sorted((daemon.state / "records").glob("rollouts-*.jsonl"))
              for line in path.read_text().splitlines()]
    assert groups and all(g["source"] == "set" and g["item"] in ("q0", "q1", "q2") and len(g["answers"]) == 4
                          for g in groups)
    kept = [g for g in groups if g["kept"]]
    assert kept and all(sum(a["advantage"] for a in g["answers"]) == pytest.approx(0, abs=1e-12) for g in kept)
    assert all(a["reward"] == float(len(a["reply"]) % 2) for g in groups for a in g["answers"])  # odd_length
