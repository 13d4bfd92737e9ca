"""Streaming output parser: exact values per format, and chunking never changes the result."""
import itertools
import json

import pytest
from hypothesis import given, settings, strategies as st

from clawd.serving.parsers import Content, Reasoning, ToolCall, make_parser, parse_complete


def counter_ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def parser(tool="hermes", reasoning="think", **kw):
    return make_parser(tool, reasoning, call_id=counter_ids(), **kw)


def merged(deltas):
    """Adjacent text deltas of one kind joined: the form chunking must not change."""
    out = []
    for d in deltas:
        if out and not isinstance(d, ToolCall) and type(out[-1]) is type(d):
            out[-1] = type(d)(out[-1].text + d.text)
        else:
            out.append(d)
    return out


def run(chunks, **kw):
    p = parser(**kw)
    deltas = [d for c in chunks for d in p.feed(c)] + p.finish()
    assert all(isinstance(d, ToolCall) or d.text for d in deltas), "empty delta"
    return merged(deltas)


def complete(text, tool="hermes", reasoning="think", **kw):
    return parse_complete(text, tool, reasoning, call_id=counter_ids(), **kw)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>{"name":"add","arguments":{"a":1,"b":[2,3]}}</tool_call>'
WEATHER = ToolCall(0, "call_0", "get_weather", '{"city": "Paris"}')


# ---------------------------------------------------------------- exact values

def test_plain_content_is_prompt():
    p = parser()
    assert p.feed("Hello") == [Content("Hello")]
    assert p.feed(" world <") == [Content(" world ")]      # "<" may open a tag
    assert p.feed("b>") == [Content("<b>")]
    assert p.finish() == []


def test_none_parsers_pass_everything_through():
    text = "<think>x</think>" + CALL
    assert run([text], tool="none", reasoning="none") == [Content(text)]
    assert complete(text, "none", "none") == (text, None, [])


def test_tools_disabled_is_content():
    assert run(["a " + CALL], tools_enabled=False, reasoning="none") == [Content("a " + CALL)]


def test_hermes_tool_call():
    text = "Let me check.\n" + CALL
    assert run([text]) == [Content("Let me check.\n"), WEATHER]
    assert complete(text) == ("Let me check.\n", None, [WEATHER])
    assert complete(text, "qwen25", "none") == ("Let me check.\n", None, [WEATHER])


def test_several_tool_calls_and_null_content():
    text = CALL + "\n" + CALL2 + "\n"
    add = ToolCall(1, "call_1", "add", '{"a": 1, "b": [2, 3]}')
    assert run([text]) == [WEATHER, Content("\n"), add, Content("\n")]
    assert complete(text) == (None, None, [WEATHER, add])
    p = parser()
    p.feed(text)
    assert p.tool_calls == [WEATHER, add]


def test_text_between_calls_is_content():
    content, _, calls = complete("A" + CALL + "B" + CALL2 + "C")
    assert content == "ABC" and [c.name for c in calls] == ["get_weather", "add"]


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "f", "arguments": {]}\n</tool_call>',       # not JSON
    '<tool_call>{"arguments": {}}</tool_call>',                        # no name
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',            # empty name
    '<tool_call>["f", {}]</tool_call>',                                # not an object
])
def test_malformed_block_is_verbatim_content(block):
    text = "x " + block + " y"
    assert run([text]) == [Content(text)]
    assert complete(text + CALL) == (text, None, [WEATHER])   # and does not take an index


def test_malformed_block_emitted_at_close():
    p = parser()
    assert p.feed("<tool_call>{oops") == []
    assert p.feed("}</tool_call>ok") == [Content("<tool_call>{oops}</tool_call>ok")]


def test_arguments_forms():
    def args(body):
        return complete(f"<tool_call>{body}</tool_call>")[2][0].arguments
    assert args('{"name": "f"}') == "{}"
    assert args('{"name": "f", "arguments": null}') == "{}"
    assert args('{"name": "f", "arguments": "{\\"a\\": 1}"}') == '{"a": 1}'
    assert args('{"name": "f", "arguments": "plain"}') == '"plain"'
    assert args('{"name": "f", "arguments": {"q": "café ☕"}}') == '{"q": "café ☕"}'
    # braces and brackets inside strings do not confuse the block boundary
    code = 'function f() { return {a: "}"}; } ]]'
    assert args('{"name": "run", "arguments": {"code": ' + json.dumps(code) + "}}") \
        == json.dumps({"code": code}, ensure_ascii=False)


def test_reasoning_then_tool_call():
    text = "<think>\nI should call it.\n</think>\n\n" + CALL
    assert run([text]) == [Reasoning("\nI should call it.\n"), Content("\n\n"), WEATHER]
    assert complete(text) == (None, "\nI should call it.\n", [WEATHER])


def test_reasoning_streams_as_it_comes():
    p = parser()
    assert p.feed("  \n<thi") == []
    assert p.feed("nk>step one") == [Reasoning("step one")]
    assert p.feed(", two</") == [Reasoning(", two")]
    assert p.feed("think>Answer") == [Content("Answer")]
    assert p.finish() == []


def test_think_only_at_start():
    text = "a<think>b</think>c"
    assert complete(text) == (text, None, [])
    assert complete("  hi") == ("  hi", None, [])
    assert complete("  ") == ("  ", None, [])


def test_starts_in_reasoning():
    assert run(["plan</think>answer"], starts_in_reasoning=True) == [Reasoning("plan"), Content("answer")]
    assert complete("just thinking", starts_in_reasoning=True) == ("", "just thinking", [])
    assert complete("x</think>y", reasoning="none", starts_in_reasoning=True) == ("x</think>y", None, [])


def test_unclosed_reasoning_stays_reasoning():
    p = parser()
    assert p.feed("<think>abc</thi") == [Reasoning("abc")]
    assert p.finish() == [Reasoning("</thi")]


def test_partial_tag_at_end_of_stream():
    p = parser()
    assert p.feed("Hello <tool_") == [Content("Hello ")]
    assert p.finish() == [Content("<tool_")]


def test_unclosed_tool_call_is_content():
    p = parser()
    assert p.feed('ok <tool_call>{"name": "f"') == [Content("ok ")]
    assert p.finish() == [Content('<tool_call>{"name": "f"')]
    assert p.tool_calls == []


def test_tag_lookalike_is_content():
    p = parser()
    out = [p.feed(c) for c in "<tool_calls are fun"]
    assert out[:11] == [[]] * 10 + [[Content("<tool_calls")]]
    assert merged([d for o in out for d in o] + p.finish()) == [Content("<tool_calls are fun")]


def test_stop_across_chunk_boundary():
    p = parser(stop=["STOP"])
    assert p.feed("Hello ST") == [Content("Hello ")]
    assert not p.stopped
    assert p.feed("OP world") == []
    assert p.stopped
    assert p.feed("more") == []
    assert p.finish() == []


def test_stop_prefix_released_when_it_diverges():
    p = parser(stop=["STOP"])
    assert p.feed("a STO") == [Content("a ")]
    assert p.feed("RM") == [Content("STORM")]
    assert p.finish() == []


def test_stop_inside_tool_call():
    text = CALL + " trailing"
    assert complete(text, stop=["Paris"]) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "', None, [])


def test_stop_inside_reasoning():
    assert complete("<think>abc</think>d", stop=["b"]) == ("", "a", [])


def test_stop_earliest_start_wins():
    # "b" completes first while streaming, but "abc" starts earlier.
    assert run(["xa", "b", "c"], stop=["abc", "b"]) == [Content("x")]
    assert run(["xa", "b", "d"], stop=["abc", "b"]) == [Content("xa")]
    assert run(["xab"], stop=["abc", "b"]) == [Content("xa")]   # finish decides


def test_misuse_raises():
    with pytest.raises(ValueError):
        make_parser("nope", "think")
    with pytest.raises(ValueError):
        make_parser("hermes", "nope")
    p = parser()
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed("x")


def test_default_call_ids_are_unique():
    text = CALL + CALL
    calls = parse_complete(text, "hermes", "none")[2]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


# ---------------------------------------------------------------- chunking never matters

PIECES = [
    "Hello", " world", "\n", "  ", "é😀", "<", ">", "</", "<tool", "<tool_call", "<tool_calls", "<think",
    "</think", "<think>", "</think>", "<tool_call>", "</tool_call>", CALL, CALL2,
    '{"name": "f", "arguments": {"x": "}{"}}', "{bad json", "ST", "OP", "STOP", "abc", "b",
]
STOPS = [[], ["STOP"], ["abc", "b"], ["</tool_call>"], ["\n\n"]]


def chunkings(text, cuts):
    cuts = sorted(set(cuts))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12), st.data(),
       st.sampled_from(STOPS), st.booleans(), st.sampled_from(["hermes", "none"]),
       st.sampled_from(["think", "none"]), st.booleans())
def test_chunking_invariance(pieces, data, stop, starts, tool, reasoning, tools_enabled):
    text = "".join(pieces)
    kw = dict(stop=stop, starts_in_reasoning=starts, tool=tool, reasoning=reasoning,
              tools_enabled=tools_enabled)
    whole = run([text], **kw)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    assert run(chunkings(text, cuts), **kw) == whole
    assert run(list(text), **kw) == whole
    content, reasoning_text, calls = complete(text, tool, reasoning, stop=stop, starts_in_reasoning=starts,
                                              tools_enabled=tools_enabled)
    assert calls == [d for d in whole if isinstance(d, ToolCall)]
    streamed = "".join(d.text for d in whole if isinstance(d, Content))
    assert content == (None if calls and not streamed.strip() else streamed)
    assert (reasoning_text or "") == "".join(d.text for d in whole if isinstance(d, Reasoning))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12), st.sampled_from(STOPS[1:]))
def test_stop_is_a_cut_at_the_first_occurrence(pieces, stop):
    text = "".join(pieces)
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    cut = text[:min(hits)] if hits else text
    assert complete(text, stop=stop) == complete(cut)


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(blacklist_characters="<"), max_size=30), st.data())
def test_text_without_markup_goes_out_at_once(text, data):
    p = parser()
    fed = emitted = ""
    for chunk in chunkings(text, data.draw(st.lists(st.integers(0, len(text)), max_size=5))):
        fed += chunk
        emitted += "".join(d.text for d in p.feed(chunk))
        # only leading whitespace may wait (it could precede <think>)
        assert emitted == (fed if fed.strip() else "")
    emitted += "".join(d.text for d in p.finish())
    assert emitted == text


@settings(max_examples=300, deadline=None)
@given(st.text("abx", max_size=14), st.lists(st.text("abx", min_size=1, max_size=4), min_size=1, max_size=3),
       st.data())
def test_stop_cut_small_alphabet(text, stop, data):
    # Overlapping stop strings on a tiny alphabet: the cut is at the earliest start, however fed.
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    expected = text[:min(hits)] if hits else text
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    for chunks in ([text], list(text), chunkings(text, cuts)):
        got = run(chunks, stop=stop, reasoning="none")
        assert "".join(d.text for d in got) == expected
