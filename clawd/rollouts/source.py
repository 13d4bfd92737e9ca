"""The rollout source: groups drawn from a prompt set and environments, scored, and put in the sample store
beside live turns (docs/ARCHITECTURE.md §19).

It takes turns over the set's items and the environments (an environment's seeds count up from 0; keep
held-out seeds at or above EVAL_SEED_BASE), and for each draws N answers (episodes) concurrently, within
`concurrency`. Live users come first: no group starts, and no model turn of one in progress, while more than
`live_headroom` live requests are in flight; no group starts while `backlog` rollout samples already wait for
the learner. An answer to a set item is scored by
the item's rules, its rubric by the judge model once the other rules hold, and, when it names one, the
deployment's checker in the worker (a judge's or a checker's failure scores 0 and is counted); an episode by its
environment. A group whose scores agree is dropped and counted; the others
become samples (clawd.rollouts.groups.group_samples) whose principal is the source's pseudo-principal
("@rollouts/set", "@rollouts/env"): the store's fairness counts it as one more user.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Awaitable, Callable

from clawd import quoting
from clawd.config.rollouts import RolloutsConfig
from clawd.rollouts.episode import EpisodeLimits, Generate, model_turn, run_episode
from clawd.rollouts.groups import Member, group_samples
from clawd.rollouts.tasks import Task, checker_score, local_score
from clawd.rollouts.worker import CallFailed, DeploymentWorker
from clawd.safety import evalset
from clawd.samples import PSEUDO_PRINCIPAL, Sample
from clawd.scoring.judges import JudgeFailed
from clawd.scoring.scorer import Judge

log = logging.getLogger("clawd.rollouts")

EVAL_SEED_BASE = 1_000_000_000  # environment seeds from here on are never trained: held out for evaluation
PRINCIPALS = {kind: f"{PSEUDO_PRINCIPAL}{kind}" for kind in ("set", "env")}  # one pseudo-principal per source
_WAIT = 0.2  # seconds between looks at the live load and the backlog while waiting
RECORD_CHARS = 2000  # of an answer's last reply, in the rollouts' record
_RETRY_MIN, _RETRY_MAX = 1.0, 30.0  # seconds after a failed group, doubling while groups keep failing


@dataclass
class RolloutStats:
    groups: int = 0            # groups drawn
    dropped_agree: int = 0     # of those, dropped: every answer scored the same
    samples: int = 0           # samples put in the store
    answers: int = 0           # answers (episodes) scored
    solved: int = 0            # of those, scored 1
    checker_failures: int = 0  # set answers whose checker raised or timed out (scored 0)
    judge_failures: int = 0    # set answers whose rubric the judge gave no answer to (scored 0)
    env_failed: int = 0        # episodes whose environment timed out or died (left out of their group)
    action_errors: int = 0     # malformed calls and raising tools, observed by the model
    waited_live: int = 0       # times the source waited for live requests to drop to live_headroom
    waited_backlog: int = 0    # times it waited for the learner to take its samples
    failed_groups: int = 0     # groups lost to an error (the engine's, a template's): logged, retried after a wait


class RolloutSource:
    def __init__(self, cfg: RolloutsConfig, *, tasks: tuple[Task, ...], tokenizer, generate: Generate,
                 put: Callable[[Sample], Awaitable[None]], waiting: Callable[[], dict[str, int]],
                 live: Callable[[], int], version: Callable[[], int], worker: DeploymentWorker,
                 record: Callable[[dict], object] | None = None, clock: Callable[[], float] = time.time,
                 priority: int | None = None, judge: Judge | None = None):
        """put: the store's (journaled) put; waiting: the store's waiting samples by principal; live: live
        requests in flight; version: the policy version serving; record: where each group's record goes (the
        rollouts' record file: what each answer said and scored); priority: the one every rollout call names
        (an engine scheduling by priority preempts its rows for live ones), None: none; judge: the judge model
        that answers the set's rubrics (None: the rules judge, which cannot; a set with a rubric is then refused
        with the config)."""
        self.cfg, self.tasks, self.tokenizer, self.generate = cfg, tasks, tokenizer, generate
        self.put, self.waiting, self.live, self.version, self.worker, self.clock = (put, waiting, live, version,
                                                                                     worker, clock)
        self.record, self.judge = record, judge
        self._priority = {} if priority is None else {"priority": priority}
        self.limits = EpisodeLimits(max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                                    max_context=cfg.max_context, env_timeout=cfg.checker_timeout,
                                    temperature=cfg.temperature)
        self.stats = RolloutStats()
        self.running = asyncio.Event()  # cleared by `clawctl rollouts pause`
        self.running.set()
        self._slots = asyncio.Semaphore(cfg.concurrency)
        self._retry = _RETRY_MIN
        self._items = itertools.cycle([("set", t) for t in tasks] + [("env", e) for e in cfg.environments])
        self._seeds = {e: itertools.count() for e in cfg.environments}

    async def run(self) -> None:
        while True:
            await self.running.wait()
            if self._backlog() >= self.cfg.backlog:
                self.stats.waited_backlog += 1
                await asyncio.sleep(_WAIT)
                continue
            if self.live() > self.cfg.live_headroom:
                self.stats.waited_live += 1
                await asyncio.sleep(_WAIT)
                continue
            kind, item = next(self._items)
            try:
                samples = await self.group(kind, item)
            except Exception as exc:  # an engine restarting, a chat template that refuses a message: not ours
                self.stats.failed_groups += 1
                self._retry = min(self._retry * 2, _RETRY_MAX) if self.stats.failed_groups > 1 else _RETRY_MIN
                log.error("rollout group of %s failed (%s: %s); the next in %.0fs", getattr(item, "id", item),
                          type(exc).__name__, exc, self._retry)
                await asyncio.sleep(self._retry)
                continue
            self._retry = _RETRY_MIN
            for sample in samples:
                await self.put(sample)
                self.stats.samples += 1

    async def _generate(self, payload: dict) -> dict:
        """The engine, after live users: every model turn of a rollout (not only a group's first) waits while
        more than `live_headroom` live requests are in flight, so a live request meets at most `concurrency`
        rollout turns already generating, and at the engine (priority scheduling) each of those yields to it."""
        while self.live() > self.cfg.live_headroom:
            self.stats.waited_live += 1
            await asyncio.sleep(_WAIT)
        return await self.generate({**payload, **self._priority})

    def _backlog(self) -> int:
        waiting = self.waiting()
        return sum(waiting.get(p, 0) for p in PRINCIPALS.values())

    async def group(self, kind: str, item) -> list[Sample]:
        """One group of `item` (a Task, or an environment's "module:Class"): its samples ([] when dropped). Its
        N members run to their end even when one fails, which then fails the group."""
        group_id, version, started = f"ro-{uuid.uuid4().hex[:16]}", self.version(), self.clock()
        seed = None
        if kind == "set":
            members = await _all(self._answer(item, f"{group_id}-{i}") for i in range(self.cfg.samples_per_prompt))
        else:
            seed = next(self._seeds[item])
            members = [m for m in await _all(self._episode(item, seed, f"{group_id}-{i}")
                                             for i in range(self.cfg.samples_per_prompt)) if m is not None]
        self.stats.groups += 1
        self.stats.answers += len(members)
        self.stats.solved += sum(m.reward == 1.0 for m in members)
        samples, advantages = group_samples(group_id, members, source=kind, principal=PRINCIPALS[kind],
                                            policy_version=version, temperature=self.cfg.temperature,
                                            scale=self.cfg.scale, discount=self.cfg.discount, created=started,
                                            scored=self.clock())
        if not samples:
            self.stats.dropped_agree += 1
        if self.record is not None:
            self.record({"time": started, "group": group_id, "source": kind, "version": version,
                         "item": item.id if kind == "set" else item, "seed": seed, "kept": bool(samples),
                         "samples": len(samples),
                         "answers": [{"reward": m.reward, "advantage": None if advantages is None else advantages[i],
                                      "turns": len(m.turns), **m.said} for i, m in enumerate(members)]})
        return samples

    async def _answer(self, task: Task, rid: str) -> Member:
        async with self._slots:
            turn = await model_turn(self._generate, self.tokenizer, self.tokenizer.encode_chat(task.chat(), None),
                                    self.limits, rid)
        if turn is None:
            return Member((), 0.0, {"ended": "no_output"})
        score = local_score(task, turn.text, True if task.rubric else None)  # the rubric's YES assumed, for now
        if score and task.rubric:
            score = local_score(task, turn.text, await self._rubric(task, turn.text))
        if score and task.callable is not None:
            try:
                score *= checker_score(await self.worker.call(task.callable, turn.text, task.id, task.chat(),
                                                              timeout=self.cfg.checker_timeout))
            except (CallFailed, ValueError) as exc:
                self.stats.checker_failures += 1
                log.warning("checker %s on %s: %s (scored 0)", task.callable, task.id, exc)
                score = 0.0
        return Member(((turn.prompt_ids, turn.output_ids, turn.logprobs),), score,
                      {"reply": turn.text[:RECORD_CHARS], "finish": turn.finish})

    async def _rubric(self, task: Task, text: str) -> bool | None:
        """The judge's answer to the item's rubric about this reply: True (YES), False, or None when it gave none."""
        if self.judge is None:
            raise RuntimeError(f"{task.id} has a rubric and no judge model answers it")  # the config refuses this
        try:
            return evalset.parse_rubric(await self.judge.complete(
                evalset.rubric_messages(task.rubric, task.chat(), text, nonce=quoting.new_nonce())))
        except JudgeFailed as exc:
            self.stats.judge_failures += 1
            log.warning("the judge on %s's rubric: %s (scored 0)", task.id, exc)
            return None

    async def _episode(self, environment: str, seed: int, rid: str) -> Member | None:
        async with self._slots:
            episode = await run_episode(environment, seed, self.worker, self._generate, self.tokenizer,
                                        self.limits, rid=rid)
        self.stats.action_errors += episode.errors
        if episode.ended == "env_failed":  # says nothing of the model's answer: out of the group
            self.stats.env_failed += 1
            return None
        last = next((m.get("content") or "" for m in reversed(episode.transcript) if m.get("role") == "assistant"), "")
        return Member(tuple((t.prompt_ids, t.output_ids, t.logprobs) for t in episode.turns), episode.reward,
                      {"reply": last[:RECORD_CHARS], "ended": episode.ended, "errors": episode.errors,
                       "tool_calls": sum(len(m.get("tool_calls", [])) for m in episode.transcript)})

    def snapshot(self) -> dict:
        return {**dataclasses.asdict(self.stats), "running": self.running.is_set(), "backlog": self._backlog()}


async def _all(calls) -> list:
    """Every call's result, each run to its end; the first failure raised once all are done (gather alone would
    leave the others running)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    if failed := next((r for r in results if isinstance(r, BaseException)), None):
        raise failed
    return results
