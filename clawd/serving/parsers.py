"""Streaming output parser: generated text in, OpenAI content / reasoning / tool-call deltas out.

Two layers, each fed text in arbitrary pieces:
  1. `_StopCutter` cuts the text at the first occurrence of any stop string.
  2. `OutputParser` splits what is left into reasoning (`<think>…</think>` at the
     start), tool-call blocks (`<tool_call>{json}</tool_call>`) and content.
Each layer holds back only a suffix that could still become a tag or a stop
string; everything else goes out as soon as it is fed. Neither layer's output
depends on how its input was chunked, so the non-streamed path
(`parse_complete`) is the streamed path fed once.

Formats live in two registries (`TOOL_FORMATS`, `REASONING_FORMATS`) so another
model family adds a tag pair and a body parser, not a new state machine.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI carries it


Delta = Union[Content, Reasoning, ToolCall]


def default_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---------------------------------------------------------------- formats

def parse_hermes_body(body: str) -> Optional[tuple[str, str]]:
    """`{"name": ..., "arguments": {...}}` → (name, arguments JSON), or None if malformed."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = obj.get("arguments")
    if args is None:
        args = {}
    elif isinstance(args, str):
        # Some models emit the arguments already encoded as a JSON string.
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return obj["name"], json.dumps(args, ensure_ascii=False)


@dataclass(frozen=True)
class ToolFormat:
    open: str
    close: str
    parse_body: Callable[[str], Optional[tuple[str, str]]]


@dataclass(frozen=True)
class ReasoningFormat:
    open: str
    close: str


HERMES = ToolFormat("<tool_call>", "</tool_call>", parse_hermes_body)
THINK = ReasoningFormat("<think>", "</think>")

TOOL_FORMATS: dict[str, Optional[ToolFormat]] = {"hermes": HERMES, "qwen25": HERMES, "none": None}
REASONING_FORMATS: dict[str, Optional[ReasoningFormat]] = {"think": THINK, "none": None}


# ---------------------------------------------------------------- stop strings

class _StopCutter:
    """Passes text through up to the first occurrence of any stop string.

    "First" means the earliest start in the whole text: a long stop string that
    begins before a short one that is already complete still wins, so text from
    a possible earlier start is held until that is decided.
    """

    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(s for s in stops if s)
        self.stopped = False
        self._held = ""

    def _first_hit(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits, default=None)

    def feed(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buf = self._held + text
        hit = self._first_hit(buf)
        # The earliest start of a suffix that could still grow into a stop string.
        partial = min(len(buf) - _partial_suffix(buf, s) for s in self.stops)
        if hit is not None and hit <= partial:
            self.stopped, self._held = True, ""
            return buf[:hit]
        self._held = buf[partial:]
        return buf[:partial]

    def finish(self) -> str:
        buf, self._held = self._held, ""
        hit = self._first_hit(buf)
        if hit is not None:
            self.stopped = True
            return buf[:hit]
        return buf


# ---------------------------------------------------------------- the parser

_START, _REASONING, _CONTENT, _TOOL = "start", "reasoning", "content", "tool"


class OutputParser:
    """Feed generated text; get deltas. Call `finish()` once at the end of the stream."""

    def __init__(self, tool_format: Optional[ToolFormat], reasoning_format: Optional[ReasoningFormat], *,
                 stop: Iterable[str] = (), call_id: Callable[[], str] = default_call_id,
                 starts_in_reasoning: bool = False):
        self._tool = tool_format
        self._think = reasoning_format
        self._stop = _StopCutter(stop)
        self._call_id = call_id
        self._calls: list[ToolCall] = []
        self._pending = ""
        self._scanned = 0  # in a tool block: how much of `_pending` holds no closing tag
        self._finished = False
        if reasoning_format is None:
            self._state = _CONTENT
        else:
            # starts_in_reasoning: the chat template already opened <think> in the prompt.
            self._state = _REASONING if starts_in_reasoning else _START

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._calls)

    @property
    def stopped(self) -> bool:
        """True once a stop string was seen: later text is ignored; call finish() for held text."""
        return self._stop.stopped

    def feed(self, text: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        return self._run(self._stop.feed(text), final=False)

    def finish(self) -> list[Delta]:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        return self._run(self._stop.finish(), final=True)

    def _run(self, text: str, final: bool) -> list[Delta]:
        out: list[Delta] = []
        self._pending += text
        while self._step(out, final):
            pass
        return out

    def _step(self, out: list[Delta], final: bool) -> bool:
        """Consumes what it can of `_pending`; True when the state changed and it should go on."""
        p = self._pending
        if self._state == _START:
            head = p.lstrip()
            if head.startswith(self._think.open):
                self._pending, self._state = head[len(self._think.open):], _REASONING
                return True
            if not final and self._think.open.startswith(head):
                return False  # only whitespace or part of "<think>" so far
            self._state = _CONTENT
            return True

        if self._state == _REASONING:
            close = self._think.close
            i = p.find(close)
            if i >= 0:
                _emit(out, Reasoning(p[:i]))
                self._pending, self._state = p[i + len(close):], _CONTENT
                return True
            keep = 0 if final else _partial_suffix(p, close)
            _emit(out, Reasoning(p[:len(p) - keep]))
            self._pending = p[len(p) - keep:]
            return False

        if self._state == _CONTENT:
            if self._tool is not None:
                i = p.find(self._tool.open)
                if i >= 0:
                    _emit(out, Content(p[:i]))
                    self._pending, self._state, self._scanned = p[i + len(self._tool.open):], _TOOL, 0
                    return True
            keep = 0 if final or self._tool is None else _partial_suffix(p, self._tool.open)
            _emit(out, Content(p[:len(p) - keep]))
            self._pending = p[len(p) - keep:]
            return False

        # _TOOL: the block is parsed whole once its closing tag arrives.
        close = self._tool.close
        i = p.find(close, self._scanned)
        if i < 0:
            if final:  # never closed: it was text after all
                _emit(out, Content(self._tool.open + p))
                self._pending = ""
            else:
                self._scanned = max(0, len(p) - len(close) + 1)
            return False
        body, self._pending, self._state = p[:i], p[i + len(close):], _CONTENT
        parsed = self._tool.parse_body(body)
        if parsed is None:
            _emit(out, Content(self._tool.open + body + close))
        else:
            call = ToolCall(len(self._calls), self._call_id(), parsed[0], parsed[1])
            self._calls.append(call)
            out.append(call)
        return True


def _emit(out: list[Delta], delta: Content | Reasoning) -> None:
    """Appends a text delta, merging it into the previous one of the same kind; drops empty ones."""
    if not delta.text:
        return
    if out and type(out[-1]) is type(delta):
        out[-1] = type(delta)(out[-1].text + delta.text)
    else:
        out.append(delta)


def make_parser(tool_parser: str, reasoning_parser: str, *, stop: Iterable[str] = (),
                tools_enabled: bool = True, call_id: Callable[[], str] = default_call_id,
                starts_in_reasoning: bool = False) -> OutputParser:
    """A parser for one response. Unknown format names raise ValueError.

    `tools_enabled=False` (a request without tools) leaves tool markup as content;
    `starts_in_reasoning` only matters with a reasoning format.
    """
    if tool_parser not in TOOL_FORMATS:
        raise ValueError(f"unknown tool parser {tool_parser!r}; known: {sorted(TOOL_FORMATS)}")
    if reasoning_parser not in REASONING_FORMATS:
        raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; known: {sorted(REASONING_FORMATS)}")
    tool = TOOL_FORMATS[tool_parser] if tools_enabled else None
    return OutputParser(tool, REASONING_FORMATS[reasoning_parser], stop=stop, call_id=call_id,
                        starts_in_reasoning=starts_in_reasoning)


def parse_complete(text: str, tool_parser: str, reasoning_parser: str, **kwargs
                   ) -> tuple[Optional[str], Optional[str], list[ToolCall]]:
    """The non-streamed path: (content, reasoning, tool_calls) of a whole response.

    content is None when there are tool calls and nothing but whitespace around
    them (OpenAI sends null there); reasoning is None when there was none.
    """
    parser = make_parser(tool_parser, reasoning_parser, **kwargs)
    deltas = parser.feed(text) + parser.finish()
    content = "".join(d.text for d in deltas if isinstance(d, Content))
    reasoning = "".join(d.text for d in deltas if isinstance(d, Reasoning))
    calls = [d for d in deltas if isinstance(d, ToolCall)]
    if calls and not content.strip():
        content = None
    return content, reasoning or None, calls
