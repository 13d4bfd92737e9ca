"""Explicit feedback, pure: the rating's effect on a decision, the registry's states, the judge's calibration,
the request's validation. Exact values throughout."""
from __future__ import annotations

import json

import pytest

from clawd.scoring.feedback import (LATE, NOT_TRAINABLE, PENDING, Calibration, Rating, Ratings, UnknownReply,
                                    feedback_hint, wilson, with_rating)
from clawd.serving.errors import ApiError
from clawd.serving.feedback import parse_feedback


def _rating(value, text=None, principal="alice", reply_id="chatcmpl-1"):
    return Rating(principal, reply_id, value, text, 10.0)


# --- the decision ---------------------------------------------------------------------------

def test_without_a_rating_the_judge_decides():
    assert with_rating("replace", (1, -1, -1), "judge hint here", None) == (-1, "judge hint here")
    assert with_rating("join", (None,), None, None) == (None, None)


def test_replace_makes_the_rating_the_vote_whatever_the_judge_said():
    assert with_rating("replace", (1, 1, 1), None, _rating(-1)) == (-1, None)
    assert with_rating("replace", (None, None), None, _rating(1)) == (1, None)  # the judge failed
    assert with_rating("replace", (), None, _rating(-1)) == (-1, None)          # nothing to judge


def test_join_counts_the_rating_as_one_more_vote():
    assert with_rating("join", (1,), None, _rating(-1)) == (0, None)        # a tie gives 0
    assert with_rating("join", (1, -1), None, _rating(-1)) == (-1, None)
    assert with_rating("join", (1, 1), None, _rating(-1)) == (1, None)      # outvoted
    assert with_rating("join", (None,), None, _rating(-1)) == (-1, None)    # the judge failed: the rating alone
    assert with_rating("join", (0,), None, _rating(1)) == (0, None)


def test_the_ratings_text_is_the_hint_when_it_gives_one():
    judge_hint = "Give the answer first."
    # the leading rejection goes; what corrects stays
    assert with_rating("replace", (1,), judge_hint, _rating(-1, "No, that's wrong: the capital of Italy is Rome.")) \
        == (-1, "the capital of Italy is Rome.")
    # a text with nothing that corrects (or too short) leaves the judge's hint
    assert with_rating("replace", (1,), judge_hint, _rating(-1, "That's wrong.")) == (-1, judge_hint)
    assert with_rating("join", (1,), judge_hint, _rating(1, "thanks")) == (1, judge_hint)
    # what moves on is cut, as from any hint
    assert feedback_hint("Please answer in under 5 words. Anyway, next question: Why?") \
        == "Please answer in under 5 words."
    assert feedback_hint(None) is None and feedback_hint("") is None


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError):
        with_rating("average", (1,), None, None)
    with pytest.raises(ValueError):
        Ratings(policy="average")


# --- calibration ----------------------------------------------------------------------------

def test_wilson_interval_exact():
    low, high = wilson(8, 10)
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    assert wilson(0, 5)[0] == 0.0 and wilson(5, 5)[1] == 1.0


def test_calibration_counts_pairs_and_agreement_over_the_judges_plus_minus_verdicts():
    cal = Calibration(min_pairs=3, alarm_below=0.6)
    for judge, rating in [(1, 1), (1, -1), (-1, -1), (0, 1), (None, -1), (1, 1)]:
        cal.add(2, "alice", judge, rating)
    cal.add(3, "bob", -1, 1)
    snap = cal.snapshot()
    assert snap["all"]["counts"] == {"+1": {"+1": 2, "-1": 1}, "0": {"+1": 1, "-1": 0}, "-1": {"+1": 1, "-1": 1},
                                     "none": {"+1": 0, "-1": 1}}
    assert snap["all"]["pairs"] == 7 and snap["all"]["judged"] == 5 and snap["all"]["agreed"] == 3
    assert snap["all"]["agreement"] == 0.6
    assert snap["versions"]["2"]["judged"] == 4 and snap["versions"]["2"]["agreement"] == 0.75
    assert snap["principals"]["bob"] == {**snap["principals"]["bob"], "judged": 1, "agreed": 0, "alarm": False}
    assert snap["alarms"] == []


def test_an_alarm_stands_only_while_the_interval_lies_wholly_below_the_threshold():
    raised = []
    cal = Calibration(min_pairs=10, alarm_below=0.7, on_alarm=raised.append)
    for _ in range(9):
        cal.add(1, "carol", 1, -1)  # the judge says good, the user says bad
    assert cal.alarms() == [] and raised == []  # fewer than min_pairs verdicts
    cal.add(1, "carol", 1, -1)
    scopes = [(a["scope"], a["key"]) for a in cal.alarms()]
    assert scopes == [("all", "all"), ("version", 1), ("principal", "carol")]
    assert [(a["scope"], a["key"]) for a in raised] == scopes and raised[0]["interval"] == [0.0, 0.2775]
    for _ in range(20):
        cal.add(1, "carol", -1, -1)  # agreement 20/30: the interval now reaches above 0.7
    assert cal.alarms() == []
    cal.forget("carol")
    assert "carol" not in cal.snapshot()["principals"] and cal.overall.pairs == 30


# --- the registry ---------------------------------------------------------------------------

def _served(ratings, reply_id="chatcmpl-1", principal="alice", excluded=None, version=4):
    ratings.served(reply_id, principal=principal, version=version, session_id="s1", turn_index=2, excluded=excluded)


def test_a_rating_waits_for_its_turn_and_the_latest_counts():
    r = Ratings()
    _served(r)
    assert r.rate(_rating(1)) == (PENDING, {"session_id": "s1", "turn_index": 2, "version": 4})
    assert r.rate(_rating(-1, "shorter please")) == (PENDING, {"session_id": "s1", "turn_index": 2, "version": 4})
    assert r.waiting("chatcmpl-1") and r.pending_of("alice") == [_rating(-1, "shorter please")]
    taken = r.take("chatcmpl-1")
    assert taken == _rating(-1, "shorter please") and r.take("chatcmpl-1") is None
    r.scored("chatcmpl-1", judged=True, judge=1, rating=taken)
    assert r.stats.trained == 1 and r.stats.alone == 0
    assert r.calibration.overall.counts["+1"]["-1"] == 1
    # after the decision: recorded and counted as late, a calibration pair all the same, never trained
    assert r.rate(_rating(1))[0] == LATE and not r.waiting("chatcmpl-1")
    assert r.calibration.overall.counts["+1"]["+1"] == 1
    assert r.stats.received == {PENDING: 2, LATE: 1, NOT_TRAINABLE: 0}


def test_a_reply_is_known_only_to_its_own_principal():
    r = Ratings()
    _served(r)
    with pytest.raises(UnknownReply):
        r.rate(_rating(1, principal="mallory"))
    with pytest.raises(UnknownReply):
        r.rate(_rating(1, reply_id="chatcmpl-never"))
    assert r.stats.unknown == 2 and not r.waiting("chatcmpl-1")


def test_turns_that_cannot_train_record_the_rating_only():
    r = Ratings()
    _served(r, excluded="no_train")
    assert r.rate(_rating(-1))[0] == NOT_TRAINABLE and not r.waiting("chatcmpl-1")
    _served(r, "chatcmpl-2")
    r.rate(_rating(-1, reply_id="chatcmpl-2"))
    r.passed_over("chatcmpl-2", "consent")  # privacy kept it out of training: the waiting rating is unused
    assert r.stats.unused == 1 and r.rate(_rating(-1, reply_id="chatcmpl-2"))[0] == NOT_TRAINABLE
    _served(r, "chatcmpl-3")
    r.passed_over("chatcmpl-3")  # learning paused: never scored
    assert r.rate(_rating(1, reply_id="chatcmpl-3"))[0] == LATE


def test_a_judgeless_decision_counts_the_rating_alone_and_makes_no_pair():
    r = Ratings()
    _served(r)
    r.rate(_rating(1))
    r.scored("chatcmpl-1", judged=False, judge=None, rating=r.take("chatcmpl-1"))
    assert (r.stats.trained, r.stats.alone, r.calibration.overall.pairs) == (1, 1, 0)
    _served(r, "chatcmpl-2")
    r.rate(_rating(-1, reply_id="chatcmpl-2"))
    r.scored("chatcmpl-2", judged=True, judge=None, rating=r.take("chatcmpl-2"))  # the judge failed
    assert (r.stats.trained, r.stats.alone) == (2, 2)
    assert r.calibration.overall.counts["none"]["-1"] == 1


def test_the_registry_is_bounded_and_forgets_a_principal():
    r = Ratings(max_replies=2)
    _served(r, "chatcmpl-1")
    r.rate(_rating(1))
    _served(r, "chatcmpl-2", principal="bob")
    _served(r, "chatcmpl-3")
    assert len(r) == 2 and r.stats.unused == 1  # the oldest went with its rating untrained
    with pytest.raises(UnknownReply):
        r.rate(_rating(1))
    assert r.forget("alice") == 1 and len(r) == 1
    with pytest.raises(UnknownReply):
        r.rate(_rating(1, reply_id="chatcmpl-3"))


# --- the request ----------------------------------------------------------------------------

def _body(**fields):
    return json.dumps(fields).encode()


def test_a_valid_request_parses():
    req = parse_feedback(_body(id="chatcmpl-abc", rating=-1, text="  too long  "), 100)
    assert (req.reply_id, req.rating, req.text, req.user) == ("chatcmpl-abc", -1, "too long", None)
    assert parse_feedback(_body(id="chatcmpl-abc", rating=1.0, text="  "), 100).text is None


@pytest.mark.parametrize("fields,param,code", [
    ({"rating": 1}, "id", "missing_required_parameter"),
    ({"id": "abc", "rating": 1}, "id", "invalid_value"),
    ({"id": 7, "rating": 1}, "id", "invalid_value"),
    ({"id": "chatcmpl-1"}, "rating", "missing_required_parameter"),
    ({"id": "chatcmpl-1", "rating": 0}, "rating", "invalid_value"),
    ({"id": "chatcmpl-1", "rating": True}, "rating", "invalid_value"),
    ({"id": "chatcmpl-1", "rating": "up"}, "rating", "invalid_value"),
    ({"id": "chatcmpl-1", "rating": 1, "text": 5}, "text", "invalid_type"),
    ({"id": "chatcmpl-1", "rating": 1, "text": "x" * 101}, "text", "text_too_long"),
    ({"id": "chatcmpl-1", "rating": 1, "score": 1}, "score", "unknown_parameter"),
    ({"id": "chatcmpl-1", "rating": 1, "user": []}, "user", "invalid_type"),
])
def test_bad_requests_are_400s_naming_the_field(fields, param, code):
    with pytest.raises(ApiError) as err:
        parse_feedback(_body(**fields), 100)
    assert (err.value.status, err.value.param, err.value.code) == (400, param, code)


@pytest.mark.parametrize("body", [b"", b"[1]", b"{", b'{"id": "chatcmpl-\\ud800", "rating": 1}'])
def test_bodies_that_are_not_json_objects_are_400s(body):
    with pytest.raises(ApiError) as err:
        parse_feedback(body, 100)
    assert err.value.status == 400 and err.value.code == "invalid_json"
