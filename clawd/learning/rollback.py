"""What a rollback does to the samples the trainer was fed (docs/ARCHITECTURE.md §17). Pure but for the
one file it keeps.

Rolling the trainer back to a checkpoint at step `target_step` discards the steps after it. The samples
trained since the last acknowledged checkpoint (the learner's unacknowledged ones) then fall in three:
in the target checkpoint's weights (acknowledged with the next checkpoint), trained into a version that
is being rejected or rolled back (never trained again: kept in a file for inspection), or trained into a
discarded step of a version that served well (waiting to be trained again).
"""
from __future__ import annotations

import logging
from pathlib import Path

from clawd.samples import Sample
from clawd.weights import lineage

log = logging.getLogger("clawd.learner")


def sort_unacked(unacked: list[Sample], ledger: list[dict], current_step: int, target_step: int,
                 doomed: set[int]) -> tuple[list[Sample], list[Sample], list[Sample]]:
    """(kept, dropped, again) of `unacked`, from the trained-steps ledger's lines (clawd.weights.Ledger) of the
    branch that ends at `current_step`: kept in the weights at target_step, dropped for having made a doomed
    version, or trained again."""
    lines = lineage(ledger, current_step)
    kept = {s for line in lines if line["step"] <= target_step for s in line["samples"]}
    spent = {s for line in lines if line["step"] > target_step and line.get("version") in doomed
             for s in line["samples"]}
    return ([s for s in unacked if s.sample_id in kept], [s for s in unacked if s.sample_id in spent],
            [s for s in unacked if s.sample_id not in kept and s.sample_id not in spent])


def keep_for_inspection(state_dir: Path, samples: list[Sample], versions: list[int]) -> None:
    """state_dir/rejected/vNNNNNN.samples.jsonl (the newest doomed version's number): the samples a rejected
    or rolled-back version was trained on, one `Sample.to_json()` per line (`Sample.from_json` reads it
    back). A failed write is logged."""
    if not samples:
        return
    path = Path(state_dir) / "rejected" / f"v{max(versions):06d}.samples.jsonl"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            for sample in samples:
                f.write(sample.to_json().decode() + "\n")
    except OSError as exc:
        log.error("could not keep %d rejected sample(s) in %s: %s", len(samples), path, exc)
