"""Session state machine: stitching, next states, regenerate, branching, closing."""
import itertools
from collections import OrderedDict

import pytest

from clawd import turns
from clawd.serving.sessions import SessionTable, canonical, prefix_hashes
from clawd.turns import FinishedTurn, Turn


def make_table(**kw):
    counter = itertools.count()
    args = dict(idle_timeout=100.0, max_turns=50, max_sessions=100,
                new_id=lambda: f"s{next(counter)}")
    args.update(kw)
    return SessionTable(**args)


def make_turn(adm, principal, messages, reply):
    return Turn(session_id=adm.session_id, turn_index=adm.turn_index, principal=principal,
                request_id=f"req-{adm.session_id}-{adm.turn_index}", rid="rid", prompt_ids=[1, 2],
                response_ids=[3], response_logprobs=[-0.5], temperature=1.0, messages=messages,
                tools=None, reply=reply, finish_reason="stop", policy_version=1, weight_version="v1",
                created=0.0)


def serve(table, messages, reply, now, principal="alice", session_id=None, done=False):
    """begin + complete; returns (admission, turn, finished by begin, finished by complete)."""
    adm = table.begin(principal, session_id, messages, now)
    turn = make_turn(adm, principal, messages, reply)
    return adm, turn, adm.finished, table.complete(adm, turn, done, now)


def asst(content=None, calls=None):
    m = {"role": "assistant", "content": content}
    if calls:
        m["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                           for cid, name, args in calls]
    return m


SYS = {"role": "system", "content": "You are helpful."}
U1 = {"role": "user", "content": "Weather in Paris and Oslo?"}
R1 = asst(None, [("call_a", "weather", '{"city": "Paris", "unit": "C"}')])
T1 = {"role": "tool", "tool_call_id": "call_a", "content": "12C"}
R2 = asst("Checking Oslo too.", [("call_b", "weather", '{"city": "Oslo"}'),
                                  ("call_c", "time", '{"tz": "Europe/Oslo"}')])
T2a = {"role": "tool", "tool_call_id": "call_b", "content": "8C"}
T2b = {"role": "tool", "tool_call_id": "call_c", "content": "14:00"}
R3 = asst("Paris 12C, Oslo 8C.")


def three_turns(table, principal="alice"):
    m1 = [SYS, U1]
    m2 = m1 + [R1, T1]
    m3 = m2 + [R2, T2a, T2b]
    a1, t1, f1, c1 = serve(table, m1, R1, 1.0, principal)
    a2, t2, f2, c2 = serve(table, m2, R2, 2.0, principal)
    a3, t3, f3, c3 = serve(table, m3, R3, 3.0, principal)
    assert c1 == c2 == c3 == []
    return (a1, a2, a3), (t1, t2, t3), (f1, f2, f3)


def test_three_turns_without_session_id_are_one_session():
    table = make_table()
    (a1, a2, a3), (t1, t2, t3), (f1, f2, f3) = three_turns(table)
    assert a1.session_id == a2.session_id == a3.session_id == "s0"
    assert a1.key == ("alice", "s0")
    assert [a1.turn_index, a2.turn_index, a3.turn_index] == [0, 1, 2]
    assert f1 == []
    assert f2 == [FinishedTurn(t1, [T1], None, 2.0)]                 # tool round trip
    assert f3 == [FinishedTurn(t2, [T2a, T2b], None, 3.0)]           # multi-message next state
    assert f2[0].trainable and f3[0].trainable
    assert len(table) == 1 and table.pending_count == 1
    assert table.close_all(9.0) == [FinishedTurn(t3, None, turns.SHUTDOWN, 9.0)]
    assert len(table) == 0 and table.pending_count == 0


def test_next_state_with_user_message_after_plain_reply():
    table = make_table()
    m1 = [SYS, {"role": "user", "content": "hi"}]
    r1 = asst("Hello!")
    _, t1, _, _ = serve(table, m1, r1, 1.0)
    follow = [{"role": "user", "content": "what can you do?"}]
    a2 = table.begin("alice", None, m1 + [r1] + follow, 2.0)
    assert a2.finished == [FinishedTurn(t1, follow, None, 2.0)]
    assert (a2.session_id, a2.turn_index) == ("s0", 1)


def test_unrelated_conversation_is_a_new_session():
    table = make_table()
    serve(table, [SYS, U1], R1, 1.0)
    a = table.begin("alice", None, [SYS, {"role": "user", "content": "other"}], 2.0)
    assert (a.session_id, a.turn_index, a.finished) == ("s1", 0, [])
    assert len(table) == 2


def test_explicit_session_ids():
    table = make_table()
    m1 = [SYS, U1]
    a1, t1, _, _ = serve(table, m1, R1, 1.0, session_id="x")
    b1, u1, _, _ = serve(table, m1, R1, 1.5, session_id="y")
    assert (a1.key, b1.key) == (("alice", "x"), ("alice", "y"))
    # reply found -> messages after it
    a2, t2, f2, _ = serve(table, m1 + [R1, T1], R2, 2.0, session_id="x")
    assert f2 == [FinishedTurn(t1, [T1], None, 2.0)] and a2.turn_index == 1
    # reply not found (client rewrote it) -> messages after the last assistant message
    rewritten = [SYS, U1, asst("I made this up"), {"role": "user", "content": "u2"},
                 asst("again"), {"role": "user", "content": "u3"}, {"role": "user", "content": "u4"}]
    b2 = table.begin("alice", "y", rewritten, 3.0)
    assert b2.finished == [FinishedTurn(u1, rewritten[-2:], None, 3.0)]
    table.complete(b2, make_turn(b2, "alice", rewritten, asst("ok")), False, 3.0)
    # no assistant message at all -> the last message only
    fresh = [{"role": "user", "content": "start over"}, {"role": "user", "content": "really"}]
    b3 = table.begin("alice", "y", fresh, 4.0)
    assert [f.next_state for f in b3.finished] == [fresh[-1:]]
    assert b3.turn_index == 2
    assert len(table) == 2


def test_two_principals_with_identical_conversations_stay_apart():
    table = make_table()
    a1, ta, _, _ = serve(table, [SYS, U1], R1, 1.0, principal="alice")
    b1, tb, _, _ = serve(table, [SYS, U1], R1, 1.0, principal="bob")
    assert a1.key == ("alice", "s0") and b1.key == ("bob", "s1")
    b2 = table.begin("bob", None, [SYS, U1, R1, T1], 2.0)
    assert b2.key == ("bob", "s1") and b2.finished == [FinishedTurn(tb, [T1], None, 2.0)]
    a2 = table.begin("alice", None, [SYS, U1, R1, T1], 2.0)
    assert a2.key == ("alice", "s0") and a2.finished == [FinishedTurn(ta, [T1], None, 2.0)]
    # same explicit id under two principals: two sessions
    x = table.begin("alice", "same", [SYS], 3.0)
    y = table.begin("bob", "same", [SYS], 3.0)
    assert x.key != y.key and len(table) == 4


def test_regenerate_excludes_abandoned_turn_and_reuses_index():
    table = make_table()
    m1, m2 = [SYS, U1], [SYS, U1, R1, T1]
    serve(table, m1, R1, 1.0)
    a2, t2, _, _ = serve(table, m2, R2, 2.0)
    # the same prompt again: regenerate of turn 1
    a2b, t2b, f, c = serve(table, m2, R3, 3.0)
    assert f == [FinishedTurn(t2, None, turns.REGENERATED, 3.0)]
    assert (a2b.session_id, a2b.turn_index) == ("s0", 1) and c == []
    # the new reply continues; the abandoned one no longer does
    a3 = table.begin("alice", None, m2 + [R3, {"role": "user", "content": "thanks"}], 4.0)
    assert a3.finished == [FinishedTurn(t2b, [{"role": "user", "content": "thanks"}], None, 4.0)]
    assert (a3.session_id, a3.turn_index) == ("s0", 2)
    assert len(table) == 1


def test_regenerate_with_explicit_id():
    table = make_table()
    _, t1, _, _ = serve(table, [SYS, U1], R1, 1.0, session_id="x")
    a, _, f, _ = serve(table, [SYS, U1], R3, 2.0, session_id="x")
    assert f == [FinishedTurn(t1, None, turns.REGENERATED, 2.0)] and a.turn_index == 0
    assert table.pending_count == 1


def test_branch_from_older_turn():
    table = make_table()
    (a1, a2, a3), (t1, t2, t3), _ = three_turns(table)
    edited = [SYS, U1, R1, {"role": "tool", "tool_call_id": "call_a", "content": "-3C"}]
    a, tb, f, _ = serve(table, edited, asst("Cold."), 4.0)
    assert (a.session_id, a.turn_index) == ("s0", 3)
    assert f == [FinishedTurn(t3, None, turns.REGENERATED, 4.0)]  # t1 already had its next state
    assert len(table) == 1 and table.pending_count == 1
    # the branch continues normally
    nxt = table.begin("alice", None, edited + [asst("Cold."), {"role": "user", "content": "ok"}], 5.0)
    assert nxt.finished == [FinishedTurn(tb, [{"role": "user", "content": "ok"}], None, 5.0)]
    assert (nxt.session_id, nxt.turn_index) == ("s0", 4)


def test_formatting_differences_still_stitch():
    table = make_table()
    m1 = [SYS, {"role": "user", "content": "list files"}]
    reply = {"role": "assistant", "content": "Sure.\n", "reasoning_content": "think",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "ls", "arguments": '{"path": "/", "all": true}'}}]}
    _, t1, _, _ = serve(table, m1, reply, 1.0)
    echoed = [
        {"role": "system", "content": [{"type": "text", "text": "You are "}, {"type": "text", "text": "helpful. "}]},
        {"role": "user", "content": "  list files\n"},
        {"role": "assistant", "content": "Sure.",  # no reasoning, other id, other key order, dict args
         "tool_calls": [{"id": "xyz", "type": "function",
                         "function": {"name": "ls", "arguments": {"all": True, "path": "/"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": None},
    ]
    a = table.begin("alice", None, echoed, 2.0)
    assert a.session_id == "s0" and a.finished == [FinishedTurn(t1, echoed[3:], None, 2.0)]


def test_canonical_form():
    assert canonical({"role": "user", "content": None}) == canonical({"role": "user", "content": " "})
    assert canonical({"role": "assistant", "content": "x", "reasoning_content": "r"}) == \
        {"role": "assistant", "content": "x"}
    bad = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "function": {"name": "f", "arguments": "{not json"}}]}
    assert canonical(bad)["tool_calls"] == [["f", "{not json"]]
    tool = {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "ok"}
    assert canonical(tool) == {"role": "tool", "content": "ok", "tool_call_id": "c1", "name": "f"}
    assert canonical({**tool, "tool_call_id": "c2"}) != canonical(tool)
    img = {"role": "user", "content": [{"type": "text", "text": "see"},
                                       {"type": "image_url", "image_url": {"url": "a.png"}}]}
    assert canonical(img) != canonical({"role": "user", "content": "see"})
    # different principals never share a hash
    assert prefix_hashes("a", [SYS])[1] != prefix_hashes("b", [SYS])[1]
    assert len(prefix_hashes("a", [SYS, U1])) == 3


def test_idle_expiry_exact_set():
    table = make_table(idle_timeout=100.0)
    _, ta, _, _ = serve(table, [{"role": "user", "content": "a"}], asst("A"), 0.0)
    _, tb, _, _ = serve(table, [{"role": "user", "content": "b"}], asst("B"), 5.0)
    _, tc, _, _ = serve(table, [{"role": "user", "content": "c"}], asst("C"), 10.0)
    assert table.next_expiry() == 100.0
    assert table.expire(100.0) == []  # idle exactly the timeout: not longer
    assert table.expire(105.5) == [FinishedTurn(ta, None, turns.IDLE_TIMEOUT, 105.5),
                                   FinishedTurn(tb, None, turns.IDLE_TIMEOUT, 105.5)]
    assert len(table) == 1 and table.pending_count == 1 and table.next_expiry() == 110.0
    # the expired conversation no longer stitches: a new session
    a = table.begin("alice", None, [{"role": "user", "content": "a"}, asst("A"),
                                    {"role": "user", "content": "more"}], 106.0)
    assert a.session_id == "s3" and a.finished == []


def test_in_flight_session_does_not_expire():
    table = make_table(idle_timeout=100.0)
    a = table.begin("alice", None, [{"role": "user", "content": "slow"}], 0.0)
    assert table.expire(1000.0) == [] and len(table) == 1
    t = make_turn(a, "alice", [{"role": "user", "content": "slow"}], asst("done"))
    assert table.complete(a, t, False, 1000.0) == []
    assert table.expire(1100.5) == [FinishedTurn(t, None, turns.IDLE_TIMEOUT, 1100.5)]


class CountingOrderedDict(OrderedDict):
    reads = 0

    def values(self):
        type(self).reads += 1
        return super().values()

    def __iter__(self):
        type(self).reads += 1
        return super().__iter__()


def test_expire_is_cheap_when_nothing_expires():
    table = make_table(idle_timeout=100.0, max_sessions=10_000)
    for i in range(500):
        serve(table, [{"role": "user", "content": f"m{i}"}], asst("r"), float(i))
    table._idle = CountingOrderedDict(table._idle)  # white box: count looks at the idle order
    CountingOrderedDict.reads = 0
    assert table.expire(100.0) == []
    assert CountingOrderedDict.reads == 1  # only the oldest session was looked at
    assert len(table) == 500


def test_max_turns():
    table = make_table(max_turns=2)
    m1 = [{"role": "user", "content": "q1"}]
    _, t1, _, c1 = serve(table, m1, asst("a1"), 1.0)
    assert c1 == []
    m2 = m1 + [asst("a1"), {"role": "user", "content": "q2"}]
    a2, t2, f2, c2 = serve(table, m2, asst("a2"), 2.0)
    assert f2 == [FinishedTurn(t1, m2[2:], None, 2.0)]
    assert c2 == [FinishedTurn(t2, None, turns.MAX_TURNS, 2.0)]
    assert len(table) == 0 and table.pending_count == 0
    a3 = table.begin("alice", None, m2 + [asst("a2"), {"role": "user", "content": "q3"}], 3.0)
    assert (a3.session_id, a3.turn_index, a3.finished) == ("s1", 0, [])


def test_session_done():
    table = make_table()
    m1 = [{"role": "user", "content": "q1"}]
    _, t1, _, _ = serve(table, m1, asst("a1"), 1.0, session_id="x")
    m2 = m1 + [asst("a1"), {"role": "user", "content": "bye"}]
    _, t2, f2, c2 = serve(table, m2, asst("ciao"), 2.0, session_id="x", done=True)
    assert f2 == [FinishedTurn(t1, m2[2:], None, 2.0)]
    assert c2 == [FinishedTurn(t2, None, turns.SESSION_DONE, 2.0)]
    assert len(table) == 0 and table.pending_count == 0
    assert table.begin("alice", "x", m2, 3.0).turn_index == 0  # the id starts afresh


def test_eviction_closes_least_recently_active():
    table = make_table(max_sessions=2)
    _, ta, _, _ = serve(table, [{"role": "user", "content": "a"}], asst("A"), 1.0)
    _, tb, _, _ = serve(table, [{"role": "user", "content": "b"}], asst("B"), 2.0)
    # a is active again: b is now the least recently active
    ma = [{"role": "user", "content": "a"}, asst("A"), {"role": "user", "content": "a2"}]
    a2, ta2, _, _ = serve(table, ma, asst("A2"), 3.0)
    c = table.begin("alice", None, [{"role": "user", "content": "c"}], 4.0)
    assert c.session_id == "s2"
    assert c.finished == [FinishedTurn(tb, None, turns.EVICTED, 4.0)]
    assert len(table) == 2 and table.pending_count == 1
    # in-flight sessions are never evicted: c (in flight since 4.0) is older than s0 (4.5),
    # yet s0 goes
    ma3 = ma + [asst("A2"), {"role": "user", "content": "a3"}]
    _, ta3, f3, _ = serve(table, ma3, asst("A3"), 4.5)
    assert f3 == [FinishedTurn(ta2, ma3[4:], None, 4.5)]
    d = table.begin("alice", None, [{"role": "user", "content": "d"}], 5.0)
    assert d.finished == [FinishedTurn(ta3, None, turns.EVICTED, 5.0)]
    assert sorted(k for k in table._sessions) == [("alice", "s2"), ("alice", "s3")]


def test_close_all():
    table = make_table()
    _, ta, _, _ = serve(table, [{"role": "user", "content": "a"}], asst("A"), 1.0)
    _, tb, _, _ = serve(table, [{"role": "user", "content": "b"}], asst("B"), 2.0, principal="bob")
    table.begin("carol", None, [{"role": "user", "content": "c"}], 3.0)  # no pending turn
    assert table.close_all(4.0) == [FinishedTurn(ta, None, turns.SHUTDOWN, 4.0),
                                    FinishedTurn(tb, None, turns.SHUTDOWN, 4.0)]
    assert len(table) == 0 and table.pending_count == 0 and table.next_expiry() is None
    assert table._replies == {} and table._prompts == {}  # indices leave with their sessions


def test_complete_after_close_finishes_turn_with_close_reason():
    table = make_table()
    a = table.begin("alice", None, [{"role": "user", "content": "a"}], 1.0)
    assert table.close_all(2.0) == []
    t = make_turn(a, "alice", [{"role": "user", "content": "a"}], asst("A"))
    assert table.complete(a, t, False, 3.0) == [FinishedTurn(t, None, turns.SHUTDOWN, 3.0)]
    assert len(table) == 0 and table.pending_count == 0


def test_complete_rejects_foreign_turn():
    table = make_table()
    a = table.begin("alice", None, [{"role": "user", "content": "a"}], 1.0)
    b = table.begin("alice", None, [{"role": "user", "content": "b"}], 1.0)
    with pytest.raises(ValueError):
        table.complete(a, make_turn(b, "alice", [], asst("x")), False, 2.0)


def test_cancel_adds_nothing_and_retry_takes_same_index():
    table = make_table()
    m1 = [{"role": "user", "content": "q1"}]
    _, t1, _, _ = serve(table, m1, asst("a1"), 1.0)
    m2 = m1 + [asst("a1"), {"role": "user", "content": "q2"}]
    a2 = table.begin("alice", None, m2, 2.0)
    assert a2.finished == [FinishedTurn(t1, m2[2:], None, 2.0)]
    table.cancel(a2, 3.0)
    assert table.pending_count == 0 and len(table) == 1
    retry = table.begin("alice", None, m2, 4.0)  # still continues the same session
    assert (retry.session_id, retry.turn_index, retry.finished) == ("s0", 1, [])
    table.cancel(retry, 5.0)
    # a cancelled first request leaves an empty session that expires quietly
    assert table.expire(105.5) == [] and len(table) == 0


def test_cancelled_regenerate_frees_the_index():
    table = make_table()
    m1 = [{"role": "user", "content": "q1"}]
    _, t1, _, _ = serve(table, m1, asst("a1"), 1.0)
    a = table.begin("alice", "s0", m1, 2.0)
    assert a.finished == [FinishedTurn(t1, None, turns.REGENERATED, 2.0)] and a.turn_index == 0
    table.cancel(a, 3.0)
    assert table.begin("alice", "s0", m1, 4.0).turn_index == 0


def test_sessions_beyond_max_bytes_close_least_recently_active_first():
    from types import SimpleNamespace
    from clawd.tokenizer import turn_bytes
    one = turn_bytes(make_turn(SimpleNamespace(session_id="s", turn_index=0), "alice", [{"role": "user", "content": "a"}], asst("A")))
    # messages 56 + 8 + 432, tools 32, reply 437, ids 3 * 36, log-probs 32
    assert one == 1105
    table = make_table(max_bytes=2 * one + 10)
    _, ta, _, ca = serve(table, [{"role": "user", "content": "a"}], asst("A"), 1.0)
    _, tb, _, cb = serve(table, [{"role": "user", "content": "b"}], asst("B"), 2.0)
    assert ca == cb == [] and table.retained_bytes == 2 * one
    x = table.begin("alice", None, [{"role": "user", "content": "x"}], 2.5)
    table.cancel(x, 2.5)  # idle, holding no turn: closing it would free nothing
    _, tc, _, cc = serve(table, [{"role": "user", "content": "c"}], asst("C"), 3.0)
    assert cc == [FinishedTurn(ta, None, turns.EVICTED, 3.0)]
    assert table.retained_bytes == 2 * one and table.evicted_for_bytes == 1 and len(table) == 3
    _, td, _, cd = serve(table, [{"role": "user", "content": "d"}], asst("D"), 4.0)
    assert cd == [FinishedTurn(tb, None, turns.EVICTED, 4.0)]  # x, older than c, stays
    assert sorted(k[1] for k in table._sessions) == ["s2", "s3", "s4"]
    # A pending turn that finishes gives its bytes back.
    nxt = [{"role": "user", "content": "c"}, asst("C"), {"role": "user", "content": "more"}]
    table.begin("alice", None, nxt, 5.0)
    assert table.retained_bytes == turn_bytes(td)
    table.close_all(6.0)
    assert table.retained_bytes == 0


def test_a_turn_larger_than_max_bytes_closes_its_own_session():
    table = make_table(max_bytes=1000)
    _, t, _, c = serve(table, [{"role": "user", "content": "a"}], asst("A"), 1.0)
    assert c == [FinishedTurn(t, None, turns.EVICTED, 1.0)]
    assert len(table) == 0 and table.retained_bytes == 0 and table.pending_count == 0


def test_hashes_tell_apart_what_json_would_and_never_fail_on_what_orjson_refuses():
    # The canonical form is encoded with orjson where it writes what `json` writes: a NaN (orjson: null) and a lone
    # surrogate (orjson: refused) take `json`'s spelling, so these messages neither collide nor raise.
    def args(value):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": value}}}]}
    nan, null = prefix_hashes("a", [args(float("nan"))]), prefix_hashes("a", [args(None)])
    assert nan[1] != null[1]
    lone = prefix_hashes("a", [{"role": "user", "content": "hi \ud800"}])
    assert lone[1] != prefix_hashes("a", [{"role": "user", "content": "hi"}])[1]
    assert prefix_hashes("a", [{"role": "user", "content": "hi \ud800"}]) == lone  # the same, every time
