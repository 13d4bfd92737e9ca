"""Bad input: malformed chat requests and fuzzed raw HTTP get a 4xx in OpenAI's error shape.

One daemon runs for the whole module, in front of the fake SGLang running as its own
process (so module-scoped fixtures need no event loop). Requests go out as raw bytes
over plain sockets, so bodies and headers can be anything that is still HTTP/1.1. After
the table and the fuzz the daemon must be healthy, still serve a chat, never have
logged a traceback, and exit cleanly (records of odd input included).
"""
from __future__ import annotations

import gzip
import http.client
import json
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from tokenizers import Tokenizer

from .harness import ROOT, Daemon

KEY = "sk-fuzz-0123456789"
AUTH = [(b"Authorization", b"Bearer " + KEY.encode())]
CHAT = b"/v1/chat/completions"
USER = {"role": "user", "content": "hi"}
LIMITS = {"max_body_bytes": 65536, "max_messages": 16, "max_message_chars": 4000}
CONTEXT = 2048  # the tiny model's


# ---- the stack ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tiny_model):
    """The fake SGLang as a subprocess: 8 tokens a reply, ending in the tiny model's EOS."""
    eos = Tokenizer.from_file(str(tiny_model / "tokenizer.json")).token_to_id("<|im_end|>")
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_sglang.py"), "--port", "0",
                             "--tokens", "8", "--eos-id", str(eos)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stdout.close()


def start_daemon(tmp: Path, tiny_model: Path, engine_url: str) -> Daemon:
    return Daemon(tmp, {"model": {"path": str(tiny_model)},
                        "engine": {"launch": "none", "url": engine_url, "health_interval": 0.5},
                        "server": LIMITS, "auth": {"keys": [{"name": "fuzz", "key": KEY}]}})


@pytest.fixture(scope="module")
def daemon(tiny_model, engine, tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("bad-input"), tiny_model, engine)
    yield d
    assert d.stop() == 0  # shutdown writes every open session's records: odd input must not break that


# ---- raw HTTP ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


def http_request(method: bytes, path: bytes, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> bytes:
    """A request with a right Content-Length, closing the connection after the reply."""
    lines = [method + b" " + path + b" HTTP/1.1", b"Host: 127.0.0.1"]
    lines += [name + b": " + value for name, value in headers]
    lines += [b"Content-Length: %d" % len(body), b"Connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def exchange(daemon: Daemon, raw: bytes, method: bytes = b"POST") -> Reply:
    host, port = daemon.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(raw)
        resp = http.client.HTTPResponse(sock, method=method.decode())
        resp.begin()
        body = resp.read()
    return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, body)


JSON = (b"Content-Type", b"application/json")


def send(daemon: Daemon, body, headers=()) -> Reply:
    """POST a chat request (a dict, or raw bytes) with the right key, as JSON unless `headers` say otherwise."""
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    typed = any(name.lower() == b"content-type" for name, _ in headers)
    return exchange(daemon, http_request(b"POST", CHAT, [*AUTH, *headers, *([] if typed else [JSON])], body))


def assert_openai_error(reply: Reply) -> dict:
    assert reply.headers.get("content-type", "").startswith("application/json"), reply
    body = reply.json()
    assert list(body) == ["error"], body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    return err


def assert_chat_completion(reply: Reply) -> str:
    assert reply.status == 200, reply
    out = reply.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["finish_reason"] in ("stop", "length")
    return out["choices"][0]["message"]["content"]


# ---- the table ----------------------------------------------------------------------------------

def chat(**extra) -> dict:
    return {"model": "m", "messages": [USER], "max_tokens": 4, **extra}


def with_messages(*messages) -> dict:
    return {"model": "m", "messages": list(messages), "max_tokens": 4}


def call(function=None) -> dict:
    fn = {"name": "get_weather", "arguments": '{"city": "Paris"}'} if function is None else function
    return {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": fn}]}


def tool(function=None, **extra) -> dict:
    fn = {"name": "get_weather", "parameters": {"type": "object"}} if function is None else function
    return {"type": "function", "function": fn, **extra}


def raw_chat(tail: bytes) -> bytes:
    """A request whose last field is spelt in raw JSON (numbers json.dumps cannot write)."""
    return b'{"messages": [{"role": "user", "content": "hi"}], ' + tail + b"}"


TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "21"}

# (id, body, extra headers, status, the param the error names)
CASES = [
    # the body as a whole
    ("malformed-json", b'{"messages": [', (), 400, None),
    ("json-array", b"[1, 2]", (), 400, None),
    ("json-string", b'"hi"', (), 400, None),
    ("empty-body", b"", (), 400, None),
    ("not-utf8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', (), 400, None),
    ("lone-surrogate", raw_chat(b'"user": "\\udc80"'), (), 400, None),
    ("surrogate-in-content", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', (), 400, None),
    ("encoded-surrogate", b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80b"}]}', (), 400, None),
    ("nested-100-deep", raw_chat(b'"tools": ' + b"[" * 100 + b"]" * 100), (), 400, None),
    ("nested-5000-deep", b"[" * 5000 + b"]" * 5000, (), 400, None),
    ("oversize-body", json.dumps(chat(user="x" * 70_000)).encode(), (), 413, None),
    # messages
    ("messages-missing", {"model": "m"}, (), 400, "messages"),
    ("messages-null", {"messages": None}, (), 400, "messages"),
    ("messages-empty", {"messages": []}, (), 400, "messages"),
    ("messages-object", {"messages": USER}, (), 400, "messages"),
    ("messages-string", {"messages": "hi"}, (), 400, "messages"),
    ("message-not-object", with_messages("hi"), (), 400, "messages[0]"),
    ("role-bad", with_messages({"role": "wizard", "content": "hi"}), (), 400, "messages[0].role"),
    ("role-missing", with_messages({"content": "hi"}), (), 400, "messages[0].role"),
    ("user-content-missing", with_messages({"role": "user"}), (), 400, "messages[0].content"),
    ("content-number", with_messages({"role": "user", "content": 5}), (), 400, "messages[0].content"),
    ("content-object", with_messages({"role": "user", "content": {"text": "hi"}}), (), 400,
     "messages[0].content"),
    ("content-part-not-object", with_messages({"role": "user", "content": ["hi"]}), (), 400,
     "messages[0].content[0]"),
    ("image-content-part", with_messages({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}), (), 400,
     "messages[0].content[0].type"),
    ("text-part-not-string", with_messages({"role": "user", "content": [{"type": "text", "text": 1}]}), (),
     400, "messages[0].content[0].text"),
    ("name-not-string", with_messages({"role": "user", "content": "hi", "name": 7}), (), 400,
     "messages[0].name"),
    ("assistant-empty", with_messages(USER, {"role": "assistant"}, USER), (), 400, "messages[1].content"),
    ("tool-without-call-id", with_messages(USER, call(), {"role": "tool", "content": "21"}), (), 400,
     "messages[2].tool_call_id"),
    ("tool-calls-not-list", with_messages(USER, {"role": "assistant", "tool_calls": {"id": "x"}}), (), 400,
     "messages[1].tool_calls"),
    ("tool-call-without-function", with_messages(USER, call(function="get_weather"), TOOL_RESULT), (), 400,
     "messages[1].tool_calls[0]"),
    ("tool-call-name-number", with_messages(USER, call({"name": 5, "arguments": "{}"}), TOOL_RESULT), (),
     400, "messages[1].tool_calls[0]"),
    ("tool-call-arguments-not-json", with_messages(USER, call({"name": "f", "arguments": "{city: Paris"}),
                                                   TOOL_RESULT), (), 400,
     "messages[1].tool_calls[0].function.arguments"),
    ("tool-call-arguments-not-object", with_messages(USER, call({"name": "f", "arguments": "[1, 2]"}),
                                                     TOOL_RESULT), (), 400,
     "messages[1].tool_calls[0].function.arguments"),
    ("tool-call-id-number", with_messages(USER, {**call(), "tool_calls": [
        {"id": 5, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, TOOL_RESULT), (), 400,
     "messages[1].tool_calls[0].id"),
    ("too-many-messages", with_messages(*[USER] * (LIMITS["max_messages"] + 1)), (), 400, "messages"),
    ("too-many-characters", with_messages({"role": "user", "content": "x" * (LIMITS["max_message_chars"] + 1)}),
     (), 400, "messages"),
    ("prompt-beyond-context", with_messages({"role": "user", "content": "中" * 1500}), (), 400, "messages"),
    # sampling
    ("n-2", chat(n=2), (), 400, "n"),
    ("n-string", chat(n="1"), (), 400, "n"),
    ("temperature-negative", chat(temperature=-1), (), 400, "temperature"),
    ("temperature-3", chat(temperature=3), (), 400, "temperature"),
    ("temperature-string", chat(temperature="hot"), (), 400, "temperature"),
    ("temperature-1e999", raw_chat(b'"temperature": 1e999'), (), 400, "temperature"),
    ("temperature-NaN", raw_chat(b'"temperature": NaN'), (), 400, "temperature"),
    ("top-p-0", chat(top_p=0), (), 400, "top_p"),
    ("top-p-1.5", chat(top_p=1.5), (), 400, "top_p"),
    ("top-k-minus-5", chat(top_k=-5), (), 400, "top_k"),
    ("top-k-float", chat(top_k=2.5), (), 400, "top_k"),
    ("min-p-2", chat(min_p=2), (), 400, "min_p"),
    ("max-tokens-0", chat(max_tokens=0), (), 400, "max_tokens"),
    ("max-tokens-negative", chat(max_tokens=-1), (), 400, "max_tokens"),
    ("max-tokens-float", chat(max_tokens=1.5), (), 400, "max_tokens"),
    ("max-tokens-beyond-context", chat(max_tokens=CONTEXT + 1), (), 400, "max_tokens"),
    ("max-completion-tokens-0", chat(max_completion_tokens=0), (), 400, "max_completion_tokens"),
    ("stop-five", chat(stop=["a", "b", "c", "d", "e"]), (), 400, "stop"),
    ("stop-empty-string", chat(stop=""), (), 400, "stop"),
    ("stop-number", chat(stop=5), (), 400, "stop"),
    ("logit-bias-bad-key", chat(logit_bias={"abc": 1}), (), 400, "logit_bias"),
    ("logit-bias-superscript-key", chat(logit_bias={"²": 1}), (), 400, "logit_bias"),
    ("logit-bias-out-of-range", chat(logit_bias={"12": 150}), (), 400, "logit_bias"),
    ("presence-penalty-3", chat(presence_penalty=3), (), 400, "presence_penalty"),
    ("frequency-penalty-string", chat(frequency_penalty="low"), (), 400, "frequency_penalty"),
    ("repetition-penalty-0", chat(repetition_penalty=0), (), 400, "repetition_penalty"),
    ("seed-string", chat(seed="x"), (), 400, "seed"),
    ("seed-beyond-int64", chat(seed=2**64), (), 400, "seed"),
    # output options
    ("stream-yes", chat(stream="yes"), (), 400, "stream"),
    ("stream-options-without-stream", chat(stream_options={"include_usage": True}), (), 400, "stream_options"),
    ("stream-options-not-object", chat(stream=True, stream_options=True), (), 400, "stream_options"),
    ("include-usage-string", chat(stream=True, stream_options={"include_usage": "yes"}), (), 400,
     "stream_options.include_usage"),
    ("logprobs-yes", chat(logprobs="yes"), (), 400, "logprobs"),
    ("top-logprobs-5", chat(logprobs=True, top_logprobs=5), (), 400, "top_logprobs"),
    ("top-logprobs-30", chat(logprobs=True, top_logprobs=30), (), 400, "top_logprobs"),
    ("response-format-json-object", chat(response_format={"type": "json_object"}), (), 400, "response_format"),
    ("response-format-string", chat(response_format="json"), (), 400, "response_format"),
    ("parallel-tool-calls-string", chat(parallel_tool_calls="no"), (), 400, "parallel_tool_calls"),
    ("chat-template-kwargs-list", chat(chat_template_kwargs=[1]), (), 400, "chat_template_kwargs"),
    ("chat-template-kwargs-messages", chat(chat_template_kwargs={"messages": None}), (), 400,
     "chat_template_kwargs"),
    ("chat-template-kwargs-tools", chat(chat_template_kwargs={"tools": []}), (), 400, "chat_template_kwargs"),
    # tools
    ("tool-choice-required", chat(tools=[tool()], tool_choice="required"), (), 400, "tool_choice"),
    ("tool-choice-named", chat(tools=[tool()], tool_choice={"type": "function",
                                                            "function": {"name": "get_weather"}}), (), 400,
     "tool_choice"),
    ("tool-choice-maybe", chat(tools=[tool()], tool_choice="maybe"), (), 400, "tool_choice"),
    ("tools-not-list", chat(tools=tool()), (), 400, "tools"),
    ("tool-wrong-type", chat(tools=[tool(type="retrieval")]), (), 400, "tools[0]"),
    ("tool-bad-name", chat(tools=[tool({"name": "get weather!"})]), (), 400, "tools[0].function.name"),
    ("tool-parameters-not-object", chat(tools=[tool({"name": "f", "parameters": "{}"})]), (), 400,
     "tools[0].function.parameters"),
    ("tool-description-number", chat(tools=[tool({"name": "f", "description": 1})]), (), 400,
     "tools[0].function.description"),
    # who and which session
    ("user-number", chat(user=5), (), 400, "user"),
    ("model-number", chat(model=5), (), 400, "model"),
    ("session-id-number", chat(session_id=5), (), 400, "session_id"),
    ("session-id-300-chars", chat(), [(b"X-Session-Id", b"s" * 300)], 400, "session_id"),
    ("session-id-blank", chat(), [(b"X-Session-Id", b"   ")], 400, "session_id"),
    ("session-id-not-utf8", chat(), [(b"X-Session-Id", b"s-\xff\xfe")], 400, "session_id"),
    ("turn-type-weird", chat(), [(b"X-Turn-Type", b"weird")], 400, "turn_type"),
    ("turn-type-number-in-body", chat(turn_type=5), (), 400, "turn_type"),
    ("session-done-maybe", chat(), [(b"X-Session-Done", b"maybe")], 400, "session_done"),
    ("session-done-string-in-body", chat(session_done="yes"), (), 400, "session_done"),
    ("no-train-maybe", chat(), [(b"X-Clawd-No-Train", b"maybe")], 400, "no_train"),
]


@pytest.mark.parametrize("body, headers, status, param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_chat_request(daemon, body, headers, status, param):
    reply = send(daemon, body, headers)
    assert reply.status == status, reply
    err = assert_openai_error(reply)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    if status == 400 and param is None:  # the body as a whole
        assert err["code"] == "invalid_json", err


def test_the_table_is_distinct():
    assert len({c[0] for c in CASES}) == len(CASES) >= 40
    assert len({(c[1] if isinstance(c[1], bytes) else json.dumps(c[1]), tuple(c[2])) for c in CASES}) == len(CASES)


@pytest.mark.parametrize("method, path, headers, status", [
    (b"GET", CHAT, AUTH, 405),
    (b"PUT", CHAT, AUTH, 405),
    (b"POST", b"/v1/completions", AUTH, 404),
    (b"GET", b"/v2/nothing/here", AUTH, 404),
    (b"POST", CHAT, [], 401),
    (b"POST", CHAT, [(b"Authorization", b"Bearer wrong-key-123")], 401),
    (b"POST", CHAT, [(b"Authorization", b"Basic " + KEY.encode())], 401),
    (b"POST", CHAT, [(b"Authorization", b"Bearer sk-\xff\xfe-not-utf8")], 401),
], ids=["get-chat", "put-chat", "unknown-route", "unknown-get-route", "no-key", "wrong-key", "basic-auth",
        "key-not-utf8"])
def test_wrong_route_method_or_key(daemon, method, path, headers, status):
    reply = exchange(daemon, http_request(method, path, headers, json.dumps(chat()).encode()), method)
    assert reply.status == status, reply
    assert_openai_error(reply)
    if status == 405:
        assert "POST" in reply.headers["allow"]


@pytest.mark.parametrize("message", [
    {"role": "user", "content": "hi", "tool_calls": 5},
    {"role": "user", "content": "hi", "tool_calls": [None, "x"]},
    {"role": "tool", "tool_call_id": "c", "content": "21", "tool_calls": {"a": 1}},
    {"role": "user", "content": "hi", "name": "bob", "reasoning_content": 7, "extra": [1]},
], ids=["user-tool-calls-int", "user-tool-calls-junk", "tool-tool-calls-dict", "user-extras"])
def test_fields_a_role_does_not_use_are_ignored(daemon, message):
    """Found by the fuzz on a fresh clone: sessions hashed such fields raw and crashed."""
    assert isinstance(assert_chat_completion(send(daemon, with_messages(message))), str)


def test_healthy_after_the_table(daemon):
    assert daemon.get("/health") == (200, {"status": "ok"})
    assert isinstance(assert_chat_completion(send(daemon, chat())), str)


def test_content_encoding_that_does_not_decode(tiny_model, engine, tmp_path):
    """A gzip body is read; a body its Content-Encoding does not decode is a 400, not a 500.

    Its own daemon: aiohttp logs the undecodable rest of such a body while closing the
    connection, which would spoil the module daemon's clean log."""
    d = start_daemon(tmp_path, tiny_model, engine)
    try:
        body = json.dumps(chat()).encode()
        assert_chat_completion(send(d, gzip.compress(body), [(b"Content-Encoding", b"gzip")]))
        reply = send(d, body, [(b"Content-Encoding", b"gzip")])
        assert reply.status == 400 and assert_openai_error(reply)["code"] == "invalid_body"
        assert_chat_completion(send(d, body))
    finally:
        assert d.stop() == 0


# ---- the fuzz ------------------------------------------------------------------------------------

FIELDS = ["messages", "model", "tools", "tool_choice", "temperature", "top_p", "top_k", "min_p", "max_tokens",
          "max_completion_tokens", "stop", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "logit_bias", "n", "stream", "stream_options", "include_usage", "logprobs", "top_logprobs",
          "response_format", "parallel_tool_calls", "chat_template_kwargs", "user", "session_id", "turn_type",
          "session_done", "no_train", "role", "content", "name", "tool_calls", "tool_call_id", "function",
          "arguments", "type", "text", "id", "parameters", "description", "reasoning_content", "image_url",
          "enable_thinking"]
ROLES = ["system", "developer", "user", "assistant", "tool", "wizard", ""]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<think>", "</think>",
           "\ud800", "\udfff", "\x00", "\u2028", "🦦", "{", '"', "\\"]

text = st.text(max_size=8) | st.sampled_from(SPECIAL)
scalars = (st.none() | st.booleans() | st.integers() | st.integers(-2, 3) | st.floats() | text
           | st.sampled_from(ROLES + ["text", "function", "auto", "none", "main", "side"]))
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(FIELDS) | text, inner, max_size=3),
    max_leaves=8)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES)},
                                          optional={"content": json_values, "name": json_values,
                                                    "tool_calls": json_values, "tool_call_id": json_values}),
                    max_size=3)
valid_messages = st.lists(st.builds(lambda r, c: {"role": r, "content": c},
                                    st.sampled_from(["system", "user", "assistant"]), text),
                          min_size=1, max_size=3)
requests = st.builds(
    lambda msgs, sane, extra: {"messages": msgs, **sane, **extra},
    valid_messages | messages,
    st.fixed_dictionaries({}, optional={"max_tokens": st.integers(1, 8), "stream": st.booleans(),
                                        "temperature": st.floats(0, 2)}),
    st.dictionaries(st.sampled_from(FIELDS[1:]), json_values, max_size=3))


@st.composite
def mutated(draw) -> bytes:
    """A valid request's JSON text with a few bytes replaced, inserted or cut."""
    raw = bytearray(json.dumps(chat(stream=draw(st.booleans()))).encode())
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(raw)))
        op = draw(st.sampled_from(["replace", "insert", "cut"]))
        byte = draw(st.binary(min_size=1, max_size=3) | st.sampled_from([b"{", b"}", b"[", b'"', b",", b":"]))
        if op == "insert":
            raw[i:i] = byte
        elif op == "cut":
            del raw[i:i + len(byte)]
        else:
            raw[i:i + len(byte)] = byte
    return bytes(raw)


def encode(value, ascii_only: bool) -> bytes:
    # surrogatepass: a lone surrogate written raw is invalid UTF-8, which is bad input too
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


def weighted(*choices: tuple[int, st.SearchStrategy]) -> st.SearchStrategy:
    """Branches drawn in proportion to their weights (st.one_of weighs alike and folds repeats)."""
    return st.sampled_from([s for weight, s in choices for _ in range(weight)]).flatmap(lambda s: s)


bodies = weighted(
    (1, st.binary(max_size=200)),
    (1, st.builds(encode, json_values, st.booleans())),
    (3, st.builds(encode, requests, st.booleans())),
    (1, mutated()),
)

TCHAR = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# aiohttp's parser refuses these when repeated (a protocol-level 400 before any handler runs)
SINGLETON = {b"content-type", b"user-agent", b"content-location", b"content-range", b"etag", b"max-forwards",
             b"server"}
# framing and transport headers: the request's framing stays ours
FRAMING = {b"host", b"content-length", b"transfer-encoding", b"connection", b"content-encoding", b"expect",
           b"upgrade", b"te", b"trailer", b"keep-alive", b"proxy-connection"}
KNOWN_VALUES = {
    b"X-Session-Id": [b"s-1", b"s-2", b"", b" ", b"x" * 257, b"caf\xc3\xa9", b"\xff"],
    b"X-Turn-Type": [b"main", b"side", b"MAIN", b" side ", b"", b"weird"],
    b"X-Session-Done": [b"1", b"0", b"true", b"no", b"", b"maybe"],
    b"X-Clawd-No-Train": [b"1", b"0", b"yes", b"off", b"maybe"],
    b"Authorization": [b"Bearer " + KEY.encode(), b"bearer " + KEY.encode(), b"Bearer", b"Bearer  ",
                       b"Bearer wrong-key-123", b"Basic " + KEY.encode(), b"Bearer " + KEY.encode() + b"\xff"],
    b"Content-Type": [b"application/json", b"text/plain", b"application/x-www-form-urlencoded",
                      b"multipart/form-data; boundary=x", b"application/json; charset=latin-1"],
    b"Accept": [b"*/*", b"text/event-stream", b"text/html"],
}
header_value = st.binary(max_size=40).map(
    lambda b: bytes(c for c in b if c in b"\t " or 0x21 <= c <= 0x7e or c >= 0x80).strip(b" \t"))
header = st.one_of(
    st.sampled_from(sorted(KNOWN_VALUES)).flatmap(lambda n: st.tuples(st.just(n), st.sampled_from(KNOWN_VALUES[n]))),
    st.tuples(st.sampled_from(sorted(KNOWN_VALUES)), header_value),
    st.tuples(st.text(TCHAR, min_size=1, max_size=16).map(str.encode), header_value),
).filter(lambda h: h[0].lower() not in FRAMING)
methods = st.sampled_from([b"POST"] * 6 + [b"GET", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"HEAD"])
known_paths = st.sampled_from([CHAT] * 8 + [b"/v1/feedback"] * 2 + [b"/v1/models", b"/health", b"/ready", b"/v1/chat/completions/",
                                            b"/V1/CHAT/COMPLETIONS", b"/v1/chat/completions?stream=true", b"/"])
odd_paths = st.text("abcxyz019-._~%/?=&", max_size=24).map(lambda p: b"/" + p.encode())
targets = weighted((8, st.tuples(methods, known_paths)), (2, st.tuples(methods, odd_paths)),
                   (1, st.just((b"OPTIONS", b"*"))))  # "*" is for OPTIONS only


def dedupe_singletons(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    seen, out = set(), []
    for name, value in headers:
        if name.lower() in SINGLETON and name.lower() in seen:
            continue
        seen.add(name.lower())
        out.append((name, value))
    return out


def check_reply(method: bytes, path: bytes, reply: Reply) -> None:
    """200 or 4xx; every error OpenAI-shaped; every 200 of the chat route a completion or a stream."""
    assert reply.status == 200 or 400 <= reply.status < 500, reply
    if method == b"HEAD":
        assert reply.body == b""
        return
    if reply.status >= 400:
        assert_openai_error(reply)
        return
    if reply.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line.removeprefix(b"data: ") for line in reply.body.split(b"\n\n") if line]
        assert events[-1] == b"[DONE]", reply
        for event in events[:-1]:
            chunk = json.loads(event)
            assert chunk["object"] == "chat.completion.chunk", chunk
        return
    out = reply.json()
    if path.startswith(CHAT) and method == b"POST":
        assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant", out


FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.data_too_large])
BODY_EXAMPLES, REQUEST_EXAMPLES = 1500, 800  # 2,300 fuzzed requests in all


@pytest.mark.slow
@settings(FUZZ, max_examples=BODY_EXAMPLES)
@given(body=bodies)
def test_fuzzed_bodies(daemon, body):
    headers = [*AUTH, (b"Content-Type", b"application/json")]
    check_reply(b"POST", CHAT, exchange(daemon, http_request(b"POST", CHAT, headers, body)))


@settings(FUZZ, max_examples=REQUEST_EXAMPLES)
@given(target=targets, keyed=st.booleans(), headers=st.lists(header, max_size=6),
       body=st.one_of(st.builds(encode, requests, st.just(True)), st.just(json.dumps(chat()).encode()),
                      st.binary(max_size=40)))
@pytest.mark.slow
def test_fuzzed_requests(daemon, target, keyed, headers, body):
    method, path = target
    headers = dedupe_singletons([*(AUTH if keyed else []), *headers])
    reply = exchange(daemon, http_request(method, path, headers, body), method)
    check_reply(method, path, reply)


def test_healthy_after_the_fuzz(daemon):
    assert daemon.get("/health") == (200, {"status": "ok"})
    status, ready = daemon.get("/ready")
    assert status == 200 and ready["ready"] is True
    assert isinstance(assert_chat_completion(send(daemon, chat())), str)
    assert daemon.proc.poll() is None
    log = "".join(daemon.lines)
    assert "Traceback" not in log and "Error handling request" not in log, log[-4000:]
