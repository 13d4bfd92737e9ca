"""bench/all.py's verdicts and provenance marks, read from result files in a temporary folder (no bench runs)."""
from __future__ import annotations

import datetime
import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.harness import load_bench

ROOT = Path(__file__).resolve().parent.parent

provenance = load_bench("provenance")
bench_all = load_bench("all", "bench_all")

HEAD = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
NOW = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
CODE_DATE = NOW - datetime.timedelta(days=1)


def head() -> "bench_all.Head":
    return bench_all.Head(commit=HEAD, code_date=CODE_DATE)


def serve_result(prov: dict | None, throughput: float = 1.0, added_ms: float = 0.2) -> dict:
    cell = {"vs_direct": {"main": {"throughput_ratio": throughput, "added_p50_ms": added_ms}}}
    cpu = {"per_request_ms": {"non-stream": {"main": 0.3, "side": 0.2}}, "per_token_over_floor": {"main": 1.5}}
    out = {"judged_delays": ["0.02"], "targets": {"added_p50_ms": 1.0, "throughput_ratio": 0.8,
                                                  "cpu_ms": {"main": 0.35, "side": 0.25}, "token_over_floor": 2.0},
           "results": {"0.02": {"modes": {"non-stream": dict(cell), "stream": dict(cell)}}, "0": {"cpu": cpu}},
           "pass": True}
    if prov is not None:
        out["provenance"] = prov
    return out


def prov(commit: str = HEAD, date: datetime.datetime = NOW, dirty: bool | None = False) -> dict:
    return {"date": date.isoformat(timespec="seconds"), "commit": commit, "dirty": dirty}


@pytest.fixture
def results(tmp_path: Path) -> Path:
    return tmp_path


def write(results: Path, name: str, data: dict) -> None:
    (results / f"{name}.json").write_text(json.dumps(data))


def first_line(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(name))


def test_a_passing_bench_is_ok_with_its_date_and_commit(results):
    write(results, "serve", serve_result(prov()))
    text, summary = bench_all.table(["serve"], {"serve": 0}, {"serve": NOW}, head(), results)
    line = first_line(text, "serve")
    assert line.startswith("serve     ok")
    assert NOW.isoformat(timespec="seconds") in line and HEAD[:12] in line
    assert "STALE" not in text and "MISSED" not in text
    assert summary["serve"]["failed"] is False and summary["serve"]["verdict"] == "ok"


def test_a_failing_exit_code_is_failed_even_when_the_figures_look_fine(results):
    write(results, "serve", serve_result(prov()))
    text, summary = bench_all.table(["serve"], {"serve": 3}, {"serve": NOW}, head(), results)
    assert first_line(text, "serve").startswith("serve     FAILED (exit 3)")
    assert "MISSED" not in text  # the figures met their targets; the verdict is the exit status
    assert summary["serve"]["failed"] is True and summary["serve"]["exit_code"] == 3


@pytest.mark.parametrize("kwargs, reason", [
    ({"commit": "0" * 40}, "is not HEAD"),
    ({"dirty": True}, "dirty tree"),
    ({"date": CODE_DATE - datetime.timedelta(hours=1)}, "older than the newest commit"),
])
def test_a_stale_result_is_marked_and_fails_a_run(results, kwargs, reason):
    write(results, "serve", serve_result(prov(**kwargs)))
    started = {"serve": kwargs.get("date", NOW)}
    text, summary = bench_all.table(["serve"], {"serve": 0}, started, head(), results)
    line = first_line(text, "serve")
    assert "STALE" in line and reason in line
    assert summary["serve"]["failed"] is True  # a run was supposed to have just written a fresh one
    text, summary = bench_all.table(["serve"], {}, None, head(), results)
    assert "STALE" in first_line(text, "serve") and summary["serve"]["failed"] is False  # --no-run: shown only


def test_a_result_older_than_the_run_was_not_written_by_it(results):
    write(results, "serve", serve_result(prov(date=NOW - datetime.timedelta(minutes=5))))
    text, summary = bench_all.table(["serve"], {"serve": 0}, {"serve": NOW}, head(), results)
    assert "not written by this run" in first_line(text, "serve") and summary["serve"]["failed"] is True


def test_a_result_without_provenance_is_marked(results):
    write(results, "serve", serve_result(None))
    text, summary = bench_all.table(["serve"], {"serve": 0}, {"serve": NOW}, head(), results)
    assert "unknown provenance" in first_line(text, "serve")
    assert summary["serve"]["provenance_known"] is False and summary["serve"]["failed"] is True


def test_a_missing_result_fails(results):
    text, summary = bench_all.table(["serve"], {"serve": 0}, {"serve": NOW}, head(), results)
    assert "missing" in first_line(text, "serve") and summary["serve"]["failed"] is True


def test_no_run_never_says_ok(results, capsys):
    write(results, "serve", serve_result(prov()))
    write(results, "trainer", {"provenance": prov(), "device": "cpu", "pass": True,
                               "ratios": {"overhead": {"median": 1.0}, "packing": {"median": 2.0}},
                               "targets": {"overhead": 1.15, "packing": 1.5}})
    code = bench_all.main(["--no-run", "--only", "serve", "trainer", "--results", str(results)])
    out = capsys.readouterr().out
    assert re.search(r"\bok\b", out) is None
    assert first_line(out, "serve").startswith("serve     not run")
    assert first_line(out, "trainer").startswith("trainer   not run")
    assert code == 0  # present, readable, nothing missed: but no verdict claimed
    assert not (results / "summary.json").exists()  # the last run's record stays


def test_no_run_fails_on_a_missed_figure_or_a_recorded_fail(results, capsys):
    write(results, "serve", serve_result(prov(), added_ms=5.0))
    assert bench_all.main(["--no-run", "--only", "serve", "--results", str(results)]) == 1
    assert "MISSED" in capsys.readouterr().out


def test_a_run_takes_the_exit_status_as_verdict(results, monkeypatch, capsys):
    def fake_run(name: str, out: Path) -> tuple[int, float]:
        write(out, name, serve_result(provenance.stamp() | {"dirty": False}))
        return codes[name], 0.0

    monkeypatch.setattr(bench_all, "run", fake_run)
    codes = {"serve": 0}
    assert bench_all.main(["--only", "serve", "--results", str(results)]) == 0
    assert first_line(capsys.readouterr().out, "serve").startswith("serve     ok")
    summary = json.loads((results / "summary.json").read_text())
    assert summary["benches"]["serve"]["verdict"] == "ok" and summary["provenance"]["commit"] == HEAD
    codes["serve"] = 1
    assert bench_all.main(["--only", "serve", "--results", str(results)]) == 1
    assert first_line(capsys.readouterr().out, "serve").startswith("serve     FAILED (exit 1)")


def test_stamp_records_head_and_a_utc_date():
    result: dict = {}
    stamped = provenance.stamp(result)
    assert result["provenance"] is stamped
    assert stamped["commit"] == HEAD and len(HEAD) == 40
    assert stamped["dirty"] in (True, False)
    date = datetime.datetime.fromisoformat(stamped["date"])
    assert date.utcoffset() == datetime.timedelta(0) and abs(date - datetime.datetime.now(datetime.timezone.utc)) \
        < datetime.timedelta(minutes=1)


def test_stamp_falls_back_to_clawd_commit_outside_git(tmp_path, monkeypatch):
    monkeypatch.setenv("CLAWD_COMMIT", "abc123")
    assert provenance.commit(tmp_path) == ("abc123", None)
    monkeypatch.delenv("CLAWD_COMMIT")
    assert provenance.commit(tmp_path) == ("unknown", None)
