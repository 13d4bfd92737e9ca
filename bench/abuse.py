"""Stalled clients and huge messages against the real daemon: nobody else is locked out, memory stays put.

One clawd (its own process, `engine.launch = "none"`, in front of tests/fake_sglang.py, as
bench/serve.py runs it) with short connection deadlines (`server.header_timeout`,
`server.body_timeout`, `server.keepalive_timeout`: --header-timeout, --body-timeout):

  (a) stalled  a normal client sends --requests chat requests (--concurrency at a time), first on a
               quiet daemon, then while --stalled connections are held open: partial headers,
               full headers and half a body, and slow readers that start a long streamed chat
               (with log-probs) and read no more than its status line. An upload staller that is
               answered or closed opens a new connection, so the count stays up for the whole run.
               With slow readers, the run starts once a witness stream of the same length, started
               after them, has been read whole: their generation is over, so a 429 then is a slot
               held by a stalled write, not engine work. A reply stalls a write only when it is
               larger than the socket buffers (a loopback takes about 2 MB of it: --slow-tokens
               8000 or more; the model's context is raised to fit). Targets: every normal request
               answered 200, its p50 latency within 2x the quiet run's, and every stalled upload
               answered 408 (any 4xx is counted as an answer) or closed within its deadline plus
               --slack seconds; the measured close times are printed.
  (b) big      --big requests, each with one distinct message of --big-chars (1,000,000)
               characters, --big-concurrency at a time: each answered below 500 (refused or
               served), and the daemon's RSS (VmRSS before and after, VmHWM reset before) grows
               by less than 100 MB. With the model's own context (--big-context 0) clawd refuses
               such a message before encoding it; `--big-context 1048576` makes it encode and serve
               them (about 2-3 s of the daemon's CPU each on the tiny model).

  (c) adversarial  inputs that cost the daemon most (digit-dense text for the PII detector, prompts
               of spaces and words for the tokenizer, a conversation of 1,000 messages) against a daemon of
               its own while a normal client is served: the worst event-loop lag (target <= 0.1 s), the
               normal client's p50 ratio and no 5xx (bench/adversarial.py; --adversarial-rounds 0 skips it).

Afterwards `/health` and a normal chat request must answer 200, and the daemon's log must hold no
"Traceback". Prints a table; writes bench/results/abuse.json (with `provenance`).

    .venv/bin/python bench/abuse.py                 # 1,000 stalled, 200 + 200 requests, 1,000 big ones
    .venv/bin/python bench/abuse.py --quick         # 100 stalled, 40 + 40 requests, 20 big ones
    .venv/bin/python bench/abuse.py --big-context 1048576 --big 50

Also the daemon plumbing bench/fuzz.py shares (start_daemon, raise_nofile, log_stats, health_check).
Exit status: 0 when every target was met; 1 when one was missed; 2 when it could not measure (the
daemon did not start or died); an exception gives a traceback and no JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from clawd.tools.sim import launch  # noqa: E402
from clawd.tools.tomlfile import merged  # noqa: E402
from clawd.tokenizer import ChatTokenizer  # noqa: E402
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)
from serve import WORDS, cpu_seconds, pct, start_fake, stop, tiny_model, wait_ready  # noqa: E402
from adversarial import adversarial_phase, adversarial_table, judge_adversarial  # noqa: E402

CHAT = "/v1/chat/completions"
TARGET_P50_RATIO = 2.0
TARGET_RSS_MB = 100.0
KINDS = ("partial headers", "partial body", "slow reader")


# ---------------------------------------------------------------- the daemon (bench/fuzz.py uses these too)

def raise_nofile() -> int:
    """Raise this process's open-file limit to its hard limit (the daemon inherits it); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def start_daemon(tmp: Path, model: Path, engine_url: str, server: dict,
                 extra: dict | None = None) -> tuple[subprocess.Popen, str, Path]:
    """clawd in front of `engine_url`, its [server] table extended by `server`; stderr to tmp/clawd.log.
    Rules judge, no learner (as tests/harness.py): nothing here is about scoring or training."""
    cfg = {"server": {"port": 0, **server}, "model": {"path": str(model)},
           "engine": {"launch": "none", "url": engine_url}, "state": {"dir": str(tmp / "state")},
           "scoring": {"mode": "rl"}, "judge": {"backend": "rules"}, "learner": {"enabled": False}}
    cfg = merged(cfg, extra or {})
    return launch_daemon(tmp, cfg)


def launch_daemon(tmp: Path, cfg: dict, start_timeout: float = 60.0) -> tuple[subprocess.Popen, str, Path]:
    """clawd on the configuration `cfg` (as a TOML file in tmp, clawd.tools.sim.launch.spawn); returns once it
    listens."""
    log = tmp / "clawd.log"
    with open(log, "w") as out:
        proc = launch.spawn(tmp, cfg, stdout=subprocess.DEVNULL, stderr=out)
    deadline = time.monotonic() + start_timeout
    while time.monotonic() < deadline:
        if url := launch.listening(log.read_text(errors="replace")):
            return proc, url, log
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"clawd did not start:\n{log.read_text(errors='replace')[-3000:]}")


def log_stats(log: Path) -> dict:
    """Lines, bytes and tracebacks in the daemon's log. `noise`: the lines that are not the one INFO line
    clawd writes per answered chat (its access line, by design one per reply, not per bad request)."""
    text = log.read_text(errors="replace")
    lines = text.count("\n")
    return {"lines": lines, "bytes": len(text.encode()), "tracebacks": text.count("Traceback"),
            "noise": lines - text.count(" INFO clawd.chat: chat id=")}


def first_traceback(log: Path) -> str | None:
    text = log.read_text(errors="replace")
    at = text.find("Traceback")
    return None if at < 0 else text[max(0, text.rfind("\n", 0, at - 1)):at + 2000]


def chat_body(max_tokens: int = 8, content: str = "What is a token?", stream: bool = False,
              logprobs: bool = False) -> dict:
    return {"model": "clawd", "max_tokens": max_tokens, "temperature": 0.7, "stream": stream, "logprobs": logprobs,
            "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": content}]}


async def health_check(http: aiohttp.ClientSession, url: str, proc: subprocess.Popen) -> dict:
    """`/health` and one normal chat request, after the abuse: both must answer 200."""
    out: dict = {"alive": proc.poll() is None, "health": None, "chat": None}
    for key, call in (("health", lambda: http.get(url + "/health")),
                      ("chat", lambda: http.post(url + CHAT, json=chat_body(), headers={"X-Session-Done": "1"}))):
        try:
            async with call() as resp:
                await resp.read()
                out[key] = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    out["ok"] = out["alive"] and out["health"] == 200 and out["chat"] == 200
    return out


def memory(pid: int) -> dict:
    """VmRSS and VmHWM of a process, in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current RSS (`5` to clear_refs), so the next peak is this phase's own."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- (a) stalled connections

async def normal_run(url: str, count: int, concurrency: int, tokens: int, pids: dict[str, int],
                     timeout: float = 30.0, budget: float = 120.0) -> dict:
    """`count` ordinary chat requests, `concurrency` at a time: latency and status of each, and the CPU
    seconds each process (clawd, the fake engine, this bench) used meanwhile. A request gets `timeout`
    seconds; none starts after `budget` seconds (those left count as "not sent"), so a locked-out
    client ends the run instead of stretching it."""
    pids = {**pids, "bench": os.getpid()}
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    latencies, refused, statuses, errors = [], [], collections.Counter(), []
    left, t0 = [count], time.perf_counter()
    body = json.dumps(chat_body(tokens)).encode()
    headers = {"Content-Type": "application/json", "X-Session-Done": "1"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:

        async def worker():
            while left[0] > 0:
                if time.perf_counter() - t0 > budget:
                    statuses["not sent (budget)"] += left[0]
                    left[0] = 0
                    break
                left[0] -= 1
                start = time.perf_counter()
                try:
                    async with http.post(url + CHAT, data=body, headers=headers) as resp:
                        reply = await resp.read()
                        statuses[str(resp.status)] += 1
                        if resp.status != 200 and sum(e.startswith(str(resp.status)) for e in errors) < 2:
                            errors.append(f"{resp.status}: {reply[:200].decode('latin-1')}")  # two of each
                        (latencies if resp.status == 200 else refused).append(time.perf_counter() - start)
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    statuses[f"no reply ({type(exc).__name__})"] += 1
                    errors.append(repr(exc)[:200])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu = {name: round(cpu_seconds(pid) - cpu0[name], 2) for name, pid in pids.items()}
    return {"requests": count, "seconds": round(time.perf_counter() - t0, 2), "by_status": dict(statuses), "cpu_s": cpu,
            "p50_ms": round(pct(latencies, 50) * 1000, 1) if latencies else None,
            "p99_ms": round(pct(latencies, 99) * 1000, 1) if latencies else None, "errors": errors[:10],
            "refused_p50_ms": round(pct(refused, 50) * 1000, 1) if refused else None}


def upload_request(kind: str, n: int) -> bytes:
    """The bytes a stalled upload sends, and then no more: headers cut short, or half of the body."""
    if kind == "partial headers":
        return b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: applic"
    body = json.dumps(chat_body(8, f"stalled upload {n}")).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body[:len(body) // 2]


async def stall_upload(host: str, port: int, kind: str, n: int, out: list, stopping: asyncio.Event) -> None:
    """Hold a stalled upload open; when the daemon answers or closes it, note how long that took and
    open another, until `stopping`. Entries: (kind, outcome, seconds from the last byte sent)."""
    while not stopping.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(upload_request(kind, n))
            await writer.drain()
        except OSError as exc:
            out.append((kind, f"connect failed ({type(exc).__name__})", 0.0))
            await asyncio.sleep(0.5)
            continue
        t0 = time.monotonic()
        read = asyncio.ensure_future(reader.read(4096))
        ended = asyncio.ensure_future(stopping.wait())
        await asyncio.wait({read, ended}, return_when=asyncio.FIRST_COMPLETED)
        waited = time.monotonic() - t0
        if read.done():
            try:
                got = read.result()
                outcome = ("closed" if not got else
                           got[9:12].decode("latin-1") if got.startswith(b"HTTP/1.") else "unparsable reply")
            except OSError:
                outcome = "closed"  # reset
            out.append((kind, outcome, waited))
        else:
            read.cancel()
            out.append((kind, "open at the end", waited))
        ended.cancel()
        writer.close()
        if outcome_is_refusal(out[-1][1]):
            await asyncio.sleep(0.1)  # refused at once (e.g. 429): do not spin on it


def outcome_is_refusal(outcome: str) -> bool:
    return outcome.isdigit() and outcome != "408"


async def slow_reader(host: str, port: int, tokens: int, n: int, out: list, stopping: asyncio.Event) -> None:
    """Start a long streamed chat on a socket with a tiny receive buffer; read its status line, no more.
    Outcomes: "admitted" (200: it took a slot) or "refused NNN"."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # set before connecting: it fixes the window
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, (host, port))
        body = json.dumps(chat_body(tokens, f"slow reader {n}", stream=True, logprobs=True)).encode()
        await loop.sock_sendall(sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                      b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        t0 = time.monotonic()
        head = await loop.sock_recv(sock, 12)  # "HTTP/1.1 200"
        outcome = "admitted" if head[9:12] == b"200" else f"refused {head[9:12].decode('latin-1') or 'closed'}"
        await stopping.wait()
        out.append(("slow reader", outcome, time.monotonic() - t0))
    except OSError as exc:
        out.append(("slow reader", f"failed ({type(exc).__name__})", 0.0))
    finally:
        sock.close()


async def stalled_phase(args, url: str, pids: dict[str, int]) -> dict:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    counts = [round(args.stalled * share) for share in args.mix]
    counts[0] += args.stalled - sum(counts)
    stopping, out = asyncio.Event(), []
    # First, so it has a slot: it ends about when the slow readers' generation, started just after it, does.
    watching = asyncio.ensure_future(witness(url, args.slow_tokens)) if counts[2] else None
    await asyncio.sleep(0.2)
    tasks = []
    for kind, count in zip(KINDS, counts):
        for n in range(count):
            if kind == "slow reader":
                tasks.append(asyncio.ensure_future(slow_reader(host, int(port), args.slow_tokens, n, out, stopping)))
            else:
                tasks.append(asyncio.ensure_future(stall_upload(host, int(port), kind, n, out, stopping)))
            if len(tasks) % 50 == 0:
                await asyncio.sleep(0.02)  # open them in waves: a burst of 1,000 SYNs overflows the backlog
    await asyncio.sleep(args.settle)
    witness_s = None
    if watching is not None:
        witness_s = await watching
        await asyncio.sleep(1.0)  # the last slow readers started up to a second after it
    loaded = await normal_run(url, args.requests, args.concurrency, args.tokens, pids, budget=args.budget)
    stopping.set()
    await asyncio.gather(*tasks)
    deadlines = {"partial headers": args.header_timeout, "partial body": args.body_timeout}
    uploads: dict = {}
    for kind in KINDS[:2]:
        rows = [(o, s) for k, o, s in out if k == kind]
        limit = deadlines[kind] + args.slack
        ended = [s for o, s in rows if o != "open at the end"]
        late = [s for o, s in rows if s > limit and not outcome_is_refusal(o)]
        uploads[kind] = {"connections": len(rows), "deadline_s": deadlines[kind],
                         "by_outcome": dict(collections.Counter(o for o, _ in rows)),
                         "ended_in_s": {"p50": round(pct(ended, 50), 2), "max": round(max(ended), 2)} if ended else None,
                         "late": len(late), "open_longest_s": round(max((s for _, s in rows), default=0.0), 2)}
    slow = [(o, s) for k, o, s in out if k == "slow reader"]
    return {"counts": dict(zip(KINDS, counts)), "loaded": loaded, "uploads": uploads, "witness_s": witness_s,
            "slow_readers": dict(collections.Counter(o for o, _ in slow))}


async def witness(url: str, tokens: int) -> float | str:
    """A stream as long as a slow reader's, read whole: the seconds it took, or what went wrong."""
    t0 = time.perf_counter()
    body = chat_body(tokens, "witness", stream=True, logprobs=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        async with http.post(url + CHAT, json=body) as resp:
            await resp.read()
            return round(time.perf_counter() - t0, 2) if resp.status == 200 else f"status {resp.status}"


# ---------------------------------------------------------------- (b) 1M-character messages

def big_texts(rng: random.Random, chars: int):
    """Endless distinct texts of `chars` characters: one text of random words, rotated by a random amount
    behind a serial number, so no two are alike (no cache can share them) and each costs the bench little."""
    base = " ".join(rng.choice(WORDS) for _ in range(chars // 5 + 1))[:chars]
    for n in range(10 ** 9):
        cut = rng.randrange(len(base))
        yield (f"{n} " + base[cut:] + " " + base[:cut])[:chars]


async def big_phase(args, url: str, pid: int) -> dict:
    texts = big_texts(random.Random(args.seed), args.big_chars)
    statuses, left = collections.Counter(), [args.big]
    reset = reset_peak(pid)
    before = memory(pid)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:

        async def worker():
            while left[0] > 0:
                left[0] -= 1
                body = json.dumps(chat_body(8, next(texts))).encode()
                try:
                    async with http.post(url + CHAT, data=body, headers={"Content-Type": "application/json"}) as resp:
                        await resp.read()
                        statuses[str(resp.status)] += 1
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    statuses[f"no reply ({type(exc).__name__})"] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.big_concurrency)))
        seconds = time.perf_counter() - t0
    await asyncio.sleep(1.0)  # let the last replies' buffers go
    after = memory(pid)
    return {"requests": args.big, "chars": args.big_chars, "seconds": round(seconds, 1), "by_status": dict(statuses),
            "status_5xx": sum(n for k, n in statuses.items() if not (k.isdigit() and int(k) < 500)),
            "rss_before_mb": round(before["VmRSS"], 1), "rss_after_mb": round(after["VmRSS"], 1),
            "peak_mb": round(after["VmHWM"], 1), "peak_reset": reset,
            "rss_growth_mb": round(after["VmRSS"] - before["VmRSS"], 1),
            "peak_growth_mb": round(after["VmHWM"] - before["VmRSS"], 1) if reset else None}


# ---------------------------------------------------------------- the run and the report

async def run(args, model: Path, tmp: Path) -> dict:
    info = ChatTokenizer(model).info
    eos, own_context = info.eos_ids[0], info.context_length
    # Delta chunks: a long stream costs the fake engine and clawd time linear in its length.
    fake, fake_url = start_fake(args.slow_tokens, eos, args.token_delay, True, tmp / "fake.log")
    clawd = None
    try:
        server = {"header_timeout": args.header_timeout, "body_timeout": args.body_timeout,
                  "keepalive_timeout": args.header_timeout, "drain_timeout": 5.0}  # stuck streams: a quick stop
        context = args.big_context or (args.slow_tokens + 64 if args.slow_tokens + 64 > own_context else 0)
        extra = {"engine": {"incremental_streaming_output": True}}
        if context:
            extra["model"] = {"context_length": context}
        clawd, url, log = start_daemon(tmp, model, fake_url, server, extra)
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, url, clawd)
        pids = {"clawd": clawd.pid, "fake": fake.pid}
        await normal_run(url, 10, args.concurrency, args.tokens, pids)  # warm-up
        out: dict = {"quiet": await normal_run(url, args.requests, args.concurrency, args.tokens, pids)}
        print(f"  quiet run: p50 {out['quiet']['p50_ms']} ms", flush=True)
        rss_before = memory(clawd.pid)["VmRSS"]
        out["stalled"] = await stalled_phase(args, url, pids)
        # not a target: what the stalled connections left in the daemon (buffers of unread streams)
        out["stalled"]["rss_mb"] = {"before": round(rss_before, 1), "after": round(memory(clawd.pid)["VmRSS"], 1)}
        print(f"  stalled run: p50 {out['stalled']['loaded']['p50_ms']} ms", flush=True)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            out["health_after_stalled"] = await health_check(http, url, clawd)
        if clawd.poll() is None:
            out["big"] = await big_phase(args, url, clawd.pid)
            print(f"  big messages: {out['big']['by_status']} in {out['big']['seconds']} s", flush=True)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            out["health"] = await health_check(http, url, clawd)
        out["log"] = log_stats(log)
        if args.adversarial_rounds:
            (tmp / "adversarial").mkdir()
            adv = await adversarial_phase(args, tmp / "adversarial", model, eos, start_daemon, wait_ready, normal_run)
            adv_log = Path(adv.pop("log"))
            adv["log"] = log_stats(adv_log)
            adv["first_traceback"] = first_traceback(adv_log)
            # With PYTHONASYNCIODEBUG=1 in the bench's environment, asyncio names each step that held the loop.
            adv["slow_steps"] = [line for line in adv_log.read_text(errors="replace").splitlines()
                                 if "Executing" in line and " took " in line][:20]
            out["adversarial"] = adv
            print(f"  adversarial: worst loop lag {adv['lag_max_s']} s", flush=True)
        if args.keep_log:
            args.keep_log.write_bytes(log.read_bytes())
        out["first_traceback"] = first_traceback(log)
        return out
    finally:
        if clawd is not None:
            stop(clawd)
        stop(fake)


def judge(res: dict) -> dict[str, tuple[object, bool]]:
    quiet, loaded = res["quiet"], res["stalled"]["loaded"]
    ratio = loaded["p50_ms"] / quiet["p50_ms"] if loaded["p50_ms"] and quiet["p50_ms"] else None
    uploads = res["stalled"]["uploads"]
    late = sum(u["late"] for u in uploads.values())
    ok200 = loaded["by_status"].get("200", 0)
    targets = {"normal requests answered 200": (f"{ok200}/{loaded['requests']}", ok200 == loaded["requests"]),
               "p50 stalled / quiet": (None if ratio is None else round(ratio, 2),
                                       ratio is not None and ratio <= TARGET_P50_RATIO),
               "stalled uploads not ended in time": (late, late == 0 and all(
                   u["connections"] for kind, u in uploads.items() if res["stalled"]["counts"][kind]))}
    big = res.get("big")
    if big is None:
        targets["big messages measured"] = (False, False)
    else:
        growth = max(big["rss_growth_mb"], big["peak_growth_mb"] or 0.0)
        targets["big messages >= 500 or no reply"] = (big["status_5xx"], big["status_5xx"] == 0)
        targets["RSS growth, after or peak (MB)"] = (growth, growth < TARGET_RSS_MB and big["peak_reset"])
    if (adv := res.get("adversarial")) is not None:
        targets.update(judge_adversarial(adv))
        targets["adversarial: tracebacks in its log"] = (adv["log"]["tracebacks"], adv["log"]["tracebacks"] == 0)
    targets["tracebacks in the log"] = (res["log"]["tracebacks"], res["log"]["tracebacks"] == 0)
    targets["healthy after"] = (res["health"]["ok"], bool(res["health"]["ok"]))
    return targets


def table(res: dict) -> str:
    q, s = res["quiet"], res["stalled"]
    lines = [f"normal client   quiet: p50 {q['p50_ms']} ms, p99 {q['p99_ms']} ms, {q['by_status']}, "
             f"{q['seconds']} s, CPU s {q['cpu_s']}",
             f"                stalled: p50 {s['loaded']['p50_ms']} ms, p99 {s['loaded']['p99_ms']} ms, "
             f"refused in {s['loaded']['refused_p50_ms']} ms (p50), "
             f"{s['loaded']['by_status']}, {s['loaded']['seconds']} s, CPU s {s['loaded']['cpu_s']}",
             "stalled " + ", ".join(f"{k}: {v}" for k, v in s["counts"].items())]
    for kind, u in s["uploads"].items():
        lines.append(f"  {kind:<16} deadline {u['deadline_s']:g} s, {u['connections']} connections, "
                     f"ended in {u['ended_in_s']}, late {u['late']}, longest open {u['open_longest_s']} s; {u['by_outcome']}")
    lines.append(f"  slow readers     {s['slow_readers']}; their generation over in {s['witness_s']} s (witness); "
                 f"daemon RSS {s['rss_mb']['before']} -> {s['rss_mb']['after']} MB")
    if "big" in res:
        b = res["big"]
        lines.append(f"big messages    {b['requests']} x {b['chars']:,} chars in {b['seconds']} s: {b['by_status']}; RSS "
                     f"{b['rss_before_mb']} -> {b['rss_after_mb']} MB, peak {b['peak_mb']} MB")
    if "adversarial" in res:
        lines += adversarial_table(res["adversarial"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stalled", type=int, default=1000, help="stalled connections held open")
    p.add_argument("--mix", type=float, nargs=3, default=[0.4, 0.4, 0.2], metavar=("HEADERS", "BODY", "READERS"),
                   help="shares of partial headers, partial bodies and slow readers")
    p.add_argument("--requests", type=int, default=200, help="normal requests, quiet and then stalled")
    p.add_argument("--concurrency", type=int, default=4, help="the normal client's requests at a time")
    p.add_argument("--tokens", type=int, default=16, help="tokens per normal reply")
    p.add_argument("--slow-tokens", type=int, default=8000,
                   help="tokens a slow reader's stream asks for (8000+ to outgrow a loopback's socket buffers; "
                        "--quick uses 2000, which does not)")
    p.add_argument("--token-delay", type=float, default=0.005, help="the fake engine's seconds per token")
    p.add_argument("--header-timeout", type=float, default=2.0, help="server.header_timeout (and keepalive_timeout)")
    p.add_argument("--body-timeout", type=float, default=3.0, help="server.body_timeout")
    p.add_argument("--slack", type=float, default=1.0, help="seconds past a deadline a close may take")
    p.add_argument("--settle", type=float, default=5.0, help="seconds between opening the stallers and the run")
    p.add_argument("--budget", type=float, default=90.0, help="seconds the stalled run may take at most")
    p.add_argument("--big", type=int, default=1000, help="requests with one huge message")
    p.add_argument("--big-chars", type=int, default=1_000_000)
    p.add_argument("--big-concurrency", type=int, default=2)
    p.add_argument("--big-context", type=int, default=0, help="model.context_length (0: the model's own)")
    p.add_argument("--adversarial-rounds", type=int, default=3, help="each adversarial input sent this often")
    p.add_argument("--adversarial-chars", type=int, default=200_000, help="characters per adversarial input")
    p.add_argument("--adversarial-concurrency", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="100 stalled, 40 requests, 20 big ones: a smoke run")
    p.add_argument("--out", type=Path, default=HERE / "results" / "abuse.json")
    p.add_argument("--keep-log", type=Path, default=None, help="copy the daemon's log here")
    args = p.parse_args(argv)
    if args.quick:
        args.stalled, args.requests, args.big = min(args.stalled, 100), min(args.requests, 40), min(args.big, 20)
        args.slow_tokens = min(args.slow_tokens, 2000)
        args.adversarial_rounds = min(args.adversarial_rounds, 1)
    prov = provenance.stamp()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench still stops its daemon and engine
    nofile = raise_nofile()
    t_start = time.monotonic()
    model = tiny_model()
    print(f"bench/abuse.py: {args.stalled} stalled, {args.requests} normal requests each run, {args.big} x "
          f"{args.big_chars:,}-char messages; {len(os.sched_getaffinity(0))} cores, open files {nofile}", flush=True)
    with tempfile.TemporaryDirectory(prefix="clawd-abuse-") as tmp:
        try:
            res = asyncio.run(run(args, model, Path(tmp)))
        except (RuntimeError, TimeoutError) as exc:
            print(f"bench/abuse.py: could not measure: {exc}", file=sys.stderr)
            return 2
    targets = judge(res)
    ok = all(met for _, met in targets.values())
    print()
    print(table(res))
    print("targets:")
    for name, (value, met) in targets.items():
        print(f"  {name:<36} {value!s:>10}  {'met' if met else 'MISSED'}")
    if res["first_traceback"]:
        print("first traceback in the daemon's log:\n" + res["first_traceback"][:1500])
    wall = time.monotonic() - t_start
    print(f"overall: {'PASS' if ok else 'FAIL'} in {wall:.0f} s")
    report = {"provenance": prov, "cores": len(os.sched_getaffinity(0)), "wall_s": round(wall, 1),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "targets": {"p50_ratio": TARGET_P50_RATIO, "rss_growth_mb": TARGET_RSS_MB},
              "figures": {name: value for name, (value, _) in targets.items()},
              "met": {name: met for name, (_, met) in targets.items()}, **res, "pass": ok}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    if not res.get("health", {}).get("alive", False):
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
