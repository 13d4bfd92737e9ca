"""Parsing and validating a chat completion request (pure: bytes + headers in, ChatRequest out).

Every problem becomes an `ApiError` with status 4xx naming the parameter, so
malformed input can never reach the engine or crash a handler. Unknown
top-level fields are ignored (clients send vendor extras), known fields are
checked strictly.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from clawd.serving.errors import bad_request

ROLES = ("system", "developer", "user", "assistant", "tool")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
MAX_DEPTH = 64  # JSON nesting; tool schemas stay far below, Python's recursion limit far above


@dataclass(frozen=True)
class Limits:
    max_messages: int
    max_message_chars: int


@dataclass(frozen=True)
class Sampling:
    """What the client asked for; unset fields are None."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Mapping[str, float] | None = None

    def full_distribution(self) -> bool:
        """True when tokens come from the untruncated distribution (docs/ARCHITECTURE.md §14)."""
        return ((self.top_p is None or self.top_p == 1.0)
                and (self.top_k is None or self.top_k <= 0)
                and (self.min_p is None or self.min_p == 0.0)
                and (self.presence_penalty is None or self.presence_penalty == 0.0)
                and (self.frequency_penalty is None or self.frequency_penalty == 0.0)
                and (self.repetition_penalty is None or self.repetition_penalty == 1.0)
                and not self.logit_bias)


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]          # as the client sent them
    render_messages: list[dict[str, Any]]   # validated and normalised: for the template, sessions, records
    tools: list[dict[str, Any]] | None
    tool_choice: str
    sampling: Sampling
    stream: bool
    include_usage: bool
    logprobs: bool
    model: str | None
    user: str | None
    session_id: str | None
    turn_type: str | None
    session_done: bool
    no_train: bool
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


def json_object(body: bytes) -> dict:
    """A request body as a JSON object, or a 400: not JSON, not an object, nested too deep, or holding a lone
    surrogate (`_check_structure`)."""
    try:
        # Decoded strictly here: json.loads(bytes) would let UTF-8-encoded surrogates through.
        text = body.decode(json.detect_encoding(body))
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"Request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise bad_request(f"Request body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("Request body must be a JSON object", code="invalid_json")
    _check_structure(text, data)
    return data


def parse_chat_request(body: bytes, headers: Mapping[str, str], limits: Limits) -> ChatRequest:
    data = json_object(body)
    messages = data.get("messages")
    if messages is None:
        raise bad_request("'messages' is a required property", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise bad_request("'messages' must be an array", "messages", "invalid_type")
    if not messages:
        raise bad_request("'messages' must contain at least one message", "messages", "empty_array")
    if len(messages) > limits.max_messages:
        raise bad_request(f"'messages' holds {len(messages)} messages, more than the limit of "
                          f"{limits.max_messages}", "messages", "too_many_messages")
    render_messages = [_check_message(m, i) for i, m in enumerate(messages)]
    chars = sum(len(m.get("content") or "") for m in render_messages)
    if chars > limits.max_message_chars:
        raise bad_request(f"messages hold {chars} characters, more than the limit of "
                          f"{limits.max_message_chars}", "messages", "messages_too_long")

    tools = _check_tools(data.get("tools"))
    tool_choice = _check_tool_choice(data.get("tool_choice"), tools)

    n = _opt_int(data, "n", 1)
    if n is not None and n != 1:
        raise bad_request("Only n = 1 is supported", "n", "unsupported_value")
    stream = _opt_bool(data, "stream") or False
    stream_options = data.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options", "invalid_type")
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        include_usage = bool(_opt_bool(stream_options, "include_usage", "stream_options.include_usage"))
    logprobs = _opt_bool(data, "logprobs") or False
    top_logprobs = _opt_int(data, "top_logprobs", 0, 20)
    if top_logprobs:
        raise bad_request("'top_logprobs' is not supported; use 'logprobs': true", "top_logprobs",
                          "unsupported_parameter")
    fmt = data.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise bad_request("'response_format' must be an object with a 'type'", "response_format")
        if fmt["type"] != "text":
            raise bad_request(f"response_format '{fmt['type']}' is not supported (no constrained "
                              "decoding)", "response_format", "unsupported_value")
    _opt_bool(data, "parallel_tool_calls")
    template_kwargs = data.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    if clash := sorted({"messages", "tools"} & template_kwargs.keys()):  # the request's own fields
        raise bad_request(f"'chat_template_kwargs' cannot set {' or '.join(clash)}; send them as top-level "
                          "fields", "chat_template_kwargs", "invalid_value")

    return ChatRequest(
        messages=messages,
        render_messages=render_messages,
        tools=tools,
        tool_choice=tool_choice,
        sampling=_check_sampling(data),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        model=_opt_str(data, "model"),
        user=_opt_str(data, "user"),
        session_id=_session_id(headers, data),
        turn_type=_turn_type(headers, data),
        session_done=_flag(headers, data, "X-Session-Done", "session_done"),
        no_train=_flag(headers, data, "X-Clawd-No-Train", "no_train"),
        chat_template_kwargs=template_kwargs,
    )


def _check_structure(text: str, data: dict) -> None:
    """Reject what would break later stages: nesting that exhausts the recursion limit in the
    template, hashing or records, and lone surrogates (JSON escapes such as "\\ud800"), which
    the tokenizer and UTF-8 record files cannot take. Both walks run only when the text hints."""
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth(data) > MAX_DEPTH:
        raise bad_request(f"Request body nests deeper than {MAX_DEPTH} levels", code="invalid_json")
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("Request body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)",
                              code="invalid_json") from None


def _depth(data: Any) -> int:
    deepest, stack = 0, [(data, 1)]
    while stack:
        obj, d = stack.pop()
        deepest = max(deepest, d)
        children = obj.values() if isinstance(obj, dict) else obj
        stack += [(c, d + 1) for c in children if isinstance(c, (dict, list))]
    return deepest


def _check_message(msg: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise bad_request(f"{where} must be an object", where, "invalid_type")
    role = msg.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", f"{where}.role",
                          "invalid_value")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = _content_text(msg.get("content"), f"{where}.content", missing_ok=role == "assistant")
    if content is None and role != "assistant":
        raise bad_request(f"{where}.content is required for role '{role}'", f"{where}.content",
                          "missing_required_parameter")
    out["content"] = content
    if (name := msg.get("name")) is not None:
        if not isinstance(name, str):
            raise bad_request(f"{where}.name must be a string", f"{where}.name", "invalid_type")
        out["name"] = name
    if role == "assistant":
        calls = msg.get("tool_calls")
        if calls is not None:
            out["tool_calls"] = _check_tool_calls(calls, f"{where}.tool_calls")
        if content is None and not out.get("tool_calls"):
            raise bad_request(f"{where} needs 'content' or 'tool_calls'", f"{where}.content",
                              "missing_required_parameter")
        if isinstance(msg.get("reasoning_content"), str):
            out["reasoning_content"] = msg["reasoning_content"]
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{where}.tool_call_id is required for role 'tool'", f"{where}.tool_call_id",
                              "missing_required_parameter")
        out["tool_call_id"] = call_id
    return out


def _content_text(content: Any, where: str, missing_ok: bool) -> str | None:
    if content is None:
        return None if missing_ok else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise bad_request(f"{where}[{j}] must be an object with a 'type'", f"{where}[{j}]", "invalid_type")
            if part["type"] != "text":
                raise bad_request(f"{where}[{j}]: content part type '{part['type']}' is not supported "
                                  "(text only)", f"{where}[{j}].type", "unsupported_value")
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{where}[{j}].text must be a string", f"{where}[{j}].text", "invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where} must be a string or an array of content parts", where, "invalid_type")


def _check_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be an array", where, "invalid_type")
    out = []
    for j, call in enumerate(calls):
        w = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{w} must be an object with function.name", w, "invalid_type")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad_request(f"{w}.function.arguments is not valid JSON", f"{w}.function.arguments",
                                  "invalid_value") from None
        if not isinstance(args, dict):
            raise bad_request(f"{w}.function.arguments must encode a JSON object", f"{w}.function.arguments",
                              "invalid_value")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_request(f"{w}.id must be a string", f"{w}.id", "invalid_type")
        # Templates render arguments as a mapping; ids are kept for tool results.
        out.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array", "tools", "invalid_type")
    out = []
    for j, tool in enumerate(tools):
        w = f"tools[{j}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f"{w} must be {{'type': 'function', 'function': {{...}}}}", w, "invalid_type")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise bad_request(f"{w}.function.name must match [A-Za-z0-9_.-]{{1,64}}", f"{w}.function.name",
                              "invalid_value")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise bad_request(f"{w}.function.parameters must be an object", f"{w}.function.parameters",
                              "invalid_type")
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad_request(f"{w}.function.description must be a string", f"{w}.function.description",
                              "invalid_type")
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters")
                                                      if k in fn}})
    return out or None


def _check_tool_choice(choice: Any, tools) -> str:
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none"):
        return choice
    if choice == "required" or isinstance(choice, dict):
        raise bad_request("tool_choice 'required' and named functions need constrained decoding, which is "
                          "not supported; use 'auto' or 'none'", "tool_choice", "unsupported_value")
    raise bad_request("tool_choice must be 'auto' or 'none'", "tool_choice", "invalid_value")


def _check_sampling(data: dict) -> Sampling:
    max_tokens = _opt_int(data, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _opt_int(data, "max_tokens", 1)
    stop = data.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise bad_request("'stop' must be a string or an array of strings", "stop", "invalid_type")
    if len(stops) > 4 or any(not s for s in stops):
        raise bad_request("'stop' takes at most 4 non-empty strings", "stop", "invalid_value")
    bias = data.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad_request("'logit_bias' must be an object", "logit_bias", "invalid_type")
        for k, v in bias.items():
            if not (k.isascii() and k.isdigit()) or not _is_number(v) or not -100 <= v <= 100:
                raise bad_request("'logit_bias' maps token ids to numbers in [-100, 100]", "logit_bias",
                                  "invalid_value")
    top_k = _opt_int(data, "top_k", -1)
    return Sampling(
        temperature=_opt_float(data, "temperature", 0.0, 2.0),
        top_p=_opt_float(data, "top_p", 0.0, 1.0, low_open=True),
        top_k=None if top_k is None or top_k <= 0 else top_k,
        min_p=_opt_float(data, "min_p", 0.0, 1.0),
        max_tokens=max_tokens,
        stop=stops,
        seed=_opt_int(data, "seed", -2**63, 2**63 - 1),  # int64, as OpenAI documents; engines seed torch with it
        presence_penalty=_opt_float(data, "presence_penalty", -2.0, 2.0),
        frequency_penalty=_opt_float(data, "frequency_penalty", -2.0, 2.0),
        repetition_penalty=_opt_float(data, "repetition_penalty", 0.0, 2.0, low_open=True),
        logit_bias=bias or None,
    )


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _opt_float(data: dict, key: str, lo: float, hi: float, low_open: bool = False) -> float | None:
    v = data.get(key)
    if v is None:
        return None
    if not _is_number(v):
        raise bad_request(f"'{key}' must be a number", key, "invalid_type")
    if v > hi or v < lo or (low_open and v == lo):
        interval = f"{'(' if low_open else '['}{lo}, {hi}]"
        raise bad_request(f"'{key}' must be in {interval}; got {v}", key, "invalid_value")
    return float(v)


def _opt_int(data: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = data.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{key}' must be an integer", key, "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad_request(f"'{key}' must be {'at least ' + str(lo) if hi is None else f'in [{lo}, {hi}]'}; got {v}",
                          key, "invalid_value")
    return v


def _opt_bool(data: dict, key: str, name: str | None = None) -> bool | None:
    v = data.get(key)
    if v is not None and not isinstance(v, bool):
        raise bad_request(f"'{name or key}' must be a boolean", name or key, "invalid_type")
    return v


def _opt_str(data: dict, key: str) -> str | None:
    v = data.get(key)
    if v is not None and not isinstance(v, str):
        raise bad_request(f"'{key}' must be a string", key, "invalid_type")
    return v


def _session_id(headers: Mapping[str, str], data: dict) -> str | None:
    value = headers.get("X-Session-Id")
    if value is None:
        value = data.get("session_id")
        if value is not None and not isinstance(value, str):
            raise bad_request("'session_id' must be a string", "session_id", "invalid_type")
    if value is not None:
        value = value.strip()
        # A header's non-ASCII bytes arrive surrogate-escaped; records are UTF-8.
        if not value or len(value) > 256 or not _utf8(value):
            raise bad_request("session id must be 1 to 256 characters", "session_id", "invalid_value")
    return value


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _turn_type(headers: Mapping[str, str], data: dict) -> str | None:
    value = headers.get("X-Turn-Type", data.get("turn_type"))
    if value is None:
        return None
    if not isinstance(value, str) or value.strip().lower() not in ("main", "side"):
        raise bad_request("turn type must be 'main' or 'side'", "turn_type", "invalid_value")
    return value.strip().lower()


def _flag(headers: Mapping[str, str], data: dict, header: str, key: str) -> bool:
    value = headers.get(header)
    if value is not None:
        low = value.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise bad_request(f"header {header} must be one of 1/0, true/false, yes/no, on/off", key, "invalid_value")
    value = data.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean", key, "invalid_type")
    return value
