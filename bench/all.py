"""`make bench`: every benchmark under bench/, then one table of their verdicts and headline figures.

Each script measures its figures side by side in its own run, writes bench/results/<name>.json
stamped with its `provenance` (bench/provenance.py: date, commit, dirty) and exits 0 only when it
measured and met its targets. This runs them one after another (never together: on a small machine
they would measure each other); each bench's verdict is its exit status (`ok`, or `FAILED (exit N)`),
shown first in its block with the result's date and commit, then the few figures that answer "is
clawd fast enough here" with the target each is judged against (`met` / `MISSED`).

A result is marked STALE when its commit is not HEAD, when it was measured on a dirty tree, when it
is older than the newest commit touching clawd/ or bench/, or (after a run) when this run did not
write it; a result without provenance is marked "unknown provenance".

Each script runs in its full form except scale.py, which runs `--quick` (ARGS below).

    .venv/bin/python bench/all.py                  # run everything: ~29 min on 2 cores, plus crash.py's
                                                   # 200 + 100 kills (over an hour; --only to leave it out)
    .venv/bin/python bench/all.py --only trainer swap
    .venv/bin/python bench/all.py --no-run         # the table from the last results: verdict "not run"

Exit status, after a run: 0 only when every bench it ran exited 0 and every result shown is fresh
(written by this run, at HEAD, on a clean tree) with no figure MISSED; else 1. The table is also
written to <results>/summary.json. With --no-run: 0 when every result is there, readable, and
neither missed a figure nor records `"pass": false` (STALE marks are shown, not judged: nothing was
supposed to be fresh); else 1. --no-run leaves summary.json, the last run's record, alone.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
SCRIPTS = ("serve", "pipeline", "trainer", "swap", "publish", "lora", "learning", "opd_signal", "fuzz", "abuse",
           "crash", "scale", "pii", "startup", "liveness", "rollouts")
OUT_FLAG = {"serve": "--out", "pipeline": "--output", "trainer": "--out", "swap": "--json", "publish": "--json",
            "lora": "--out", "learning": "--out", "fuzz": "--out", "abuse": "--out", "crash": "--out", "scale": "--out",
            "pii": "--out", "startup": "--out", "opd_signal": "--out", "liveness": "--out", "rollouts": "--out"}
# scale.py's full form takes ~4 min on top of serve.py's similar figures; its quick form answers "does it scale".
ARGS = {"scale": ["--quick"]}
if str(HERE) not in sys.path:  # run as a script it is already there; imported (by a test) it is not
    sys.path.insert(0, str(HERE))
import provenance  # noqa: E402


def _row(figure: str, value: float | None, fmt: str, target: str = "", ok: bool | None = None) -> dict:
    return {"figure": figure, "value": value, "shown": "-" if value is None else fmt.format(value),
            "target": target, "ok": ok}


def serve(r: dict) -> list[dict]:
    delay = r["judged_delays"][0]
    rows = []
    for mode in ("non-stream", "stream"):
        cell = r["results"][delay]["modes"][mode]["vs_direct"]["main"]
        rows.append(_row(f"{mode} main throughput, clawd / direct", cell["throughput_ratio"], "{:.2f}x", ">= 0.80",
                         cell["throughput_ratio"] >= r["targets"]["throughput_ratio"]))
        rows.append(_row(f"{mode} main added p50 latency (ms)", cell["added_p50_ms"], "{:+.1f}", "<= 1",
                         cell["added_p50_ms"] <= r["targets"]["added_p50_ms"]))
    cpu = (r["results"].get("0") or {}).get("cpu")  # CPU per request: at delay 0, as serve.py judges it
    if cpu:
        for path, limit in r["targets"]["cpu_ms"].items():
            v = cpu["per_request_ms"]["non-stream"].get(path)
            rows.append(_row(f"clawd CPU per {path} turn (ms)", v, "{:.3f}", f"<= {limit:g}",
                             v is not None and v <= limit))
        x = cpu.get("per_token_over_floor", {}).get("main")
        limit = r["targets"]["token_over_floor"]
        rows.append(_row("clawd CPU per streamed token / the SSE relay floor's", x, "{:.2f}x", f"<= {limit:g}",
                         x is not None and x <= limit))
    return rows


def pipeline(r: dict) -> list[dict]:
    cell = r["results"]["64"]["daemon/interval"]
    return [_row("turn -> queued sample, CPU per turn (us)", cell["cpu_us_per_turn"], "{:.0f}"),
            _row("  that path / a bare asyncio.Queue put", cell["slower_than_queue"], "{:.0f}x slower")]


def trainer(r: dict) -> list[dict]:
    ratios, targets = r["ratios"], r["targets"]
    return [_row(f"training step / bare fwd+bwd time ({r['device']})", ratios["overhead"]["median"], "{:.3f}",
                 f"<= {targets['overhead']}", ratios["overhead"]["median"] <= targets["overhead"]),
            _row("padded / packed time", ratios["packing"]["median"], "{:.2f}x", f">= {targets['packing']}",
                 ratios["packing"]["median"] >= targets["packing"])]


def swap(r: dict) -> list[dict]:
    return [_row("requests failed across publishes", r["requests_failed"], "{:d}", "0", r["requests_failed"] == 0),
            _row(f"intake held per publish, p50 (s, {r['publishes']} publishes)", r["intake_held_s"]["p50"],
                 "{:.3f}"),
            _row("latency overlapping a publish / clear, p50", r["overlap_over_clear_p50"], "{:.2f}x")]


def publish(r: dict) -> list[dict]:
    return [_row("replica held per publish, disk / weight-update group, p50", r["held_ratio_disk_over_group"],
                 "{:.2f}x"),
            _row("  pushes that fell back to disk", r["fallbacks"], "{:d}", "0", r["fallbacks"] == 0)]


def lora(r: dict) -> list[dict]:
    ratios, target = r["ratios"], r["targets"]["bytes_full_over_lora"]
    return [_row(f"bytes per publish, full / LoRA rank {r['rank']}", ratios["bytes_full_over_lora"], "{:.1f}x",
                 f">= {target:g}", ratios["bytes_full_over_lora"] >= target),
            _row("  engine swap seconds, full / LoRA, p50", ratios["swap_s_full_over_lora"], "{:.1f}x"),
            _row("  trainer peak RSS, LoRA / full", ratios["peak_rss_lora_over_full"], "{:.2f}")]


def learning(r: dict) -> list[dict]:
    rows = []
    targets = r.get("targets") or {}
    judged_arms, controls = targets.get("judged_arms", []), targets.get("controls_unchanged", [])
    for arm, cell in r["arms"].items():
        if arm in controls:  # a negative control: its paired satisfaction change must include 0
            change = cell["paired"]["satisfied"]
            rows.append(_row(f"{arm} (control): change, 95% low", change["low"], "{:+.2f}",
                             "<= 0", change["low"] <= 0))
            rows.append(_row(f"{arm} (control): change, 95% high", change["high"], "{:+.2f}",
                             ">= 0", change["high"] >= 0))
            continue
        # opd needs a teacher that can read the hint: on the random tiny model it cannot, so no target.
        judged = arm in judged_arms
        rows.append(_row(f"{arm}: satisfaction after / before", cell["ratio"], "{:.2f}x", "> 1" if judged else "",
                         (cell["ratio"] is not None and cell["ratio"] > 1) if judged else None))
    return rows


def fuzz(r: dict) -> list[dict]:
    most_lines = r["targets"]["log_lines_per_1000"]
    return [_row("malformed requests sent", r["requests"], "{:d}"),
            _row("  replies >= 500", r["status_5xx"], "{:d}", "0", r["status_5xx"] == 0),
            _row("  tracebacks in the daemon's log", r["tracebacks"], "{:d}", "0", r["tracebacks"] == 0),
            _row("  log lines per 1,000 of them", r["log_lines_per_1000"], "{:.1f}", f"<= {most_lines:g}",
                 r["log_lines_per_1000"] <= most_lines),
            _row("  /health and a chat answer 200 after", r["healthy_after"], "{}", "True", r["healthy_after"] is True)]


def abuse(r: dict) -> list[dict]:
    figures, met = r["figures"], r["met"]
    shown = (("normal requests answered 200", "{}", "all"), ("p50 stalled / quiet", "{:.2f}x", "<= 2"),
             ("stalled uploads not ended in time", "{:d}", "0"), ("big messages >= 500 or no reply", "{:d}", "0"),
             ("RSS growth, after or peak (MB)", "{:.1f}", "< 100"), ("tracebacks in the log", "{:d}", "0"))
    # a figure the run could not reach (the daemon died first) is shown as "-" and MISSED
    return [_row(name, figures.get(name), fmt, target, met.get(name, False)) for name, fmt, target in shown]


def crash(r: dict) -> list[dict]:
    f, met = r["figures"], r["targets"]
    kills = sum(f["trainer_kills"].values())
    return [_row("daemon SIGKILLs, each restarted on its state", f["daemon_kills"], "{:d}"),
            _row("trainer kills (mid-checkpoint, mid-publish, plain)", kills, "{:d}", "as asked",
                 met["trainer_kills_landed"]),
            _row("  acknowledged samples lost", f["lost"], "{:d}", "0", met["lost"]),
            _row("  samples trained twice in the final lineage", f["duplicated"], "{:d}", "0", met["duplicated"]),
            _row("  serving, training and a clean exit after", f["served_at_end"], "{}", "True",
                 met["serving_at_end"])]


def scale(r: dict) -> list[dict]:
    rows = []
    sections = r["sections"]
    if "serving" in sections:
        serving = sections["serving"]
        target = serving["targets"]["scaling"]
        for n, cell in serving["scaling"].items():
            rows.append(_row(f"{n} replicas: req/s / ({n} x one replica)", cell["ratio"], "{:.2f}", f">= {target:g}",
                             cell["ok"]))
        split = sum(c["sessions_on_two_replicas"] for c in serving["results"].values())
        rows.append(_row("  sessions that reached two replicas", split, "{:d}", "0", split == 0))
    if "daemon" in sections:
        daemon = sections["daemon"]
        rows.append(_row("main turns per clawd core-second (fake engine)", daemon["cpu"]["main"]["req_per_clawd_core_s"],
                         "{:.0f}"))
        rows.append(_row("  RSS per live session (kB)", daemon["memory"]["kb_per_session"], "{:.1f}"))
    if "trainer" in sections:
        ratios = sections["trainer"]["ratios"]
        rows.append(_row("trainer: params + AdamW per rank of 2 / one process", max(ratios), "{:.2f}", "0.45-0.55",
                         sections["trainer"]["pass"]))
    return rows


def pii(r: dict) -> list[dict]:
    rows = []
    for c, cell in r["per_category"].items():
        rows.append(_row(f"pii {c}: precision", cell["precision"], "{:.3f}", f">= {r['targets']['precision']}",
                         r["met"][f"{c} precision"]))
        if f"{c} recall" in r["met"]:
            rows.append(_row(f"  pii {c}: recall", cell["recall"], "{:.3f}", f">= {r['targets']['recall'][c]}",
                             r["met"][f"{c} recall"]))
    return rows + [_row("pii detection cost, PII-dense chat (us/KB)", r["cost"]["labelled_us_per_kb"], "{:.0f}")]


def startup(r: dict) -> list[dict]:
    return [_row(f"{kind} CPU to ready, with / without clawd.startup", r["figures"][kind]["cpu_ratio"], "{:.3f}",
                 "< 1", r["figures"][kind]["cpu_ratio"] < 1) for kind in ("engine", "trainer")]


def liveness(r: dict) -> list[dict]:
    this = r["results"]["this"]
    rows = [_row("CPU engine: worst liveness poll / longest step", this["worst_ratio"], "{:.3f}", "< 0.1",
                 this["worst_ratio"] < 0.1)]
    if "throughput_ratio" in r["results"]:
        rows.append(_row("  tokens/s over the compared tree's", r["results"]["throughput_ratio"], "{:.2f}", ">= 0.9",
                         r["results"]["throughput_ratio"] >= 0.9))
    return rows


def rollouts(r: dict) -> list[dict]:
    met = r["met"]
    rows = [_row("live p50 with rollouts / without", r["p50_ratio"], "{:.2f}", "<= 1.25",
                 met["live p50 with rollouts <= 1.25x without"]),
            _row("live p99 with rollouts / without", r["p99_ratio"], "{:.2f}", "<= 1.5",
                 met["live p99 with rollouts <= 1.5x without"])]
    if "solve" in r:
        rows.append(_row("solve rate on held-out episodes (model as it is)", r["solve"]["rate"], "{:.0%}"))
    return rows


def opd_signal(r: dict) -> list[dict]:
    step = r["one_step"]
    return [_row("OPD teacher, right over wrong answer (nats)", r["gap"]["system_default"]["answer_right"]
                 - r["gap"]["system_default"]["answer_wrong"], "{:+.2f}", "> 0.5",
                 r["met"]["teacher prefers the right answer"]),
            _row(f"top-K OPD, {r['steps']} steps: right over wrong, first token (nats)",
                 step["system_default/topk"]["right_over_wrong"], "{:+.3f}",
                 f"> 0 and > token-level's {step['system_default/token']['right_over_wrong']:+.3f}",
                 r["met"]["top-K raises right over wrong"] and r["met"]["top-K beats token-level"])]


EXTRACT = {"serve": serve, "pipeline": pipeline, "trainer": trainer, "swap": swap, "publish": publish, "lora": lora,
           "learning": learning,
           "opd_signal": opd_signal, "fuzz": fuzz, "abuse": abuse, "crash": crash, "scale": scale, "pii": pii,
           "startup": startup, "liveness": liveness, "rollouts": rollouts}


# ---------------------------------------------------------------- provenance marks

@dataclass
class Head:
    """What a fresh result must match: HEAD's sha, and the date of the newest commit touching clawd/ or bench/."""
    commit: str | None
    code_date: datetime.datetime | None


def current_head(root: Path = ROOT) -> Head:
    sha = provenance.git_output(root, "rev-parse", "HEAD")
    sha = sha.strip() if sha else provenance.commit(root)[0]
    date = (provenance.git_output(root, "log", "-1", "--format=%cI", "--", "clawd", "bench") or "").strip()
    return Head(None if sha == "unknown" else sha, _parse_date(date))


def _parse_date(text: object) -> datetime.datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        date = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return date if date.tzinfo else date.replace(tzinfo=datetime.timezone.utc)


def marks(result: dict, head: Head, since: datetime.datetime | None = None) -> tuple[bool, list[str]]:
    """(provenance known, the reasons the result is STALE: none when fresh). `since`: when the run that
    should have written it started (None with --no-run)."""
    prov = result.get("provenance")
    date = _parse_date(prov.get("date")) if isinstance(prov, dict) else None
    if not isinstance(prov, dict) or not isinstance(prov.get("commit"), str) or date is None:
        return False, []
    stale = []
    if head.commit is None:
        stale.append("HEAD unknown, the commit cannot be checked")
    elif prov["commit"] != head.commit:
        stale.append(f"commit {prov['commit'][:12]} is not HEAD {head.commit[:12]}")
    if prov.get("dirty"):
        stale.append("measured on a dirty tree")
    if head.code_date is not None and date < head.code_date:
        stale.append(f"older than the newest commit to clawd/ or bench/ ({head.code_date.isoformat()})")
    if since is not None and date < since.replace(microsecond=0):
        stale.append("not written by this run")
    return True, stale


# ---------------------------------------------------------------- the table

def verdict(name: str, codes: dict[str, int]) -> str:
    if name not in codes:
        return "not run"
    return "ok" if codes[name] == 0 else f"FAILED (exit {codes[name]})"


def block(name: str, codes: dict[str, int], started: dict[str, datetime.datetime], head: Head,
          results: Path) -> tuple[list[str], dict]:
    """One bench's lines (its verdict first, then the result's date, commit and marks, then its figure rows)
    and its summary entry, with "failed": whether it makes all.py's exit status non-zero."""
    ran = name in codes
    entry: dict = {"verdict": verdict(name, codes), "exit_code": codes.get(name)}
    failed = ran and codes[name] != 0
    head_line = f"{name:<9} {entry['verdict']}"
    path = results / f"{name}.json"
    if not path.exists():
        entry["error"] = f"no {path.name}"
        entry["failed"] = True
        return [f"{head_line} · no results: {path.name} missing"], entry
    try:
        r = json.loads(path.read_text())
        rows = EXTRACT[name](r)
    except (KeyError, TypeError, ValueError, IndexError) as exc:  # a results file from an older script
        entry["error"] = f"unreadable {path.name}: {exc!r}"
        entry["failed"] = True
        return [f"{head_line} · unreadable {path.name}: {exc!r}"], entry
    known, stale = marks(r, head, started.get(name))
    prov = r.get("provenance") if known else None
    entry.update(provenance=prov, provenance_known=known, stale=stale, rows=rows, recorded_pass=r.get("pass"))
    if known:
        dirty = {True: ", dirty", False: "", None: ", dirty unknown"}.get(prov.get("dirty"), "")
        head_line += f" · result of {prov['date']}, commit {prov['commit'][:12]}{dirty}"
    else:
        head_line += " · unknown provenance"
    if stale:
        head_line += " · STALE: " + "; ".join(stale)
    if not ran and r.get("pass") is False:
        head_line += " · the result records a FAIL"
    missed = any(row["ok"] is False for row in rows)
    if ran:  # it was supposed to have just written a fresh result
        failed = failed or missed or not known or bool(stale)
    else:
        failed = missed or r.get("pass") is False
    entry["failed"] = failed
    lines = [head_line]
    for row in rows:
        mark = "" if row["ok"] is None else ("met" if row["ok"] else "MISSED")
        lines.append(f"{'':<9} {row['figure']:<52} {row['shown']:>14}  {row['target']:<8} {mark}".rstrip())
    return lines, entry


def table(names: list[str], codes: dict[str, int], started: dict[str, datetime.datetime] | None = None,
          head: Head | None = None, results: Path = RESULTS) -> tuple[str, dict]:
    """The table's text and {bench: summary entry}. `codes`: exit status of each bench run just now;
    `started`: when each of them started (a result older than that was not written by it)."""
    head = head if head is not None else current_head()
    summary, lines = {}, []
    for name in names:
        block_lines, summary[name] = block(name, codes, started or {}, head, results)
        lines += block_lines
    header = f"{'bench':<9} {'figure':<52} {'value':>14}  {'target':<8}"
    return "\n".join([header, "-" * len(header)] + lines), summary


def run(name: str, results: Path) -> tuple[int, float]:
    started = time.monotonic()
    print(f"== bench/{name}.py", flush=True)
    out = ([OUT_FLAG[name], str(results / f"{name}.json")] if results.resolve() != RESULTS.resolve() else [])
    code = subprocess.run([sys.executable, str(HERE / f"{name}.py"), *ARGS.get(name, []), *out], cwd=ROOT).returncode
    return code, time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=SCRIPTS, help="run (and show) only these")
    p.add_argument("--no-run", action="store_true", help="only read the last results")
    p.add_argument("--results", type=Path, default=RESULTS, help="the results folder (default bench/results)")
    args = p.parse_args(argv)
    names = [n for n in SCRIPTS if (HERE / f"{n}.py").exists() and (not args.only or n in args.only)]
    codes, seconds, started = {}, {}, {}
    if not args.no_run:
        args.results.mkdir(parents=True, exist_ok=True)
        for name in names:
            started[name] = datetime.datetime.now(datetime.timezone.utc)
            codes[name], seconds[name] = run(name, args.results)
    text, summary = table(names, codes, started, results=args.results)
    print("\n" + text)
    if seconds:
        print("\n" + ", ".join(f"{n} {s:.0f} s (exit {codes[n]})" for n, s in seconds.items()))
    failed = [n for n, s in summary.items() if s["failed"]]
    if not args.no_run:
        record = {"provenance": provenance.stamp(), "benches": summary, "seconds": seconds}
        (args.results / "summary.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.results / 'summary.json'}")
    if failed:
        print(f"all.py: FAILED: {', '.join(failed)}")
    else:
        print("all.py: every bench ok, every result fresh" if codes else "all.py: results read; nothing was run")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
