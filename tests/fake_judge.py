"""A scripted fake OpenAI-compatible judge: POST /v1/chat/completions on loopback.

Each request takes the next `Reply` from the script (the default one when the
script is empty): a chat completion carrying `content`, or an error status with
OpenAI's error shape, any raw body, extra headers, a delay, a hang that lasts
until the client goes away (or the fake closes), or a body cut short. It
records every request and the most calls it ever had in flight at once.

    async with FakeJudge(api_key="k") as fake:
        fake.script(Reply(status=500), Reply(content="\\boxed{1}"))
        ... OpenAIJudge(fake.url, "k", "judge-model") ...

`Reply(echo="literal")` (or "reader") answers with the text of every message it was sent (as
`reader_view` sees it), then `content`: a judge that repeats its prompt before its own verdict;
"literal-after" and "reader-after" answer `content` first, then repeat the quoted part of the
prompt (from the assistant output's marker to the last marker). `EchoEngine` does the same for
the SGLang judge, from the prompt's token ids.

With `ssl_context` it serves https; `name` is the host its URL names (a certificate's
name, looked up through a stub nameserver in tests/test_judge_dns.py).
"""
from __future__ import annotations

import asyncio
import json
import ssl
import time
import unicodedata
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class Reply:
    content: str | None = "\\boxed{1}"
    status: int = 200
    body: Any = None  # replaces the whole body: dict/list as JSON, str/bytes as they are
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds before answering
    hang: bool = False  # never answer
    drop: bool = False  # send part of a body, then close the connection
    echo: str = ""  # "literal", "reader", "literal-after", "reader-after": echo_reply


# Look-alikes a reading model may take for ASCII; this fake's own list, independent of clawd's.
_READS_AS = str.maketrans({**dict.fromkeys("‹«ᐸ⟨〈〈❮❬⟪≺˂≮﹤＜", "<"), **dict.fromkeys("›»ᐳ⟩〉〉❯❭⟫≻˃≯﹥＞", ">"),
                           **dict.fromkeys("＼﹨⧵∖", "\\"), "о": "o", "х": "x", "е": "e"})


def reader_view(text: str) -> str:
    """Text as a model that reads past look-alikes may repeat it: compatibility forms folded, accents,
    combining marks and invisible format characters gone, look-alike brackets and backslashes ASCII."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch) and unicodedata.category(ch) != "Cf")
    return unicodedata.normalize("NFKC", text.translate(_READS_AS))


def quoted_region(text: str) -> str:
    """The quoted part of a judge prompt: from the assistant output's opening marker to the last marker."""
    start, end = text.rfind("<<<ASSISTANT_OUTPUT"), text.rfind(">>>")
    return text[start:end + 3] if 0 <= start < end else ""


def echo_reply(prompt: str, answer: str, mode: str) -> str:
    """The answer with an echo of the prompt (`Reply.echo`'s modes)."""
    view, _, where = mode.partition("-")
    seen = reader_view(prompt) if view == "reader" else prompt
    return f"{answer}\n{quoted_region(seen)}" if where == "after" else f"{seen}\n{answer}"


class EchoEngine:
    """An engine for SGLangJudge: /generate answers with `echo_reply` of the decoded prompt ids and
    `honest` (as token ids)."""

    def __init__(self, tokenizer, honest: str, mode: str = "literal"):
        self.tok, self.honest, self.mode = tokenizer, honest, mode
        self.payloads: list[dict] = []

    async def generate(self, payload: dict) -> dict:
        self.payloads.append(payload)
        prompt = self.tok.tokenizer.decode(list(payload["input_ids"]), skip_special_tokens=False)
        return {"output_ids": self.tok.encode(echo_reply(prompt, self.honest, self.mode)),
                "meta_info": {"finish_reason": {"type": "stop"}}}


def completion(content: str | None, model: str) -> dict:
    return {"id": "chatcmpl-fake", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def error_body(status: int) -> dict:
    return {"error": {"message": f"fake error {status}", "type": "server_error" if status >= 500
                      else "invalid_request_error", "param": None, "code": status}}


class FakeJudge:
    def __init__(self, default: Reply = Reply(), *, api_key: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, ssl_context: ssl.SSLContext | None = None, name: str | None = None):
        self.default, self.api_key, self.host, self.port = default, api_key, host, port
        self.ssl_context, self.name = ssl_context, name
        self.requests: list[tuple[dict[str, str], Any]] = []  # (headers, JSON body) in arrival order
        self.peers: set[tuple] = set()  # client addresses seen: one per connection
        self.active = 0
        self.max_active = 0
        self.disconnects = 0  # handlers cancelled because the client went away
        self._script: deque[Reply] = deque()
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://{self.name or self.host}:{self.port}/v1"

    def script(self, *replies: Reply) -> None:
        self._script.extend(replies)

    async def start(self) -> FakeJudge:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        # handler_cancellation: a client that hangs up cancels its handler (counted).
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, ssl_context=self.ssl_context).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        self._closing.set()  # release hanging handlers so the shutdown does not wait on them
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeJudge:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _chat(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw
        self.requests.append((dict(request.headers), body))
        self.peers.add(request.transport.get_extra_info("peername"))
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "Incorrect API key provided", "type":
                                                "invalid_request_error", "param": None,
                                                "code": "invalid_api_key"}}, status=401)
        reply = self._script.popleft() if self._script else self.default
        if reply.drop:
            resp = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "4096"})
            await resp.prepare(request)
            await resp.write(b'{"choices": [')
            request.transport.close()
            return resp
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if reply.hang:
                await self._closing.wait()
                return web.json_response(error_body(503), status=503)
            if reply.delay:
                await asyncio.sleep(reply.delay)
        except asyncio.CancelledError:
            self.disconnects += 1
            raise
        finally:
            self.active -= 1
        if reply.body is not None:
            if isinstance(reply.body, (str, bytes)):
                return web.Response(status=reply.status, body=reply.body, headers=reply.headers)
            return web.json_response(reply.body, status=reply.status, headers=reply.headers)
        if reply.status != 200:
            return web.json_response(error_body(reply.status), status=reply.status, headers=reply.headers)
        model = body.get("model", "") if isinstance(body, dict) else ""
        content = reply.content
        if reply.echo:
            texts = [m.get("content") or "" for m in body.get("messages", [])] if isinstance(body, dict) else []
            content = echo_reply("\n".join(texts), content or "", reply.echo)
        return web.json_response(completion(content, model), headers=reply.headers)
