"""Scale-out figures: throughput over 1, 2 and 4 policy replicas, and what one clawd daemon sustains.

One file of ~650 lines: each section starts its own processes and load beside the figures it reads from
them, and the fake engine's subcommand lives here so that the bench needs nothing more from tests/ (the
hosts section's namespaces and node 0's driver: bench/hosts.py).

Sections, each a function `(args, ctx) -> dict` in SECTIONS, run in order by main(), which prints each
section's table and writes one JSON (docs/SCALING.md reads its figures):

  serving  one clawd per replica count (1, 2, 4), `engine.launch = "none"`, `engine.urls` = that many
           fake SGLang engines (tests/fake_sglang.py, run by this script with `max_running_requests`
           so that each replica saturates: it runs --engine-slots calls at once and queues the rest,
           --token-delay s a token). Many multi-turn sessions (X-Session-Id) through the official
           `openai` async client, closed loop, in interleaved rounds (1, 2, 4, then 4, 2, 1, ...).
           Figures: completed requests/s and tokens/s per replica count, their ratio to N x one
           replica (target >= 0.9), how the fakes' requests split over the replicas, and how many
           sessions reached more than one replica (target 0: affinity).
  daemon   one clawd, one fake with no token delay (clawd is the bottleneck; the load goes through bare
           aiohttp, as the openai client costs more CPU per request than clawd): requests per second of
           clawd's own CPU (utime + stime from /proc/<pid>/stat) for side turns (serving only) and
           main turns (serving, session, capture, records, the rules judge, the journal), interleaved;
           then RSS growth (VmRSS from /proc/<pid>/status) per live session of --turns turns. No target.
  trainer  parameter + AdamW bytes per rank after a step, one process vs 2 FSDP2 ranks under torchrun
           (bench/trainer_memory.py; --trainer-model, e.g. state/models/SmolLM2-135M-Instruct). Target: a
           rank of 2 holds 0.45-0.55 of one rank's.
  hosts    the trainer world across two hosts, simulated by two network namespaces and a veth pair (root
           only; bench/hosts.py): --hosts-steps steps on 2 ranks of one host, then on 1 + 1 ranks, node 0
           through the daemon's trainer child and node 1 by clawd-trainer@1's line; then a chat through a
           daemon in one namespace to a fake replica in the other. Target: every step's published weights
           and metrics equal on both worlds; the step seconds side by side. Not in the default run.

    .venv/bin/python bench/scale.py            # ~4 min on 2 cores; writes bench/results/scale.json
    .venv/bin/python bench/scale.py --quick    # ~1 min: a smoke run
    .venv/bin/python bench/scale.py --sections daemon --memory-sessions 2000
    sudo .venv/bin/python bench/scale.py --sections hosts --out /tmp/hosts.json   # ~30 s

Exit status: 0 when every section measured and met its targets; 1 when a target was missed or a
request failed; 2 when a section said it could not measure (hosts, where namespaces cannot be made: the
JSON's `could_not_measure` names it); an exception (it could not measure) gives 1 and a traceback, and no
JSON. The JSON carries `provenance` (bench/provenance.py) and `pass`.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from clawd.tools.sim import launch  # noqa: E402
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)

TARGET_SCALING = 0.9  # throughput with N replicas >= this x N x one replica
WORDS = ("model", "token", "server", "client", "request", "response", "session", "turn", "sample",
         "batch", "weight", "judge", "score", "reward", "policy", "engine", "stream", "journal")


# ---------------------------------------------------------------- processes

def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kb(pid: int) -> int:
    """VmRSS of a process in kB, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def session_key(ids: list[int], end_id: int) -> str:
    """A prompt's session key: its ids up to the end of its first message (the system prompt, which names
    the session). The fake engine and this script compute it alike, so the fakes can say which sessions
    reached them without a tokenizer."""
    n = ids.index(end_id) + 1 if end_id in ids else len(ids)
    return hashlib.sha1(",".join(map(str, ids[:n])).encode()).hexdigest()[:16]


async def _fake_engine(args: argparse.Namespace) -> None:
    """The `fake-engine` subcommand: tests/fake_sglang.py's FakeSGLang with a bounded batch (its standalone
    command line has no max_running_requests); on SIGTERM it writes {session key: requests} to --stats."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fake_sglang import FakeSGLang
    fake = FakeSGLang(tokens=args.tokens, eos_id=args.eos_id, token_delay=args.token_delay,
                      max_running_requests=args.slots or None, host=args.host, port=0)
    await fake.start()
    print(f"PORT {fake.port}", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    counts: dict[str, int] = {}
    for body in fake.requests:
        key = session_key(body.get("input_ids") or [], args.eos_id)
        counts[key] = counts.get(key, 0) + 1
    Path(args.stats).write_text(json.dumps(counts))
    await fake.close()


def start_fake(tmp: Path, name: str, tokens: int, eos_id: int, delay: float, slots: int, host: str = "127.0.0.1",
               under: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, Path]:
    """`under`: a command the fake runs under (`ip netns exec NS`: another host's network)."""
    stats, log = tmp / f"{name}.stats.json", tmp / f"{name}.log"
    with open(log, "w") as err:  # the child holds its own copy of the descriptor
        proc = subprocess.Popen([*under, sys.executable, __file__, "fake-engine", "--tokens", str(tokens), "--eos-id",
                                 str(eos_id), "--token-delay", str(delay), "--slots", str(slots), "--stats", str(stats),
                                 "--host", host], stdout=subprocess.PIPE, stderr=err, text=True)
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        stop(proc)
        raise RuntimeError(f"fake engine did not start: {line!r}\n{log.read_text()[-2000:]}")
    return proc, f"http://{host}:{int(line.split()[1])}", stats


def start_clawd(tmp: Path, model: Path, urls: list[str]) -> tuple[subprocess.Popen, str]:
    """One daemon in front of `urls`: the rules judge in rl mode, no learner (no trainer, no reference engine).
    `url` is the first replica too, so a daemon that does not route yet still serves (from one replica)."""
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = {"server": {"port": 0, "max_concurrent_requests": 1024},
           "model": {"path": str(model)},
           "engine": {"launch": "none", "url": urls[0], "urls": list(urls)},
           "state": {"dir": str(tmp / "state"), "min_free_bytes": 64 * 1024 * 1024},
           "scoring": {"mode": "rl"}, "judge": {"backend": "rules"}, "learner": {"enabled": False}}
    log = tmp / "clawd.log"
    with open(log, "w") as err:
        proc = launch.spawn(tmp, cfg, stdout=subprocess.DEVNULL, stderr=err)
    deadline, url = time.monotonic() + 90, None
    while time.monotonic() < deadline and proc.poll() is None:
        url = url or launch.listening(log.read_text())
        if url is not None and ready(url):
            return proc, url
        time.sleep(0.1)
    stop(proc)
    raise RuntimeError(f"clawd did not start or get ready:\n{log.read_text()[-3000:]}")


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=5) as resp:
            return resp.status == 200
    except OSError:  # not ready yet: a 503, or the listener not up
        return False


def stop(proc: subprocess.Popen) -> None:
    if proc.stdout is not None:
        proc.stdout.close()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- load: multi-turn sessions

def system_text(name: str, words: int) -> str:
    """The session's name first, so that its key (session_key) differs from every other session's."""
    return f"Session {name}. You are a helpful assistant. " + " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(words))


def question(n: int, turn: int) -> str:
    return f"Question {n}.{turn}: what is a {WORDS[(n + turn) % len(WORDS)]} and how does it relate to a " \
           f"{WORDS[(n // 3 + 2 * turn) % len(WORDS)]}?"


@dataclass
class Phase:
    """What one closed-loop run completed inside its measuring window."""
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds inside the window
    errors: list[str] = field(default_factory=list)
    sessions: dict[str, str] = field(default_factory=dict)  # session name -> its first prompt's system text


class ChatFailed(Exception):
    """A chat request that did not answer 200 (or did not connect)."""


class Chat:
    """POST /v1/chat/completions through the official `openai` async client (non-streamed), or through bare
    aiohttp (also streamed): the openai client spends more CPU per request than clawd does, so where clawd's
    own limit is measured on shared cores the lighter client leaves clawd the CPU. Same body, same headers."""

    def __init__(self, url: str, connections: int, kind: str = "openai"):
        self.url, self.kind = url, kind
        if kind == "openai":
            import httpx2  # the openai package's own HTTP client library
            import openai
            limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)
            http = openai.DefaultAsyncHttpx2Client(limits=limits, timeout=httpx2.Timeout(300.0))
            self.client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, http_client=http)
        else:
            import aiohttp
            self.client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                                timeout=aiohttp.ClientTimeout(total=300))

    async def send(self, messages: list[dict], max_tokens: int, headers: dict, stream: bool = False) -> tuple[str, int]:
        """(the reply's content, its completion tokens); ChatFailed on any failure. Streamed: every event
        read, the count from the usage chunk (stream_options.include_usage)."""
        body = {"model": "clawd", "messages": messages, "max_tokens": max_tokens, "temperature": 1.0}
        if self.kind == "openai":
            import openai
            assert not stream, "streams go through aiohttp"
            try:
                reply = await self.client.chat.completions.create(**body, extra_headers=headers)
            except openai.APIError as exc:
                raise ChatFailed(f"{type(exc).__name__}: {exc}"[:300]) from exc
            return reply.choices[0].message.content or "", reply.usage.completion_tokens
        import aiohttp
        body.update({"stream": True, "stream_options": {"include_usage": True}} if stream else {})
        try:
            async with self.client.post(self.url + "/v1/chat/completions", json=body, headers=headers) as resp:
                if resp.status != 200:
                    raise ChatFailed(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                if not stream:
                    data = await resp.json(content_type=None)
                    return data["choices"][0]["message"].get("content") or "", data["usage"]["completion_tokens"]
                raw = await resp.read()
        except (aiohttp.ClientError, ValueError, KeyError, IndexError) as exc:
            raise ChatFailed(f"{type(exc).__name__}: {exc}"[:300]) from exc
        parts, tokens = [], None
        for event in raw.split(b"\n\n"):
            if event.startswith(b"data: {"):
                chunk = json.loads(event[6:])
                parts += [c["delta"].get("content") or "" for c in chunk.get("choices") or []]
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
        if tokens is None or not raw.rstrip().endswith(b"data: [DONE]"):
            raise ChatFailed(f"a stream without usage or [DONE]: {raw[-200:]!r}")
        return "".join(parts), tokens

    async def close(self) -> None:
        await self.client.close()


async def converse(chat: Chat, name: str, n: int, turns: int, max_tokens: int, system_words: int, headers: dict,
                   stream: bool = False, close: bool = True, on_reply=lambda tokens: None) -> None:
    """One session, `name`, of `turns` turns (X-Session-Done on the last when `close`); ChatFailed ends it."""
    messages = [{"role": "system", "content": system_text(name, system_words)}, {"role": "user", "content": question(n, 0)}]
    for turn in range(turns):
        last = {"X-Session-Done": "1"} if close and turn == turns - 1 else {}
        content, tokens = await chat.send(messages, max_tokens, {**headers, "X-Session-Id": name, **last}, stream)
        on_reply(tokens)
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": question(n, turn + 1)}]


async def closed_loop(url: str, pids: dict[str, int], prefix: str, sessions: int, turns: int, warm: float,
                      duration: float, max_tokens: int, system_words: int, headers: dict | None = None,
                      client: str = "openai", stream: bool = False) -> Phase:
    """`sessions` workers, each running sessions of `turns` turns back to back, for warm + duration seconds;
    completions and CPU are counted inside the last `duration` seconds only. Workers still waiting at the
    end are cancelled (their requests aborted), so no drain is timed."""
    out = Phase(seconds=duration)
    chat = Chat(url, sessions + 8, client)
    serial = itertools.count()
    window = [float("inf"), float("inf")]

    def count(tokens: int) -> None:
        if window[0] <= time.monotonic() < window[1]:
            out.requests += 1
            out.tokens += tokens

    async def worker() -> None:
        while True:
            n = next(serial)
            name = f"{prefix}-{n}"
            out.sessions[name] = system_text(name, system_words)
            try:
                await converse(chat, name, n, turns, max_tokens, system_words, headers or {}, stream, on_reply=count)
            except ChatFailed as exc:  # counted, and judged: a failed request fails the section
                out.errors.append(str(exc))

    def cpu_now() -> dict[str, float]:
        return {**{k: cpu_seconds(p) for k, p in pids.items()}, "client": sum(os.times()[:2])}

    tasks = [asyncio.create_task(worker()) for _ in range(sessions)]
    try:
        await asyncio.sleep(warm)
        cpu0, window[0] = cpu_now(), time.monotonic()
        window[1] = window[0] + duration
        await asyncio.sleep(duration)
        cpu1 = cpu_now()
        out.cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    finally:
        for t in tasks:
            t.cancel()
        ended = await asyncio.gather(*tasks, return_exceptions=True)
        await chat.close()
    # a worker that died of anything but a failed request or the cancel is a bug of the bench: raise it
    broken = [e for e in ended if isinstance(e, Exception)]
    if broken:
        raise broken[0]
    return out


# ---------------------------------------------------------------- section: serving over replicas

def scaling_verdict(rates: dict[int, float], target: float = TARGET_SCALING) -> dict[int, dict]:
    """Per replica count N: measured / (N x the one-replica rate), and whether it meets `target`."""
    one = rates[1]
    return {n: {"ratio": round(r / (n * one), 3) if one > 0 else 0.0, "ok": one > 0 and r >= target * n * one}
            for n, r in rates.items() if n != 1}


def serving_section(args: argparse.Namespace, ctx: "Context") -> dict:
    counts = sorted(set(args.replicas) | {1})
    fakes, clawds, stats = [], {}, []
    tmp = ctx.tmp / "serving"
    tmp.mkdir()
    try:
        for i in range(max(counts)):
            proc, url, path = start_fake(tmp, f"fake{i}", args.tokens, ctx.eos_id, args.token_delay, args.engine_slots)
            fakes.append((proc, url))
            stats.append(path)
        for n in counts:
            clawds[n] = start_clawd(tmp / f"clawd{n}", ctx.model, [u for _, u in fakes[:n]])
        phases: dict[int, list[Phase]] = {n: [] for n in counts}
        for r in range(args.rounds):
            for n in (counts if r % 2 == 0 else counts[::-1]):
                proc, url = clawds[n]
                phases[n].append(asyncio.run(closed_loop(
                    url, {"clawd": proc.pid}, f"r{r}n{n}", args.sessions, args.turns, args.warm, args.duration,
                    args.tokens + 16, args.system_words)))
    finally:
        for proc, _ in clawds.values():
            stop(proc)
        for proc, _ in fakes:
            stop(proc)
    missing = [p.name for p in stats if not p.exists()]
    if missing:  # a fake that died cannot say which sessions it served
        raise RuntimeError(f"no per-session counts from {', '.join(missing)}")
    seen = [json.loads(p.read_text()) for p in stats]
    per_n, rates = {}, {}
    for n in counts:
        ph = phases[n]
        seconds = sum(p.seconds for p in ph)
        requests, tokens = sum(p.requests for p in ph), sum(p.tokens for p in ph)
        keys = {session_key(ctx.tok.encode_chat([{"role": "system", "content": s}], None), ctx.eos_id)
                for p in ph for s in p.sessions.values()}
        by_replica = [sum(c for k, c in s.items() if k in keys) for s in seen[:max(counts)]]
        split = sum(1 for k in keys if sum(1 for s in seen if k in s) > 1)
        rates[n] = requests / seconds
        per_n[n] = {"requests": requests, "seconds": seconds, "req_per_s": round(rates[n], 2),
                    "tokens_per_s": round(tokens / seconds, 1), "sessions": len(keys),
                    "engine_requests_by_replica": by_replica, "sessions_on_two_replicas": split,
                    "round_req_per_s": [round(p.requests / p.seconds, 2) for p in ph],
                    "clawd_cpu_ms_per_req": round(1000 * sum(p.cpu["clawd"] for p in ph) / max(requests, 1), 2),
                    "errors": sum(len(p.errors) for p in ph),
                    "first_errors": [e for p in ph for e in p.errors][:3]}
    verdict = scaling_verdict(rates)
    ideal = args.engine_slots / (args.tokens * args.token_delay) if args.token_delay > 0 else None
    ok = (all(v["ok"] for v in verdict.values()) and all(c["errors"] == 0 for c in per_n.values())
          and all(c["sessions_on_two_replicas"] == 0 for c in per_n.values()))
    lines = [f"{'replicas':>8}  {'req/s':>7}  {'tokens/s':>9}  {'/ (N x one)':>11}  {'by round':>19}  "
             f"{'engine requests per replica':<28}  {'split':>5}  {'cpu ms/req':>10}  {'errors':>6}"]
    for n, c in per_n.items():
        ratio = "-" if n == 1 else f"{verdict[n]['ratio']:.2f}" + ("" if verdict[n]["ok"] else " MISSED")
        rounds = "/".join(f"{x:.1f}" for x in c["round_req_per_s"])
        lines.append(f"{n:>8}  {c['req_per_s']:>7.2f}  {c['tokens_per_s']:>9.1f}  {ratio:>11}  {rounds:>19}  "
                     f"{str(c['engine_requests_by_replica']):<28}  {c['sessions_on_two_replicas']:>5}  "
                     f"{c['clawd_cpu_ms_per_req']:>10.2f}  {c['errors']:>6}")
    lines.append(f"one replica's ceiling: {args.engine_slots} slots / ({args.tokens} tokens x {args.token_delay:g} s) = "
                 f"{ideal:.2f} req/s" if ideal else "no token delay: the engine is not the bottleneck")
    lines.append(f"targets: req/s with N replicas >= {TARGET_SCALING:g} x N x one replica; no session on two replicas "
                 f"('split'); no request error. {'PASS' if ok else 'FAIL'}")
    return {"pass": ok, "table": "\n".join(lines), "replica_counts": counts, "results": per_n,
            "scaling": verdict, "one_replica_ceiling_req_per_s": ideal,
            "targets": {"scaling": TARGET_SCALING, "sessions_on_two_replicas": 0}}


# ---------------------------------------------------------------- section: one daemon's limits

def live_sessions(url: str) -> int | None:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("clawd_live_sessions "):
                return int(float(line.split()[1]))
    return None


async def open_sessions(url: str, prefix: str, count: int, turns: int, concurrency: int, system_words: int,
                        max_tokens: int) -> int:
    """`count` sessions of `turns` no_train main turns each, left open; returns how many failed."""
    chat, serial, errors = Chat(url, concurrency + 8, "aiohttp"), iter(range(count)), [0]

    async def worker() -> None:
        for n in serial:
            try:
                await converse(chat, f"{prefix}-{n}", n, turns, max_tokens, system_words, {"X-Clawd-No-Train": "1"},
                               close=False)
            except ChatFailed:  # counted: the section then reports it did not measure cleanly
                errors[0] += 1

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await chat.close()
    return errors[0]


def daemon_section(args: argparse.Namespace, ctx: "Context") -> dict:
    tmp = ctx.tmp / "daemon"
    tmp.mkdir()
    fake, fake_url, _ = start_fake(tmp, "fake", args.tokens, ctx.eos_id, 0.0, 0)
    clawd = None
    try:
        clawd, url = start_clawd(tmp / "clawd", ctx.model, [fake_url])
        pids = {"clawd": clawd.pid, "fake": fake.pid}
        # Idle cost first (timers, health polls): at low request rates it weighs on CPU per request.
        idle0 = cpu_seconds(clawd.pid)
        time.sleep(args.idle)
        idle_ms_per_s = round(1000 * (cpu_seconds(clawd.pid) - idle0) / args.idle, 2)
        # (headers, streamed): serving alone; everything a main turn costs; the same, streamed token by token
        kinds = {"side": ({"X-Turn-Type": "side"}, False), "main": ({}, False), "main/sse": ({}, True)}
        phases: dict[str, list[Phase]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in (list(kinds) if r % 2 == 0 else list(kinds)[::-1]):
                headers, streamed = kinds[kind]
                phases[kind].append(asyncio.run(closed_loop(
                    url, pids, f"d{r}{kind.replace('/', '-')}", args.daemon_sessions, args.turns, args.warm,
                    args.duration, args.tokens + 16, args.system_words, headers, "aiohttp", streamed)))
        # Memory: sessions held open (no_train, so no sample waits in the store beside them).
        half = args.memory_sessions // 2
        rss = [rss_kb(clawd.pid)]
        live = [live_sessions(url)]
        errors = 0
        for step, count in enumerate((half, args.memory_sessions - half)):
            errors += asyncio.run(open_sessions(url, f"m{step}", count, args.turns, 32, args.system_words,
                                                args.tokens + 16))
            rss.append(rss_kb(clawd.pid))
            live.append(live_sessions(url))
    finally:
        if clawd is not None:
            stop(clawd)
        stop(fake)
    cpu = {}
    for kind, ph in phases.items():
        requests = sum(p.requests for p in ph)
        seconds = sum(p.seconds for p in ph)
        used = {k: sum(p.cpu[k] for p in ph) for k in ph[0].cpu}
        if requests == 0 or used["clawd"] <= 0:
            raise RuntimeError(f"daemon section, {kind} turns: nothing measured ({requests} requests)")
        cpu[kind] = {"requests": requests, "req_per_s": round(requests / seconds, 1),
                     "req_per_clawd_core_s": round(requests / used["clawd"], 1),
                     "cpu_ms_per_req": {k: round(1000 * v / requests, 3) for k, v in used.items()},
                     "clawd_cores_busy": round(used["clawd"] / seconds, 2),
                     "errors": sum(len(p.errors) for p in ph), "first_errors": [e for p in ph for e in p.errors][:3]}
    opened = live[2] - live[0] if None not in live else args.memory_sessions
    memory = {"sessions": args.memory_sessions, "turns_each": args.turns, "live_sessions": live, "rss_kb": rss,
              "kb_per_session": round((rss[2] - rss[0]) / max(opened, 1), 2),
              "kb_per_session_second_half": round((rss[2] - rss[1]) / max(live[2] - live[1], 1), 2)
              if None not in live else None, "errors": errors}
    ok = all(c["errors"] == 0 for c in cpu.values()) and errors == 0 and opened == args.memory_sessions
    lines = [f"{'turns':>8}  {'req/s':>7}  {'req per clawd core-s':>20}  {'clawd cores busy':>16}  "
             f"{'cpu ms/req clawd / fake / client':>32}  {'errors':>6}"]
    for kind, c in cpu.items():
        ms = c["cpu_ms_per_req"]
        lines.append(f"{kind:>8}  {c['req_per_s']:>7.1f}  {c['req_per_clawd_core_s']:>20.1f}  {c['clawd_cores_busy']:>16.2f}  "
                     f"{ms['clawd']:>10.2f} / {ms['fake']:>6.2f} / {ms['client']:>6.2f}       {c['errors']:>6}")
    lines.append(f"memory: {opened} live sessions of {args.turns} turns (no_train): RSS {rss[0] / 1024:.1f} -> "
                 f"{rss[1] / 1024:.1f} -> {rss[2] / 1024:.1f} MiB, {memory['kb_per_session']:.1f} kB per session "
                 f"(second half {memory['kb_per_session_second_half']} kB); live sessions {live}")
    lines.append(f"no target; measured when every request succeeded and every session stayed open: {'yes' if ok else 'NO'}")
    lines.append(f"idle: clawd used {idle_ms_per_s:.1f} ms of CPU per second over {args.idle:g} s with no request")
    return {"pass": ok, "table": "\n".join(lines), "cpu": cpu, "memory": memory, "idle_cpu_ms_per_s": idle_ms_per_s}


def trainer_section(args: argparse.Namespace, ctx: "Context") -> dict:
    """Parameter and optimizer bytes per rank after a step: one process, then 2 FSDP2 ranks under torchrun
    (bench/trainer_memory.py). Target: a rank of 2 holds 1/2 of them (within 10 %: shards are padded)."""
    runs = {}
    for n in (1, 2):
        out = ctx.tmp / f"trainer-{n}.json"
        cmd = [sys.executable, str(ROOT / "bench" / "trainer_memory.py"), str(args.trainer_model or ctx.model),
               str(ctx.tmp / f"trainer-state-{n}"), str(out)]
        if n > 1:
            cmd[1:1] = ["-m", "torch.distributed.run", "--nproc-per-node", str(n), "--standalone"]
        subprocess.run(cmd, check=True, timeout=1200, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
        runs[n] = json.loads(out.read_text())["ranks"]
    one = runs[1][0]["params_bytes"] + runs[1][0]["optimizer_bytes"]
    per_rank = [r["params_bytes"] + r["optimizer_bytes"] for r in runs[2]]
    ratios = [b / one for b in per_rank]
    ok = all(0.45 <= x <= 0.55 for x in ratios)
    lines = [f"model {args.trainer_model or ctx.model}: {runs[1][0]['full_params_bytes'] / 2**20:.1f} MiB of float32 parameters",
             "ranks  params + AdamW state per rank (MiB)   vs one rank   peak RSS per rank (MiB)"]
    lines.append(f"1      {one / 2**20:10.1f}                          1.00          {runs[1][0]['peak_rss_bytes'] / 2**20:.0f}")
    rss = ", ".join(f"{r['peak_rss_bytes'] / 2**20:.0f}" for r in runs[2])
    lines.append(f"2      {', '.join(f'{b / 2**20:.1f}' for b in per_rank):>20}          "
                 f"{', '.join(f'{x:.2f}' for x in ratios)}    {rss}")
    lines.append(f"target: each of 2 ranks holds 0.45-0.55 of one rank's parameters and optimizer state: {'yes' if ok else 'NO'}")
    return {"pass": ok, "table": "\n".join(lines), "ranks": runs, "ratios": ratios}


def hosts_section(args: argparse.Namespace, ctx: "Context") -> dict:
    """The trainer world across two hosts, simulated by two network namespaces (bench/hosts.py): the same steps
    on 2 ranks of one host, then on 1 + 1 ranks of hosts A and B, compared; then a chat through a daemon in A to
    a replica in B. Could not measure (exit 2) where namespaces cannot be made."""
    import hosts  # bench/hosts.py

    if why := hosts.unavailable():
        return {"pass": None, "could_not_measure": why, "table": f"could not measure: {why}"}
    tmp = ctx.tmp / "hosts"
    tmp.mkdir()
    one = hosts.one_host(tmp, ctx.model, args.hosts_steps)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench still removes its namespaces
    try:
        with hosts.TwoHosts() as net:
            two, node1_exit, node1_argv = hosts.two_hosts(net, tmp, ctx.model, args.hosts_steps)
            replica, url, stats = start_fake(tmp, "replica-b", args.tokens, ctx.eos_id, 0.0, 0, hosts.ADDRESS["b"],
                                             tuple(net.run_in("b", [])))
            try:
                served = hosts.run_driver(tmp, "serve", ctx.model, net.run_in("a", []), "serve", serve=url)
            finally:
                stop(replica)  # it writes the requests it saw on the way out
            served["replica_requests"] = sum(json.loads(stats.read_text()).values())
    except hosts.Unavailable as exc:
        return {"pass": None, "could_not_measure": str(exc), "table": f"could not measure: {exc}"}
    finally:
        signal.signal(signal.SIGTERM, previous)
    compared = hosts.compare(one, two)
    ok = (compared["equal"] and compared["world_size"] == [2, 2] and node1_exit == 0 and served["status"] == 200
          and served["replica_requests"] >= 1)
    lines = [hosts.table(compared, served), f"node 1 (clawd-trainer@1): {' '.join(node1_argv[1:])}; exit {node1_exit}",
             "target: every step equal on both worlds, node 1 exits 0, the chat served from B: "
             + ("yes" if ok else "NO")]
    return {"pass": ok, "table": "\n".join(lines), **compared, "served": served, "node1_argv": node1_argv[1:],
            "node1_exit": node1_exit, "left_over_namespaces": hosts.left_over()}


# ---------------------------------------------------------------- main

@dataclass
class Context:
    """What every section shares: the model, its tokenizer, a scratch folder, the cores."""
    model: Path
    tok: object
    eos_id: int
    tmp: Path
    cores: int


SECTIONS = {"serving": serving_section, "daemon": daemon_section, "trainer": trainer_section, "hosts": hosts_section}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=[s for s in SECTIONS if s != "hosts"])
    p.add_argument("--quick", action="store_true", help="short phases, one round, few sessions: a smoke run")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, --quick 1)")
    p.add_argument("--warm", type=float, default=None, help="seconds before a phase's window (default 2, --quick 1.5)")
    p.add_argument("--duration", type=float, default=None, help="a phase's measured window (default 8 s, --quick 4)")
    p.add_argument("--sessions", type=int, default=64, help="serving: concurrent sessions")
    p.add_argument("--daemon-sessions", type=int, default=32, help="daemon: concurrent sessions")
    p.add_argument("--turns", type=int, default=4, help="turns per session")
    p.add_argument("--tokens", type=int, default=32, help="tokens per reply, EOS included")
    p.add_argument("--token-delay", type=float, default=0.02, help="serving: the fake engines' seconds per token")
    p.add_argument("--engine-slots", type=int, default=4, help="serving: calls one fake engine runs at once")
    p.add_argument("--system-words", type=int, default=150)
    p.add_argument("--idle", type=float, default=None, help="daemon: seconds its idle CPU is read over (default 5, --quick 2)")
    p.add_argument("--memory-sessions", type=int, default=None, help="daemon: sessions held open (default 1000, --quick 200)")
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny test model)")
    p.add_argument("--trainer-model", type=Path, default=None,
                   help="trainer: the model whose ranks are measured (default: --model's)")
    p.add_argument("--hosts-steps", type=int, default=None, help="hosts: steps per world (default 5, --quick 2)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale.json")
    args = p.parse_args(argv)
    quick = {"rounds": (3, 1), "warm": (2.0, 1.5), "duration": (8.0, 4.0), "memory_sessions": (1000, 200), "idle": (5.0, 2.0)}
    quick["hosts_steps"] = (5, 2)
    for name, (full, short) in quick.items():
        if getattr(args, name) is None:
            setattr(args, name, short if args.quick else full)
    if args.quick and args.turns == 4:
        args.turns = 2
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fake-engine"]:
        p = argparse.ArgumentParser()
        for flag, kind in (("--tokens", int), ("--eos-id", int), ("--token-delay", float), ("--slots", int),
                           ("--stats", str)):
            p.add_argument(flag, type=kind, required=True)
        p.add_argument("--host", default="127.0.0.1")
        asyncio.run(_fake_engine(p.parse_args(argv[1:])))
        return 0
    args = parse(argv)
    prov = provenance.stamp()
    started = time.monotonic()
    from clawd.tokenizer import ChatTokenizer
    from clawd.tools.models import cached_tiny_model
    model = args.model or cached_tiny_model(ROOT / "bench" / "results" / "tiny-model")
    tok = ChatTokenizer(model)
    cores = len(os.sched_getaffinity(0))
    print(f"bench/scale.py: {cores} cores shared by the load generator, clawd and the fake engines; "
          f"sections {', '.join(args.sections)}{' (quick)' if args.quick else ''}; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="clawd-scale-") as tmp:
        ctx = Context(model, tok, tok.info.eos_ids[0], Path(tmp), cores)
        for name in args.sections:
            t0 = time.monotonic()
            results[name] = SECTIONS[name](args, ctx)
            results[name]["wall_s"] = round(time.monotonic() - t0, 1)
            print(f"\n== {name} ({results[name]['wall_s']:.0f} s)\n{results[name]['table']}", flush=True)
    ok = all(r["pass"] is not False for r in results.values())
    unmeasured = [name for name, r in results.items() if r.get("could_not_measure")]
    wall = time.monotonic() - started
    load = os.getloadavg()
    # other processes' load takes cores from clawd: its CPU per request is the figure that carries over
    verdict = f"COULD NOT MEASURE ({', '.join(unmeasured)})" if unmeasured else "PASS" if ok else "FAIL"
    print(f"\noverall: {verdict} in {wall:.0f} s; load average now {load[0]:.1f} (5 min {load[1]:.1f})")
    report = {"provenance": prov, "cores": cores, "wall_s": round(wall, 1), "load_average_after": load,
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "sections": {k: {kk: vv for kk, vv in v.items() if kk != "table"} for k, v in results.items()},
              "pass": ok and not unmeasured, "could_not_measure": unmeasured}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 2 if unmeasured else 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
