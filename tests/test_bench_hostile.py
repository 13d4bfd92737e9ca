"""bench/fuzz.py's and bench/abuse.py's pure parts (the seeded cases, reply parsing, the verdict) and
bench/all.py's rows for their results. No daemon runs here: the benches themselves are the check."""
from __future__ import annotations

import collections
import datetime
import json
import random
import subprocess
from pathlib import Path

from tests.harness import load_bench

ROOT = Path(__file__).resolve().parent.parent


fuzz = load_bench("fuzz")
abuse = load_bench("abuse")
bench_all = load_bench("all", "bench_all")
HEAD = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
NOW = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)


def test_the_cases_are_the_same_for_a_seed_and_cover_every_category():
    rng_a, rng_b = random.Random(7), random.Random(7)
    assert [fuzz.body_case(rng_a) for _ in range(100)] == [fuzz.body_case(rng_b) for _ in range(100)]
    rng_a, rng_b = random.Random(3), random.Random(3)
    assert [fuzz.raw_case(rng_a) for _ in range(200)] == [fuzz.raw_case(rng_b) for _ in range(200)]
    rng = random.Random(1)
    bodies = collections.Counter(fuzz.body_case(rng)[0] for _ in range(600))
    assert set(bodies) == {"truncated", "invalid json", "wrong type", "huge number", "deep nesting", "bad utf-8",
                           "content-type", "content-encoding", "mutation", "structure", "clawd headers"}
    raws = collections.Counter(fuzz.raw_case(rng)[0] for _ in range(600))
    assert set(raws) == {"request line", "method", "path", "headers", "content-length", "transfer-encoding",
                         "injection", "nul bytes", "mutation"}


def test_a_case_is_bytes_and_a_wrong_type_lands_in_the_named_field():
    kind, body, headers = fuzz.body_case(random.Random(5))
    assert isinstance(body, bytes) and isinstance(headers, dict)
    assert json.loads(json.dumps(fuzz._put(("messages", 1, "role"), 42)))["messages"][1]["role"] == 42
    spliced = fuzz._splice(random.Random(0), [("max_tokens",)], b"1e999")
    assert b'"max_tokens": 1e999' in spliced or spliced == b"1e999"


def test_the_final_status_skips_interim_replies_and_reads_http_0_9():
    assert fuzz.STATUS_LINE.findall(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 400 Bad Request\r\n\r\n") == [b"100", b"400"]
    assert fuzz.STATUS_LINE.findall(b"HTTP/0.9 200 OK\r\nContent-Length: 2\r\n\r\n{}") == [b"200"]
    assert fuzz.STATUS_LINE.findall(b"garbage HTTP/1.1 500 x") == []


def test_big_texts_are_distinct_and_exactly_as_long_as_asked():
    texts = abuse.big_texts(random.Random(1), 5000)
    got = [next(texts) for _ in range(20)]
    assert {len(t) for t in got} == {5000} and len(set(got)) == 20


def test_a_stalled_upload_refused_at_once_is_not_a_stall():
    assert abuse.outcome_is_refusal("429") and abuse.outcome_is_refusal("400")
    assert not abuse.outcome_is_refusal("408") and not abuse.outcome_is_refusal("closed")


def abuse_result(loaded_p50: float | None = 120.0, late: int = 0, growth: float = 3.0, statuses=None) -> dict:
    statuses = statuses or {"200": 200}
    upload = {"late": late, "connections": 400}
    return {"quiet": {"p50_ms": 100.0}, "stalled": {"loaded": {"p50_ms": loaded_p50, "requests": 200,
                                                                "by_status": statuses},
                                                     "uploads": {"partial headers": upload, "partial body": upload},
                                                     "counts": {"partial headers": 400, "partial body": 400}},
            "big": {"status_5xx": 0, "rss_growth_mb": growth, "peak_growth_mb": 1.0, "peak_reset": True},
            "log": {"tracebacks": 0}, "health": {"ok": True}}


def test_abuse_judges_each_target():
    ok = abuse.judge(abuse_result())
    assert all(met for _, met in ok.values())
    assert ok["p50 stalled / quiet"] == (1.2, True)
    bad = abuse.judge(abuse_result(loaded_p50=None, late=2, growth=150.0, statuses={"429": 200}))
    assert bad["normal requests answered 200"] == ("0/200", False)
    assert bad["p50 stalled / quiet"] == (None, False)
    assert bad["stalled uploads not ended in time"] == (4, False)
    assert bad["RSS growth, after or peak (MB)"] == (150.0, False)


def test_all_py_shows_both_results_with_their_targets(tmp_path):
    prov = {"date": NOW.isoformat(timespec="seconds"), "commit": HEAD, "dirty": False}
    fuzz_result = {"provenance": prov, "requests": 20000, "status_5xx": 0, "tracebacks": 3, "log_lines_per_1000": 0.5,
                   "healthy_after": True, "targets": {"log_lines_per_1000": 5.0}, "pass": False}
    targets = abuse.judge(abuse_result(loaded_p50=900.0))
    abuse_json = {"provenance": prov, "figures": {k: v for k, (v, _) in targets.items()},
                  "met": {k: m for k, (_, m) in targets.items()}, "pass": False}
    (tmp_path / "fuzz.json").write_text(json.dumps(fuzz_result))
    (tmp_path / "abuse.json").write_text(json.dumps(abuse_json))
    head = bench_all.Head(commit=HEAD, code_date=NOW - datetime.timedelta(days=1))
    text, summary = bench_all.table(["fuzz", "abuse"], {}, None, head, tmp_path)
    missed = [line for line in text.splitlines() if line.endswith("MISSED")]
    assert len(missed) == 2  # the tracebacks and the p50 ratio
    assert any("tracebacks" in line and line.endswith("MISSED") for line in text.splitlines())
    assert any("9.00x" in line and line.endswith("MISSED") for line in text.splitlines())
    assert summary["fuzz"]["failed"] and summary["abuse"]["failed"]
