"""Scoring: a finished main turn becomes a training sample, or a recorded exclusion.

One task per finished turn (docs/ARCHITECTURE.md §2): judge votes (rl), hint votes
and teacher log-probs (opd), or both (combine), then the decision table of
`judging.decide`, then the sample store (journal first, queue second). Every
remote call is bounded by the judge client's timeout, retries and concurrency
limit; a failure excludes that turn, is counted, and never stalls another.
Each scored turn leaves one line in the judge records.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Protocol

from clawd import quoting
from clawd.scoring import judging, rules
from clawd.scoring.feedback import Rating, Ratings, with_rating
from clawd.config.schema import Config
from clawd.learning.journal import JournalError
from clawd.encoding import Encoder, encode_quoted
from clawd.scoring.judges import JudgeFailed, teacher_prompt
from clawd.scoring.teacher import Teacher, TeacherScores
from clawd.records import RecordWriter
from clawd.learning.store import SampleStore
from clawd.tokenizer import ChatTokenizer, TemplateError, turn_bytes
from clawd.turns import FinishedTurn, Turn

log = logging.getLogger("clawd.scoring")

SCORING_BACKLOG = "scoring_backlog"  # beyond scoring.max_pending turns or max_pending_bytes waiting
TEACHER_FAILED = "teacher_failed"    # the hint was accepted but the teacher could not score the response
JOURNAL_FAILED = "journal_failed"    # the sample could not be written: nothing was acknowledged
SCORING_CANCELLED = "scoring_cancelled"  # still being judged when shutdown's drain time ran out


def _calibration_alarm(alarm: dict) -> None:
    log.warning("judge calibration: the users' ratings confirm %.0f%% of the judge's verdicts in %s %s (95%% "
                "interval %s, %d verdicts rated): the judge may not read these users", 100 * alarm["agreement"],
                alarm["scope"], alarm["key"], alarm["interval"], alarm["judged"])


class Judge(Protocol):
    async def complete(self, messages: list[dict[str, Any]]) -> str: ...


@dataclass
class ScoringStats:
    submitted: int = 0
    emitted: int = 0
    pending: int = 0
    pending_bytes: int = 0  # turn_bytes of the turns pending (their messages wait whole for the judge)
    excluded: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)
    votes: dict[str, int] = field(default_factory=dict)   # "+1", "0", "-1", "failed"
    hints_offered: int = 0
    hints_accepted: int = 0
    reference_failed: int = 0  # samples kept without the reference's log-probs (out of the KL term)

    def exclude(self, reason: str) -> None:
        self.excluded[reason] = self.excluded.get(reason, 0) + 1


class Scorer:
    def __init__(self, cfg: Config, *, tokenizer: ChatTokenizer, judge: Judge | None, teacher: Teacher | None,
                 store: SampleStore, records: RecordWriter, spawn: Callable[[Coroutine], asyncio.Task] | None = None,
                 reference: Teacher | None = None, encoder: Encoder | None = None,
                 on_write_error: Callable[[OSError], None] | None = None,
                 judge_view: Callable[[Turn, list], tuple[Turn, list]] | None = None,
                 record_view: Callable[[dict], dict | None] | None = None):
        self.mode = cfg.scoring.mode
        self.m = cfg.scoring.prm_m
        self.at_least_one = cfg.scoring.at_least_one
        self.max_pending = cfg.scoring.max_pending
        self.max_pending_bytes = cfg.scoring.max_pending_bytes
        self.text_chars = cfg.judge.record_text_chars
        self.tok = tokenizer
        self.encoder = encoder      # teacher prompts of long turns are encoded there (clawd.encoding)
        self.judge = judge          # None: the rules judge
        self.teacher = teacher      # None in rl mode
        self.hint_placement = cfg.judge.hint_placement
        self.reference = reference  # the frozen reference, for the KL term's log-probs; None: not collected
        self.store = store
        self.records = records
        self.stats = ScoringStats()
        # Starts a scoring task: the daemon's TaskGroup.create_task, so one group owns every task (tests pass
        # None: the running loop's). The Scorer keeps the ones in flight to drain them at shutdown.
        self.spawn = spawn
        self.on_write_error = on_write_error  # a failed journal write: the disk budget
        self._tasks: dict[asyncio.Task, FinishedTurn] = {}  # turns being scored
        # Privacy (clawd.privacy.policy): what an external judge is shown of a turn, and what a judge record
        # keeps (None: no record). Unset: as they are.
        self.judge_view = judge_view
        self.record_view = record_view
        # Sessions that already gave a sample (rl's at-least-one rule); bounded, oldest forgotten.
        self._served_sessions: OrderedDict[tuple[str, str], None] = OrderedDict()
        # Users' explicit ratings of replies, waiting for their turns, and the judge's calibration against them.
        fb = cfg.feedback
        self.ratings = Ratings(policy=fb.ratings, max_replies=fb.max_replies, min_pairs=fb.min_pairs,
                               alarm_below=fb.alarm_below, on_alarm=_calibration_alarm)
        if self.mode != "rl" and teacher is None:
            raise ValueError(f"mode {self.mode} needs a teacher")

    def submit(self, finished: FinishedTurn) -> None:
        """Called for every finished main turn; never blocks."""
        self.stats.submitted += 1
        turn = finished.turn
        reason = turn.excluded or (finished.reason if finished.next_state is None else None)
        if finished.next_state is None and reason is None:
            reason = judging.NO_NEXT_STATE
        if reason is not None and turn.excluded is None and self.ratings.waiting(turn.request_id):
            reason = None  # nothing followed it for a judge to read, but its user rated it: that can train it
        size = turn_bytes(turn) if reason is None else 0
        # Over budget the turn is excluded, not cut: the judge and teacher prompts need its messages whole.
        if reason is None and (self.stats.pending >= self.max_pending
                               or self.stats.pending_bytes + size > self.max_pending_bytes):
            reason = SCORING_BACKLOG
        if reason is not None:
            self.ratings.passed_over(turn.request_id, turn.excluded)
            self._exclude(finished, reason)
            return
        self.stats.pending += 1
        self.stats.pending_bytes += size
        task = (self.spawn or asyncio.get_running_loop().create_task)(self._guarded(finished))
        self._tasks[task] = finished
        task.add_done_callback(self._forget_task)
        # A done callback, not a finally: it also runs for a task cancelled before it started.
        task.add_done_callback(lambda _task: self._release(size))

    async def _teacher_prompt(self, turn: Turn, hint: str) -> list[int]:
        return await encode_quoted(self.tok, *teacher_prompt(self.tok, turn, hint, self.hint_placement), self.encoder)

    def _forget_task(self, task: asyncio.Task) -> None:
        self._tasks.pop(task, None)

    def pending_of(self, principal: str) -> list[FinishedTurn]:
        """The principal's turns waiting for their judge (clawctl export)."""
        return [f for f in self._tasks.values() if f.turn.principal == principal]

    async def forget(self, principal: str) -> int:
        """Stop scoring the principal's turns (none becomes a sample); returns how many were being scored.
        Their judge records, the cancelled ones' included, are the records' to remove (clawctl forget)."""
        tasks = [t for t, f in self._tasks.items() if f.turn.principal == principal]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for key in [k for k in self._served_sessions if k[0] == principal]:
            del self._served_sessions[key]
        return len(tasks)

    def _release(self, size: int) -> None:
        self.stats.pending -= 1
        self.stats.pending_bytes -= size

    async def _guarded(self, finished: FinishedTurn) -> None:
        """A turn's scoring; a bug in it is counted and logged and never reaches the task group (which would
        stop the daemon)."""
        try:
            await self._score(finished)
        except Exception:
            self.stats.exclude("scoring_error")
            log.exception("scoring failed")

    async def close(self, timeout: float) -> None:
        """Let turns in scoring finish for up to `timeout` seconds, then cancel the rest
        (they were never acknowledged as samples; README: what survives a crash)."""
        if self._tasks:
            _, late = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in late:
                task.cancel()
            if late:
                log.warning("shutdown: %d turn(s) still being scored were dropped", len(late))
                await asyncio.wait(late)

    def _exclude(self, finished: FinishedTurn, reason: str) -> None:
        self.stats.exclude(reason)
        self._record({"session_id": finished.turn.session_id, "turn_index": finished.turn.turn_index,
                      "principal": finished.turn.principal, "mode": self.mode, "emitted": False,
                      "reason": reason, "sample_id": None})

    async def _score(self, finished: FinishedTurn) -> None:
        started = time.monotonic()
        turn = finished.turn
        try:
            outcome, raw, rating = await self._judge(finished)
        except asyncio.CancelledError:  # shutdown ran out of time: say so in the records
            self._exclude(finished, SCORING_CANCELLED)
            raise
        decision, scores, overlaps = outcome.decision, None, None
        if decision.emit and decision.has_hint:
            scores, decision, outcome, overlaps = await self._teacher(finished, outcome,
                                                                      user_hint=rating is not None and rating.text)
        reference = await self._reference(turn) if decision.emit and self.reference is not None else None
        sample_id = None
        if decision.emit:
            sample = judging.build_sample(turn, decision, scores and scores.logprobs, mode=self.mode,
                                          sample_id=secrets.token_hex(16), now=time.time(),
                                          teacher_top=scores and scores.top, reference_logprobs=reference)
            try:
                await self.store.put(sample)
            except JournalError as exc:
                log.error("session %s turn %d: the journal refused the sample: %s",
                          turn.session_id, turn.turn_index, exc)
                decision = judging.Decision(False, 0.0, False, JOURNAL_FAILED)
                if isinstance(exc, OSError) and self.on_write_error is not None:  # a full disk pauses learning
                    self.on_write_error(exc)
            else:
                sample_id = sample.sample_id
                self._served_sessions[(turn.principal, turn.session_id)] = None
                if len(self._served_sessions) > 100_000:
                    self._served_sessions.popitem(last=False)
        if decision.emit:
            self.stats.emitted += 1
            self.stats.kinds[decision.reason] = self.stats.kinds.get(decision.reason, 0) + 1
        else:
            self.stats.exclude(decision.reason)
        record = outcome.to_record()
        record.update(emitted=decision.emit, reason=decision.reason, has_hint=decision.has_hint,
                      reward=decision.reward, sample_id=sample_id, principal=turn.principal,
                      raw=[t[:self.text_chars] if t is not None else None for t in raw],
                      latency=round(time.monotonic() - started, 4))
        if overlaps is not None:  # the candidate hints' overlaps, in candidate_hints' order
            record["hint_overlaps"] = overlaps
        if rating is not None:  # the user's own rating decided it (the text's hint, if any, is `hint`)
            record["rating"] = rating.rating
        self._record(record)

    def _record(self, record: dict) -> None:
        """A judge record, as privacy lets it be kept (redacted; none for a key with record = false)."""
        if self.record_view is not None and (record := self.record_view(record)) is None:
            return
        self.records.write(record, time.time())

    async def _judge(self, finished: FinishedTurn) -> tuple[judging.Outcome, list[str | None], Rating | None]:
        """The judge's votes and hint, then the user's rating if one came (it is taken once the judge has
        answered, so one that arrives meanwhile counts), and the decision on both."""
        turn, next_state = finished.turn, finished.next_state
        wants_rl, wants_hint = self.mode in ("rl", "combine"), self.mode in ("opd", "combine")
        if next_state is None:  # only a rating brought it here: the judge has nothing to read
            votes, hint_votes, hint, raw = (), (), None, []
        elif self.judge is None:
            vote, rules_hint = rules.rules_vote(turn, next_state)
            votes = (vote,) if wants_rl else ()
            # As a hint judge would vote: +1 "the next state holds a hint", -1 "it does not".
            hint_votes = ((1 if rules_hint else -1, rules_hint),) if wants_hint else ()
            hint = rules_hint if wants_hint else None  # already length-checked by rules_vote
            raw = []
        else:
            if self.judge_view is not None:  # an external judge sees PII replaced ([privacy] redact_judge)
                turn, next_state = self.judge_view(turn, next_state)
            # Each prompt gets its own marker nonce (judging.py: prompt safety).
            rl_calls = [self._ask(judging.rl_judge_messages(turn, next_state, quoting.new_nonce()))
                        for _ in range(self.m if wants_rl else 0)]
            hint_calls = [self._ask(judging.hint_judge_messages(turn, next_state, quoting.new_nonce()))
                          for _ in range(self.m if wants_hint else 0)]
            raw = list(await asyncio.gather(*rl_calls, *hint_calls))
            rl_raw, hint_raw = raw[:len(rl_calls)], raw[len(rl_calls):]
            votes = tuple(judging.parse_vote(t) if t is not None else None for t in rl_raw)
            hint_votes = tuple(judging.parse_hint_vote(t) if t is not None else (None, None) for t in hint_raw)
            hint = judging.select_hint(hint_votes) if wants_hint else None
        for v in votes:
            key = {1: "+1", 0: "0", -1: "-1"}.get(v, "failed")
            self.stats.votes[key] = self.stats.votes.get(key, 0) + 1
        self.stats.hints_offered += sum(1 for v, h in hint_votes if v == 1 and h)
        self.stats.hints_accepted += hint is not None
        judged = wants_rl and next_state is not None
        rating = self.ratings.take(turn.request_id)
        rl_vote, hint = with_rating(self.ratings.policy, votes, hint, rating)
        rl_vote, hint = (rl_vote if wants_rl else None), (hint if wants_hint else None)
        self.ratings.scored(turn.request_id, judged=judged, judge=judging.majority(votes) if judged else None,
                            rating=rating)
        at_least_one = (self.at_least_one and self.mode == "rl"
                        and (turn.principal, turn.session_id) not in self._served_sessions)
        decision = judging.decide(self.mode, rl_vote=rl_vote, hint=hint, has_next_state=True,
                                  at_least_one_applies=at_least_one)
        outcome = judging.Outcome(session_id=turn.session_id, turn_index=turn.turn_index, mode=self.mode,
                                  judge="rules" if self.judge is None else "model", votes=votes,
                                  score=rl_vote, hint_votes=hint_votes, hint=hint, decision=decision)
        return outcome, raw, rating

    async def _ask(self, messages: list[dict[str, Any]]) -> str | None:
        """One judge call; a failure is a missing vote (the client counted it)."""
        try:
            return await self.judge.complete(messages)
        except JudgeFailed as exc:
            log.warning("judge call failed: %s", exc)
            return None

    async def _reference(self, turn: Turn) -> list[float] | None:
        """The frozen reference's log-probs of the response under the turn's own prompt (the KL term's). A
        failure keeps the sample without them: the trainer leaves it out of the KL term, nothing else."""
        try:
            return await self.reference.logprobs(list(turn.prompt_ids), list(turn.response_ids))
        except JudgeFailed as exc:
            self.stats.reference_failed += 1
            log.warning("session %s turn %d: reference log-probs failed: %s", turn.session_id, turn.turn_index, exc)
            return None

    async def _teacher(self, finished: FinishedTurn, outcome: judging.Outcome, *, user_hint: bool = False) \
            -> tuple[TeacherScores | None, judging.Decision, judging.Outcome, list[int | None] | None]:
        """The teacher's scores of the reply under the hint, the decision, the outcome (its hint the one chosen)
        and the candidates' overlaps. With the reply's top-k ids (top-K distillation) the teacher scores those
        too, and when a model judge offered several hints, each is scored and the one under which the teacher's
        top-k overlaps the student's most is kept (the upstream project's "sequence optimal" choice)."""
        turn = finished.turn
        tops, response = turn.response_top_ids, list(turn.response_ids)
        # A rating's text may be the hint (user_hint): then it is the one, whatever the judge offered.
        candidates = judging.candidate_hints(outcome.hint_votes) if tops and self.judge is not None else []
        if user_hint and outcome.hint not in candidates:
            candidates = []
        try:
            if len(candidates) < 2:
                # the hint cannot forge control tokens
                prompt = await self._teacher_prompt(turn, outcome.hint)
                return await self.teacher.scores(prompt, response, tops), outcome.decision, outcome, None
            prompts = [await self._teacher_prompt(turn, h) for h in candidates]
            tried = await asyncio.gather(*(self.teacher.scores(prompt, response, tops, with_overlap=True)
                                           for prompt in prompts), return_exceptions=True)
            for exc in tried:
                if isinstance(exc, BaseException) and not isinstance(exc, (JudgeFailed, TemplateError)):
                    raise exc
            overlaps = [None if isinstance(s, BaseException) else s.overlap for s in tried]
            scored = [i for i, o in enumerate(overlaps) if o is not None]
            if scored:
                best = max(scored, key=lambda i: overlaps[i])  # the first of equal overlaps: the longest hint
                return tried[best], outcome.decision, dataclasses.replace(outcome, hint=candidates[best]), overlaps
            raise next(s for s in tried if isinstance(s, BaseException))
        except (JudgeFailed, TemplateError) as exc:
            log.warning("session %s turn %d: teacher failed: %s", turn.session_id, turn.turn_index, exc)
        # Without teacher log-probs the hint is unusable; a ±1 score still teaches (combine).
        fallback = judging.decide(self.mode, rl_vote=outcome.score, hint=None, has_next_state=True)
        if fallback.emit:
            return None, fallback, outcome, None
        return None, judging.Decision(False, 0.0, False, TEACHER_FAILED), outcome, None
