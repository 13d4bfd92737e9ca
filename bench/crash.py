"""Crash safety under load: seeded SIGKILLs of the daemon, and trainer kills mid-checkpoint, mid-publish and at
random times; then whether every acknowledged sample is in the final weights' lineage, once.

One state directory, one daemon life after another (docs/ARCHITECTURE.md §7, §12): the tiny model on clawd's CPU
engine, the rules judge, the learner on with small batches (`--batch` 2, a checkpoint every step, no stale drops)
so that steps happen between kills, and `--users` closed-loop chat users (tests/load.py `ChatLoad`: a question,
then a thank-you that makes it a +1 sample) talking across every restart. Each life ends in a SIGKILL of the
daemon at a seeded random moment (a share while its children start, the rest 0.5-3 s after both are up), and the
next life starts on the same state directory. Some lives also kill the trainer first, each kind a third:

    checkpoint  CLAWD_FAULTS="trainer.checkpoint.mid=kill@K" in the daemon's environment: its trainer children
                inherit it and SIGKILL themselves in the middle of their K-th checkpoint (K seeded, 1-3)
    publish     the same with "trainer.publish.mid=kill@K": in the middle of writing a published version
    sigkill     the bench SIGKILLs the trainer process 0.2-3 s after it is ready

A trainer kill has landed when the daemon logs `trainer down (exit code -9)`; every one is counted (a child that
restarts in an armed life may die again). Lives are added until `--daemon-kills` daemon kills and
`--trainer-kills` trainer kills have landed (at most twice the lives asked). A last life is not killed: it trains
and publishes a step under the load, then the load stops, it trains what is left, answers one more chat request
and stops cleanly (exit 0).

Measured at the end, read by this script from the files (not with clawd's own readers):
    acknowledged  ids ACKed in the journal (trained, and the step checkpointed), plus the ids scoring reported
                  written (the judge record names a sample only after its journal APPEND was fsynced)
    lineage       state/trainer/steps.jsonl (clawd.weights.Ledger), one line per trainer step {"step",
                  "batch_id", "version", "samples", ...}; a step resumed from checkpoint k is numbered k+1
                  again, so the lineage of the final weights is, for each step 1..the newest complete
                  checkpoint's step, the LAST line written for it (read here, and compared with
                  clawd.weights.lineage)
    lost          acknowledged ids in no lineage step (target 0)
    duplicated    ids trained in two lineage steps, or twice in one (target 0)
Also judged: the daemon serves at the end (a chat request answered 200, and it exits 0), no process of a killed
life outlives it, the journal never loses a record nor an ACK between kills, nothing is left unacked, and this
lineage is clawd.weights.lineage's.
Exit status: 0 when every target is met; 1 when one is missed (or an exception: a traceback, no JSON); 2 when it
could not measure (no steps ledger or no checkpoint at the end; the JSON says why). The JSON carries
`provenance` (bench/provenance.py) and `pass`.

    .venv/bin/python bench/crash.py                                    # 200 + 100 kills; see bench/README.md
    .venv/bin/python bench/crash.py --daemon-kills 10 --trainer-kills 6 2>/tmp/clawd.log
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if str(ROOT / "bench") not in sys.path:  # run as a script it is already there; imported (by a test) it is not
    sys.path.insert(0, str(ROOT / "bench"))
from clawd.tools.models import cached_tiny_model  # noqa: E402
from clawd.weights import lineage as clawd_lineage  # noqa: E402
from tests.harness import Daemon  # noqa: E402
from clawd.learning.frames import APPEND, scan_records  # noqa: E402
from clawd.learning.journal import SEGMENT_RE  # noqa: E402
from tests.load import (OK, ChatLoad, free_port, newest_checkpoint, port_free, tagged_processes,  # noqa: E402
                        wait_until, witnessed_samples)
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)

RESULTS = ROOT / "bench" / "results"
LIFE = "CLAWD_BENCH_CRASH_LIFE"  # in each life's environment: every process of its tree carries it
LEDGER = Path("trainer") / "steps.jsonl"
KINDS = ("checkpoint", "publish", "sigkill")
FAULTS = {"checkpoint": "trainer.checkpoint.mid", "publish": "trainer.publish.mid"}
TRAINER_KILLED = re.compile(r"trainer down \(exit code -9\)")
TRAINER_DOWN = re.compile(r"trainer down \(exit code (\S+)\)")
TRAINER_READY = re.compile(r"trainer (\d+) ready")


# ---- the lineage (pure) ----------------------------------------------------------------------------------------

def read_ledger(path: Path) -> tuple[list[dict], int]:
    """The ledger's lines in file order, and how many could not be read (a torn or foreign line)."""
    lines, bad = [], 0
    if not path.is_file():
        return lines, bad
    for text in path.read_text().splitlines():
        try:
            line = json.loads(text)
            ok = isinstance(line, dict) and isinstance(line.get("step"), int) and isinstance(line.get("samples"), list)
        except ValueError:
            ok = False
        if ok:
            lines.append(line)
        elif text.strip():
            bad += 1
    return lines, bad


def lineage(lines: list[dict], final_step: int) -> dict[int, dict]:
    """{step: the last line written for it} for steps 1..final_step: what the final weights were trained on.
    A line for a step after final_step was trained after the last checkpoint and lost with its process."""
    out: dict[int, dict] = {}
    for line in lines:
        if 1 <= line["step"] <= final_step:
            out[line["step"]] = line
    return out


def audit(steps: dict[int, dict], final_step: int, acknowledged: set[str]) -> dict:
    """Lost: acknowledged ids in no step of the lineage. Duplicated: ids in two of its steps, or twice in one."""
    seen: Counter[str] = Counter()
    for line in steps.values():
        seen.update(line["samples"])
    return {"lineage_steps": len(steps), "lineage_samples": len(seen),
            "missing_steps": [n for n in range(1, final_step + 1) if n not in steps],
            "lost": sorted(acknowledged - set(seen)),
            "duplicated": sorted(i for i, n in seen.items() if n > 1)}


@dataclass(frozen=True)
class JournalScan:
    appended: tuple[str, ...]   # APPEND ids in file order, over every segment
    acked: frozenset            # ids named by ACK records
    live: tuple[str, ...]       # appended and not acked: what the next start replays
    damaged: int                # damaged spans (a SIGKILL may only tear the tail, which is not damage)


def read_journal(directory: Path) -> JournalScan:
    """Every good record of every segment, decoded by the format's pure decoder (it reads each format version)."""
    appended, acked, damaged = [], set(), 0
    for path in sorted(p for p in Path(directory).iterdir() if SEGMENT_RE.fullmatch(p.name)):
        scan = scan_records(path.read_bytes())
        damaged += len(scan.damaged)
        for kind, value in scan.records:
            if kind == APPEND:
                appended.append(value[0])
            else:
                acked.update(value)
    live = tuple(i for i in dict.fromkeys(appended) if i not in acked)
    return JournalScan(tuple(appended), frozenset(acked), live, damaged)


# ---- one life --------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def environment(**values: str | None):
    """os.environ with `values` set (None: removed) for the block: the daemon started inside inherits it."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def seen(daemon: Daemon, pattern: str, timeout: float) -> str | None:
    """The first log line matching pattern within timeout; None when none came (or the daemon exited first)."""
    try:
        return daemon.wait_for(pattern, timeout)
    except (TimeoutError, RuntimeError):
        return None


def sections(args, port: int) -> dict:
    return {"model": {"path": str(args.model), "max_tokens_cap": 6},
            "server": {"port": port, "drain_timeout": 10.0},
            "engine": {"launch": "local", "restart_backoff_initial": 0.2},
            # no stale drops: every ACK then means "trained, and the step checkpointed"
            "learner": {"enabled": True, "rollout_batch_size": args.batch, "min_batch_size": 1,
                        "max_staleness": 1_000_000, "rollout_timeout": 1.0},
            "journal": {"fsync": "always"},
            "train": {"checkpoint_every": args.checkpoint_every, "optimizer": {"lr": 1e-4}}}


def choose(rng: random.Random, landed: Counter, asked: int, lives_left: int) -> str | None:
    """This life's trainer kill: the kind landed least so far (ties drawn), with the odds that spread the kills
    still asked over the lives left; None for a life that only kills the daemon."""
    short = asked - sum(landed[k] for k in KINDS)
    if short <= 0 or rng.random() >= short / max(lives_left, 1):
        return None
    fewest = min(landed[k] for k in KINDS)
    return rng.choice([k for k in KINDS if landed[k] == fewest])


def live(args, rng: random.Random, n: int, kind: str | None, tmp: Path, port: int) -> dict:
    """One life: start, maybe kill the trainer, SIGKILL the daemon; what it logged and left behind."""
    tag = f"{os.getpid()}-{n}"
    k = rng.randint(1, 3) if kind in FAULTS else None
    spec = f"{FAULTS[kind]}=kill@{k}" if k else None
    rec = {"life": n, "kind": kind, "fault": spec, "early": False}
    with environment(**{LIFE: tag, "CLAWD_FAULTS": spec}):
        daemon = Daemon(tmp, sections(args, port), wait_ready=False, timeout=120)
    try:
        if kind in FAULTS:  # give the armed point time to be reached: K batches trained by a ready trainer
            seen(daemon, TRAINER_READY.pattern, args.start_wait)
            rec["fault_landed"] = seen(daemon, TRAINER_KILLED.pattern, args.fault_wait) is not None
            time.sleep(rng.uniform(0.0, 3.0))  # the daemon dies while the trainer restarts, or soon after
        elif kind == "sigkill":
            ready = seen(daemon, TRAINER_READY.pattern, args.start_wait)
            time.sleep(rng.uniform(0.2, 3.0))
            pid = int(TRAINER_READY.search(ready).group(1)) if ready else None
            if pid is not None and pid in tagged_processes(LIFE, tag):  # never a process of another tree
                os.kill(pid, signal.SIGKILL)
                seen(daemon, TRAINER_KILLED.pattern, 10)
            time.sleep(rng.uniform(0.0, 3.0))
        else:
            rec["early"] = rng.random() < args.early
            if not rec["early"]:
                seen(daemon, TRAINER_READY.pattern, args.start_wait)
                seen(daemon, r"policy engine ready", args.start_wait)
            time.sleep(rng.uniform(0.5, 3.0))
        rec["died_by_itself"] = daemon.proc.poll() is not None
        tree = tagged_processes(LIFE, tag)
        daemon.proc.kill()
        rec["daemon_killed"] = daemon.proc.wait(30) == -signal.SIGKILL
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()
        daemon._reader.join(5)
    rec["orphans"] = 0 if wait_until(lambda: not tagged_processes(LIFE, tag), 15) else len(tagged_processes(LIFE, tag))
    if rec["orphans"]:
        print(f"life {n}: orphans {tagged_processes(LIFE, tag)} (tree before the kill: {tree})", file=sys.stderr)
    wait_until(lambda: port_free(port), 15)
    text = "".join(daemon.lines)
    rec["trainer_kills"] = len(TRAINER_KILLED.findall(text)) if kind else 0
    rec["trainer_downs"] = TRAINER_DOWN.findall(text)
    rec["publishes"] = len(re.findall(r"clawd.learner: published v\d+", text))
    return rec


def debug(daemon: Daemon) -> dict:
    """/debug/process, or {} while the daemon does not answer."""
    try:
        return daemon.get("/debug/process")[1] or {}
    except OSError:
        return {}


def final_life(args, tmp: Path, port: int, load: ChatLoad) -> dict:
    """The last life, not killed: a step trained and published under the load (learning goes on after the kills),
    then the load stops, it trains what is left, answers a chat request and stops cleanly."""
    daemon = Daemon(tmp, sections(args, port), wait_ready=False, timeout=120)
    out = {"ready": False, "trained": False, "drained": False, "served": False, "exit_code": None}
    try:
        daemon.wait_ready(args.start_wait)
        out["ready"] = True
        out["trained"] = bool(wait_until(lambda: debug(daemon).get("learner", {}).get("publishes", 0) >= 1,
                                         args.drain_timeout, 0.2))
        load.stop()

        def drained():
            d = debug(daemon)
            return bool(d) and (d["scoring"]["pending"] == 0 and d["queue"]["journal_live"] == 0
                                and d["learner"]["waiting_since"] is not None)
        out["drained"] = bool(wait_until(drained, args.drain_timeout, 0.2))
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Still there?"}]}).encode()
        request = urllib.request.Request(daemon.url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json", "X-Session-Done": "1"})
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                out["served"] = resp.status == 200 and bool(json.loads(resp.read())["choices"])
        except OSError as exc:  # an HTTP error status or no answer: the target is missed, and why is kept
            out["served_error"] = repr(exc)
    finally:
        out["exit_code"] = daemon.stop(60)
    return out


# ---- the run ---------------------------------------------------------------------------------------------------

def run(args) -> dict:
    rng = random.Random(args.seed)
    lives, landed = [], Counter()
    journal_regressions, previous = [], None
    started = time.monotonic()
    with (contextlib.nullcontext(str(args.workdir)) if args.workdir
          else tempfile.TemporaryDirectory(prefix="clawd-bench-crash-")) as tmp:
        tmp, port = Path(tmp), free_port()
        tmp.mkdir(parents=True, exist_ok=True)
        state = tmp / "state"
        # 0.5 s after an error: while a life starts, users retrying faster only take CPU from its engine and trainer
        load = ChatLoad(f"http://127.0.0.1:{port}/v1", users=args.users, tag="crash", pause_after_error=0.5).start()
        try:
            most = 2 * max(args.daemon_kills, args.trainer_kills)
            while len(lives) < most and (len(lives) < args.daemon_kills
                                         or sum(landed[k] for k in KINDS) < args.trainer_kills):
                kind = choose(rng, landed, args.trainer_kills, max(args.daemon_kills - len(lives), 1))
                rec = live(args, rng, len(lives), kind, tmp, port)
                landed[kind] += rec["trainer_kills"]
                scan = read_journal(state / "journal")
                witnessed = witnessed_samples(state)
                problems = []
                if not witnessed <= set(scan.appended):
                    problems.append(f"witnessed, no APPEND: {sorted(witnessed - set(scan.appended))[:5]}")
                if previous is not None and scan.appended[:len(previous.appended)] != previous.appended:
                    problems.append("journal records lost")
                if previous is not None and not previous.acked <= scan.acked:
                    problems.append("an ACK disappeared")
                if scan.damaged:
                    problems.append(f"{scan.damaged} damaged span(s)")
                if problems:
                    journal_regressions.append({"life": rec["life"], "problems": problems})
                previous = scan
                rec.update(appended=len(scan.appended), acked=len(scan.acked), live=len(scan.live),
                           ok_requests=load.counts()[OK], at_s=round(time.monotonic() - started, 1))
                lives.append(rec)
                print(json.dumps({k: rec[k] for k in ("life", "kind", "fault", "trainer_kills", "publishes", "appended",
                                                      "acked", "live", "orphans", "at_s")}), file=sys.stderr)
            final = final_life(args, tmp, port, load)
        finally:
            load.stop()
        scan = read_journal(state / "journal")
        witnessed = witnessed_samples(state)
        lines, bad_lines = read_ledger(state / LEDGER)
        ckpt = newest_checkpoint(state)
        ledger_found = (state / LEDGER).is_file()
    final_step = ckpt["step"] if ckpt else 0
    steps = lineage(lines, final_step)
    agrees = list(steps.values()) == clawd_lineage(lines, final_step)  # the trainer's own reading of its ledger
    acknowledged = set(scan.acked) | witnessed
    result = audit(steps, final_step, acknowledged)
    trainer_downs = Counter(code for rec in lives for code in rec["trainer_downs"])
    could_not = [why for why, bad in (("no steps ledger (state/trainer/steps.jsonl)", not ledger_found),
                                      ("no complete checkpoint at the end", ckpt is None)) if bad]
    figures = {
        "daemon_kills": sum(rec["daemon_killed"] for rec in lives),
        "daemon_kills_early": sum(rec["daemon_killed"] and rec["early"] for rec in lives),
        "daemon_restarts": len(lives),
        "daemon_died_by_itself": sum(rec["died_by_itself"] for rec in lives),
        "trainer_kills": {k: landed[k] for k in KINDS},
        "trainer_kill_lives": {k: sum(rec["kind"] == k for rec in lives) for k in KINDS},
        "trainer_exits": dict(trainer_downs),
        "steps_trained": len(lines), "final_step": final_step, "ledger_bad_lines": bad_lines,
        "acked": len(scan.acked), "witnessed": len(witnessed), "acknowledged": len(acknowledged),
        "lineage_steps": result["lineage_steps"], "lineage_samples": result["lineage_samples"],
        "missing_steps": len(result["missing_steps"]), "lineage_agrees_with_clawd": agrees,
        "lost": len(result["lost"]), "duplicated": len(result["duplicated"]),
        "live_at_end": len(scan.live), "orphans": sum(rec["orphans"] for rec in lives),
        "journal_regressions": len(journal_regressions),
        "served_at_end": final["served"], "final_exit_code": final["exit_code"], "drained": final["drained"],
        "trained_in_last_life": final["trained"],
        "requests": dict(load.counts()),
    }
    met = {"lost": figures["lost"] == 0, "duplicated": figures["duplicated"] == 0,
           "serving_at_end": final["served"] and final["exit_code"] == 0 and final["trained"],
           "nothing_left_unacked": figures["live_at_end"] == 0 and final["drained"],
           "no_orphans": figures["orphans"] == 0, "journal_never_regressed": not journal_regressions,
           "daemon_kills_landed": figures["daemon_kills"] >= args.daemon_kills,
           "trainer_kills_landed": sum(landed[k] for k in KINDS) >= args.trainer_kills,
           # the bench's reading of the steps ledger and the trainer's own (clawd.weights.lineage) name the same steps
           "lineage_agrees_with_clawd": agrees}
    return {"figures": figures, "targets": met, "could_not_measure": could_not,
            "lost_ids": result["lost"][:50],
            # where each duplicated id sits: [step, batch_id, version] of every lineage step holding it
            "duplicated_ids": {i: [[n, line["batch_id"], line["version"]] for n, line in steps.items()
                                   if i in line["samples"]] for i in result["duplicated"][:50]},
            "missing_step_numbers": result["missing_steps"][:50], "journal_regression_detail": journal_regressions[:20],
            "lives": lives, "final_life": final, "wall_s": round(time.monotonic() - started, 1),
            "pass": not could_not and all(met.values())}


def table(res: dict, args) -> str:
    f, t = res["figures"], res["targets"]

    def mark(name):
        return "met" if t[name] else "MISSED"
    tk, lives = f["trainer_kills"], f["trainer_kill_lives"]
    rows = [("daemon SIGKILLs landed", f"{f['daemon_kills']} / {args.daemon_kills}",
             f"{f['daemon_kills_early']} while its children started; {mark('daemon_kills_landed')}"),
            ("daemon restarts on the same state", f["daemon_restarts"], ""),
            ("trainer kills mid-checkpoint", tk["checkpoint"], f"in {lives['checkpoint']} armed lives"),
            ("trainer kills mid-publish", tk["publish"], f"in {lives['publish']} armed lives"),
            ("trainer kills, plain SIGKILL", tk["sigkill"], f"in {lives['sigkill']} lives"),
            ("trainer kills landed, all kinds", f"{sum(tk.values())} / {args.trainer_kills}",
             mark("trainer_kills_landed")),
            ("trainer exits seen by the daemon",
             " ".join(f"{c}:{n}" for c, n in f["trainer_exits"].items()) or "-", ""),
            ("optimizer steps (ledger lines)", f["steps_trained"], f"{f['ledger_bad_lines']} unreadable"),
            ("final checkpoint step", f["final_step"], f"{f['missing_steps']} with no ledger line"),
            ("acknowledged samples", f["acknowledged"], f"{f['acked']} acked, {f['witnessed']} witnessed"),
            ("lineage: steps / samples", f"{f['lineage_steps']} / {f['lineage_samples']}",
             "clawd.weights.lineage " + ("agrees" if f["lineage_agrees_with_clawd"] else "DISAGREES")
             + f": {mark('lineage_agrees_with_clawd')}"),
            ("acknowledged samples lost", f["lost"], f"target 0: {mark('lost')}"),
            ("samples in two lineage steps", f["duplicated"], f"target 0: {mark('duplicated')}"),
            ("serving, training, clean exit at the end",
             f"{f['served_at_end']}, {f['trained_in_last_life']}, exit {f['final_exit_code']}", mark("serving_at_end")),
            ("left unacked at the end", f["live_at_end"], f"drained {f['drained']}: {mark('nothing_left_unacked')}"),
            ("processes outliving a killed daemon", f["orphans"], mark("no_orphans")),
            ("journal regressions between kills", f["journal_regressions"], mark("journal_never_regressed")),
            ("requests by outcome", " ".join(f"{k}:{n}" for k, n in sorted(f["requests"].items())), "")]
    return "\n".join(f"{a:<38} {str(b):>14}  {c}".rstrip() for a, b, c in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--daemon-kills", type=int, default=200, help="SIGKILLs of the daemon (one per life)")
    p.add_argument("--trainer-kills", type=int, default=100, help="trainer kills, a third of each kind")
    p.add_argument("--seed", type=int, default=20261201)
    p.add_argument("--users", type=int, default=3, help="closed-loop chat users")
    p.add_argument("--batch", type=int, default=2, help="rollout_batch_size")
    p.add_argument("--checkpoint-every", type=int, default=1, help="[train] checkpoint_every")
    p.add_argument("--early", type=float, default=0.3, help="share of daemon-only kills while its children start")
    p.add_argument("--start-wait", type=float, default=180.0, help="how long a life waits for its trainer or engine")
    p.add_argument("--fault-wait", type=float, default=45.0,
                   help="how long an armed life waits for its fault once its trainer is ready")
    p.add_argument("--drain-timeout", type=float, default=300.0, help="the last life's time to train what is left")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for the daemon's engine and trainer")
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny test model)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the state directory and config here (default: a temporary folder, removed)")
    p.add_argument("--out", type=Path, default=RESULTS / "crash.json")
    args = p.parse_args(argv)
    args.model = args.model or cached_tiny_model(RESULTS / "tiny-model")
    if args.threads:  # one OpenMP thread each: the engine and the trainer otherwise stall each other on 2 cores
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    res = {"provenance": provenance.stamp(), **run(args)}
    res["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print()
    print(table(res, args))
    for why in res["could_not_measure"]:
        print(f"could not measure: {why}")
    print(f"\noverall: {'PASS' if res['pass'] else 'FAIL'} in {res['wall_s']:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 2 if res["could_not_measure"] else 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
