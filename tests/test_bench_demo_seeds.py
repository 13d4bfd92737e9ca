"""bench/demo_seeds.py: the demo's runs on several seeds pooled, read from their own files (no demo is run)."""
from __future__ import annotations

import json

from tests.harness import load_bench

demo_seeds = load_bench("demo_seeds")
SETTINGS = {"model": "m", "tuning": "lora", "lora_rank": 16, "mode": "rl", "judge": "rules", "lr": 3e-4, "train": [],
            "batch": 8, "max_tokens": 48, "concurrency": 8, "temperature": 0.7, "probes_per_persona": 2}


def seed_run(work, seed: int, guard: list[tuple[bool, bool]], style: list[tuple[bool, bool]], lr: float = 3e-4,
             last: int = 3):
    """A demo's output as the bench reads it: summary.json and the evaluation answers of v0 and v`last` (0: no step
    landed, v0 answered alone)."""
    out = work / f"seed-{seed}"
    out.mkdir(parents=True)
    rows = [{"kind": "answer", "persona": "concise", "style": "headed", "question": 0, "version": 1,
             "satisfied": True, "correct": True}]  # a live answer: never a probe
    for persona, of, pairs in (("guard", "correct", guard), ("concise", "satisfied", style)):
        for q, (before, after) in enumerate(pairs):
            for version, value in ((0, before), (last, after))[:1 + (last > 0)]:
                style_ = "greedy" if persona == "guard" else "sampled"
                rows.append({"kind": "probe", "persona": persona, "style": style_, "question": q, "version": version,
                             of: value, "correct" if of == "satisfied" else "satisfied": None,
                             "text": f"{persona} {q} {value}"})  # an answer that changed reads differently
    (out / "replies.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    head = {"style_up": True, "guard_non_inferior": False, "guard_n": len(guard), "guard_v0_right": 0}
    fig = {"n": 1, "diff": 0.0, "low": 0.0, "high": 0.0}
    (out / "summary.json").write_text(json.dumps({**SETTINGS, "lr": lr, "seed": seed, "headline": head,
                                                  "evaluation": {"satisfied (sampled)": fig, "guard: correct": fig},
                                                  "versions": {"0": {}, "3": {}}}))


def test_seeds_pool_by_question_and_the_targets_are_the_demos(tmp_path, capsys):
    # The guard: 20 questions, 2 lost in each seed (the same two), none won: -10 points, the same in both seeds.
    guard = [(True, False)] * 2 + [(True, True)] * 18
    style = [(False, True)] * 2  # two probes, both up in each seed
    for seed in (1, 2):
        seed_run(tmp_path, seed, guard, style)
    # A seed whose every answer stayed version 0's (its steps rolled back): nothing learnt to judge, left out.
    seed_run(tmp_path, 3, [(True, True)] * 20, [(False, False)] * 2)
    seed_run(tmp_path, 4, [(True, True)] * 20, [(False, False)] * 2, last=0)  # and one where no step landed
    out = tmp_path / "pooled.json"
    code = demo_seeds.main(["--seeds", "1,2,3,4", "--resume", "--work", str(tmp_path), "--out", str(out)])
    res = json.loads(out.read_text())
    assert code == 1 and res["pass"] is False  # the guard lost 10 points: not non-inferior
    assert res["learnt_nothing"] == [3, 4]
    g = res["guard"]["clustered"]
    assert (g["n"], g["clusters"], g["diff"], g["worse"], g["better"]) == (40, 20, -0.1, 4, 0)
    s = res["style"]["clustered"]
    assert (s["n"], s["clusters"], s["diff"]) == (4, 2, 1.0) and res["targets"]["style_up"] is True
    # Two seeds that agree question by question are one seed's evidence: the clustered interval is the wider.
    ind = res["guard"]["independent"]
    assert g["high"] - g["low"] > ind["high"] - ind["low"]
    assert "pooled guard: -10.0" in capsys.readouterr().out


def test_runs_of_different_settings_are_not_pooled(tmp_path, capsys):
    seed_run(tmp_path, 1, [(True, True)] * 4, [(False, True)])
    seed_run(tmp_path, 2, [(True, True)] * 4, [(False, True)], lr=5e-4)
    assert demo_seeds.main(["--seeds", "1,2", "--resume", "--work", str(tmp_path),
                            "--out", str(tmp_path / "x.json")]) == 2
    assert "cannot pool" in capsys.readouterr().err
