"""The rollouts stage: the rollout source's task and its deployment worker (docs/ARCHITECTURE.md §19).

Built after serving (it reads the live requests in flight) and drained before it: the source stops drawing,
a group in progress is dropped (its answers were never put), the worker is killed, the record closed. Its
edges: the policy engines (through the balanced client, with the policy's adapter in LoRA mode), the sample
store, the policy serving, serving's admission count, and the judge model (the set's rubrics).
"""
from __future__ import annotations

import asyncio
from typing import Callable

from clawd.config.engine import ROLLOUT_PRIORITY
from clawd.config.schema import Config
from clawd.learning.store import SampleStore
from clawd.lifetime import Stage
from clawd.records import RecordWriter
from clawd.rollouts import tasks as rollout_tasks
from clawd.rollouts.source import RolloutSource
from clawd.rollouts.worker import DeploymentWorker
from clawd.served import Policy


class Rollouts(Stage):
    def __init__(self, cfg: Config, *, tokenizer, generate, store: SampleStore, policy: Policy,
                 live: Callable[[], int], judge=None):
        self.cfg = cfg
        tasks = rollout_tasks.load(cfg.rollouts.set) if cfg.rollouts.set else ()  # checked with the config
        self.worker = DeploymentWorker(name="clawd-rollouts")
        # What each group's answers said and scored (records/rollouts-DAY.jsonl): no person's text, so kept like
        # the turn records, [records] retention_days, pruned as the file rotates.
        self.records = RecordWriter(cfg.state_dir / "records", kind="rollouts",
                                    retention_days=cfg.records.retention_days)
        self.source = RolloutSource(cfg.rollouts, tasks=tasks, tokenizer=tokenizer, generate=generate,
                                    put=store.put, waiting=store.waiting_by_principal, live=live,
                                    version=lambda: policy.version, worker=self.worker, record=self.records.write,
                                    priority=ROLLOUT_PRIORITY if cfg.priority_scheduling else None, judge=judge)
        self._task: asyncio.Task | None = None

    async def start(self, tasks: asyncio.TaskGroup) -> None:
        self._task = tasks.create_task(self.source.run(), name="rollouts")

    def stopping(self) -> None:
        self.source.running.clear()

    async def drain(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.worker.close()
        self.records.close()

    def cut_short(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def status(self) -> dict:
        return {"rollouts": {**self.source.snapshot(), "set": self.cfg.rollouts.set or None,
                             "environments": list(self.cfg.rollouts.environments),
                             "worker": {"pid": self.worker.pid, "started": self.worker.started,
                                        "timeouts": self.worker.timeouts}}}
