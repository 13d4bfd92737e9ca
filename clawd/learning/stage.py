"""The learning stage: the trainer subprocess, the publisher and the learner (docs/ARCHITECTURE.md §6).

Built from the config and its edges: the sample store and the version history, the engines it publishes to,
the judge its gate asks, and where each step and publish is reported. Started inside the daemon's task group
(the trainer, on GPUs once the engines are up; the learner); drained by letting the step in progress finish
and checkpointing, then stopping the trainer.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Callable

from clawd.config.schema import Config
from clawd.engine.replicas import Balanced
from clawd.engine.stage import Engines
from clawd.learning import weight_groups
from clawd.learning.learner import Learner
from clawd.learning.lineages import Lineages, SelectedStore
from clawd.learning.publisher import Publisher
from clawd.learning.store import SampleStore
from clawd.lifetime import Stage
from clawd.pauses import Pauses
from clawd.safety import evalset
from clawd.safety.monitors import Monitors
from clawd.safety.gate import PromotionGate
from clawd.safety.versions import Versions
from clawd.served import Policy
from clawd.tokenizer import ChatTokenizer
from clawd.trainer.link import TrainerSupervisor
from clawd.trainer.options import trainer_options

log = logging.getLogger("clawd")


class Learning(Stage):
    def __init__(self, cfg: Config, *, store: SampleStore, versions: Versions, policy: Policy, pauses: Pauses,
                 engines: Engines, tokenizer: ChatTokenizer, judge, share_weights: Callable[[str], None] | None,
                 on_step: Callable, on_publish: Callable[[float, float], None], spawn: Callable[..., asyncio.Task],
                 monitors: Monitors | None = None):
        """judge: the gate's (None: the rules judge); share_weights: opens a version's directory to an engine run
        as another user ([privacy] weights_group); on_step, on_publish: the learner's reports; spawn: starts a
        task in the daemon's group and monitors: the behaviour monitors (adapters per principal: each principal's
        own learner and the watch over their versions)."""
        self.cfg, self.engines = cfg, engines
        self.trainer = TrainerSupervisor(trainer_options(cfg), ready_timeout=cfg.learner.trainer_ready_timeout)
        publisher = Publisher(engines.replicas, cfg.learner.publish_timeout, adapters=engines.adapters,
                              base_dir=str(cfg.model_path), groups=weight_groups.for_config(cfg, self.trainer),
                              before_load=share_weights)
        gate = lambda: _gate(cfg, tokenizer, Balanced(engines.replicas), judge)  # noqa: E731 (one per learner)
        # Adapters per principal: a learner per principal's own adapter, beside the shared one's.
        self.lineages = None if not cfg.train.per_principal else Lineages(
            cfg, store=store, trainer=self.trainer, publisher=publisher, policy=policy, versions=versions,
            pauses=pauses, gate=gate, on_step=on_step, on_publish=on_publish, spawn=spawn, monitors=monitors)
        self.learner = Learner(cfg.learner, store if self.lineages is None else SelectedStore(store, self.lineages.shared),
                               self.trainer, publisher, policy, cfg.state_dir,
                               control_seed=cfg.train.seed, pauses=pauses, versions=versions,
                               lora=cfg.train.lora.enabled, gate=gate(), max_sample_tokens=cfg.max_sample_tokens,
                               on_step=on_step, on_publish=on_publish,
                               reserve=self.lineages.reserve if self.lineages is not None else lambda version: version)
        if cfg.learner.control != "none":
            log.warning("learner control %r: training on a reward cut off from the replies (an experiment)",
                        cfg.learner.control)
        self._tasks: list[asyncio.Task] = []

    async def start(self, tasks: asyncio.TaskGroup) -> None:
        # A trainer on CUDA starts once the engines are up: SGLang measures the GPU's free memory as it starts.
        waits = self.engines.ready if self.cfg.train.world.device.startswith("cuda") else ()
        self._tasks = [tasks.create_task(_after(waits, self.trainer.run()), name="trainer"),
                       tasks.create_task(self.learner.run(), name="learner")]
        if self.lineages is not None:  # the principals' own adapters on disk, then whoever qualifies
            self.lineages.find(k.name for k in self.cfg.auth.keys)
            self._tasks.append(tasks.create_task(self.lineages.watch(), name="lineages"))

    def stopping(self) -> None:
        self.trainer.hold_restarts()  # a trainer that dies now stays down: we are leaving

    async def drain(self) -> None:
        if self.lineages is not None:
            await self.lineages.stop(self.cfg.server.drain_timeout)
        await self.learner.stop(self.cfg.server.drain_timeout)  # the step in progress, then a checkpoint
        for task in self._tasks[::-1]:  # a step cut short is replayed from the journal next start
            task.cancel()
        await self.trainer.stop()

    def cut_short(self) -> None:
        self.trainer.kill()

    async def rollback(self, target: int | None, reason: str) -> int:
        """To `target` in the history that holds it (a principal's own adapter's, or the shared one's)."""
        owner = self.lineages.learner_of(target) if self.lineages is not None and target is not None else None
        return await (owner or self.learner).rollback(target, reason=reason)

    def status(self) -> dict:
        learner, trainer, cfg = self.learner, self.trainer, self.cfg
        state = trainer.state or {}
        groups = learner.publisher.groups
        return {"learner": {**dataclasses.asdict(learner.stats), "control": cfg.learner.control,
                            "busy": learner.busy, "limits": learner.limits.snapshot(),
                            "weight_sync": groups and dataclasses.asdict(groups.stats)},
                "trainer": {"alive": trainer.alive, "pid": trainer.pid, "restarts": trainer.restarts,
                            "world_size": trainer.ready.world_size if trainer.ready else cfg.train.world.size,
                            "step": trainer.ready.step if trainer.ready else None, "version": trainer.version,
                            "checkpoint_step": state.get("checkpoint_step"), "owed": state.get("owed", []),
                            "writing": state.get("writing")},  # a version's directory written off the critical path
                "lineages": None if self.lineages is None else self.lineages.snapshot()}


async def _after(events: tuple[asyncio.Event, ...], work) -> None:
    """Run the coroutine `work` once every event is set (closed unrun if cancelled first)."""
    try:
        for event in events:
            await event.wait()
    except BaseException:
        work.close()
        raise
    await work


def _gate(cfg: Config, tokenizer: ChatTokenizer, engine: Balanced, judge) -> PromotionGate | None:
    """The gate before promotion, on the evaluation set (`[gate] set`, or the one clawd ships); None when off.
    A bad set stops the start with its file and line, as a bad config does."""
    if not cfg.gate.enabled:
        return None
    path = cfg.gate.set or evalset.default_path()
    prompts = evalset.load(path)
    gate = PromotionGate(cfg.gate, prompts[:cfg.gate.prompts or len(prompts)], tokenizer, engine, judge)
    if gate.needs_judge and judge is None:
        raise evalset.EvalSetError(f"{path}: rubric checks need a judge model: judge.backend is \"rules\"")
    log.info("gate: %d prompt(s) from %s, %d sample(s) each, margin %.0f%%", len(gate.prompts), path,
             cfg.gate.samples_per_prompt, 100 * cfg.gate.margin)
    return gate
