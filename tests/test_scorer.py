"""The Scorer in-process with a scripted judge: every outcome counted, nothing stalls."""
import asyncio
import dataclasses
import json

import pytest

from clawd.config.loading import config_from_dict
from clawd.learning.journal import Journal
from clawd.scoring.judges import JudgeFailed
from clawd.records import RecordWriter
from clawd.learning.store import SampleStore
from clawd.scoring.scorer import Scorer
from clawd.scoring.teacher import TeacherScores
from clawd.turns import FinishedTurn, Turn


def _finished(i, next_state=True):
    turn = Turn(session_id=f"s{i}", turn_index=0, principal="p", request_id=f"r{i}", rid=f"rid{i}",
                prompt_ids=[1, 2, 3], response_ids=[4, 5], response_logprobs=[-0.5, -0.25], temperature=1.0,
                messages=[{"role": "user", "content": f"question {i}"}], tools=None,
                reply={"role": "assistant", "content": "answer"}, finish_reason="stop", policy_version=0,
                weight_version="0", created=0.0)
    return FinishedTurn(turn, [{"role": "user", "content": f"reply number {i}."}] if next_state else None,
                        None if next_state else "idle_timeout", 0.0)


class ScriptedJudge:
    """Answers by the number in the next state: a vote, garbage, a failure, or a hang until cancelled."""

    def __init__(self):
        self.hung = 0

    async def complete(self, messages):
        text = messages[-1]["content"]
        if "reply number 0." in text:
            return "Looks good. \\boxed{1}"
        if "reply number 1." in text:
            return "I cannot decide \\boxed{maybe}"
        if "reply number 2." in text:
            raise JudgeFailed("timeout", "slow judge, retries exhausted")
        if "reply number 3." in text:
            await asyncio.sleep(0.05)  # a slow vote that still arrives
            return "\\boxed{-1}"
        self.hung += 1
        await asyncio.Event().wait()  # never answers


@pytest.fixture
async def scorer(tmp_path):
    cfg = config_from_dict({"scoring": {"mode": "rl", "prm_m": 1}, "judge": {"backend": "sglang"}})
    store = SampleStore(Journal(tmp_path / "journal"))
    await store.replay()
    judge = ScriptedJudge()
    s = Scorer(cfg, tokenizer=None, judge=judge, teacher=None, store=store,
               records=RecordWriter(tmp_path / "records", kind="judge"))
    yield s, store, judge
    await store.journal.close()
    s.records.close()


async def test_every_outcome_is_counted_and_a_hung_judge_stalls_nothing(scorer):
    s, store, judge = scorer
    for i in range(5):
        s.submit(_finished(i))
    s.submit(_finished(9, next_state=False))
    async with asyncio.timeout(5):
        while s.stats.pending > 1:  # all but the hung one finish
            await asyncio.sleep(0.01)
    assert judge.hung == 1
    assert s.stats.emitted == 2 and store.waiting == 2
    assert sorted(smp.reward for smp in store._waiting) == [-1.0, 1.0]
    assert s.stats.excluded == {"judge_failed": 2, "idle_timeout": 1}
    assert s.stats.votes == {"+1": 1, "-1": 1, "failed": 2}
    await s.close(timeout=0.1)  # the hung one is cancelled and recorded
    assert s.stats.pending == 0 and s.stats.excluded["scoring_cancelled"] == 1


async def test_backlog_beyond_max_pending_is_excluded(tmp_path):
    cfg = config_from_dict({"scoring": {"mode": "rl", "max_pending": 2}, "judge": {"backend": "sglang"}})
    store = SampleStore(Journal(tmp_path / "journal"))
    await store.replay()
    s = Scorer(cfg, tokenizer=None, judge=ScriptedJudge(), teacher=None, store=store,
               records=RecordWriter(tmp_path / "records", kind="judge"))
    for i in (4, 5, 6):  # all three hang
        s.submit(_finished(i))
    assert s.stats.pending == 2 and s.stats.excluded == {"scoring_backlog": 1}
    await s.close(timeout=0.05)
    await store.journal.close()
    s.records.close()


class FixedTeacher:
    """The teacher's interface: a log-prob per response token."""

    async def logprobs(self, prompt_ids, response_ids, **_):
        return [-0.1] * len(response_ids)

    async def scores(self, prompt_ids, response_ids, top_ids=None, **_):
        return TeacherScores(await self.logprobs(prompt_ids, response_ids), None)


async def test_rules_judge_counts_the_hints_it_offers_and_accepts_like_a_hint_judge(tiny_model, tmp_path):
    """With the rules judge in combine mode, a correction's hint is both offered and accepted (the rules'
    hint vote is +1 when the next state holds a hint, as a hint judge's would be); thanks offer none."""
    from clawd.tokenizer import ChatTokenizer
    cfg = config_from_dict({"scoring": {"mode": "combine"}, "judge": {"backend": "rules"}})
    store = SampleStore(Journal(tmp_path / "journal"))
    await store.replay()
    s = Scorer(cfg, tokenizer=ChatTokenizer(tiny_model), judge=None, teacher=FixedTeacher(), store=store,
               records=RecordWriter(tmp_path / "records", kind="judge"))
    correction, thanks = _finished(0), _finished(1)
    correction.next_state[0]["content"] = "No, that is wrong. Please answer in one short sentence."
    thanks.next_state[0]["content"] = "Thanks, that helps!"
    s.submit(correction)
    s.submit(thanks)
    async with asyncio.timeout(10):
        while s.stats.pending:
            await asyncio.sleep(0.01)
    assert s.stats.hints_offered == 1 and s.stats.hints_accepted == 1
    assert s.stats.votes == {"-1": 1, "+1": 1} and s.stats.emitted == 2
    await s.close(timeout=1)
    await store.journal.close()
    s.records.close()


async def test_backlog_beyond_max_pending_bytes_is_excluded_and_released(tmp_path):
    from clawd.tokenizer import turn_bytes
    size = turn_bytes(_finished(4).turn)
    # messages 56 + 8 + 441, tools 32, reply 442, ids 5 * 36, log-probs 2 * 32
    assert size == 1223
    cfg = config_from_dict({"scoring": {"mode": "rl", "max_pending_bytes": 2 * size + 1},
                            "judge": {"backend": "sglang"}})
    store = SampleStore(Journal(tmp_path / "journal"))
    await store.replay()
    s = Scorer(cfg, tokenizer=None, judge=ScriptedJudge(), teacher=None, store=store,
               records=RecordWriter(tmp_path / "records", kind="judge"))
    s.submit(_finished(4))  # hangs
    s.submit(_finished(0))  # answers at once
    s.submit(_finished(5))  # would take the backlog over its bytes
    assert s.stats.pending == 2 and s.stats.pending_bytes == 2 * size
    assert s.stats.excluded == {"scoring_backlog": 1}
    async with asyncio.timeout(5):
        while s.stats.pending > 1:
            await asyncio.sleep(0.01)
    assert s.stats.pending_bytes == size and s.stats.emitted == 1  # the answered turn gave its bytes back
    s.submit(_finished(6))  # fits again
    assert s.stats.pending == 2 and s.stats.pending_bytes == 2 * size
    await s.close(timeout=0.05)  # the hung ones are cancelled: their bytes come back too
    assert s.stats.pending == 0 and s.stats.pending_bytes == 0
    assert s.stats.excluded == {"scoring_backlog": 1, "scoring_cancelled": 2}
    await store.journal.close()
    s.records.close()


class HintJudge:
    """A hint judge whose m votes offer three different hints."""

    HINTS = ("Name the capital: Rome.", "Say it is Rome, in Italy, the capital city.", "Answer: Rome.")

    def __init__(self):
        self.calls = 0

    async def complete(self, messages):
        self.calls += 1
        return f"\\boxed{{1}}\n[HINT_START]{self.HINTS[(self.calls - 1) % 3]}[HINT_END]"


class OverlapTeacher:
    """The teacher's interface with top-k rows: the overlap its top-k would have with the student's under each
    hint is scripted (the first hint's is the largest, though the second is longer);
    it fails under the third when asked to."""

    def __init__(self, tok, fail_third=False):
        self.tok, self.fail_third, self.asked = tok, fail_third, []

    async def scores(self, prompt_ids, response_ids, top_ids=None, *, with_overlap=False, **_):
        text = self.tok.decode(prompt_ids)
        hint = next(i for i, h in enumerate(HintJudge.HINTS) if h in text)
        self.asked.append((hint, with_overlap))
        if hint == 2 and self.fail_third:
            raise JudgeFailed("timeout", "slow teacher")
        return TeacherScores([-0.1 * (hint + 1)] * len(response_ids), [[-1.0] * len(r) for r in top_ids],
                             (5, 3, 4)[hint] if with_overlap else None)


@pytest.mark.parametrize("fail_third", [False, True])
async def test_the_hint_whose_teacher_overlaps_the_students_top_k_most_is_kept(tiny_model, tmp_path, fail_third):
    """Top-K distillation with a model judge that offers several hints: each is scored, the one under which the
    teacher's top-k overlaps the student's most is the sample's (the longest first among equal ones), and the
    judge record lists every candidate's overlap (None for one the teacher could not score)."""
    from clawd.tokenizer import ChatTokenizer
    tok = ChatTokenizer(tiny_model)
    cfg = config_from_dict({"scoring": {"mode": "opd", "prm_m": 3}, "judge": {"backend": "sglang"},
                            "train": {"loss": {"opd_top_k": 2}}})
    store = SampleStore(Journal(tmp_path / "journal"))
    await store.replay()
    teacher = OverlapTeacher(tok, fail_third)
    s = Scorer(cfg, tokenizer=tok, judge=HintJudge(), teacher=teacher, store=store,
               records=RecordWriter(tmp_path / "records", kind="judge"))
    finished = _finished(0)
    finished = FinishedTurn(dataclasses.replace(finished.turn, response_top_ids=[[4, 7], [5, 9]]), finished.next_state,
                            None, 0.0)
    s.submit(finished)
    async with asyncio.timeout(10):
        while s.stats.pending:
            await asyncio.sleep(0.01)
    await s.close(timeout=1)
    (sample,) = store._waiting
    assert sample.teacher_logprobs == [-0.1, -0.1] and sample.top_ids == [[4, 7], [5, 9]]  # the first hint's
    assert sorted(teacher.asked) == [(0, True), (1, True), (2, True)]
    s.records.close()
    await store.journal.close()
    (rec,) = [json.loads(line) for path in sorted((tmp_path / "records").glob("judge-*.jsonl"))
              for line in path.read_text().splitlines()]
    assert rec["hint"] == HintJudge.HINTS[0] and rec["emitted"]
    # candidate_hints' order: the longest first
    assert rec["hint_overlaps"] == ([3, 5, 4] if not fail_third else [3, 5, None])
