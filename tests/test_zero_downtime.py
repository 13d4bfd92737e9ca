"""Zero downtime: weights are published again and again under a steady chat load (over the replica's
weight-update group: disk publishes are under load in the learning tests), no request fails, and
requests were in flight during every publish (the overlap the claim rests on, read from the daemon's log:
each hold, the engine's pause to its continue, overlaps requests that were served in full)."""
from __future__ import annotations

import re

import pytest

from .harness import Daemon
from .load import load_until_published, publish_windows

PUBLISHES = 5


@pytest.mark.slow
def test_five_publishes_under_load_fail_no_request(tiny_model, tmp_path):
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 8},
                               # over the replica's weight-update group (gloo): its pause too must hold no one
                               "engine": {"launch": "local", "weight_sync": "distributed"},
                               "learner": {"enabled": True, "rollout_batch_size": 1, "min_batch_size": 1},
                               "train": {"optimizer": {"lr": 1e-4}}})
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
    sync = learner["weight_sync"]
    assert sync["pushes"] >= PUBLISHES and sync["fallbacks"] == 0, sync  # not one publish went by disk
    assert failures == [] and ok > 2 * PUBLISHES
    assert len(swaps) >= PUBLISHES
    versions = sorted({t["policy_version"] for t in daemon.records()})
    assert versions[0] == 0 and versions[-1] >= PUBLISHES - 1  # turns were served across the versions
    # The first PUBLISHES publishes happened under load (it stops once they are made; later ones may not).
    windows = publish_windows(daemon.lines)[:PUBLISHES]
    assert len(windows) == PUBLISHES and all(w["hold_start"] is not None for w in windows), windows
    # In flight during each hold: served requests that were running when the engine paused (parked, then
    # finished on the new weights) or that arrived while it was paused (they waited, then were served).
    during = {w["version"]: [r for r in requests if r["ok"] and r["start"] < w["hold_end"] and r["end"] > w["hold_start"]]
              for w in windows}
    parked = {w["version"]: sum(1 for r in during[w["version"]] if r["start"] < w["hold_start"]) for w in windows}
    print(f"served requests in flight during each publish's hold: {({v: len(rs) for v, rs in during.items()})}, "
          f"of which running when it paused: {parked}")
    assert all(during.values()), {v: len(rs) for v, rs in during.items()}
    assert sum(parked.values()) >= 1  # the retract path too: a request running at a pause was served in full

