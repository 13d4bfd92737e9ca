"""The learning view's data (`GET /dashboard/data`, clawd.ops.dashboard): one dict assembled from what the
stages already keep: the status snapshot, the version history, the live monitors and the last steps.

Ops reads, owns nothing: the daemon hands this the objects and the page gets the contract that
clawd.ops.dashboard documents. Large parts are left out (a gate's per-prompt outcomes, a tally's texts).
"""
from __future__ import annotations

import statistics
import time
from collections import Counter, deque
from typing import Any

from clawd.config.monitors import DEFAULT_RULES

MONITOR_KEYS = tuple(DEFAULT_RULES)
GATE_KEYS = ("score", "incumbent", "diff", "low", "high", "passed", "detail")
VERSIONS_SHOWN = 200
STEPS_KEPT = 50
ROLLOUT_KEYS = ("running", "groups", "answers", "solved", "backlog")


class StepLog:
    """The last STEPS_KEPT training steps, as the page plots them."""

    def __init__(self) -> None:
        self.steps: deque[dict[str, Any]] = deque(maxlen=STEPS_KEPT)

    def add(self, trained, batch) -> None:
        m = trained.metrics
        self.steps.append({"step": (trained.state or {}).get("step"), "version": trained.version, "time": time.time(),
                           "samples": len(batch), "loss": m.get("loss"), "kl": m.get("loss_kl"),
                           "entropy": m.get("entropy"), "sources": dict(Counter(s.source for s in batch)),
                           "reward_mean": statistics.fmean(s.reward for s in batch) if batch else None})


def learning_view(snapshot: dict, versions, monitors, steps: StepLog, samples_per_minute: float) -> dict[str, Any]:
    """The dashboard's dict: `snapshot` is the status snapshot (clawd.ops.status), `versions` the history
    (clawd.safety.versions.Versions), `monitors` the live tallies (clawd.safety.monitors.Monitors) or None."""
    live = monitors.snapshot() if monitors is not None else {}
    feedback = snapshot.get("feedback")
    calibration = feedback["calibration"] if feedback and feedback["enabled"] else None
    agreement = {} if calibration is None else {int(v): s["agreement"] for v, s in calibration["versions"].items()}

    def row(v: dict) -> dict:
        kept = v["monitors"] or {}
        summary = live.get(v["version"]) or kept.get("summary") or {}
        return {"version": v["version"], "parent": v["parent"], "created": v["created"], "status": v["status"],
                "steps": len(v["steps"]), "samples": v["samples"],
                "gate": None if v["gate"] is None else {k: v["gate"].get(k) for k in GATE_KEYS},
                "monitors": {"replies": summary.get("replies") or 0, **{k: summary.get(k) for k in MONITOR_KEYS}},
                "judge_agreement": agreement.get(v["version"]),
                "alarms": [{"monitor": a["monitor"], "action": a["action"], "detail": a["detail"]}
                           for a in kept.get("alarms", [])]}

    paused = snapshot["paused"]
    return {"generated": time.time(), "policy": {"version": snapshot["policy"]["version"]},
            "learning": {"paused": bool(paused["learning"]),
                         "reasons": [{"reason": r["reason"], "detail": r["detail"], "since": r["since"]}
                                     for r in paused["reasons"]]},
            "queue": {"waiting": snapshot["queue"]["waiting"], "batch": snapshot["queue"]["batch_size"]},
            "samples_per_minute": samples_per_minute,
            "rollouts": None if (r := snapshot.get("rollouts")) is None else {k: r[k] for k in ROLLOUT_KEYS},
            "feedback": None if calibration is None else _ratings_view(feedback, calibration),
            "own_adapters": None if (lineages := snapshot.get("lineages")) is None else {
                "adapters": lineages["adapters"], "max": lineages["max_adapters"],
                "versions": {ln["lineage"]: ln["version"] for ln in lineages["principals"].values()}},
            "versions": [row(v) for v in versions.snapshot(VERSIONS_SHOWN)],
            "steps": list(steps.steps)}


def _ratings_view(feedback: dict, calibration: dict) -> dict[str, Any]:
    """Users' ratings and the judge's agreement with them, overall, and the calibration alarms standing."""
    overall = calibration["all"]
    low, high = overall["interval"] or (None, None)
    return {"ratings": sum(feedback["received"].values()), "judged": overall["judged"],
            "agreement": overall["agreement"], "low": low, "high": high,
            "alarms": [{"scope": a["scope"], "key": str(a["key"]), "agreement": a["agreement"], "judged": a["judged"]}
                       for a in calibration["alarms"]]}
