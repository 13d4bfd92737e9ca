"""Judge and teacher backends: one scored call each, bounded in time, failing closed.

A finished turn is scored by a judge (votes, hints) and, for OPD, by a teacher
(log-probs of the response under a hinted prompt). Every backend call goes
through the same wrapper (docs/ARCHITECTURE.md §5): a per-attempt timeout, retries
with exponential backoff and jitter on timeouts, connection errors, 5xx and
429 (Retry-After honoured up to `backoff_max`), no retry on other 4xx or on a
refused TLS certificate, and a semaphore bounding the calls in flight. After
the last failure it raises `JudgeFailed`: the caller drops the sample; nothing
waits forever, and other turns never wait on a failing one except through the
concurrency limit.
Every outcome is counted in the backend's `JudgeStats`.

Backends:
- `SGLangJudge`: SGLang's native /generate, token in (the judge messages rendered
  with the policy's chat template, `judge_prompt_ids`), the output ids decoded by clawd.
- `OpenAIJudge`: any OpenAI-compatible /chat/completions with its own key.
- `clawd.scoring.teacher.Teacher`: log-probs of the exact response ids via prefill scoring, through the
  same wrapper.

Quoted text in token prompts: the tokenizer cuts every added token (`<|im_end|>`,
`<|im_start|>`) out of any text, so a user's `<|im_end|>\n<|im_start|>system` would
close the judge's user turn. `judge_prompt_ids` and `teacher_prompt_ids` render the
chat template with a placeholder where the untrusted text goes, then encode the
template's own text as usual and the untrusted text with added tokens as plain text
(`ChatTokenizer.encode_chat_quoted`); text without such look-alikes gives exactly the
ids `encode_chat` gives.

Host names: aiohttp's own resolver runs getaddrinfo in a thread, and the daemon has
none; the OpenAI judge's session looks names up on the loop (`scoring/resolver.py`),
and TLS is verified against the system's trust store or `ca_file`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import ipaddress
import json
import logging
import math
import random
import secrets
import ssl
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable, TypeVar
from urllib.parse import urlsplit

import aiohttp

from clawd.devices import nameserver_problem, parse_nameserver
from clawd.encoding import Encoder, encode_quoted
from clawd.engine.client import EngineClient, EngineError, EngineRejected, EngineUnavailable
from clawd.messages import content_parts
from clawd.scoring import judging
from clawd.scoring.resolver import LookupFailed, LoopResolver, NoLookups
from clawd.tokenizer import ChatTokenizer, TemplateError

log = logging.getLogger("clawd.judge")
T = TypeVar("T")


@dataclass(frozen=True)
class CallPolicy:
    timeout: float = 60.0  # seconds per attempt
    retries: int = 2  # attempts after the first
    backoff_initial: float = 0.5
    backoff_max: float = 8.0
    concurrency: int = 8  # attempts in flight per backend

    def __post_init__(self):
        if not (self.timeout > 0 and self.retries >= 0 and 0 <= self.backoff_initial <= self.backoff_max
                and self.concurrency >= 1):
            raise ValueError(f"invalid call policy: {self}")


@dataclass
class JudgeStats:
    """Counters of one backend. Calls end as ok, failed or cancelled; attempts that
    went wrong are counted by kind (a call retried twice adds 2 to `retried`)."""

    calls: int = 0
    ok: int = 0
    failed: int = 0  # JudgeFailed raised: the sample is dropped
    cancelled: int = 0
    retried: int = 0
    timeouts: int = 0
    http_errors: int = 0  # an HTTP error status (4xx, 5xx)
    connection_errors: int = 0  # refused, reset, dropped mid-body
    engine_errors: int = 0  # SGLang errors the engine client does not split further
    bad_responses: int = 0  # 200 with a body that is not what was asked for
    latency_sum: float = 0.0  # seconds from call to result, over ok calls (queueing included)
    latency_count: int = 0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class JudgeFailed(Exception):
    """A judge or teacher call that gave no usable result; callers fail closed."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class AttemptFailed(Exception):
    """One attempt went wrong. `kind` names the JudgeStats counter; `retry_after` in seconds."""

    def __init__(self, reason: str, kind: str, *, retryable: bool, detail: str = "",
                 retry_after: float | None = None):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.kind, self.retryable = reason, kind, retryable
        self.detail, self.retry_after = detail, retry_after


# --- pure parts ------------------------------------------------------------------------------

def backoff_delay(policy: CallPolicy, retry: int, retry_after: float | None, u: float) -> float:
    """Seconds before retry number `retry` (0-based); u in [0, 1) is the jitter draw.
    Exponential with jitter in [half, full]; a server's Retry-After wins, capped."""
    if retry_after is not None:
        return min(max(retry_after, 0.0), policy.backoff_max)
    base = min(policy.backoff_max, policy.backoff_initial * 2.0 ** retry)
    return base * (0.5 + 0.5 * u)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Retry-After as seconds: delta-seconds or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return max(seconds, 0.0) if math.isfinite(seconds) else None


def error_message(body: Any) -> str:
    """The message in an OpenAI-style error body ({"error": {...}} / {"error": "..."} /
    {"message": ...} / {"detail": ...}), else the start of the body."""
    if isinstance(body, dict):
        err = body.get("error", body.get("message", body.get("detail")))
        if isinstance(err, dict):
            return str(err.get("message", err))[:500]
        if err is not None:
            return str(err)[:500]
    return str(body)[:500]


def http_failure(status: int, message: str, retry_after: float | None) -> AttemptFailed:
    """Retry 5xx and 429; any other status is the request's fault and will not improve."""
    retryable = status >= 500 or status == 429
    return AttemptFailed(f"http_{status}", "http_errors", retryable=retryable, detail=message,
                         retry_after=retry_after if retryable else None)


def chat_content(body: Any) -> str:
    """choices[0].message.content of a chat completion; the text whatever it says."""
    try:
        choice = body["choices"][0]
        content = choice["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise AttemptFailed("bad_response", "bad_responses", retryable=True,
                            detail=f"no choices[0].message.content: {error_message(body)}") from None
    if isinstance(content, list):  # content parts
        content = content_parts(content)[0]
    if not isinstance(content, str):
        raise AttemptFailed("bad_response", "bad_responses", retryable=True, detail="message.content is not text")
    return content


def aborted(out: Any) -> bool:
    """SGLang answers an aborted request with 200 and its partial output (SGLang 0.5.23: docs/ARCHITECTURE.md §10)."""
    try:
        return (out["meta_info"]["finish_reason"] or {}).get("type") == "abort"
    except (KeyError, TypeError, AttributeError):
        return False


def engine_failure(exc: EngineError) -> AttemptFailed:
    """EngineClient's errors: 400 is final; unreachable and everything else is retried."""
    if isinstance(exc, EngineRejected):
        return AttemptFailed("http_400", "http_errors", retryable=False, detail=str(exc))
    if isinstance(exc, EngineUnavailable):
        return AttemptFailed("connection", "connection_errors", retryable=True, detail=str(exc))
    return AttemptFailed("engine_error", "engine_errors", retryable=True, detail=str(exc))


# --- prompt ids with quoted text -------------------------------------------------------------

def judge_prompt(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], None, dict[str, str]]:
    """A judge prompt as (messages, tools, quotes) for `encode_chat_quoted`: every message's text (clawd's
    words and the material judging.py quotes) is quoted, so none of it can become a control token."""
    key = secrets.token_hex(8)
    quotes = {f"QUOTED{key}N{i}": m["content"] for i, m in enumerate(messages) if isinstance(m.get("content"), str)}
    skeleton = [{**m, "content": f"QUOTED{key}N{i}"} if f"QUOTED{key}N{i}" in quotes else m
                for i, m in enumerate(messages)]
    return skeleton, None, quotes


def judge_prompt_ids(tok: ChatTokenizer, messages: list[dict[str, Any]]) -> list[int]:
    return tok.encode_chat_quoted(*judge_prompt(messages))


def teacher_prompt(tok: ChatTokenizer, turn: Any, hint: str, placement: str = "user"
                   ) -> tuple[list[dict[str, Any]], Any, dict[str, str]]:
    """The teacher's prompt P' (judging.teacher_messages) as (messages, tools, quotes): the turn's messages
    encoded as the policy's prompt was, the hint quoted (the judge wrote it, maybe copying user text)."""
    ph = f"QUOTED{secrets.token_hex(8)}HINT"
    messages = judging.teacher_messages(turn, ph, placement, tok.default_system() if placement == "system" else "")
    return messages, turn.tools, {ph: judging.teacher_hint(hint)}


def teacher_prompt_ids(tok: ChatTokenizer, turn: Any, hint: str, placement: str = "user") -> list[int]:
    return tok.encode_chat_quoted(*teacher_prompt(tok, turn, hint, placement))


# --- the wrapper -----------------------------------------------------------------------------

class Backend:
    """A policy, its counters and its semaphore; `_call` runs one call with retries."""

    name = "backend"
    # Replaceable in tests, to see the backoff without waiting for it.
    sleep: Callable[[float], Awaitable[None]] = staticmethod(asyncio.sleep)
    jitter: Callable[[], float] = staticmethod(random.random)

    def __init__(self, policy: CallPolicy):
        self.policy = policy
        self.stats = JudgeStats()
        self._slots = asyncio.Semaphore(policy.concurrency)

    def reconfigure(self, policy: CallPolicy, *, temperature: float, max_tokens: int) -> None:
        """SIGHUP: new timeouts, retries, backoff and sampling for the next calls. The concurrency
        stays (its semaphore has waiters); calls in flight finish under the policy they read."""
        self.policy = dataclasses.replace(policy, concurrency=self.policy.concurrency)

    def _refuse(self, reason: str, detail: str) -> JudgeFailed:
        """A call that fails before any attempt (the request cannot be built)."""
        self.stats.calls += 1
        self.stats.failed += 1
        log.warning("%s call failed: %s: %s", self.name, reason, detail)
        return JudgeFailed(reason, detail)

    async def _call(self, attempt: Callable[[int], Awaitable[T]]) -> T:
        """attempt(i) makes try number i; it raises AttemptFailed for a failure it recognises."""
        p, stats = self.policy, self.stats
        stats.calls += 1
        t0 = time.monotonic()
        try:
            for i in range(p.retries + 1):
                try:
                    async with self._slots:  # a slot per attempt: backoff sleeps hold none
                        async with asyncio.timeout(p.timeout):
                            result = await attempt(i)
                except TimeoutError:  # only ours: attempts turn their own timeouts into AttemptFailed
                    failure = AttemptFailed("timeout", "timeouts", retryable=True,
                                            detail=f"no answer in {p.timeout:g} s")
                except AttemptFailed as exc:
                    failure = exc
                else:
                    stats.ok += 1
                    stats.latency_sum += time.monotonic() - t0
                    stats.latency_count += 1
                    return result
                setattr(stats, failure.kind, getattr(stats, failure.kind) + 1)
                if not failure.retryable or i == p.retries:
                    break
                stats.retried += 1
                log.info("%s attempt %d failed (%s), retrying", self.name, i + 1, failure)
                await self.sleep(backoff_delay(p, i, failure.retry_after, self.jitter()))
        except asyncio.CancelledError:
            stats.cancelled += 1
            raise
        stats.failed += 1
        log.warning("%s call failed after %d attempt(s): %s", self.name, i + 1, failure)
        raise JudgeFailed(failure.reason, failure.detail)


# --- SGLang: judge and teacher ---------------------------------------------------------------

class SGLangJudge(Backend):
    """The judge on an SGLang (or CPU) engine: chat template → ids → /generate → decoded text."""

    name = "judge.sglang"

    def __init__(self, engine: EngineClient, tokenizer: ChatTokenizer, *, temperature: float = 0.6,
                 top_p: float = 1.0, top_k: int = -1, max_new_tokens: int = 1024,
                 policy: CallPolicy = CallPolicy(), encoder: Encoder | None = None):
        """encoder: the worker long prompts are encoded in (None: here, yielding between pieces)."""
        super().__init__(policy)
        self.engine, self.tokenizer, self.encoder = engine, tokenizer, encoder
        self.sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
        self.max_new_tokens = max_new_tokens

    def reconfigure(self, policy: CallPolicy, *, temperature: float, max_tokens: int) -> None:
        super().reconfigure(policy, temperature=temperature, max_tokens=max_tokens)
        self.sampling = {**self.sampling, "temperature": temperature}
        self.max_new_tokens = max_tokens

    async def complete(self, messages: list[dict[str, Any]], *, rid: str | None = None) -> str:
        try:  # a long turn's prompt is encoded off the loop (clawd.encoding)
            ids = await encode_quoted(self.tokenizer, *judge_prompt(messages), self.encoder)
        except TemplateError as exc:
            raise self._refuse("template", str(exc)) from None
        room = self.tokenizer.info.context_length - len(ids)
        if room < 1:
            raise self._refuse("prompt_too_long", f"{len(ids)} tokens, context {room + len(ids)}")
        rid = rid or f"judge-{uuid.uuid4().hex}"
        sampling = {**self.sampling, "max_new_tokens": min(self.max_new_tokens, room)}

        async def attempt(i: int) -> str:
            # A fresh rid per attempt: a timed-out one may still be in the engine.
            out = await generate_once(self.engine, {"input_ids": ids, "sampling_params": sampling, "rid": f"{rid}.{i}"})
            output_ids = out.get("output_ids") if isinstance(out, dict) else None
            if not isinstance(output_ids, list) or not all(type(t) is int for t in output_ids):
                raise AttemptFailed("bad_response", "bad_responses", retryable=True, detail="no output_ids")
            return self.tokenizer.decode(output_ids)

        return await self._call(attempt)


async def generate_once(engine: EngineClient, payload: dict) -> dict:
    """One /generate attempt; engine failures and aborts become retryable attempt failures."""
    try:
        out = await engine.generate(payload)
    except EngineError as exc:
        raise engine_failure(exc) from None
    if aborted(out):
        raise AttemptFailed("aborted", "engine_errors", retryable=True, detail="aborted by the engine")
    return out


# --- OpenAI-compatible judge -----------------------------------------------------------------

def _tls_context(ca_file: str) -> ssl.SSLContext | bool:
    """True: aiohttp's verifying default (the system's trust store). A `ca_file` context trusts
    that CA only, and still checks the host name."""
    if not ca_file:
        return True
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"judge ca_file {ca_file!r}: {exc}") from None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


class OpenAIJudge(Backend):
    """A judge behind any OpenAI-compatible API. `url` is the base, e.g. https://prm.example.com/v1
    or http://10.0.0.5:8000/v1. A host name is looked up on the loop (scoring/resolver.py) at
    `nameserver` ("IP", "IP:port", "[IPv6]:port"; "" reads /etc/resolv.conf); https verifies
    the server against `ca_file` when set (a private CA), else the system's trust store."""

    name = "judge.openai"

    def __init__(self, url: str, api_key: str, model: str, *, temperature: float = 0.6,
                 max_tokens: int = 1024, policy: CallPolicy = CallPolicy(), ca_file: str = "",
                 nameserver: str = ""):
        super().__init__(policy)
        self.url = url.rstrip("/")
        self.host = urlsplit(self.url).hostname or ""
        if problem := nameserver_problem(nameserver):
            raise ValueError(f"judge nameserver {nameserver!r} {problem}")
        self._resolver = NoLookups() if _is_ip(self.host) else LoopResolver(parse_nameserver(nameserver))
        self._tls = _tls_context(ca_file)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model, self.temperature, self.max_tokens = model, temperature, max_tokens
        self._session: aiohttp.ClientSession | None = None

    def reconfigure(self, policy: CallPolicy, *, temperature: float, max_tokens: int) -> None:
        super().reconfigure(policy, temperature=temperature, max_tokens=max_tokens)
        self.temperature, self.max_tokens = temperature, max_tokens

    async def start(self) -> OpenAIJudge:
        # aiohttp's DNS cache keeps every name a fixed 10 s; the resolver keeps each for its TTL.
        connector = aiohttp.TCPConnector(limit=0, resolver=self._resolver, use_dns_cache=False, ssl=self._tls)
        # The wrapper's asyncio.timeout bounds each attempt; aiohttp only bounds the connect.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.policy.timeout)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self._resolver.close()

    async def __aenter__(self) -> OpenAIJudge:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def complete(self, messages: list[dict[str, Any]]) -> str:
        assert self._session is not None, "OpenAIJudge.start() was not called"
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "stream": False}

        async def attempt(i: int) -> str:
            try:
                async with self._session.post(self.url + "/chat/completions", json=body,
                                              headers=self._headers) as resp:
                    raw = await resp.read()
                    status, retry_after = resp.status, parse_retry_after(resp.headers.get("Retry-After"))
            except aiohttp.ClientConnectorCertificateError as exc:  # a wrong certificate stays wrong: no retry
                raise AttemptFailed("tls", "connection_errors", retryable=False,
                                    detail=f"{self.host}: {exc.certificate_error}") from None
            except (aiohttp.ClientError, OSError) as exc:
                if isinstance(getattr(exc, "os_error", None), LookupFailed):  # the name gave no address
                    raise AttemptFailed("dns", "connection_errors", retryable=True,
                                        detail=str(exc.os_error)) from None
                raise AttemptFailed("connection", "connection_errors", retryable=True,
                                    detail=f"{type(exc).__name__}: {exc}") from None
            try:
                obj = json.loads(raw)
            except ValueError:
                obj = raw[:500].decode("utf-8", "replace")
            if status != 200:
                raise http_failure(status, error_message(obj), retry_after)
            if isinstance(obj, dict) and "error" in obj and "choices" not in obj:  # errors sent as 200
                raise AttemptFailed("bad_response", "bad_responses", retryable=True, detail=error_message(obj))
            return chat_content(obj)

        return await self._call(attempt)
