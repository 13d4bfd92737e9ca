"""clawd.serving.capture: the captured turn of a main completion, exact values (pure, over a real reply)."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from clawd.engine.chunks import Chunk
from clawd.served import Policy
from clawd.serving.capture import Capture, captured_turn
from clawd.serving.reply import ReplyBuilder
from clawd.serving.request import Limits, parse_chat_request
from clawd.tokenizer import ChatTokenizer
from clawd.turns import LOGPROB_MISMATCH, SAMPLING_PARAMS

ADMISSION = SimpleNamespace(session_id="s1", turn_index=3)


@pytest.fixture(scope="module")
def tok(tiny_model):
    return ChatTokenizer(tiny_model)


def reply(tok, chunks, req) -> ReplyBuilder:
    out = ReplyBuilder(req, "r1", tok=tok, model="m", policy=Policy(version=4, weight_version="4"), replicas=None,
                       tool_parser="none", reasoning_parser="none")
    for chunk in chunks:
        out.add(chunk)
    out.close()
    return out


def request(**body):
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}).encode()
    return parse_chat_request(raw, {}, Limits(max_messages=10, max_message_chars=100))


def test_the_turn_holds_the_engines_ids_and_log_probs_and_the_replicas_version(tok):
    req = request()
    ids = tok.encode("Hello there")
    out = reply(tok, [Chunk(ids=ids, logprobs=[-0.5] * len(ids), logprob_ids=ids, top_ids=[[i, 0] for i in ids],
                            finish={"type": "stop"}, meta={"weight_version": "5"})], req)
    cap = Capture(admission=ADMISSION, principal="alice", temperature=1.0, excluded=None, version=4, req=req)
    turn = captured_turn(cap, "r1", [1, 2, 3], out, top_k=2, weight_version="4", now=9.0)
    assert (turn.session_id, turn.turn_index, turn.principal, turn.request_id, turn.rid) == (
        "s1", 3, "alice", "chatcmpl-r1", "r1")
    assert (turn.prompt_ids, turn.response_ids, turn.response_logprobs) == ([1, 2, 3], ids, [-0.5] * len(ids))
    assert turn.response_top_ids == [[i, 0] for i in ids]
    assert (turn.policy_version, turn.weight_version, turn.excluded, turn.created) == (5, "5", None, 9.0)
    assert turn.reply == {"role": "assistant", "content": "Hello there"} and turn.finish_reason == "stop"
    # top-k ids the engine did not give for every token, or not k of them: none kept
    assert captured_turn(cap, "r1", [1], out, top_k=3, weight_version="4", now=9.0).response_top_ids is None
    assert captured_turn(cap, "r1", [1], out, top_k=0, weight_version="4", now=9.0).response_top_ids is None


def test_log_probs_that_are_not_of_the_output_ids_exclude_the_turn(tok):
    req = request()
    ids = tok.encode("Hello")
    wrong = reply(tok, [Chunk(ids=ids, logprobs=[-0.1] * len(ids), logprob_ids=[i + 1 for i in ids],
                              finish={"type": "stop"}, meta={})], req)
    cap = Capture(admission=ADMISSION, principal="a", temperature=1.0, excluded=SAMPLING_PARAMS, version=4, req=req)
    turn = captured_turn(cap, "r1", [1], wrong, top_k=0, weight_version="4", now=1.0)
    assert turn.excluded == LOGPROB_MISMATCH and turn.weight_version == "4"  # no replica named one: the policy's
    missing = reply(tok, [Chunk(ids=ids, logprobs=[None] * len(ids), logprob_ids=ids, finish={"type": "stop"},
                                meta={})], req)
    turn = captured_turn(cap, "r1", [1], missing, top_k=0, weight_version="4", now=1.0)
    assert turn.excluded == LOGPROB_MISMATCH and all(math.isnan(lp) for lp in turn.response_logprobs)
