"""Explicit feedback in the Scorer, in-process: a rating joins or replaces the judge, trains a turn the judge
cannot score, gives the teacher its hint, and counts toward the judge's calibration."""
from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from clawd.config.loading import config_from_dict
from clawd.learning.journal import Journal
from clawd.learning.store import SampleStore
from clawd.records import RecordWriter
from clawd.scoring.feedback import LATE, PENDING, Rating
from clawd.scoring.judges import JudgeFailed
from clawd.scoring.scorer import Scorer
from clawd.scoring.teacher import TeacherScores
from clawd.turns import FinishedTurn, Turn


def _finished(i, next_state="Thanks!", principal="alice"):
    turn = Turn(session_id=f"s{i}", turn_index=0, principal=principal, request_id=f"chatcmpl-{i}", rid=str(i),
                prompt_ids=[1, 2, 3], response_ids=[4, 5], response_logprobs=[-0.5, -0.25], temperature=1.0,
                messages=[{"role": "user", "content": f"question {i}"}], tools=None,
                reply={"role": "assistant", "content": "answer"}, finish_reason="stop", policy_version=3,
                weight_version="3", created=0.0)
    return FinishedTurn(turn, [{"role": "user", "content": next_state}] if next_state else None,
                        None if next_state else "session_done", 0.0)


class Judge:
    """+1 for "Thanks!", fails for "judge down", waits for `release` on "slow"."""

    def __init__(self):
        self.asked, self.release = 0, asyncio.Event()

    async def complete(self, messages):
        self.asked += 1
        text = messages[-1]["content"]
        if "judge down" in text:
            raise JudgeFailed("connection", "refused")
        if "slow" in text:
            await self.release.wait()
            return "\\boxed{1}"
        return "Looks good. \\boxed{1}"


class HintTeacher:
    def __init__(self, tok):
        self.tok, self.prompts = tok, []

    async def scores(self, prompt_ids, response_ids, top_ids=None, **_):
        self.prompts.append(self.tok.decode(prompt_ids))
        return TeacherScores([-0.2] * len(response_ids), None)


async def _scorer(tmp_path, mode="rl", ratings="replace", teacher=None, tok=None):
    cfg = config_from_dict({"scoring": {"mode": mode}, "judge": {"backend": "sglang", "teacher_engine": "policy"},
                            "feedback": {"ratings": ratings, "min_pairs": 1, "alarm_below": 0.9}})
    store = SampleStore(Journal(tmp_path / "journal"))
    await store.replay()
    judge = Judge()
    s = Scorer(cfg, tokenizer=tok, judge=judge, teacher=teacher, store=store,
               records=RecordWriter(tmp_path / "records", kind="judge"))
    return s, store, judge


def _serve(s, finished):
    t = finished.turn
    s.ratings.served(t.request_id, principal=t.principal, version=t.policy_version, session_id=t.session_id,
                     turn_index=t.turn_index, excluded=t.excluded)


def _rate(s, i, value, text=None, principal="alice"):
    return s.ratings.rate(Rating(principal, f"chatcmpl-{i}", value, text, 1.0))[0]


async def _settle(s):
    async with asyncio.timeout(10):
        while s.stats.pending:
            await asyncio.sleep(0.01)


async def _close(s, store, tmp_path):
    await s.close(timeout=1)
    await store.journal.close()
    s.records.close()
    return [json.loads(line) for path in sorted((tmp_path / "records").glob("judge-*.jsonl"))
            for line in path.read_text().splitlines()]


async def test_with_the_judge_down_a_rated_turn_trains_on_the_rating_alone(tmp_path):
    s, store, judge = await _scorer(tmp_path)
    rated, unrated = _finished(0, "judge down"), _finished(1, "judge down")
    for f in (rated, unrated):
        _serve(s, f)
    assert _rate(s, 0, -1) == PENDING
    s.submit(rated)
    s.submit(unrated)
    await _settle(s)
    assert [smp.reward for smp in store._waiting] == [-1.0]
    assert s.stats.excluded == {"judge_failed": 1} and s.ratings.stats.alone == 1
    # the judge gave no verdict: a "none" pair, outside the agreement
    assert s.ratings.calibration.overall.counts["none"] == {"+1": 0, "-1": 1}
    records = await _close(s, store, tmp_path)
    by_session = {r["session_id"]: r for r in records}
    assert by_session["s0"]["rating"] == -1 and by_session["s0"]["votes"] == [None] and by_session["s0"]["emitted"]
    assert "rating" not in by_session["s1"]


async def test_a_turn_nothing_followed_trains_only_when_rated_and_no_judge_is_asked(tmp_path):
    s, store, judge = await _scorer(tmp_path)
    rated, unrated = _finished(0, next_state=None), _finished(1, next_state=None)
    for f in (rated, unrated):
        _serve(s, f)
    _rate(s, 0, 1)
    s.submit(rated)
    s.submit(unrated)
    await _settle(s)
    assert [smp.reward for smp in store._waiting] == [1.0] and judge.asked == 0
    assert s.stats.excluded == {"session_done": 1} and s.ratings.calibration.overall.pairs == 0
    assert _rate(s, 1, 1) == LATE  # its turn was decided (excluded): recorded, not trained
    await _close(s, store, tmp_path)


@pytest.mark.parametrize("policy,reward", [("replace", -1.0), ("join", None)])
async def test_replace_overrules_the_judge_and_join_ties_it(tmp_path, policy, reward):
    s, store, judge = await _scorer(tmp_path, ratings=policy)
    f = _finished(0)
    _serve(s, f)
    _rate(s, 0, -1)
    s.submit(f)
    await _settle(s)
    assert [smp.reward for smp in store._waiting] == ([] if reward is None else [reward])
    if reward is None:
        assert s.stats.excluded == {"score_zero": 1}
    # the judge said +1, the user -1: a disagreement, and (min_pairs 1, below 0.9) an alarm
    assert s.ratings.calibration.overall.counts["+1"] == {"+1": 0, "-1": 1}
    assert [a["scope"] for a in s.ratings.calibration.alarms()] == ["all", "version", "principal"]
    await _close(s, store, tmp_path)


async def test_a_rating_that_arrives_while_the_judge_thinks_counts_and_one_after_is_late(tmp_path):
    s, store, judge = await _scorer(tmp_path)
    f = _finished(0, "slow")
    _serve(s, f)
    s.submit(f)
    await asyncio.sleep(0.05)
    assert _rate(s, 0, -1) == PENDING
    judge.release.set()
    await _settle(s)
    assert [smp.reward for smp in store._waiting] == [-1.0]
    assert _rate(s, 0, 1) == LATE
    assert s.ratings.calibration.overall.counts["+1"] == {"+1": 1, "-1": 1}  # the late one is a pair too
    assert [smp.reward for smp in store._waiting] == [-1.0]
    await _close(s, store, tmp_path)


async def test_the_ratings_text_is_the_hint_the_teacher_reads(tiny_model, tmp_path):
    from clawd.tokenizer import ChatTokenizer
    tok = ChatTokenizer(tiny_model)
    teacher = HintTeacher(tok)
    s, store, judge = await _scorer(tmp_path, mode="combine", teacher=teacher, tok=tok)
    f = _finished(0, next_state=None)
    f = dataclasses.replace(f, turn=dataclasses.replace(f.turn, messages=[{"role": "user", "content": "Capital?"}]))
    _serve(s, f)
    _rate(s, 0, -1, "No, that's wrong: the capital of Italy is Rome.")
    s.submit(f)
    await _settle(s)
    (sample,) = store._waiting
    assert sample.reward == -1.0 and sample.has_hint and sample.teacher_logprobs == [-0.2, -0.2]
    (prompt,) = teacher.prompts
    assert "the capital of Italy is Rome." in prompt and "that's wrong" not in prompt
    (record,) = await _close(s, store, tmp_path)
    assert record["hint"] == "the capital of Italy is Rome." and record["reason"] == "opd+rl"


async def test_a_paused_or_excluded_turn_leaves_its_rating_unused(tmp_path):
    s, store, judge = await _scorer(tmp_path)
    f = _finished(0)
    f = dataclasses.replace(f, turn=dataclasses.replace(f.turn, excluded="consent"))  # privacy's verdict
    _serve(s, _finished(0))  # at serve time it looked trainable
    _rate(s, 0, -1)
    s.submit(f)
    await _settle(s)
    assert store._waiting == [] and s.ratings.stats.unused == 1 and judge.asked == 0
    assert s.ratings.rate(Rating("alice", "chatcmpl-0", 1, None, 2.0))[0] == "not_trainable"
    await _close(s, store, tmp_path)
