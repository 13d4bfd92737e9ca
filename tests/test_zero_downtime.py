"""Zero downtime: weights are published again and again under a steady chat load, and no request fails."""
from __future__ import annotations

import re

from .harness import Daemon
from .load import load_until_published

PUBLISHES = 5


def test_five_publishes_under_load_fail_no_request(tiny_model, tmp_path):
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 8},
                               "engine": {"launch": "local"},
                               "learner": {"enabled": True, "rollout_batch_size": 1, "min_batch_size": 1},
                               "train": {"lr": 1e-4}})
    try:
        requests, learner = load_until_published(daemon, users=4, publishes=PUBLISHES, timeout=240)
    finally:
        assert daemon.stop() == 0
    failures = [r["error"] for r in requests if not r["ok"]]
    ok = len(requests) - len(failures)
    swaps = [float(m.group(1)) for m in
             (re.search(r"published v\d+ in ([0-9.]+)s", line) for line in daemon.lines) if m]
    print(f"\n{ok} requests served, {len(failures)} failed, swaps (s): {swaps}")
    assert learner["publishes"] >= PUBLISHES and learner["failed_publishes"] == 0
    assert failures == [] and ok > 2 * PUBLISHES
    assert len(swaps) >= PUBLISHES
    versions = sorted({t["policy_version"] for t in daemon.records()})
    assert versions[0] == 0 and versions[-1] >= PUBLISHES - 1  # turns were served across the versions
