"""bench/crash.py: its pure lineage audit on exact values. The real thing (daemon and trainer SIGKILLs, every
target judged by its exit status) runs in `make bench` (bench/all.py), not here: a run of even one kill of each
costs two daemon lives (~27 CPU-s), and tests/test_crash_safety.py holds the same invariants over five kills."""
from __future__ import annotations

import json
import random
from collections import Counter

from tests.harness import load_bench

crash = load_bench("crash", "bench_crash")


def line(step: int, batch: str, samples: list[str], version: int | None = None) -> dict:
    return {"step": step, "batch_id": batch, "version": version, "samples": samples}


def test_lineage_keeps_the_last_line_of_each_step_up_to_the_final_checkpoint():
    lines = [line(1, "a", ["s1", "s2"], 1), line(2, "b", ["s3"], 2),
             line(3, "c", ["s4"], None),          # killed before its checkpoint...
             line(2, "d", ["s3", "s5"], 3),       # ...resumed from the checkpoint at 1: step 2 again
             line(3, "e", ["s4"], 4),
             line(4, "f", ["s6"], None)]          # after the final checkpoint: not in the weights
    assert crash.lineage(lines, 3) == {1: lines[0], 2: lines[3], 3: lines[4]}
    assert crash.lineage(lines, 0) == {}
    assert list(crash.lineage(lines, 3).values()) == crash.clawd_lineage(lines, 3)


def test_audit_finds_lost_duplicated_and_missing():
    steps = {1: line(1, "a", ["s1", "s2"]), 2: line(2, "b", ["s2", "s3"]), 4: line(4, "d", ["s4", "s4"])}
    assert crash.audit(steps, 4, {"s1", "s2", "s3", "s4", "s9"}) == {
        "lineage_steps": 3, "lineage_samples": 4, "missing_steps": [3],
        "lost": ["s9"], "duplicated": ["s2", "s4"]}
    assert crash.audit({}, 0, set()) == {"lineage_steps": 0, "lineage_samples": 0, "missing_steps": [],
                                         "lost": [], "duplicated": []}


def test_read_ledger_counts_lines_it_cannot_read(tmp_path):
    path = tmp_path / "steps.jsonl"
    assert crash.read_ledger(path) == ([], 0)
    good = line(1, "a", ["s1"], 1)
    path.write_text(json.dumps(good) + "\n\n" + '{"step": "2"}\n' + "[1]\n" + '{"step": 3, "sam')
    assert crash.read_ledger(path) == ([good], 3)


def test_choose_spreads_the_kinds_and_stops_when_enough_landed():
    rng = random.Random(1)
    assert crash.choose(rng, Counter(checkpoint=1, publish=0, sigkill=1), 10, 1) == "publish"
    assert crash.choose(rng, Counter(checkpoint=2, publish=2, sigkill=1), 5, 1) is None
    assert crash.choose(rng, Counter(), 3, 1) in crash.KINDS
