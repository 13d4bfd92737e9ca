"""The scoring stage: a finished turn → judge votes, a hint, teacher log-probs → a sample (docs/ARCHITECTURE.md §3).

Built from the config and its edges: the engines the judge and teacher ask, the sample store samples go to,
the judge records, the privacy policy (what an external judge is shown, what a record keeps), the pauses and
the monitors a turn is reported to. Its parts: the encoder worker (long prompts, judge and teacher prompts),
the judge and teacher backends, the `Scorer` and the `TurnHandover` the serving stage hands turns to. Drained
by finishing the turns being scanned, then the turns being judged (or dropping them at the drain timeout).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Callable

from clawd.config.judge import JudgeConfig
from clawd.config.schema import Config
from clawd.encoding import Encoder
from clawd.learning.store import SampleStore
from clawd.lifetime import Stage
from clawd.pauses import Pauses
from clawd.privacy.policy import Privacy
from clawd.records import RecordWriter
from clawd.safety.monitors import Monitors
from clawd.scoring.handover import TurnHandover
from clawd.scoring.judges import CallPolicy, OpenAIJudge, SGLangJudge
from clawd.scoring.scorer import Scorer
from clawd.scoring.teacher import Teacher
from clawd.tokenizer import ChatTokenizer

log = logging.getLogger("clawd")


class Scoring(Stage):
    def __init__(self, cfg: Config, *, tokenizer: ChatTokenizer, engine_for: dict, store: SampleStore,
                 turn_records: RecordWriter, judge_records: RecordWriter, privacy: Privacy, pauses: Pauses,
                 monitors: Monitors | None, on_write_error: Callable[[OSError], None], on_turn: Callable[[], None],
                 spawn: Callable[..., asyncio.Task]):
        """engine_for: the engine clients by role ("policy", "reference"); on_turn: counts each turn handed over;
        spawn: starts a task owned by the daemon's task group."""
        self.cfg, self.pauses = cfg, pauses
        self.encoder = Encoder(cfg.model_path)  # long prompts (and judge and teacher prompts) encoded off the loop
        self.judge = _judge(cfg, tokenizer, engine_for, self.encoder)
        self.teacher, reference = _teachers(cfg, engine_for)
        external = isinstance(self.judge, OpenAIJudge)  # a third party: PII replaced in what it is shown
        self.scorer = Scorer(cfg, tokenizer=tokenizer, judge=self.judge, teacher=self.teacher, store=store,
                             records=judge_records, spawn=spawn, reference=reference, encoder=self.encoder,
                             on_write_error=on_write_error, record_view=privacy.judge_record,
                             judge_view=privacy.for_judge if external else None)
        self.handover = TurnHandover(turn_records, self.scorer, pauses, privacy, monitors, on_turn=on_turn,
                                     spawn=spawn)

    async def open(self, exits: contextlib.AsyncExitStack) -> None:
        exits.push_async_callback(self.encoder.close)
        if isinstance(self.judge, OpenAIJudge):
            await self.judge.start()
            exits.push_async_callback(self.judge.close)

    async def drain(self) -> None:
        await self.handover.flush()  # turns whose PII scan is under way
        await self.scorer.close(self.cfg.server.drain_timeout)  # turns being judged finish or are dropped

    def set_judge(self, j: JudgeConfig) -> None:
        """A reload's [judge] settings, applied to the backends in flight (SIGHUP)."""
        for backend in (self.judge, self.teacher):
            if backend is not None:
                backend.reconfigure(call_policy(j), temperature=j.temperature, max_tokens=j.max_new_tokens)
        self.scorer.text_chars = j.record_text_chars

    def status(self) -> dict:
        sc = self.scorer.stats
        return {"scoring": {"turns": sc.submitted, "samples": sc.emitted, "pending": sc.pending,
                            "pending_bytes": sc.pending_bytes, "votes": dict(sc.votes),
                            "kinds": dict(sc.kinds), "excluded": dict(sc.excluded), "hints_offered": sc.hints_offered,
                            "hints_accepted": sc.hints_accepted, "reference_failed": sc.reference_failed,
                            "not_learned_while_paused": self.pauses.turns_not_learned},
                "feedback": {"enabled": self.cfg.feedback.enabled, "ratings": self.scorer.ratings.policy,
                             "replies_remembered": len(self.scorer.ratings),
                             **dataclasses.asdict(self.scorer.ratings.stats),
                             "calibration": self.scorer.ratings.calibration.snapshot()},
                "encoder": dataclasses.asdict(self.encoder.stats)}


def call_policy(j: JudgeConfig) -> CallPolicy:
    return CallPolicy(timeout=j.timeout, retries=j.retries, backoff_initial=j.backoff_initial,
                      backoff_max=j.backoff_max, concurrency=j.concurrency)


def _judge(cfg: Config, tokenizer: ChatTokenizer, engine_for: dict, encoder: Encoder):
    """The judge backend; None for the rules judge (scored in-process)."""
    j = cfg.judge
    if j.backend == "rules":
        return None
    if j.backend == "openai":
        return OpenAIJudge(j.url, j.api_key, j.model, temperature=j.temperature, max_tokens=j.max_new_tokens,
                           policy=call_policy(j), ca_file=j.ca_file, nameserver=j.nameserver)
    # The reference engine holds the initial weights: the policy's tokenizer fits it.
    return SGLangJudge(engine_for[j.engine], tokenizer, temperature=j.temperature,
                       max_new_tokens=j.max_new_tokens, policy=call_policy(j), encoder=encoder)


def _teachers(cfg: Config, engine_for: dict) -> tuple[Teacher | None, Teacher | None]:
    """The teacher of a hinted response (None in rl mode), and the reference's scorer for a full fine-tune's KL term."""
    if cfg.scoring.mode != "rl" and cfg.judge.teacher_engine == "policy" and not cfg.train.lora.enabled:
        log.warning("judge.teacher_engine = \"policy\": the policy being trained is its own teacher; the frozen "
                    "reference (\"reference\", the default) does not drift with it")  # LoRA: the base is frozen
    kl = cfg.train.loss.kl_coef > 0 and not cfg.train.lora.enabled  # LoRA: the trainer turns its adapters off instead
    on = lambda role: Teacher(engine_for[role], policy=call_policy(cfg.judge))  # noqa: E731
    return None if cfg.scoring.mode == "rl" else on(cfg.judge.teacher_engine), on("reference") if kl else None
