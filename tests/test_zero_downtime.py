"""Zero downtime: weights are published again and again under a steady chat load, and no request fails."""
from __future__ import annotations

import re
import threading
import time

import openai

from .harness import Daemon

PUBLISHES = 5


def test_five_publishes_under_load_fail_no_request(tiny_model, tmp_path):
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 8},
                               "engine": {"launch": "local"},
                               "learner": {"enabled": True, "rollout_batch_size": 1, "min_batch_size": 1},
                               "train": {"lr": 1e-4}})
    ok, failures, stop = [0], [], threading.Event()

    def user(n: int) -> None:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0, timeout=60)
        i = 0
        while not stop.is_set():
            i += 1
            messages = [{"role": "user", "content": f"User {n}, question {i}."}]
            try:
                if i % 2:  # every other conversation is thanked: a +1 sample, then a training step
                    reply = client.chat.completions.create(model="m", messages=messages)
                    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                                 {"role": "user", "content": "Thanks, that's perfect."}]
                stream = client.chat.completions.create(model="m", messages=messages, stream=True,
                                                        extra_headers={"X-Session-Done": "1"})
                assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in stream)
                ok[0] += 1 + (i % 2)
            except Exception as exc:  # any failure at all is what this test counts
                failures.append(repr(exc))

    users = [threading.Thread(target=user, args=(n,), daemon=True) for n in range(4)]
    try:
        for t in users:
            t.start()
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            learner = daemon.get("/debug/process")[1]["learner"]
            if learner["publishes"] >= PUBLISHES:
                break
            time.sleep(0.2)
        stop.set()
        for t in users:
            t.join(60)
        learner = daemon.get("/debug/process")[1]["learner"]
    finally:
        stop.set()
        assert daemon.stop() == 0
    swaps = [float(m.group(1)) for m in
             (re.search(r"published v\d+ in ([0-9.]+)s", line) for line in daemon.lines) if m]
    print(f"\n{ok[0]} requests served, {len(failures)} failed, swaps (s): {swaps}")
    assert learner["publishes"] >= PUBLISHES and learner["failed_publishes"] == 0
    assert failures == [] and ok[0] > 2 * PUBLISHES
    assert len(swaps) >= PUBLISHES
    versions = sorted({t["policy_version"] for t in daemon.records()})
    assert versions[0] == 0 and versions[-1] >= PUBLISHES - 1  # turns were served across the versions
