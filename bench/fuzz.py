"""Malformed input against the real daemon: no 5xx, no traceback, a bounded log, healthy after.

One file of ~550 lines: the seeded case generators are most of it, read beside the phases that send them.

Two phases against one clawd (run as its own process, `engine.launch = "none"`, in front of
tests/fake_sglang.py, the way bench/serve.py runs it; or, with --make-run, on `make run`'s own
configuration, etc/clawd.toml: SmolLM2 on the CPU engine, the reference engine launched too, the
learner on; only the port, the state directory and the connection deadlines differ):

  bodies  `POST /v1/chat/completions` through an HTTP client, with seeded malformed bodies:
          truncated and invalid JSON, a wrong type in every field, huge numbers, deep nesting,
          invalid UTF-8 and surrogates, wrong Content-Type / Content-Encoding, compressed
          garbage, random byte mutations of a valid body, garbage in clawd's own headers;
  raw     whole requests written to raw sockets: bad request lines and methods, bad and huge
          headers, invalid Content-Length / Transfer-Encoding combinations, header injection,
          NUL bytes, `..` and overlong paths, random mutations of a valid request.

Targets (the exit status): no response >= 500, no "Traceback" in the daemon's log, at most
--max-log-lines log lines per 1,000 bad requests, and after both phases `/health` answers 200
and a normal chat request 200; with --make-run also no engine found hung and no engine or trainer
restarted (/metrics). Prints counts by status code per phase and category; writes
bench/results/fuzz.json (with `provenance`, bench/provenance.py).

    .venv/bin/python bench/fuzz.py                 # 10,000 + 10,000 requests, ~1-2 min on 2 cores
    .venv/bin/python bench/fuzz.py --quick         # 300 + 300, a smoke run
    .venv/bin/python bench/fuzz.py --bodies 2000 --raw 2000 --seed 7 --concurrency 32
    .venv/bin/python bench/fuzz.py --make-run --bodies 1500 --raw 1500   # ~5-10 min: real engines

Exit status: 0 when every target was met; 1 when one was missed; 2 when it could not measure
(the daemon did not start, or died); an exception gives a traceback and no JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import gzip
import json
import os
import random
import re
import signal
import sys
import tempfile
import tomllib
import time
import zlib
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from clawd.tokenizer import ChatTokenizer  # noqa: E402
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)
from serve import start_fake, stop, tiny_model, wait_ready  # noqa: E402
from abuse import first_traceback, health_check, launch_daemon, log_stats, raise_nofile, start_daemon  # noqa: E402

DEFAULT_MAX_LOG_LINES = 5.0  # per 1,000 bad requests: a summary now and then, never a line per request
CHAT = "/v1/chat/completions"
STATUS_LINE = re.compile(rb"(?:^|\r\n)HTTP/\d\.\d (\d{3})")  # aiohttp answers HTTP/0.9 to a request line without version


# ---------------------------------------------------------------- the cases

BASE_HEADERS = {"Content-Type": "application/json", "X-Turn-Type": "side", "X-Session-Done": "1"}
WRONG = [None, True, False, 0, -1, 1.5, -1e308, 1e308, 2 ** 63, -(2 ** 63) - 1, "", "x", "9" * 50, "\u0000",
         "\u202e\ufeff", [], [None], {}, {"": None}, [[[]]], {"a": [1, {"b": "c"}]}, "NaN", [1, "a", None]]
NUMBERS = [b"1e999", b"-1e999", b"NaN", b"Infinity", b"-Infinity", b"1" * 5000, b"-" + b"9" * 4400, b"1e-999",
           b"123456789012345678901234567890", b"1.7976931348623157e309", b"-0", b"4" * 300 + b".5", b"0x10",
           b"1e+308", b"2e308", b"-", b"1.", b".5", b"01", b"1_000"]
BAD_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xa0\xa1", b"\xe2\x28\xa1", b"\xf0\x28\x8c\xbc", b"\xed\xa0\x80",
            b"\xed\xbf\xbf", b"\xed\xa0\xbd\xed\xb8\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\xe0\x80\xaf",
            b"\xf8\x88\x80\x80\x80", b"\x80", b"ok\xc3", b"\\ud800", b"\\udfff", b"\\ud800\\u0041", b"\\udc00\\ud800",
            b"\\uD83D", b"\\u0000", b"\\uZZZZ", b"\\u12", b"\\x41", b"\\", b"\x00", b"\x1b[31m"]
SENTINEL = "\u0000SENTINEL\u0000"
SENTINEL_JSON = json.dumps(SENTINEL).encode()


def valid_body(max_tokens: int = 8) -> dict:
    return {"model": "clawd", "max_tokens": max_tokens, "temperature": 0.7, "stream": False,
            "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a token?"}]}


def rich_body() -> dict:
    """Every field clawd reads, so that a wrong value can land in each of them."""
    call = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"q\": 1}"}}
    return {"model": "clawd", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "sun"},
        {"role": "user", "content": "Thanks", "name": "bob"}],
        "tools": [{"type": "function", "function": {"name": "get", "description": "d", "parameters": {
            "type": "object", "properties": {"q": {"type": "integer"}}}}}],
        "tool_choice": "auto", "max_tokens": 8, "max_completion_tokens": 8, "temperature": 0.5, "top_p": 0.9,
        "top_k": 20, "min_p": 0.0, "stop": ["\n\n"], "seed": 3, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "repetition_penalty": 1.0, "logit_bias": {"42": 1.0}, "logprobs": True, "top_logprobs": 2, "n": 1,
        "user": "u1", "stream": False, "stream_options": {"include_usage": True}, "response_format": {"type": "text"},
        "chat_template_kwargs": {"enable_thinking": False}, "session_id": "s1", "turn_type": "side",
        "session_done": True, "no_train": True}


def _paths(obj, prefix=()) -> list[tuple]:
    out = [prefix] if prefix else []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        out += _paths(value, prefix + (key,))
    return out


RICH_PATHS = _paths(rich_body())
STRING_PATHS = [p for p in RICH_PATHS if isinstance(p[-1], str) and p[-1] in ("content", "text", "name", "model", "user",
                                                                              "arguments", "description", "role")]


def _put(path: tuple, value) -> dict:
    body = rich_body()
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return body


def _splice(rng: random.Random, paths: list[tuple], raw: bytes) -> bytes:
    """The rich body with `raw` bytes (not valid JSON on their own, or not UTF-8) at a random path, or all of it."""
    if rng.random() < 0.1:
        return raw
    return json.dumps(_put(rng.choice(paths), SENTINEL)).encode().replace(SENTINEL_JSON, raw)


def _mutate(rng: random.Random, data: bytes, ops: int) -> bytes:
    buf = bytearray(data)
    for _ in range(ops):
        at = rng.randrange(len(buf) + 1)
        op = rng.randrange(5)
        if op == 0 and at < len(buf):
            buf[at] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[at:at] = bytes([rng.randrange(256)])
        elif op == 2:
            del buf[at:at + rng.randrange(1, 16)]
        elif op == 3:
            buf[at:at] = buf[rng.randrange(len(buf) + 1):][:rng.randrange(1, 64)]
        else:
            buf[at:at] = rng.choice([b"{", b"}", b"[", b"]", b'"', b",", b":", b"\\", b"\x00", b"null", b"-"])
    return bytes(buf)


_USER = [{"role": "user", "content": "x"}]
STRUCTURES = [  # request shapes clawd must refuse; built and serialized once each (a few are large)
    lambda: {"model": "clawd"}, lambda: {"messages": []}, lambda: {"messages": [{"content": "no role"}]},
    lambda: {"messages": [{"role": "wizard", "content": "x"}]}, lambda: {"messages": [{"role": "user"}] * 3000},
    lambda: {"messages": [{"role": "tool", "content": "x"}]},
    lambda: {"messages": [{"role": "user", "content": [{"type": "x"}]}]},
    lambda: {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
    lambda: {"messages": _USER, "tools": [{"type": "function"}] * 5000},
    lambda: {"messages": _USER, "stop": ["x"] * 10_000},
    lambda: {"messages": _USER, "logit_bias": {str(i): 1 for i in range(20_000)}},
    lambda: [valid_body()], lambda: "messages", lambda: 42]


@functools.lru_cache(maxsize=None)
def _structure(i: int) -> bytes:
    return json.dumps(STRUCTURES[i]()).encode()


@functools.lru_cache(maxsize=1)
def _bomb() -> bytes:
    return gzip.compress(b" " * 16_000_000, 9, mtime=0)  # 16 MB of spaces in ~16 KB: past server.max_body_bytes once inflated


def body_case(rng: random.Random) -> tuple[str, bytes, dict]:
    """(category, body, headers) of one malformed chat request."""
    headers = dict(BASE_HEADERS)
    valid = json.dumps(rich_body() if rng.random() < 0.5 else valid_body()).encode()
    kind = rng.choice(("truncated", "invalid json", "wrong type", "huge number", "deep nesting", "bad utf-8",
                       "content-type", "content-encoding", "mutation", "structure", "clawd headers"))
    if kind == "truncated":
        body = valid[:rng.randrange(len(valid))]
    elif kind == "invalid json":
        body = rng.choice([b"", b"{", b"}", b"[", b"null", b"true", b"1", b'"x"', b"{'model': 1}", b'{"messages": [}',
                           b'{"messages": [],}', b"{/* c */}", b'{"a":1}{"b":2}', b"\x00" * 16, b"\xef\xbb\xbf{}",
                           bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))), b"[]" * 1000])
    elif kind == "wrong type":
        body = json.dumps(_put(rng.choice(RICH_PATHS), rng.choice(WRONG))).encode()
    elif kind == "huge number":
        body = _splice(rng, RICH_PATHS, rng.choice(NUMBERS))
    elif kind == "deep nesting":
        depth = rng.choice((65, 200, 1000, 10_000, 100_000))
        body = _splice(rng, RICH_PATHS, rng.choice((b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth)))
    elif kind == "bad utf-8":
        if rng.random() < 0.15:
            body = rng.choice([b"\xef\xbb\xbf" + valid, valid.decode().encode("utf-16"), valid.decode().encode("utf-32")])
        else:
            body = _splice(rng, STRING_PATHS, b'"' + rng.choice(BAD_UTF8) + b'"')
    elif kind == "content-type":
        body = valid
        ctype = rng.choice([None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                            "application/json; charset=latin-1", "application/json; charset=utf-16", "garbage",
                            "", "application/json;;;", "*/*", "application/xml"])
        if ctype is None:
            del headers["Content-Type"]
        else:
            headers["Content-Type"] = ctype
    elif kind == "content-encoding":
        encoding, make = rng.choice([
            ("gzip", lambda: gzip.compress(valid, mtime=0)), ("gzip", lambda: rng.randbytes(64)), ("deflate", lambda: rng.randbytes(64)),
            ("br", lambda: rng.randbytes(64)), ("gzip", lambda: gzip.compress(valid, mtime=0)[:-12]), ("gzip", _bomb),
            ("deflate", lambda: zlib.compress(rng.randbytes(256))), ("gzip, deflate", lambda: gzip.compress(valid, mtime=0)),
            ("zstd", lambda: gzip.compress(valid, mtime=0)), ("identity", lambda: valid), ("x-unknown", lambda: valid),
            ("gzip", lambda: valid), ("deflate", lambda: gzip.compress(valid, mtime=0)),
            ("gzip", lambda: gzip.compress(rng.randbytes(256), mtime=0))])
        body = make()
        headers["Content-Encoding"] = encoding
    elif kind == "mutation":
        body = _mutate(rng, valid, rng.randrange(1, 9))
    elif kind == "structure":
        body = _structure(rng.randrange(len(STRUCTURES)))
        if rng.random() < 0.1:
            body = valid.replace(b'"messages"', b'"messages": 5, "messages"', 1)  # a duplicate key
    else:  # clawd headers: session, turn and flag headers with values they do not accept
        body = valid
        for name in rng.sample(["X-Session-Id", "X-Turn-Type", "X-Session-Done", "X-Clawd-No-Train", "Authorization"],
                               rng.randrange(1, 4)):
            headers[name] = rng.choice(["", " ", "x" * 10_000, "x" * 200, "../../etc/passwd", "main\tside", "yes please",
                                        "-1", "Bearer", "Bearer " + "k" * 5000, "side,main", "2", "%00"])
    return kind, body, headers


def _request(method: bytes = b"POST", path: bytes = CHAT.encode(), version: bytes = b"HTTP/1.1",
             headers: list[bytes] | None = None, body: bytes | None = None) -> bytes:
    body = json.dumps(valid_body()).encode() if body is None else body
    if headers is None:
        headers = [b"Host: 127.0.0.1", b"Content-Type: application/json", b"X-Turn-Type: side", b"X-Session-Done: 1",
                   b"Connection: close", b"Content-Length: %d" % len(body)]
    return b"%s %s %s\r\n%s\r\n\r\n%s" % (method, path, version, b"\r\n".join(headers), body)


def _std(body: bytes, *extra: bytes, length: bool = True) -> list[bytes]:
    return ([b"Host: 127.0.0.1", b"Content-Type: application/json", b"Connection: close"]
            + ([b"Content-Length: %d" % len(body)] if length else []) + list(extra))


def raw_case(rng: random.Random) -> tuple[str, bytes]:
    """(category, bytes) of one malformed request written to a raw socket."""
    body = json.dumps(valid_body()).encode()
    kind = rng.choice(("request line", "method", "path", "headers", "content-length", "transfer-encoding",
                       "injection", "nul bytes", "mutation"))
    if kind == "request line":
        data = rng.choice([
            bytes(rng.randrange(32, 127) for _ in range(rng.randrange(1, 100))) + b"\r\n\r\n",
            bytes(rng.randrange(256) for _ in range(rng.randrange(1, 100))) + b"\r\n\r\n",
            b"GET\r\n\r\n", b"GET /health\r\n\r\n", b"GET /health HTTP/9.9\r\nHost: a\r\n\r\n",
            b"GET /health HTTP/1.1 extra\r\nHost: a\r\n\r\n", b"GET  /health  HTTP/1.1\r\n\r\n",
            b"get /health HTTP/1.1\r\nHost: a\r\n\r\n", b"GET\t/health\tHTTP/1.1\r\n\r\n", b"GET /health HTTP/1.1\n\n",
            b"\r\n\r\nGET /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n", b"GET /health HTTP/" + b"1" * 1000 + b"\r\n\r\n",
            b"GET /health HTTX/1.1\r\n\r\n", b"GET /health HTTP/1.10\r\n\r\n", b"GET /health HTTP/01.1\r\n\r\n",
            b" GET /health HTTP/1.1\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"GET /health HTTP/1.0\r\n\r\n",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + rng.randbytes(64), b"GET /health HTTP/1.1" + b"a" * 100_000 + b"\r\n\r\n",
            b"\r\n" * 1000, b"GET /health HTTP/1.1\r\r\n\r\n"])
    elif kind == "method":
        method = rng.choice([b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"TRACE", b"CONNECT", b"HEAD", b"FOO", b"G\x00ET",
                             b"GET\x7f", b"M" * 10_000, b"POST;", b"P0ST", b"\xc3\xa9", b"get", b"", b"POST POST"])
        path = rng.choice([b"/health", CHAT.encode(), b"/v1/models", b"*", b"/metrics"])
        data = _request(method, path, headers=None if rng.random() < 0.5 else _std(b""), body=body if rng.random() < 0.5 else b"")
    elif kind == "path":
        path = rng.choice([b"/../../etc/passwd", b"/v1/../health", b"/%2e%2e/%2e%2e/etc/passwd", b"//v1//chat//completions",
                           b"/v1/chat/completions/../../../../etc/passwd", b"/v1/chat/completions?" + b"a=1&" * 5000,
                           b"/" + b"a" * 8000, b"/" + b"a" * 9000, b"/" + b"a" * 65_536, b"/" + b"a" * 1_000_000,
                           b"/.." * 5000, b"*", b"http://evil.example/health", b"/\x00", b"/%00", b"/%ff%fe",
                           b"/v1/chat/completions%00", b"/health#frag", b"/\xc3\xa9\xff", b"/%2F%2F", b"\\..\\..\\",
                           b"/v1/chat/completions;x=1", b"", b"health", b"/%", b"/%zz", b"/v1/models/" + b"%2e%2e/" * 100])
        method = rng.choice([b"GET", b"POST"])
        data = _request(method, path, headers=_std(body if method == b"POST" else b""), body=body if method == b"POST" else b"")
    elif kind == "headers":
        extra = rng.choice([[b"NoColonHere"], [b"X-Space : 1"], [b"X(bad)name: 1"], [b" folded: 1", b"\tcontinued"],
                            [b"X-Big: " + b"v" * 10_000], [b"X-Huge: " + b"v" * 100_000], [b"X-H%d: v" % i for i in range(1000)],
                            [b"X-" + b"n" * 10_000 + b": 1"], [b"X-Nul: a\x00b"], [b"Host: second"], [b"X-Utf8: \xc3\xa9\xff"],
                            [b": empty-name"], [b"X-Empty:"], [b"Content-Type: " + b"a" * 9000],
                            [b"Expect: 100-continue"], [b"Expect: garbage"], [b"Connection: upgrade", b"Upgrade: websocket"],
                            [b"Authorization: Basic ????"], [b"X-Session-Id: " + b"s" * 8000]])
        if rng.random() < 0.2:  # bare LF line ends or none at all
            data = _request(headers=_std(body, *extra), body=body).replace(b"\r\n", rng.choice([b"\n", b"\r"]))
        else:
            data = _request(headers=_std(body, *extra), body=body)
    elif kind == "content-length":
        value = rng.choice([b"-1", b"abc", b"+10", b"0x10", b"99999999999999999999", b" 10 ", b"1e3", b"", b"10, 20",
                            b"%d" % (len(body) - 10), b"%d" % (len(body) + 100), b"0", b"\xd9\xa1\xd9\xa2", b"4294967296"])
        extra = [b"Content-Length: " + value] + ([b"Content-Length: 7"] if rng.random() < 0.2 else [])
        data = _request(headers=_std(body, *extra, length=False), body=body)
    elif kind == "transfer-encoding":
        te = rng.choice([b"chunked", b"chunked, identity", b"xchunked", b" chunked", b"gzip, chunked", b"chunked, gzip",
                         b"identity", b"CHUNKED", b"chunked\x00"])
        chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        payload = rng.choice([chunked, chunked[:-5], b"zz\r\n" + body + b"\r\n0\r\n\r\n", b"-5\r\n" + body + b"\r\n0\r\n\r\n",
                              b"ffffffffffffffff\r\n" + body + b"\r\n0\r\n\r\n", b"%x;ext=\x01\r\n%s\r\n0\r\n\r\n" % (len(body), body),
                              chunked[:-2] + b"X-Trailer: \x00\r\n\r\n", body, b"0\r\n\r\n"])
        extra = [b"Transfer-Encoding: " + te] + ([b"Content-Length: %d" % len(payload)] if rng.random() < 0.5 else [])
        data = _request(headers=_std(payload, *extra, length=False), body=payload,
                        version=rng.choice([b"HTTP/1.1", b"HTTP/1.0"]))
    elif kind == "injection":
        data = rng.choice([
            _request(headers=_std(body, b"X-Session-Id: a\r\nX-Injected: 1"), body=body),
            _request(headers=_std(body, b"X-Session-Id: a\rX-Injected: 1"), body=body),
            _request(headers=_std(body, b"X-Session-Id: a\nX-Injected: 1"), body=body),
            _request(b"GET", b"/health\r\nX-Injected: 1", headers=_std(b""), body=b""),
            _request(b"GET", b"/health HTTP/1.1\r\nHost: a\r\n\r\nGET /health", headers=_std(b""), body=b""),
            _request(headers=_std(body, b"X-Turn-Type: side\r\n\r\nGET /metrics HTTP/1.1"), body=body),
            _request(b"GET", b"/health", headers=[b"Host: a"], body=b"") + _request(b"GET", b"/v1/models", headers=[b"Host: a"], body=b""),
            _request(headers=_std(body, b"X-Turn-Type: %0d%0aX-Injected: 1"), body=body)])
    elif kind == "nul bytes":
        data = _request(body=body)
        at = rng.randrange(len(data))
        data = data[:at] + b"\x00" * rng.randrange(1, 4) + data[at:]
    else:
        data = _mutate(rng, _request(body=body), rng.randrange(1, 9))
    return kind, data


# ---------------------------------------------------------------- the two phases

class Tally:
    """Replies by category and outcome (a status code, or how the connection ended without one)."""

    def __init__(self):
        self.by_category: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.odd_replies: list[dict] = []  # first few replies >= 500 or none, with what provoked them

    def add(self, category: str, outcome: str, request: bytes, reply: bytes) -> None:
        self.by_category[category][outcome] += 1
        if not (outcome.isdigit() and int(outcome) < 500) and len(self.odd_replies) < 40:
            self.odd_replies.append({"category": category, "status": outcome,
                                       "request": request[:300].decode("latin-1"),
                                       "reply": reply[:300].decode("latin-1")})

    def summary(self) -> dict:
        totals = sum(self.by_category.values(), collections.Counter())
        return {"requests": sum(totals.values()), "by_status": dict(sorted(totals.items())),
                "status_5xx": sum(n for k, n in totals.items() if k.isdigit() and int(k) >= 500),
                "by_category": {c: dict(sorted(v.items())) for c, v in sorted(self.by_category.items())},
                "odd_replies": self.odd_replies}


async def body_phase(url: str, count: int, seed: int, concurrency: int, timeout: float) -> Tally:
    tally, rng = Tally(), random.Random(seed)
    cases = [body_case(rng) for _ in range(count)]  # built before sending: the same cases every run
    queue = collections.deque(cases)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    # A connection per request: a case that makes the daemon drop its connection then costs no other case
    # its reply (with keep-alive the next request on that connection would fail instead).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as http:

        async def worker():
            while queue:
                category, body, headers = queue.popleft()
                try:
                    # No Content-Type unless the case sets one: aiohttp would add application/octet-stream.
                    async with http.post(url + CHAT, data=body, headers=headers,
                                         skip_auto_headers=("Content-Type",)) as resp:
                        reply = await resp.read()
                        tally.add(category, str(resp.status), body, reply)
                except asyncio.TimeoutError:
                    tally.add(category, "no reply (timeout)", body, b"")
                except (aiohttp.ClientError, OSError) as exc:
                    tally.add(category, f"no reply ({type(exc).__name__})", body, str(exc).encode())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


async def raw_exchange(host: str, port: int, data: bytes, timeout: float) -> tuple[str, bytes]:
    """Write `data`, read what comes back: (the first status code, or how it ended, and the bytes read)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        return f"no connection ({type(exc).__name__})", b""
    got = b""
    try:
        writer.write(data)
        await asyncio.wait_for(writer.drain(), timeout)
        deadline = time.monotonic() + timeout
        while True:
            # Once a reply has started, a short quiet spell ends it (a keep-alive connection stays open).
            wait = deadline - time.monotonic() if not got else 0.3
            if wait <= 0:
                break
            try:
                chunk = await asyncio.wait_for(reader.read(65536), wait)
            except asyncio.TimeoutError:
                break
            if not chunk:
                break
            got += chunk
    except (OSError, asyncio.TimeoutError) as exc:
        if not got:
            return f"no reply ({type(exc).__name__})", got
    finally:
        writer.close()
    if not got:
        return ("no reply (timeout)" if time.monotonic() >= deadline else "closed, no reply"), got
    # The final status: 1xx replies (100 Continue) come before it.
    codes = STATUS_LINE.findall(got)
    final = [c for c in codes if not c.startswith(b"1")]
    return (final or codes)[0].decode() if codes else "unparsable reply", got


async def raw_phase(url: str, count: int, seed: int, concurrency: int, timeout: float) -> Tally:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    tally, rng = Tally(), random.Random(seed + 1)
    queue = collections.deque(raw_case(rng) for _ in range(count))

    async def worker():
        while queue:
            category, data = queue.popleft()
            outcome, got = await raw_exchange(host, int(port), data, timeout)
            # A later response on the same connection (pipelined or smuggled) counts when it is a 5xx.
            later = [code for code in STATUS_LINE.findall(got)[1:] if code >= b"500"]
            tally.add(category, later[0].decode() if later else outcome, data, got)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tally


# ---------------------------------------------------------------- report

def table(phases: dict[str, dict]) -> str:
    lines = []
    for name, res in phases.items():
        lines.append(f"{name}: {res['requests']} requests in {res['seconds']:.1f} s, "
                     f"{res['log_lines']} log lines, {res['log_noise_lines']} besides answered chats "
                     f"({res['log_lines_per_1000']:.1f} per 1,000 requests)")
        lines.append("  by status: " + ", ".join(f"{k}: {v}" for k, v in res["by_status"].items()))
        width = max(len(c) for c in res["by_category"])
        for cat, counts in res["by_category"].items():
            lines.append(f"    {cat:<{width}}  " + ", ".join(f"{k}: {v}" for k, v in counts.items()))
    return "\n".join(lines)


def make_run_config(tmp: Path, deadlines: dict) -> dict:
    """etc/clawd.toml as `make run` starts it, on a port of its own, a scratch state directory and `deadlines`."""
    cfg = tomllib.loads((ROOT / "etc" / "clawd.toml").read_text())
    model = Path(cfg["model"]["path"])
    cfg["model"]["path"] = str(model if model.is_absolute() else ROOT / model)
    if not Path(cfg["model"]["path"]).is_dir():
        raise RuntimeError(f"{cfg['model']['path']} is missing: run `make model` first")
    cfg["server"] = {**cfg.get("server", {}), "port": 0, **deadlines}
    cfg["state"] = {**cfg.get("state", {}), "dir": str(tmp / "state")}
    return cfg


async def engine_faults(url: str) -> dict:
    """Engines found hung and engines and trainers restarted, from /metrics."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return {"engine_hangs": total("clawd_engine_hangs_total"), "engine_restarts": total("clawd_engine_restarts_total"),
            "trainer_restarts": total("clawd_trainer_restarts_total")}


async def run(args, model: Path, tmp: Path) -> dict:
    fake = None
    clawd = None
    # Short deadlines: a request that stalls on purpose (a Content-Length longer than its body)
    # is answered 408 (or closed) within seconds instead of holding a worker for the default 30 s.
    deadlines = {"header_timeout": args.deadline, "body_timeout": args.deadline, "keepalive_timeout": args.deadline}
    try:
        if args.make_run:
            clawd, url, log = launch_daemon(tmp, make_run_config(tmp, deadlines), start_timeout=300)
        else:
            eos = ChatTokenizer(model).info.eos_ids[0]
            fake, fake_url = start_fake(args.tokens, eos, 0.0, False, tmp / "fake.log")
            clawd, url, log = start_daemon(tmp, model, fake_url, deadlines)
        async with aiohttp.ClientSession() as http:
            await wait_ready(http, url, clawd, timeout=600 if args.make_run else 60)
        phases = {}
        for name, phase, count in (("bodies", body_phase, args.bodies), ("raw", raw_phase, args.raw)):
            before = log_stats(log)
            t0 = time.monotonic()
            tally = await phase(url, count, args.seed, args.concurrency, args.deadline + 3.0)
            seconds = time.monotonic() - t0
            await asyncio.sleep(0.5)  # lines logged as the last connections close
            after = log_stats(log)
            res = tally.summary()
            res["seconds"] = round(seconds, 2)
            res["log_lines"] = after["lines"] - before["lines"]
            res["log_noise_lines"] = after["noise"] - before["noise"]
            res["log_bytes"] = after["bytes"] - before["bytes"]
            res["log_lines_per_1000"] = round(1000 * res["log_noise_lines"] / max(res["requests"], 1), 2)
            res["tracebacks"] = after["tracebacks"] - before["tracebacks"]
            phases[name] = res
            print(f"  {name}: {res['requests']} requests in {seconds:.1f} s", flush=True)
            if clawd.poll() is not None:
                break
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            health = await health_check(http, url, clawd)
        faults = await engine_faults(url) if args.make_run and clawd.poll() is None else None
        final = log_stats(log)
        if args.keep_log:
            args.keep_log.write_bytes(log.read_bytes())
        return {"phases": phases, "health": health, "log": final, "first_traceback": first_traceback(log),
                "daemon_exit": clawd.poll(), "faults": faults}
    finally:
        if clawd is not None:
            stop(clawd)
        if fake is not None:
            stop(fake)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bodies", type=int, default=10_000, help="malformed chat bodies to send")
    p.add_argument("--raw", type=int, default=10_000, help="malformed raw-socket requests to send")
    p.add_argument("--quick", action="store_true", help="300 of each: a smoke run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--deadline", type=float, default=2.0,
                   help="the daemon's server.header_timeout, body_timeout and keepalive_timeout (s)")
    p.add_argument("--tokens", type=int, default=4, help="tokens per reply of a request that is valid after all")
    p.add_argument("--max-log-lines", type=float, default=DEFAULT_MAX_LOG_LINES,
                   help="target: most daemon log lines per 1,000 bad requests")
    p.add_argument("--make-run", action="store_true", help="against etc/clawd.toml (the CPU engines, the learner)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "fuzz.json")
    p.add_argument("--keep-log", type=Path, default=None, help="copy the daemon's log here")
    args = p.parse_args(argv)
    if args.quick:
        args.bodies, args.raw = min(args.bodies, 300), min(args.raw, 300)
    if args.make_run and args.out == HERE / "results" / "fuzz.json":
        args.out = HERE / "results" / "fuzz-make-run.json"
    prov = provenance.stamp()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench still stops its daemon and engine
    nofile = raise_nofile()
    t_start = time.monotonic()
    model = tiny_model()
    print(f"bench/fuzz.py: {args.bodies} bodies + {args.raw} raw requests, seed {args.seed}, "
          f"concurrency {args.concurrency}, {len(os.sched_getaffinity(0))} cores, open files {nofile}", flush=True)
    with tempfile.TemporaryDirectory(prefix="clawd-fuzz-") as tmp:
        try:
            res = asyncio.run(run(args, model, Path(tmp)))
        except (RuntimeError, TimeoutError) as exc:
            print(f"bench/fuzz.py: could not measure: {exc}", file=sys.stderr)
            return 2
    phases = res["phases"]
    requests = sum(r["requests"] for r in phases.values())
    lines = sum(r["log_noise_lines"] for r in phases.values())
    per_1000 = round(1000 * lines / max(requests, 1), 2)
    five = sum(r["status_5xx"] for r in phases.values())
    measured = set(phases) == {"bodies", "raw"} and requests >= args.bodies + args.raw
    targets = {"status_5xx": (five, five == 0), "tracebacks": (res["log"]["tracebacks"], res["log"]["tracebacks"] == 0),
               "log_lines_per_1000": (per_1000, per_1000 <= args.max_log_lines),
               "healthy_after": (res["health"]["ok"], bool(res["health"]["ok"]))}
    if args.make_run:
        faults = res["faults"] or {}
        for name in ("engine_hangs", "engine_restarts", "trainer_restarts"):
            targets[name] = (faults.get(name), faults.get(name) == 0)
    ok = measured and all(met for _, met in targets.values())
    print()
    print(table(phases))
    print(f"\nhealth after: alive {res['health']['alive']}, /health {res['health']['health']}, "
          f"chat {res['health']['chat']}")
    print("targets:")
    for name, (value, met) in targets.items():
        print(f"  {name:<20} {value!s:>8}  {'met' if met else 'MISSED'}")
    if res["first_traceback"]:
        print("first traceback in the daemon's log:\n" + res["first_traceback"][:1500])
    for err in [e for r in phases.values() for e in r["odd_replies"] if e["status"].isdigit()][:3]:
        print(f"a reply >= 500 ({err['category']}): {err['request'][:120]!r} -> {err['reply'][:160]!r}")
    wall = time.monotonic() - t_start
    print(f"overall: {'PASS' if ok else 'FAIL'} in {wall:.0f} s")
    report = {"provenance": prov, "cores": len(os.sched_getaffinity(0)), "wall_s": round(wall, 1),
              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "requests": requests, "status_5xx": five, "tracebacks": res["log"]["tracebacks"],
              "log_lines_per_1000": per_1000, "healthy_after": res["health"]["ok"],
              "targets": {"status_5xx": 0, "tracebacks": 0, "log_lines_per_1000": args.max_log_lines,
                          "healthy_after": True},
              "phases": phases, "health": res["health"], "log": res["log"],
              "first_traceback": res["first_traceback"], "measured": measured, "pass": ok}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    if not measured:
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
