"""The adversarial-input phase of bench/abuse.py: what the limits admit and costs the daemon most.

A daemon of its own (in front of the same fake engine; the model's context raised to 1,048,576 tokens so
that every input below is served, encoded and scanned, not refused) gets, --adversarial-rounds times over,
one chat request per input below (each made distinct, so no cache helps; `X-Session-Done`, so each turn
is handed to privacy at once), --adversarial-concurrency at a time, while a normal client sends its
requests. Inputs (--adversarial-chars characters each): digit-dense text for the PII detector (dates, a list
of possible phone numbers, an IP log, card numbers, high-entropy tokens, bare digits), and for the
tokenizer a prompt of spaces (80 to a token) and one of random words; plus one conversation of many
messages.

Read from the daemon's /metrics: `clawd_event_loop_lag_max_seconds` (the longest the loop was held since
start: the warm-up and the quiet run included, so an upper bound of this phase's), the lag histogram's
count above 0.1 s during the phase, and the PII scans deferred. Targets: worst lag <= 0.1 s, every
normal request answered 200, no 5xx to any adversarial request; the normal client's p50 during the phase
over its quiet p50 is reported (the inputs' honest work shares the daemon's core with it).
"""
from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import string
import time
from pathlib import Path

import aiohttp

from serve import start_fake, stop

TARGET_LAG_S = 0.1
CONTEXT = 1_048_576


def adversarial_inputs(rng: random.Random, chars: int) -> dict[str, str]:
    def fill(unit: str) -> str:
        return (unit * (chars // len(unit) + 1))[:chars]

    ips = " ".join(f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(256)}" for _ in range(chars // 12))
    tokens = " ".join("".join(rng.choice(string.ascii_letters + string.digits) for _ in range(24))
                      for _ in range(chars // 25))
    words = " ".join(rng.choice(["the", "a", "token", "of", "loop", "daemon", "naïve", "東京"]) for _ in range(chars // 5))
    return {"dates": fill("2024-01-02 "), "phone list": fill("0123456  "), "ip log": ips[:chars],
            "card numbers": fill("4111 1111 1111 1111 "), "tokens": tokens[:chars], "digits": fill("1234567890"),
            "spaces": " " * chars, "words": words[:chars]}


def many_messages(rng: random.Random, chars: int) -> list[dict]:
    """One conversation of 1,000 short digit-dense messages (each scanned on its own)."""
    per = max(16, chars // 1000)
    return [{"role": "user" if i % 2 == 0 else "assistant",
             "content": f"{i} " + "".join(rng.choice("0123456789 -") for _ in range(per))} for i in range(1000)]


def lag_metrics(text: str) -> dict:
    def value(pattern: str) -> float:
        m = re.search(pattern, text, re.M)
        return float(m.group(1)) if m else 0.0
    return {"max_s": value(r"^clawd_event_loop_lag_max_seconds (\S+)$"),
            "count": value(r"^clawd_event_loop_lag_seconds_count (\S+)$"),
            "within_0_1": value(r'^clawd_event_loop_lag_seconds_bucket\{le="0\.1"\} (\S+)$'),
            "deferred": value(r"^clawd_pii_scans_deferred_total (\S+)$"),
            "waiting": value(r"^clawd_pii_scans_waiting (\S+)$"),
            "unread": value(r"^clawd_pii_phones_unread_total (\S+)$")}


async def scrape(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/metrics") as resp:
        return lag_metrics(await resp.text())


async def send_adversarial(url: str, bodies: list[tuple[str, dict]], concurrency: int) -> dict:
    statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    refusals: dict[str, str] = {}  # the first answer >= 400 per input, to read
    queue = list(bodies)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:

        async def worker():
            while queue:
                name, body = queue.pop(0)
                t0 = time.perf_counter()
                try:
                    async with http.post(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json", "X-Session-Done": "1"}) as resp:
                        reply = await resp.read()
                        statuses[name][str(resp.status)] += 1
                        if resp.status >= 400:
                            refusals.setdefault(name, reply[:300].decode("utf-8", "replace"))
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    statuses[name][f"no reply ({type(exc).__name__})"] += 1
                seconds[name].append(time.perf_counter() - t0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {name: {"by_status": dict(c), "seconds_max": round(max(seconds[name]), 2), "refusal": refusals.get(name)}
            for name, c in statuses.items()}


async def adversarial_phase(args, tmp: Path, model: Path, eos_id: int, start_daemon, wait_ready,
                            normal_run) -> dict:
    rng = random.Random(args.seed)
    fake, fake_url = start_fake(args.tokens, eos_id, 0.0, False, tmp / "fake.log", context=CONTEXT)
    clawd = None
    try:
        clawd, url, log = start_daemon(tmp, model, fake_url, {"drain_timeout": 5.0},
                                       {"model": {"context_length": CONTEXT}})
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            await wait_ready(http, url, clawd)
            pids = {"clawd": clawd.pid}
            await normal_run(url, 10, args.concurrency, args.tokens, pids)  # warm-up
            quiet = await normal_run(url, args.requests, args.concurrency, args.tokens, pids)
            before = await scrape(http, url)
            bodies = []
            for r in range(args.adversarial_rounds):
                for name, text in adversarial_inputs(rng, args.adversarial_chars).items():
                    bodies.append((name, {"model": "clawd", "max_tokens": 4, "messages": [
                        {"role": "user", "content": f"{r} {rng.random()} {text}"}]}))
                bodies.append(("many messages", {"model": "clawd", "max_tokens": 4,
                                                 "messages": many_messages(rng, args.adversarial_chars)}))
            t0 = time.perf_counter()
            sent, loaded = await asyncio.gather(send_adversarial(url, bodies, args.adversarial_concurrency),
                                                normal_run(url, args.requests, args.concurrency, args.tokens, pids))
            seconds = time.perf_counter() - t0
            for _ in range(600):  # the PII scans still queued finish
                after = await scrape(http, url)
                if after["waiting"] == 0:
                    break
                await asyncio.sleep(0.1)
        status_5xx = sum(n for s in sent.values() for k, n in s["by_status"].items() if not (k.isdigit() and int(k) < 500))
        return {"quiet": quiet, "loaded": loaded, "inputs": sent, "seconds": round(seconds, 1),
                "requests": len(bodies), "chars": args.adversarial_chars, "status_5xx": status_5xx,
                "lag_max_s": round(after["max_s"], 3), "lag_over_0_1_in_phase": int(
                    (after["count"] - after["within_0_1"]) - (before["count"] - before["within_0_1"])),
                "scans_deferred": int(after["deferred"] - before["deferred"]),
                "phones_unread": int(after["unread"] - before["unread"]), "log": str(log)}
    finally:
        if clawd is not None:
            stop(clawd)
        stop(fake)


def judge_adversarial(adv: dict) -> dict[str, tuple[object, bool]]:
    quiet, loaded = adv["quiet"], adv["loaded"]
    ratio = loaded["p50_ms"] / quiet["p50_ms"] if loaded["p50_ms"] and quiet["p50_ms"] else None
    ok200 = loaded["by_status"].get("200", 0)
    # The p50 ratio is reported, not judged: the adversarial inputs take the daemon's core for seconds of
    # honest work (their scans, in slices), and a normal request waits its turn between the slices.
    return {"adversarial: worst loop lag (s)": (adv["lag_max_s"], adv["lag_max_s"] <= TARGET_LAG_S),
            "adversarial: normal answered 200": (f"{ok200}/{loaded['requests']}", ok200 == loaded["requests"]),
            "adversarial: p50 loaded / quiet (reported)": (None if ratio is None else round(ratio, 2), True),
            "adversarial: 5xx": (adv["status_5xx"], adv["status_5xx"] == 0)}


def adversarial_table(adv: dict) -> list[str]:
    q, l = adv["quiet"], adv["loaded"]
    lines = [f"adversarial     {adv['requests']} requests of {adv['chars']:,} chars in {adv['seconds']} s; worst loop lag "
             f"{adv['lag_max_s']} s (since start), {adv['lag_over_0_1_in_phase']} lags over 0.1 s in the phase; "
             f"PII scans deferred {adv['scans_deferred']}, phones unread {adv['phones_unread']}",
             f"  normal client quiet p50 {q['p50_ms']} ms, during p50 {l['p50_ms']} ms p99 {l['p99_ms']} ms, "
             f"{l['by_status']}"]
    for name, s in adv["inputs"].items():
        lines.append(f"  {name:<14} {s['by_status']}, slowest {s['seconds_max']} s")
    return lines
