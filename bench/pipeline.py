"""Scoring pipeline throughput: a finished turn to a queued sample, beside a bare asyncio.Queue put.

One process, one event loop, the real objects (docs/ARCHITECTURE.md §12: ratios measured side by side in one run):
  queue         `await asyncio.Queue.put` of a pre-built Sample: the floor
  build+queue   `judging.build_sample` (a fresh id, list copies, validation) then the put
  judge/…       `Scorer.submit` with an instant fake judge ("\\boxed{1}", mode rl, prm_m 1), the real
                SampleStore, Journal (fsync "interval" or "always") and judge RecordWriter in a
                directory next to the repo (tmpfs would hide the fsync)
  rules/…       the same with the rules judge (judge=None)
  daemon/…      what the daemon runs when a next state arrives: the turn record, then submit
Each path runs at concurrency 1 (submit, wait until the sample is in the store, repeat) and in
bursts (submit N, wait until all N are in the store), in interleaved rounds after a warm-up.
Prints a table; writes bench/results/pipeline.json.

    .venv/bin/python bench/pipeline.py                        # about a minute on 2 cores
    .venv/bin/python bench/pipeline.py --duration 3 --profile /tmp/pipeline.prof --paths judge/interval

It states no target: its figures are read against the queue's, not judged. Exit status: 0 when every
cell was measured (every submitted turn became exactly one queued sample); 1 (a traceback, no JSON
written) when one could not be; 2 on bad arguments. The JSON carries `provenance` (bench/provenance.py).
"""
from __future__ import annotations

import argparse
import array
import asyncio
import cProfile
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from clawd.scoring.handover import TurnHandover  # noqa: E402
from clawd.pauses import Pauses  # noqa: E402
from clawd.ops.status import Rate  # noqa: E402
from clawd.scoring import judging  # noqa: E402
from clawd.config.loading import config_from_dict
from clawd.config.schema import Config
from clawd.learning.journal import Journal  # noqa: E402
from clawd.records import RecordWriter  # noqa: E402
from clawd.learning.store import SampleStore  # noqa: E402
from clawd.samples import Sample  # noqa: E402
from clawd.scoring.scorer import Scorer  # noqa: E402
from clawd.turns import FinishedTurn, Turn  # noqa: E402
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)

RESULTS = ROOT / "bench" / "results"
WORDS = ("model", "token", "server", "client", "request", "response", "session", "turn", "sample", "batch",
         "weight", "judge", "score", "reward", "policy", "engine", "stream", "journal", "file", "config")
EMIT = judging.Decision(True, 1.0, False, judging.KIND_RL)  # what the instant judge's "\boxed{1}" decides in rl mode


@dataclass(frozen=True)
class PathSpec:
    name: str
    kind: str                 # "queue", "build", "scorer"
    judge: bool = True        # the instant fake judge; False = the rules judge
    fsync: str = "interval"
    turn_record: bool = False  # write the turn record first, as the daemon's on_finished does


PATHS = {p.name: p for p in (
    PathSpec("queue", "queue"),
    PathSpec("build+queue", "build"),
    PathSpec("judge/interval", "scorer"),
    PathSpec("judge/always", "scorer", fsync="always"),
    PathSpec("rules/interval", "scorer", judge=False),
    PathSpec("daemon/interval", "scorer", turn_record=True),
)}


class InstantJudge:
    """A judge that answers at once: what is left is clawd's own work."""

    async def complete(self, messages):
        return "\\boxed{1}"


class TimedStore(SampleStore):
    """Notes when each sample becomes visible: `put` returns right after it joins the waiting queue."""

    def __init__(self, journal: Journal, **kw):
        super().__init__(journal, **kw)
        self.seen: dict[str, float] = {}

    async def put(self, sample: Sample) -> None:
        await super().put(sample)
        self.seen[sample.session_id] = time.perf_counter()


# ---------------------------------------------------------------- turns

def prose(rng: random.Random, words: int) -> str:
    out = []
    for i in range(words):
        w = rng.choice(WORDS)
        out.append(w.capitalize() if i == 0 or out[-1].endswith(".") else w)
        if rng.random() < 0.08:
            out[-1] += "."
    return " ".join(out) + "."


def make_turns(count: int, prompt_len: int, response_len: int, seed: int = 0) -> list[FinishedTurn]:
    """Distinct finished turns, one session each (a burst never holds one session twice)."""
    rng = random.Random(seed)
    now = time.time()
    turns = []
    for n in range(count):
        messages = [{"role": "system", "content": "You are a helpful assistant. " + prose(rng, 60)},
                    {"role": "user", "content": prose(rng, 40)},
                    {"role": "assistant", "content": prose(rng, 50)},
                    {"role": "user", "content": "Now explain how the " + prose(rng, 30)}]
        reply = {"role": "assistant", "content": prose(rng, 75)}  # ~100 tokens of text
        turn = Turn(session_id=uuid.UUID(int=rng.getrandbits(128)).hex, turn_index=1, principal=f"user{n % 8}",
                    request_id=f"req-{n}", rid=uuid.UUID(int=rng.getrandbits(128)).hex,
                    prompt_ids=[rng.randrange(49152) for _ in range(prompt_len)],
                    response_ids=[rng.randrange(49152) for _ in range(response_len)],
                    response_logprobs=[-rng.expovariate(2.0) for _ in range(response_len)],
                    temperature=1.0, messages=messages, tools=None, reply=reply, finish_reason="stop",
                    policy_version=0, weight_version="0", created=now)
        # "thanks" makes the rules judge vote +1 too, so every path emits a sample
        next_state = [{"role": "user", "content": "Thanks, that works. Now can you " + prose(rng, 20)}]
        turns.append(FinishedTurn(turn, next_state, None, now))
    return turns


# ---------------------------------------------------------------- one cell: one path at one concurrency

@dataclass
class Cell:
    turns: int
    seconds: float
    cpu: float
    latencies: array.array
    fsyncs: int = 0
    journal_bytes: int = 0


def bursts(pool: list, size: int):
    """Consecutive slices of the pool, `size` at a time, cycling."""
    at = 0
    while True:
        if at + size > len(pool):
            at = 0
        yield pool[at:at + size]
        at += size


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def run_queue(spec: PathSpec, turns: list[FinishedTurn], samples: list[Sample], concurrency: int,
                    duration: float) -> Cell:
    lat = array.array("d")
    q: asyncio.Queue = asyncio.Queue()
    pool = list(zip(turns, samples))
    n, cpu0, t0 = 0, cpu_now(), time.perf_counter()
    for burst in bursts(pool, concurrency):
        for finished, sample in burst:
            start = time.perf_counter()
            if spec.kind == "build":
                sample = judging.build_sample(finished.turn, EMIT, None, mode="rl", sample_id=uuid.uuid4().hex,
                                        now=time.time())
            await q.put(sample)
            lat.append(time.perf_counter() - start)
        n += len(burst)
        if q.qsize() >= 4096:  # a consumer would free them; freeing a built Sample is part of building one
            q = asyncio.Queue()
        if time.perf_counter() - t0 >= duration:
            break
    return Cell(n, time.perf_counter() - t0, cpu_now() - cpu0, lat)


async def run_scorer(spec: PathSpec, cfg: Config, turns: list[FinishedTurn], concurrency: int, duration: float,
                     workdir: Path) -> Cell:
    tmp = Path(tempfile.mkdtemp(prefix="cell-", dir=workdir))
    try:
        journal = Journal(tmp / "journal", fsync=spec.fsync, fsync_interval=cfg.journal.fsync_interval,
                          segment_bytes=cfg.journal.segment_bytes)
        store = TimedStore(journal, fair_share=cfg.scoring.fair_share)
        await store.replay()  # opens the journal (its segment-creation fsyncs are not counted)
        judge_records = RecordWriter(tmp / "records", kind="judge")
        turn_records = RecordWriter(tmp / "records", kind="turns") if spec.turn_record else None
        # rl mode never calls the tokenizer (only the teacher's prompt needs it)
        scorer = Scorer(cfg, tokenizer=None, judge=InstantJudge() if spec.judge else None, teacher=None,
                        store=store, records=judge_records)

        # The daemon's handover (turn record, rate, pause check, submit), or the submit alone.
        on_finished = (TurnHandover(turn_records, scorer, Pauses(tmp / "pause.json", False), Rate())
                       if turn_records is not None else scorer.submit)

        lat = array.array("d")
        fsyncs0, bytes0 = journal.fsyncs, journal.bytes_written
        n, cpu0, t0 = 0, cpu_now(), time.perf_counter()
        for burst in bursts(turns, concurrency):
            submitted = {}
            for finished in burst:
                submitted[finished.turn.session_id] = time.perf_counter()
                on_finished(finished)
            n += len(burst)
            await store.wait_for(n)
            lat.extend(store.seen[sid] - t for sid, t in submitted.items())
            if time.perf_counter() - t0 >= duration:
                break
        cell = Cell(n, time.perf_counter() - t0, cpu_now() - cpu0, lat)
        await scorer.close(10.0)
        await journal.close()  # its last fsync ("interval") is counted: durability's whole bill
        judge_records.close()
        if turn_records is not None:
            turn_records.close()
        cell.fsyncs, cell.journal_bytes = journal.fsyncs - fsyncs0, journal.bytes_written - bytes0
        st = scorer.stats
        if st.emitted != n or st.excluded or store.waiting != n:
            raise RuntimeError(f"{spec.name}: {n} turns gave {st.emitted} samples ({store.waiting} waiting), "
                               f"excluded {st.excluded}")
        return cell
    finally:
        shutil.rmtree(tmp)


# ---------------------------------------------------------------- statistics and report

@dataclass
class Stats:
    turns: int = 0
    seconds: float = 0.0
    cpu: float = 0.0
    fsyncs: int = 0
    journal_bytes: int = 0
    round_rates: list[float] = field(default_factory=list)
    latencies: list[array.array] = field(default_factory=list)

    def add(self, c: Cell) -> None:
        self.turns += c.turns
        self.seconds += c.seconds
        self.cpu += c.cpu
        self.fsyncs += c.fsyncs
        self.journal_bytes += c.journal_bytes
        self.round_rates.append(c.turns / c.seconds)
        self.latencies.append(c.latencies)

    def summary(self) -> dict:
        lat = np.concatenate([np.frombuffer(a, dtype=np.float64) for a in self.latencies])
        p50, p99 = np.percentile(lat, [50, 99]) * 1e6
        return {"turns": self.turns, "seconds": round(self.seconds, 3),
                "turns_per_s": round(self.turns / self.seconds, 1),
                "round_turns_per_s": [round(r, 1) for r in self.round_rates],
                "p50_us": round(float(p50), 2), "p99_us": round(float(p99), 2),
                "cpu_us_per_turn": round(self.cpu / self.turns * 1e6, 2),
                "fsyncs_per_turn": round(self.fsyncs / self.turns, 5),
                "journal_bytes_per_turn": round(self.journal_bytes / self.turns, 1)}


def table(results: dict, concurrencies: list[int]) -> str:
    head = (f"{'path':<16} {'conc':>4} {'turns/s':>10} {'by round':>19} {'p50 us':>9} {'p99 us':>9} "
            f"{'cpu us/turn':>11} {'rate/queue':>10} {'slower':>8} {'fsync/turn':>10}")
    lines = [head, "-" * len(head)]
    for c in concurrencies:
        for name, r in results[str(c)].items():
            rounds = r["round_turns_per_s"]
            spread = f"[{min(rounds):.0f}, {max(rounds):.0f}]"
            fs = f"{r['fsyncs_per_turn']:.4f}" if PATHS[name].kind == "scorer" else "-"
            lines.append(f"{name:<16} {c:>4} {r['turns_per_s']:>10.0f} {spread:>19} {r['p50_us']:>9.1f} "
                         f"{r['p99_us']:>9.1f} {r['cpu_us_per_turn']:>11.1f} {r['rate_vs_queue']:>10.4f} "
                         f"{r['slower_than_queue']:>7.0f}x {fs:>10}")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- main

async def main_async(args) -> dict:
    names = args.paths or list(PATHS)
    if "queue" not in names:
        names = ["queue"] + names  # the ratios' denominator
    specs = [PATHS[n] for n in names]
    turns = make_turns(args.pool, args.prompt_tokens, args.response_tokens)
    if max(args.concurrency) > len(turns):
        raise SystemExit("--pool must be at least the largest --concurrency")
    samples = [judging.build_sample(f.turn, EMIT, None, mode="rl", sample_id=uuid.uuid4().hex, now=time.time())
               for f in turns]
    cfgs = {(s.judge, s.fsync): config_from_dict({"scoring": {"mode": "rl", "prm_m": 1},
                                                  "judge": {"backend": "sglang" if s.judge else "rules"},
                                                  "journal": {"fsync": s.fsync}}, source="bench")
            for s in specs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="pipeline-", dir=args.workdir or RESULTS))
    profiler = cProfile.Profile() if args.profile else None

    async def cell(spec: PathSpec, conc: int, duration: float) -> Cell:
        if spec.kind == "scorer":
            return await run_scorer(spec, cfgs[(spec.judge, spec.fsync)], turns, conc, duration, workdir)
        return await run_queue(spec, turns, samples, conc, duration)

    stats = {(s.name, c): Stats() for s in specs for c in args.concurrency}
    order = [(s, c) for c in args.concurrency for s in specs]
    try:
        for s, c in order:  # warm-up: imports, regexes, the allocator, the page cache
            await cell(s, c, args.warmup)
        for r in range(args.rounds):
            for s, c in (order if r % 2 == 0 else order[::-1]):
                if profiler and s.kind == "scorer":
                    profiler.enable()
                result = await cell(s, c, args.duration)
                if profiler:
                    profiler.disable()
                stats[(s.name, c)].add(result)
    finally:
        shutil.rmtree(workdir)
    if profiler:
        profiler.dump_stats(args.profile)

    results: dict = {}
    for c in args.concurrency:
        base = stats[("queue", c)].summary()
        results[str(c)] = {}
        for s in specs:
            r = stats[(s.name, c)].summary()
            r["rate_vs_queue"] = round(r["turns_per_s"] / base["turns_per_s"], 6)
            r["slower_than_queue"] = round(base["turns_per_s"] / r["turns_per_s"], 2)
            results[str(c)][s.name] = r
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=0.8, help="seconds per path, concurrency and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=float, default=0.2, help="seconds per path and concurrency, not counted")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--paths", nargs="+", choices=list(PATHS), help="default: all (queue is always run)")
    ap.add_argument("--pool", type=int, default=256, help="distinct pre-built turns, cycled")
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--response-tokens", type=int, default=100)
    ap.add_argument("--workdir", type=Path, help="where journals go (default bench/results: the repo's disk)")
    ap.add_argument("--profile", type=Path, help="cProfile the scorer paths' measured cells into this file")
    ap.add_argument("--output", type=Path, default=RESULTS / "pipeline.json")
    args = ap.parse_args()

    prov = provenance.stamp()
    t0 = time.perf_counter()
    results = asyncio.run(main_async(args))
    wall = time.perf_counter() - t0
    print(table(results, args.concurrency))
    meta = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "wall_s": round(wall, 1),
            "duration": args.duration, "rounds": args.rounds, "warmup": args.warmup,
            "prompt_tokens": args.prompt_tokens, "response_tokens": args.response_tokens, "pool": args.pool,
            "workdir": str(args.workdir or RESULTS)}
    print(f"{os.cpu_count()} cpus, {args.rounds} rounds x {args.duration}s per cell, wall {wall:.1f}s; "
          f"latency = submit -> sample visible in the store; slower = queue turns/s / path turns/s")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"provenance": prov, "meta": meta, "results": results}, indent=1) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
