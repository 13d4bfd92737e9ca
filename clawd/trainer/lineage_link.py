"""One principal's lineage of a trainer that holds adapters per principal, as a learner sees a trainer.

The trainer child (clawd.trainer.worker.lineages) holds the shared adapter and one per principal who has their own; the
daemon drives each lineage with a learner of its own (clawd.learning.lineages), and every learner speaks to the
one trainer. `LineageTrainer` is what such a learner is given: the supervisor's calls with the lineage named, and
the lineage's own state (its step, versions, owed writes) in place of the trainer's. A lineage the child has not
made yet reads as a fresh one: no step, no version, its weights the shared adapter's. The daemon side: no torch.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from clawd.samples import Sample
from clawd.trainer.catalogue import Checkpointed, ForgetLineage, Ready, Trained
from clawd.trainer.link import TrainerSupervisor

FRESH = {"step": 0, "version": 0, "weights_version": 0, "checkpoint_step": 0, "owed": [], "writing": None}


class LineageTrainer:
    def __init__(self, trainer: TrainerSupervisor, key: str):
        self.trainer, self.key = trainer, key

    @property
    def alive(self) -> bool:
        return self.trainer.alive

    @property
    def pid(self) -> int | None:
        return self.trainer.pid

    @property
    def state(self) -> dict | None:
        """The lineage's state as the live child's last reply for it gave it (None while there is no child)."""
        if not self.trainer.alive:
            return None
        return self.trainer.link.states.get(self.key) or {**FRESH, "lineage": self.key}

    @property
    def ready(self) -> Ready | None:
        """The live child's handshake, as this lineage's: its pid, and the lineage's step and versions."""
        state, ready = self.state, self.trainer.ready
        if state is None or ready is None:
            return None
        return Ready(ready.pid, state["step"], state["version"], state["weights_version"], ready.world_size)

    @property
    def version(self) -> int:
        return self.trainer.version_of(self.key)

    async def ready_info(self) -> Ready:
        await self.trainer.ready_info()  # waits for a live child
        return self.ready

    async def train(self, batch_id: str, version: int, samples: Sequence[Sample], *, timeout: float | None = None,
                    deferred: bool = False, renumber: Callable[[int], int] = lambda version: version) -> Trained:
        return await self.trainer.train(batch_id, version, samples, timeout=timeout, deferred=deferred,
                                        lineage=self.key, renumber=renumber)

    async def publish(self, version: int, timeout: float | None = None) -> str:
        return await self.trainer.publish(version, timeout, self.key)

    async def written(self, version: int, timeout: float | None = None) -> str:
        return await self.trainer.written(version, timeout, self.key)

    async def checkpoint(self, timeout: float | None = None) -> Checkpointed:
        return await self.trainer.checkpoint(timeout, self.key)

    async def restore(self, version: int, timeout: float | None = None) -> int:
        return await self.trainer.restore(version, timeout, self.key)

    async def ask(self, request, timeout: float | None = None) -> tuple[int | None, Any]:
        return await self.trainer.ask(request, timeout, self.key)

    async def forget(self, timeout: float | None = None) -> bool:
        """The lineage gone from the trainer: its adapter and its directory. Whether there was one."""
        _, reply = await self.trainer.ask(ForgetLineage(self.key), timeout)
        if self.trainer.link is not None:
            self.trainer.link.states.pop(self.key, None)
        return reply.removed
