"""`make bench`: every benchmark under bench/, then one table of their headline figures.

Each script measures its figures side by side in its own run and writes
bench/results/<name>.json; this runs them one after another (never together: on
a small machine they would measure each other) and reads back the few figures
that answer "is clawd fast enough here", with the target each is judged against.
The table is also written to bench/results/summary.json.

    .venv/bin/python bench/all.py                  # run everything (~10 min on 2 cores)
    .venv/bin/python bench/all.py --only trainer swap
    .venv/bin/python bench/all.py --no-run         # the table from the last results
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SCRIPTS = ("serve", "pipeline", "trainer", "swap", "learning")


def _row(figure: str, value: float | None, fmt: str, target: str = "", ok: bool | None = None) -> dict:
    return {"figure": figure, "value": value, "shown": "-" if value is None else fmt.format(value),
            "target": target, "ok": ok}


def serve(r: dict) -> list[dict]:
    delay = r["judged_delays"][0]
    rows = []
    for mode in ("non-stream", "stream"):
        cell = r["results"][delay][mode]
        rows.append(_row(f"{mode} throughput, clawd / direct", cell["throughput_ratio"], "{:.2f}x", ">= 0.80",
                         cell["throughput_ratio"] >= r["targets"]["throughput_ratio"]))
        rows.append(_row(f"{mode} added p50 latency (ms)", cell["added_p50_ms"], "{:+.1f}", "<= 1",
                         cell["added_p50_ms"] <= r["targets"]["added_p50_ms"]))
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


def learning(r: dict) -> list[dict]:
    rows = []
    for mode, cell in r["modes"].items():
        # opd needs a teacher that can read the hint: on the random tiny model it cannot, so no target.
        judged = mode != "opd" or r.get("profile") != "tiny"
        rows.append(_row(f"{mode}: satisfaction after / before", cell["ratio"], "{:.2f}x", "> 1" if judged else "",
                         (cell["ratio"] is not None and cell["ratio"] > 1) if judged else None))
    return rows


EXTRACT = {"serve": serve, "pipeline": pipeline, "trainer": trainer, "swap": swap, "learning": learning}


def run(name: str) -> tuple[int, float]:
    started = time.monotonic()
    print(f"== bench/{name}.py", flush=True)
    code = subprocess.run([sys.executable, str(HERE / f"{name}.py")], cwd=HERE.parent).returncode
    return code, time.monotonic() - started


def table(names: list[str], codes: dict[str, int]) -> tuple[str, dict]:
    summary, lines = {}, []
    for name in names:
        path = RESULTS / f"{name}.json"
        if not path.exists():
            summary[name] = {"error": f"no {path.name}"}
            lines.append(f"{name:<9} (no results: {path.name} missing)")
            continue
        try:
            rows = EXTRACT[name](json.loads(path.read_text()))
        except (KeyError, TypeError, ValueError) as exc:  # a results file from an older script
            summary[name] = {"error": f"unreadable {path.name}: {exc!r}"}
            lines.append(f"{name:<9} (unreadable {path.name}: {exc!r})")
            continue
        summary[name] = {"exit_code": codes.get(name), "rows": rows}
        for i, row in enumerate(rows):
            verdict = "" if row["ok"] is None else ("ok" if row["ok"] else "MISSED")
            lines.append(f"{name if i == 0 else '':<9} {row['figure']:<52} {row['shown']:>14}  "
                         f"{row['target']:<8} {verdict}")
    header = f"{'bench':<9} {'figure':<52} {'value':>14}  {'target':<8}"
    return "\n".join([header, "-" * len(header)] + lines), summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=SCRIPTS, help="run (and show) only these")
    p.add_argument("--no-run", action="store_true", help="only read the last results")
    args = p.parse_args()
    names = [n for n in SCRIPTS if (HERE / f"{n}.py").exists() and (not args.only or n in args.only)]
    codes, seconds = {}, {}
    if not args.no_run:
        for name in names:
            codes[name], seconds[name] = run(name)
    text, summary = table(names, codes)
    print("\n" + text)
    if seconds:
        print("\n" + ", ".join(f"{n} {s:.0f} s (exit {codes[n]})" for n, s in seconds.items()))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "summary.json").write_text(json.dumps({"benches": summary, "seconds": seconds}, indent=1) + "\n")
    print(f"wrote {RESULTS / 'summary.json'}")
    missed = [n for n, s in summary.items() if "error" in s or any(r["ok"] is False for r in s["rows"])]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
