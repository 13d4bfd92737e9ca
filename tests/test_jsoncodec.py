"""clawd.jsoncodec: orjson where it reads and writes as the standard library does, `json` where it would not
(exact values), and a reply whose log-probs hold a NaN or an infinity written as `json` writes them."""
from __future__ import annotations

import json
import math
from collections import OrderedDict

import pytest

from clawd import jsoncodec
from clawd.engine.chunks import Chunk
from clawd.served import Policy
from clawd.serving.reply import ReplyBuilder
from clawd.serving.request import Limits, parse_chat_request
from clawd.tokenizer import ChatTokenizer


@pytest.mark.parametrize("text", [
    b'{"a":[1,2.5,"x",null,true],"b":{"c":-0.0}}', '{"\\u00e9t\\u00e9": "\\ud83d\\ude00"}', b'[1e-05, 3.4e+38]',
    b'{"text": "caf\xc3\xa9"}', b'"\\u2028"'])
def test_loads_equals_the_standard_librarys_on_strict_json(text):
    assert jsoncodec.loads(text) == json.loads(text)


@pytest.mark.parametrize("text", [b"[NaN, Infinity, -Infinity]", b'["\\ud800"]', b"[1e400]"])
def test_what_orjson_refuses_is_read_as_the_standard_library_reads_it(text):
    got, want = jsoncodec.loads(text), json.loads(text)
    assert repr(got) == repr(want)  # NaN != NaN: compared as written


def test_an_integer_past_64_bits_is_the_one_difference_left():
    # Why loads reads only the engine's answers (module docstring): should orjson change, this says so.
    assert jsoncodec.loads(b"[123456789012345678901234567890]") == [1.2345678901234568e+29]
    assert jsoncodec.loads(b"[18446744073709551615]") == json.loads(b"[18446744073709551615]")  # 2**64 - 1


@pytest.mark.parametrize("text", [b"", b"{", b"[1,]", b"nul"])
def test_what_neither_reads_raises_a_value_error(text):
    with pytest.raises(ValueError):
        jsoncodec.loads(text)


def test_dumps_is_compact_utf8_and_a_nan_stays_a_nan():
    assert jsoncodec.dumps({"a": [1, None, "é"], "b": True}) == '{"a":[1,null,"é"],"b":true}'.encode()
    assert jsoncodec.dumps([1.5, -2.25]) == b"[1.5,-2.25]"
    # A null in the output may have been a NaN: `json` writes it again, as it always did.
    assert jsoncodec.dumps({"lp": math.nan, "x": None}) == b'{"lp":NaN,"x":null}'
    assert jsoncodec.dumps([-math.inf]) == b"[-Infinity]"
    # The caller's word that nothing is infinite skips that check; orjson then writes null (why it is a word).
    assert jsoncodec.dumps({"x": None}, finite=True) == b'{"x":null}'
    assert jsoncodec.dumps({1: "a"}) == b'{"1":"a"}'  # a key orjson refuses: json's spelling
    assert jsoncodec.dumps(["\ud800"]) == b'["\\ud800"]'  # a lone surrogate, escaped: UTF-8 cannot hold it


@pytest.mark.parametrize("obj", [{"b": 1, "a": {"d": None, "c": "é"}}, {"z": math.nan, "y": None}, {"s": "\ud800"},
                                 {"k": 2 ** 70}, {2: "x", 1: "y"}])
def test_dumps_with_sorted_keys_writes_what_json_writes_with_them(obj):
    want = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    got = jsoncodec.dumps(obj, sort_keys=True)
    assert got == (want.encode() if "\ud800" not in want else json.dumps(obj, sort_keys=True,
                                                                          separators=(",", ":")).encode())


@pytest.fixture(scope="module")
def tok(tiny_model):
    return ChatTokenizer(tiny_model)


def _reply(tok, logprobs):
    req = parse_chat_request(json.dumps({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                         "stream": True}).encode(), {}, Limits(max_messages=10, max_message_chars=100))
    out = ReplyBuilder(req, "r1", tok=tok, model="m", policy=Policy(version=4, weight_version="4"), replicas=None,
                       tool_parser="none", reasoning_parser="none")
    ids = [tok.encode("hello")[0]] * len(logprobs)
    deltas, lps = out.add(Chunk(ids=ids, logprobs=logprobs, logprob_ids=ids, finish=None, meta={}, top_ids=[]))
    return out, out.sse(deltas[0] if deltas else {}, logprobs=lps)


def test_a_reply_with_an_infinite_log_prob_is_written_as_json_writes_it(tok):
    out, event = _reply(tok, [-0.25, -math.inf])
    assert not out.finite
    assert event.startswith(b"data: ") and b'"logprob":-Infinity' in event
    assert b'"logprob":-Infinity' in out.completion_body()
    out, event = _reply(tok, [-0.25, -0.5])
    assert out.finite and b'"logprob":-0.25' in event and b'"logprobs":{"content":[' in event
    body = json.loads(out.completion_body())
    assert [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]] == [-0.25, -0.5]


def test_finite_throughout_walks_what_orjson_writes():
    assert jsoncodec.finite_throughout({"ids": list(range(300)), "lps": [None, -0.5, -1e-9], "m": [{"c": "x"}],
                                        "t": (1.0,)})
    assert not jsoncodec.finite_throughout([1e308, 1e308])  # finite, but the sum overflows: json writes them
    for bad in ({"a": {"b": [None, math.nan]}}, [[1, 2], [3.0, math.inf]], ({"x": -math.inf},), math.nan,
                [[1, 2], {"k": math.nan}], [[1, 2], [None, math.nan]], [(1,), [2.0, -math.inf]], [[[math.nan]]],
                [1, 2, [3, math.nan]], [OrderedDict(x=math.inf)], [type("F", (float,), {})(math.nan)]):
        assert not jsoncodec.finite_throughout(bad), bad
    # The fast paths' shapes, finite: rows of ids (a turn's top-k), rows with a null, ints past a float's range.
    for good in ([[1, 2], [3, 4]], [[1, None], (2.5,)], [10**400, 1], [[10**400], [1]], [[], [1]], [], [[]]):
        assert jsoncodec.finite_throughout(good), good
    # A turn record with a NaN deep inside is written as `json` writes it; without, as orjson does (the same).
    record = {"prompt_ids": [1, 2, 3], "response_logprobs": [-0.5, None], "reward": None, "text": "é\n"}
    assert jsoncodec.dumps(record) == json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
    record["response_logprobs"][1] = math.nan
    assert jsoncodec.dumps(record) == json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode()
    assert b"NaN" in jsoncodec.dumps(record)


@pytest.mark.parametrize("usage", [False, True])
def test_an_sse_event_is_its_chunk_as_dumps_writes_it(tok, usage):
    # `sse` writes from a head it keeps: byte for byte what encoding the whole chunk gives, whatever the delta.
    req = parse_chat_request(json.dumps({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                         "stream": True, "stream_options": {"include_usage": usage}}).encode(), {},
                             Limits(max_messages=10, max_message_chars=100))
    out = ReplyBuilder(req, "r\u00e91", tok=tok, model="m\"x", policy=Policy(version=4, weight_version="4"),
                       replicas=None, tool_parser="none", reasoning_parser="none")
    lps = [{"token": "a", "logprob": -0.25, "bytes": [97], "top_logprobs": []}]
    for delta, finish, logprobs in [({"role": "assistant", "content": ""}, None, None),
                                    ({"content": "é\n\"\\"}, None, lps),
                                    ({"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                                      "function": {"name": "f", "arguments": "{}"}}]}, None, None),
                                    ({}, "stop", None)]:
        assert out.sse(delta, finish=finish, logprobs=logprobs) == \
            b"data: " + jsoncodec.dumps(out.sse_chunk(delta, finish=finish, logprobs=logprobs)) + b"\n\n"
    out.meta = {"weight_version": "5"}  # a new fingerprint mid-reply: a new head
    assert b'"system_fingerprint":"clawd-v5"' in out.sse({"content": "x"})
