"""Behaviour monitors (clawd/safety/monitors.py): exact summaries of hand-written traffic, each drift rule
just past and just under its threshold, the minimums, refusals, tool-call errors, bounded memory, and a
collapse into one template that rolls back, with a healthy version as the negative control."""
from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from clawd.safety.degeneration import summarise
from clawd.safety.monitors import (MONITORS, TEXT_CHARS, TEXTS_KEPT, Alarm, Monitors, Tally, drift, is_refusal,
                                   tool_call_error, worst)
from clawd.config.monitors import DEFAULT_RULES, MonitorRule, MonitorsConfig
from clawd.turns import FinishedTurn, Turn

RULES = MonitorsConfig().rules()
ENOUGH = {"replies": 30, "tool_turns": 30, "judgements": 30, "steps": 1, "kl_steps": 1, "entropy_steps": 1}
TOOLS = [{"type": "function", "function": {"name": "search", "description": "", "parameters": {}}}]


_SESSIONS = itertools.count()


def _record(text, *, version=1, ids=5, finish="stop", tools=None, calls=None, session=None):
    """A turn record; each in a session of its own unless `session` says which."""
    reply = {"role": "assistant", "content": text}
    if calls is not None:
        reply["tool_calls"] = calls
    session = f"s{next(_SESSIONS)}" if session is None else session
    turn = Turn(session_id=session, turn_index=0, principal="p", request_id="r", rid="r", prompt_ids=[1],
                response_ids=list(range(ids)), response_logprobs=[0.0] * ids, temperature=0.7, messages=[],
                tools=tools, reply=reply, finish_reason=finish, policy_version=version, weight_version="w",
                created=0.0)
    return FinishedTurn(turn, None, "session_done", 1.0).to_record()


def _call(name="search", arguments='{"q": "x"}'):
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_monitors_table_matches_the_config():
    assert list(MONITORS) == list(RULES) == list(DEFAULT_RULES)
    rises = {"empty_share", "one_word_share", "repeated_opening_share", "top_reply_share", "refusal_share",
             "tool_error_share", "hint_share", "kl"}
    assert {n for n, m in MONITORS.items() if m.kind == "rise"} == rises
    assert {n for n, m in MONITORS.items() if m.kind == "keeps"} == {"distinct_2", "entropy"}
    assert MONITORS["mean_words"].kind == "moves" and MONITORS["reward_mean"].kind == "fall"


def test_summary_exact_values():
    t = Tally()
    for text in ["The cat sat.", "The cat sat.", "", "Dogs.", "I'm sorry, but I can't help with that."]:
        t.add_turn(text, finish_reason="stop", response_tokens=5, tools_offered=False, tool_error=None)
    t.add_turn("You", finish_reason="length", response_tokens=1, tools_offered=False, tool_error=None)  # not a reply
    t.add_turn(None, finish_reason="tool_calls", response_tokens=9, tools_offered=True, tool_error=False)
    t.add_turn(None, finish_reason="tool_calls", response_tokens=9, tools_offered=True, tool_error=False)
    t.add_turn(None, finish_reason="tool_calls", response_tokens=9, tools_offered=True, tool_error=False)
    t.add_turn(None, finish_reason="tool_calls", response_tokens=9, tools_offered=True, tool_error=True)
    for reward, hint in [(1.0, False), (0.5, True), (-0.25, False), (math.nan, True)]:  # NaN: left out
        t.add_judgement(reward, hint)
    for metrics in [{"loss_kl": 0.1, "entropy": 2.0}, {"entropy": 1.0, "loss_kl": math.nan}, {"skipped": True}]:
        t.add_step(metrics)
    s = t.summary()
    assert s == {
        "mean_words": 3.0,                  # (3 + 3 + 0 + 1 + 8) / 5
        "empty_share": 0.2,                 # "" of 5
        "one_word_share": 0.4,              # "" and "Dogs."
        "repeated_opening_share": 0.4,      # "the cat sat" twice
        "top_reply_share": 0.4,             # "the cat sat" twice
        "distinct_2": 0.8182,               # bigrams: 2 + 2 + 7 = 11, distinct 2 + 7 = 9
        "refusal_share": 0.2,               # the fifth
        "tool_error_share": 0.25,           # 1 of 4 tool turns
        "reward_mean": 0.4167,              # 1.25 / 3
        "hint_share": 0.3333,               # 1 of 3
        "kl": 0.1,                          # one step had it
        "entropy": 1.5,                     # (2 + 1) / 2
        "replies": 5, "judgements": 3, "steps": 3,
        "window": 5, "turns": 10, "skipped": 1, "tool_turns": 4, "kl_steps": 1, "entropy_steps": 2,
        "top_openings": [["the cat sat", 2]], "top_replies": [["the cat sat", 2]],
    }
    assert json.loads(json.dumps(s)) == s


def test_empty_tally_measures_nothing():
    s = Tally().summary()
    assert all(s[name] is None for name in MONITORS)
    assert (s["replies"], s["judgements"], s["steps"]) == (0, 0, 0)


def test_pooled_is_raw_not_an_average_of_summaries():
    a, b = Tally(), Tally()
    for _ in range(3):
        a.add_turn("", finish_reason="stop", response_tokens=2, tools_offered=False, tool_error=None)
    b.add_turn("Paris is the capital.", finish_reason="stop", response_tokens=5, tools_offered=False, tool_error=None)
    a.add_judgement(1.0, False)
    for r in (0.0, 0.0, 0.0):
        b.add_judgement(r, True)
    p = Tally.pooled([a, b]).summary()
    assert p["empty_share"] == 0.75 and p["replies"] == 4      # an average of summaries would say 0.5
    assert p["reward_mean"] == 0.25 and p["hint_share"] == 0.75
    assert Tally.pooled([]).summary()["replies"] == 0


def _pair(name, now, base):
    return {**ENOUGH, name: now}, {**ENOUGH, name: base}


# (baseline, a value just past the threshold, one just under it) for each monitor at its default threshold.
def _cases():
    for name, m in MONITORS.items():
        t = DEFAULT_RULES[name][1]
        if m.kind == "rise":
            yield name, 0.05, 0.05 + t + 0.0001, 0.05 + t - 0.0001
        elif m.kind == "fall":
            yield name, 0.4, 0.4 - t - 0.0001, 0.4 - t + 0.0001
        elif m.kind == "keeps":
            yield name, 0.8, 0.8 * (1 - t) - 0.0001, 0.8 * (1 - t) + 0.0001
        else:  # moves: either way
            yield name, 10.0, 10.0 * (1 + t) + 0.01, 10.0 * (1 + t) - 0.01
            yield name, 10.0, 10.0 * (1 - t) - 0.01, 10.0 * (1 - t) + 0.01


@pytest.mark.parametrize("name,base,past,under", list(_cases()))
def test_each_rule_fires_just_past_its_threshold_only(name, base, past, under):
    alarms = drift(*_pair(name, past, base), RULES, 24)
    assert [(a.monitor, a.action, a.value, a.baseline, a.threshold) for a in alarms] == \
        [(name, DEFAULT_RULES[name][0], past, base, DEFAULT_RULES[name][1])]
    assert drift(*_pair(name, under, base), RULES, 24) == []
    assert drift(*_pair(name, base, base), RULES, 24) == []


def test_exactly_at_the_threshold_is_not_past_it():
    assert drift(*_pair("top_reply_share", 0.3, 0.1), RULES, 24) == []   # 0.3 - 0.1 is 0.19999999999999998
    assert drift(*_pair("distinct_2", 0.4, 0.8), RULES, 24) == []
    assert drift(*_pair("mean_words", 15.0, 10.0), RULES, 24) == []


def test_detail_lines():
    def detail(name, now, base):
        [alarm] = drift(*_pair(name, now, base), RULES, 24)
        return alarm.detail
    assert detail("one_word_share", 0.62, 0.04) == "one_word_share 4% -> 62%: rose by more than 20 points"
    assert detail("mean_words", 3.1, 12.5) == "mean_words 12.50 -> 3.10: moved by more than 50% of the baseline's"
    assert detail("distinct_2", 0.05, 0.82) == "distinct_2 0.82 -> 0.05: under 50% of the baseline's"
    assert detail("reward_mean", -0.3, 0.4) == "reward_mean 0.40 -> -0.30: fell by more than 0.5"
    assert detail("kl", 1.5, 0.1) == "kl 0.10 nats -> 1.50 nats: rose by more than 1"


def test_off_never_fires_and_configured_rules_apply():
    now = {**ENOUGH, **{n: 100.0 for n in MONITORS}, "reward_mean": -100.0, "distinct_2": 0.0, "entropy": 0.0}
    base = {**ENOUGH, **{n: 1.0 for n in MONITORS}, "reward_mean": 1.0}
    assert len(drift(now, base, RULES, 24)) == len(MONITORS)
    off = {n: MonitorRule("off", 0.5) for n in MONITORS}
    assert drift(now, base, off, 24) == []
    cfg = MonitorsConfig(one_word_share=MonitorRule("halt", 0.5), empty_share=MonitorRule("off"))
    rules = cfg.rules()
    assert drift(*_pair("one_word_share", 0.5, 0.05), rules, 24) == []   # 45 points: under the 50 configured
    [a] = drift(*_pair("one_word_share", 0.6, 0.05), rules, 24)
    assert (a.action, a.threshold) == ("halt", 0.5)
    assert drift(*_pair("empty_share", 1.0, 0.0), rules, 24) == []
    # A monitor missing from the rules keeps its default: the net stays on.
    assert [a.monitor for a in drift(*_pair("empty_share", 1.0, 0.0), {}, 24)] == ["empty_share"]


@pytest.mark.parametrize("count,names", [
    ("replies", ["one_word_share", "refusal_share", "mean_words"]),
    ("tool_turns", ["tool_error_share"]),
    ("judgements", ["reward_mean", "hint_share"]),
])
def test_min_replies_on_either_side(count, names):
    for name in names:
        now, baseline = _pair(name, *{"mean_words": (30.0, 10.0), "reward_mean": (-0.9, 0.0)}.get(name, (0.9, 0.0)))
        assert len(drift(now, baseline, RULES, 24)) == 1
        assert drift({**now, count: 23}, baseline, RULES, 24) == []
        assert drift(now, {**baseline, count: 23}, RULES, 24) == []
        assert len(drift({**now, count: 24}, {**baseline, count: 24}, RULES, 24)) == 1


def test_steps_and_missing_values():
    now, base = _pair("kl", 5.0, 0.0)
    assert drift({**now, "kl_steps": 0}, base, RULES, 24) == []
    assert drift(now, {**base, "kl": None}, RULES, 24) == []
    now, base = _pair("entropy", 0.1, 2.0)
    assert drift(now, {**base, "entropy_steps": 0}, RULES, 24) == []
    assert drift(*_pair("entropy", 0.0, 0.0), RULES, 24) == []  # relative to nothing: no alarm


def test_worst():
    def alarm(action):
        return Alarm("kl", action, 1.0, 0.0, 0.5, "")
    assert worst([]) is None
    assert worst([alarm("alarm")]) == "alarm"
    assert worst([alarm("alarm"), alarm("rollback"), alarm("halt")]) == "rollback"
    assert worst(iter([alarm("halt"), alarm("alarm")])) == "halt"


@pytest.mark.parametrize("text", [
    "I can't help with that.", "Sorry, I can't do that.", "i cannot assist with this request",
    "I\u2019m sorry, but I won't answer.", "Thanks for asking, but I cannot provide that.",
    "As an AI language model, I have no opinions.", "Unfortunately I must decline.",
])
def test_refusals(text):
    assert is_refusal(text)


@pytest.mark.parametrize("text", [
    "Paris is the capital of France. I'm sorry, but I cannot say more.",  # answered first: the phrase is 7th word
    "Sorry for the wait! The answer is Paris.",
    "I can't be sure, but it is probably Jupiter.",
    "The answer is 42. Sorry if that was unclear.", "", "...",
])
def test_not_refusals(text):
    assert not is_refusal(text)


def test_tool_call_error():
    assert tool_call_error(_record("hi")) is None                                  # no tools offered
    assert tool_call_error(_record("hi", tools=[])) is None
    assert tool_call_error(_record("Paris.", tools=TOOLS)) is False                # answering in text is fine
    assert tool_call_error(_record(None, tools=TOOLS, calls=[_call()])) is False
    assert tool_call_error(_record(None, tools=TOOLS, calls=[_call(arguments="{}")])) is False
    # The parser leaves a malformed or unclosed block as text.
    assert tool_call_error(_record('<tool_call>{"name": search}</tool_call>', tools=TOOLS)) is True
    assert tool_call_error(_record('Let me look. <tool_call>{"name": "search"', tools=TOOLS)) is True
    assert tool_call_error(_record(None, tools=TOOLS, calls=[_call(name="delete_all")])) is True
    assert tool_call_error(_record(None, tools=TOOLS, calls=[_call(arguments='"just a string"')])) is True
    assert tool_call_error(_record(None, tools=TOOLS, calls=[_call(arguments="[1, 2]")])) is True
    assert tool_call_error(_record(None, tools=TOOLS, calls=[_call(arguments="{oops")])) is True
    assert tool_call_error(_record(None, tools=TOOLS, calls=[_call(), _call(name="nope")])) is True


def test_bounded_memory():
    t = Tally()
    for i in range(10_000):
        t.add_turn(f"reply {i}", finish_reason="stop", response_tokens=3, tools_offered=False, tool_error=None)
    assert len(t.texts) == TEXTS_KEPT == 512
    assert t.texts[-1] == "reply 9999" and t.replies == 10_000
    s = t.summary()
    assert (s["replies"], s["window"]) == (10_000, 512)
    long = Tally()
    reply = " ".join(["word"] * 5000)                      # 25,000 characters
    long.add_turn(reply, finish_reason="length", response_tokens=5000, tools_offered=False, tool_error=None)
    long.add_turn(" Short.", finish_reason="stop", response_tokens=2, tools_offered=False, tool_error=None)
    assert [len(x) for x in long.texts] == [TEXT_CHARS, 6]
    assert long.summary()["mean_words"] == 2500.5            # counted in full on arrival
    assert summarise(long.texts)["one_word_share"] == long.summary()["one_word_share"] == 0.5
    m = Monitors(MonitorsConfig())
    for v in range(100):
        m.observe_judgement(v, 0.0, False)
    assert list(m.snapshot()) == list(range(36, 100))       # the newest 64
    m.observe_judgement(36, 0.0, False)                     # observed again: now recent
    m.observe_judgement(100, 0.0, False)
    assert 36 in m.snapshot() and 37 not in m.snapshot() and len(m.snapshot()) == 64
    m.forget(36)
    m.forget(12345)                                         # unknown: nothing to forget
    assert 36 not in m.snapshot()


def _varied(seed, n=30):
    vocab = [f"w{i}" for i in range(80)]
    rng = random.Random(seed)
    return [" ".join(rng.sample(vocab, 6)).capitalize() + "." for _ in range(n)]


def _feed(m, version, texts):
    for i, text in enumerate(texts):
        m.observe_turn(version, _record(text, version=version))
        m.observe_judgement(version, 0.5, i % 4 == 0)
        m.observe_step(version, {"loss_kl": 0.05, "entropy": 1.2})


def test_collapse_into_one_template_rolls_back():
    m = Monitors(MonitorsConfig())
    _feed(m, 0, ["The answer is a planet."] * 30)  # an old bad version: not in the last three clean ones
    for v in (1, 2, 3):
        _feed(m, v, _varied(v))
    _feed(m, 4, ["The answer is a planet."] * 30)
    _feed(m, 5, _varied(5))
    clean = [0, 1, 2, 3]
    alarms = m.check(4, clean)
    assert {a.monitor: a.action for a in alarms} == {
        "repeated_opening_share": "rollback", "top_reply_share": "rollback", "distinct_2": "rollback"}
    assert worst(alarms) == "rollback"
    by = {a.monitor: a for a in alarms}
    assert (by["top_reply_share"].value, by["top_reply_share"].baseline) == (1.0, 0.0)
    assert by["top_reply_share"].detail == "top_reply_share 0% -> 100%: rose by more than 20 points"
    assert m.check(5, clean) == []                      # a healthy version: no alarm
    # 3's baseline is 0, 1, 2 (never itself), so the bad 0 is in it: 3 is no worse, so it stays quiet.
    assert m.baseline(3, clean).summary()["replies"] == 90 and m.check(3, clean) == []
    assert m.check(99, clean) == []                     # no traffic yet
    assert Monitors(MonitorsConfig(enabled=False)).check(4, clean) == []
    few = Monitors(MonitorsConfig(min_replies=31))
    for v, texts in ((1, _varied(1)), (4, ["The answer is a planet."] * 30)):
        _feed(few, v, texts)
    assert few.check(4, [1]) == []                      # 30 replies: under the minimum


def test_a_burst_of_retries_is_not_a_template():
    # Each session asks its question again after a correction and gets the same opening: within a session
    # that is consistency. Counted across replies it read as a template and rolled back v0's own weights.
    m = Monitors(MonitorsConfig())
    _feed(m, 0, _varied(0))
    tails = iter(_varied(1))
    retries = [f"A {animal} {sound}s, {next(tails).lower()}" for animal, sound in
               (("rooster", "crow"), ("cow", "moo"), ("duck", "quack"), ("owl", "hoot"), ("lion", "roar"),
                ("horse", "neigh"), ("sheep", "baa"), ("dog", "bark"), ("cat", "meow"), ("snake", "hiss"))
               for _ in range(3)]
    for i, text in enumerate(retries):
        m.observe_turn(1, _record(text, version=1, session=f"retried{i // 3}"))
        m.observe_judgement(1, 0.5, False)
    now = m.snapshot_of(1)
    assert now["replies"] == 30 and now["repeated_opening_share"] == 0.0 and now["top_openings"] == []
    assert m.check(1, [0]) == []
    # the same replies, each in a session of its own: thirty openings shared in threes, a template
    _feed(m, 2, retries)
    assert {a.monitor: a.action for a in m.check(2, [0])} == {"repeated_opening_share": "rollback"}


def test_observe_turn_reads_records():
    m = Monitors(MonitorsConfig())
    m.observe_turn(7, _record("You", ids=1, finish="length"))                       # cut after one token
    m.observe_turn(7, _record("You", ids=1, finish="stop"))                         # an answer "You"
    m.observe_turn(7, _record(None, finish="tool_calls", tools=TOOLS, calls=[_call()]))
    m.observe_turn(7, _record('<tool_call>{"bad"}</tool_call>', tools=TOOLS))
    s = m.snapshot()[7]
    assert (s["turns"], s["skipped"], s["replies"], s["tool_turns"], s["tool_error_share"]) == (4, 1, 2, 2, 0.5)
    assert s["one_word_share"] == 0.5


def test_cached_summaries_follow_new_replies():
    m = Monitors(MonitorsConfig(min_replies=1))
    _feed(m, 1, ["Paris is the capital of France."])
    _feed(m, 2, ["Rome is the capital of Italy."])
    assert m.check(2, [1]) == []
    m.observe_turn(2, _record(""))                      # the version's own cache: now half empty
    assert [a.monitor for a in m.check(2, [1])] == ["empty_share", "one_word_share"]  # mean 3 words: 50%, not past
    assert m.snapshot()[2]["empty_share"] == 0.5
    for _ in range(3):                                  # the baseline's cache: now mostly empty too
        m.observe_turn(1, _record(""))
    assert m.baseline(2, [1]).summary()["empty_share"] == 0.75
    assert "empty_share" not in {a.monitor for a in m.check(2, [1])}
    m.forget(1)
    _feed(m, 1, ["Bern is the capital of Switzerland."])  # a new tally of the same version: not the old cache
    assert m.baseline(2, [1]).summary()["empty_share"] == 0.0


def test_a_forgotten_principals_texts_leave_every_tally_and_unrecorded_ones_are_never_kept():
    monitors = Monitors(MonitorsConfig(enabled=True))
    for version, principal, text in ((1, "alice", "Otters hold hands."), (1, "bob", "Seals sleep."),
                                     (2, "alice", "Otters again."), (2, "ghost", "Unrecorded words.")):
        monitors.observe_turn(version, {"principal": principal, "policy_version": version, "finish_reason": "stop",
                                        "response_ids": [1, 2, 3], "reply": {"role": "assistant", "content": text}},
                              keep_text=principal != "ghost")
    tallies = monitors._tallies
    assert list(tallies[2].texts) == ["Otters again."] and tallies[2].replies == 2  # ghost counted, not kept
    revision = tallies[1].text_revision
    assert monitors.forget_principal("alice") == 2
    assert (list(tallies[1].texts), list(tallies[1].owners), list(tallies[1].word_counts)) == (["Seals sleep."],
                                                                                               ["bob"], [2])
    assert list(tallies[2].texts) == [] and tallies[2].replies == 2  # counts stay: numbers, no words
    assert tallies[1].text_revision == revision + 1 and monitors.forget_principal("alice") == 0
    assert "Otters" not in json.dumps(monitors.snapshot())


def test_a_rollouts_score_is_not_a_judge_verdict():
    """reward_mean is the judge's mean over live turns: an active rollout's checker score (another scale, no
    user) is left out, so starting or stopping rollouts moves no monitor."""
    import dataclasses
    from tests.trainer_handlers import make_sample
    m = Monitors(MonitorsConfig())
    live = dataclasses.replace(make_sample(0), reward=-1.0, policy_version=3)
    rollout = dataclasses.replace(make_sample(1), source="env", reward=1.0, advantage=0.5, policy_version=3)
    m.observe_sample(live)
    m.observe_sample(rollout)
    tally = m._tally(3)
    assert (tally.judgements, tally.reward_sum) == (1, -1.0)
