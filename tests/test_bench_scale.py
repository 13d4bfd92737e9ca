"""bench/scale.py's pure parts, its fake engine's per-session counts, and bench/all.py's rows for its result."""
from __future__ import annotations

import json
import urllib.request

from tests.harness import load_bench

scale = load_bench("scale", "bench_scale")
bench_all = load_bench("all", "bench_all")

END = 9  # stands for the model's <|im_end|>


def test_a_session_key_covers_the_ids_up_to_the_first_end_and_no_further():
    assert scale.session_key([5, 6, END, 7], END) == scale.session_key([5, 6, END, 8, 8], END)
    assert scale.session_key([5, 6, END], END) != scale.session_key([5, 7, END], END)
    # a prompt without an end id is keyed whole
    assert scale.session_key([5, 6], END) == scale.session_key([5, 6], END) != scale.session_key([5, 6, 1], END)
    assert len(scale.session_key([1, END], END)) == 16


def test_scaling_is_judged_against_n_times_one_replica():
    verdict = scale.scaling_verdict({1: 10.0, 2: 18.0, 4: 35.0})
    assert verdict == {2: {"ratio": 0.9, "ok": True}, 4: {"ratio": 0.875, "ok": False}}
    assert scale.scaling_verdict({1: 0.0, 2: 5.0}) == {2: {"ratio": 0.0, "ok": False}}


def test_every_session_names_itself_first_in_its_system_prompt():
    a, b = scale.system_text("r0n1-3", 5), scale.system_text("r0n1-4", 5)
    assert a.startswith("Session r0n1-3. ") and b.startswith("Session r0n1-4. ")
    assert a.split(". ", 1)[1] == b.split(". ", 1)[1]  # the rest is shared


def test_the_fake_engine_counts_requests_per_session_and_writes_them_on_sigterm(tmp_path):
    proc, url, stats = scale.start_fake(tmp_path, "fake", tokens=3, eos_id=END, delay=0.0, slots=2)
    try:
        for ids in ([1, 2, END, 4], [1, 2, END, 4, 5, 6], [1, 3, END]):
            body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 8}}).encode()
            request = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as resp:
                assert json.loads(resp.read())["meta_info"]["completion_tokens"] == 3
    finally:
        scale.stop(proc)
    assert proc.returncode == 0
    assert json.loads(stats.read_text()) == {scale.session_key([1, 2, END], END): 2,
                                             scale.session_key([1, 3, END], END): 1}


def result(ratios: dict, split: int = 0) -> dict:
    return {"sections": {
        "serving": {"targets": {"scaling": 0.9},
                    "scaling": {n: {"ratio": r, "ok": r >= 0.9} for n, r in ratios.items()},
                    "results": {"1": {"sessions_on_two_replicas": 0}, "2": {"sessions_on_two_replicas": split}}},
        "daemon": {"cpu": {"main": {"req_per_clawd_core_s": 303.2}}, "memory": {"kb_per_session": 18.0}}}}


def test_all_py_shows_each_replica_count_against_its_target():
    rows = bench_all.scale(result({"2": 0.95, "4": 0.5}))
    assert [(r["figure"], r["shown"], r["ok"]) for r in rows] == [
        ("2 replicas: req/s / (2 x one replica)", "0.95", True),
        ("4 replicas: req/s / (4 x one replica)", "0.50", False),
        ("  sessions that reached two replicas", "0", True),
        ("main turns per clawd core-second (fake engine)", "303", None),
        ("  RSS per live session (kB)", "18.0", None)]
    assert bench_all.scale(result({"2": 1.0}, split=3))[1]["ok"] is False


def test_all_py_shows_the_trainer_ranks_share_against_its_target():
    r = {"sections": {"trainer": {"ratios": [0.5, 0.51], "pass": True}}}
    assert [(row["figure"], row["shown"], row["target"], row["ok"]) for row in bench_all.scale(r)] == [
        ("trainer: params + AdamW per rank of 2 / one process", "0.51", "0.45-0.55", True)]
