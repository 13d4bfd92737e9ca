"""The monitors' watch (clawd/safety/watch.py) on real Monitors and Versions: what it judges a version against."""
from __future__ import annotations

from clawd.pauses import Pauses
from clawd.safety.monitors import Monitors
from clawd.safety.versions import SERVING, Version, Versions
from clawd.safety.watch import Watch
from clawd.config.monitors import MonitorsConfig
from clawd.served import Policy


def _serve(monitors: Monitors, version: int, texts: list[str]) -> None:
    for text in texts:
        monitors.observe_turn(version, {"kind": "answer", "version": version, "text": text,
                                        "finish_reason": "stop", "response_ids": [1, 2, 3]})


async def test_the_base_version_is_never_judged_against_itself(tmp_path):
    """v0 served varied probes first (clean), then users whose questions share an opening: its own traffic
    changed, it did not drift. Before the fix v0 was compared with its own earlier summary and 'rolled back'
    (learning halted: no clean version had a checkpoint), as a demo run found."""
    monitors = Monitors(MonitorsConfig(min_replies=8, baseline_versions=2))
    versions = Versions(tmp_path / "versions.jsonl")
    versions.add(Version(version=0, parent=None, created=0.0, status=SERVING))
    pauses = Pauses(tmp_path / "pauses.json", start_paused=False)
    watch = Watch(monitors, versions, Policy(version=0), pauses, tmp_path, None, interval=0.1)
    words = "apples rivers clocks maps tea stones birds lamps snow wheels honey paper".split()
    _serve(monitors, 0, [f"{w} are what I would say about {w} today." for w in words])
    assert await watch.check() == [] and versions.get(0).monitors["clean"]
    _serve(monitors, 0, [f"The capital of country {i} is city {i}." for i in range(40)])
    assert await watch.check() == [] and not pauses.held  # nothing to compare v0 with: no alarm, no halt
    # v1 collapsed into one reply is judged against v0 and alarms: the check itself still works
    versions.add(Version(version=1, parent=0, created=1.0, status=SERVING))
    watch.policy = Policy(version=1)
    _serve(monitors, 1, ["The answer is a planet."] * 40)
    assert "top_reply_share" in [a.monitor for a in await watch.check()] and pauses.held
