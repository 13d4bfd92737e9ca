"""The OpenAI reply of one chat completion: engine chunks in, the ids and log-probs kept, the text decoded and
parsed (content, reasoning, tool calls), and the response out: whole (`completion`) or as server-sent events
(`sse`, `usage_chunk`). It names the weight version of the replica that produced the reply.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from clawd import jsoncodec
from clawd.engine.chunks import Chunk
from clawd.engine.replicas import Attempt, Replicas
from clawd.served import Policy
from clawd.serving.detokenize import IncrementalDetokenizer
from clawd.serving.parsers import Content, Reasoning, ToolCall, make_parser
from clawd.serving.request import ChatRequest
from clawd.tokenizer import ChatTokenizer


class ReplyBuilder:
    """Accumulates engine chunks into ids, log-probs and OpenAI deltas for one response."""

    def __init__(self, req: ChatRequest, rid: str, *, tok: ChatTokenizer, model: str, policy: Policy,
                 replicas: Replicas, tool_parser: str, reasoning_parser: str, route: Attempt | None = None,
                 served_as: str | None = None):
        """route: which replica serves it; served_as: LoRA, the version of the adapter the request carries."""
        self.req = req
        self.tok = tok
        self.model = model
        self.policy = policy
        self.replicas = replicas
        self.route = route
        self.completion_id = f"chatcmpl-{rid}"
        self.created = int(time.time())
        self.detok = IncrementalDetokenizer(tok.tokenizer, tok.special_ids)
        self.parser = make_parser(tool_parser, reasoning_parser,
                                  stop=list(req.sampling.stop), tools_enabled=req.tool_choice != "none",
                                  call_id=lambda: f"call_{uuid.uuid4().hex[:24]}")
        self.ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.logprob_ids: list[int] = []
        self.top_ids: list[list[int]] = []
        self.meta: dict = {}
        self.engine_finish: str | None = None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []
        self.failed = False
        self.served_as = served_as
        # Log-probs are the only floats a reply holds (when asked for): while all are finite, orjson writes it
        # as `json` would.
        self.finite = True
        self._head, self._head_of = b"", ""  # the start of every SSE event, and the fingerprint it names

    @property
    def weight_version(self) -> str | None:
        """The weight version of the replica that produced the reply: its own word when it gave one (SGLang's
        meta_info.weight_version, the last token's), else what that replica last reported. In LoRA mode the
        adapter's version, which the request named (the engine's own stays the base's)."""
        if self.served_as is not None:
            return self.served_as
        served = self.meta.get("weight_version")
        if served is None and self.route is not None and self.route.replica is not None:
            served = self.replicas.version(self.route.replica)
        return None if served is None else str(served)

    def version(self, default: int) -> int:
        """The policy version number of the weights that produced the reply (staleness counts from it)."""
        try:
            return int(self.weight_version)  # type: ignore[arg-type]
        except (TypeError, ValueError):  # no number (a remote engine's base model: "default")
            return default

    @property
    def fingerprint(self) -> str:
        # OpenAI's "backend configuration" field: here, which policy version served the reply.
        return f"clawd-v{self.version(self.policy.version)}"

    def add(self, chunk: Chunk) -> tuple[list[dict], list[dict]]:
        self.ids += chunk.ids
        self.logprobs += chunk.logprobs
        self.logprob_ids += chunk.logprob_ids
        self.top_ids += chunk.top_ids
        if self.finite and self.req.logprobs and chunk.logprobs:  # unasked, no float reaches the client
            self.finite = jsoncodec.finite_throughout(chunk.logprobs)
        if chunk.meta:
            self.meta = chunk.meta
        if chunk.finish is not None:
            self.engine_finish = chunk.finish.get("type")
        logprobs = self._token_logprobs(chunk.ids, chunk.logprobs) if self.req.logprobs else []
        return self._deltas(self.parser.feed(self.detok.push(chunk.ids))), logprobs

    def close(self) -> list[dict]:
        return self._deltas(self.parser.feed(self.detok.flush()) + self.parser.finish())

    def _token_logprobs(self, ids: list[int], logprobs: list[float | None]) -> list[dict]:
        out = []
        for tid, lp in zip(ids, logprobs):
            text = self.tok.tokenizer.decode([tid], skip_special_tokens=False)
            out.append({"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")), "top_logprobs": []})
        return out

    def _deltas(self, events) -> list[dict]:
        deltas = []
        for ev in events:
            if isinstance(ev, Content):
                self.content.append(ev.text)
                deltas.append({"content": ev.text})
            elif isinstance(ev, Reasoning):
                self.reasoning.append(ev.text)
                deltas.append({"reasoning_content": ev.text})
            elif isinstance(ev, ToolCall):
                self.calls.append(ev)
                deltas.append({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                               "function": {"name": ev.name, "arguments": ev.arguments}}]})
        return deltas

    @property
    def finish_reason(self) -> str:
        if self.engine_finish == "length":
            return "length"
        return "tool_calls" if self.calls else "stop"

    def reply_message(self) -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or (None if self.calls else "")}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls]
        return msg

    def usage(self) -> dict:
        prompt = int(self.meta.get("prompt_tokens") or 0)
        return {"prompt_tokens": prompt, "completion_tokens": len(self.ids), "total_tokens": prompt + len(self.ids)}

    def completion(self) -> dict:
        choice: dict[str, Any] = {"index": 0, "message": self.reply_message(), "logprobs": None,
                                  "finish_reason": self.finish_reason}
        if self.req.logprobs:
            choice["logprobs"] = {"content": self._token_logprobs(self.ids, self.logprobs)}
        return {"id": self.completion_id, "object": "chat.completion", "created": self.created,
                "model": self.model, "system_fingerprint": self.fingerprint, "choices": [choice],
                "usage": self.usage()}

    def _chunk_head(self, fingerprint: str) -> dict:
        """What every `chat.completion.chunk` of this reply begins with."""
        return {"id": self.completion_id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": fingerprint}

    def sse_chunk(self, delta: dict, *, finish: str | None = None, logprobs: list[dict] | None = None) -> dict:
        """One `chat.completion.chunk`, as `sse` writes it."""
        chunk = {**self._chunk_head(self.fingerprint),
                 "choices": [{"index": 0, "delta": delta, "logprobs": {"content": logprobs} if logprobs else None,
                              "finish_reason": finish}]}
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def sse(self, delta: dict, *, finish: str | None = None, logprobs: list[dict] | None = None) -> bytes:
        """`sse_chunk` as one server-sent event, byte for byte as `jsoncodec.dumps` writes it, from a head that
        stays the same through a reply (until its fingerprint changes): a stream writes one event a token."""
        fingerprint = self.fingerprint
        if fingerprint != self._head_of:
            head = jsoncodec.dumps(self._chunk_head(fingerprint), finite=True)
            self._head = b"data: " + head[:-1] + b',"choices":[{"index":0,"delta":'
            self._head_of = fingerprint
        if not self.finite:  # a NaN or an infinity among the log-probs: all of it as `json` writes it
            return b"data: " + jsoncodec.dumps(self.sse_chunk(delta, finish=finish, logprobs=logprobs)) + b"\n\n"
        return b"".join((self._head, jsoncodec.dumps(delta, finite=True),
                         b',"logprobs":', jsoncodec.dumps({"content": logprobs}, finite=True) if logprobs else b"null",
                         b',"finish_reason":', jsoncodec.dumps(finish, finite=True) if finish else b"null",
                         b'}],"usage":null}\n\n' if self.req.include_usage else b"}]}\n\n"))

    def completion_body(self) -> bytes:
        """The whole reply's JSON (`completion`)."""
        return jsoncodec.dumps(self.completion(), finite=self.finite)

    def usage_chunk(self) -> dict:
        return {**self._chunk_head(self.fingerprint), "choices": [], "usage": self.usage()}
