"""The engines stage: the policy replicas and the reference engine, supervised (docs/ARCHITECTURE.md §10).

Built from the config and the policy (what a (re)started replica loads); started inside the daemon's task
group (a supervisor task per engine, and in LoRA mode the unloader of retired adapters); stopped last.
"""
from __future__ import annotations

import asyncio
import contextlib

from clawd.config.engine import LIVE_PRIORITY
from clawd.config.schema import Config
from clawd.engine.client import EngineClient
from clawd.engine.lora import AdapterUse
from clawd.engine.replicas import Balanced, Replicas
from clawd.engine.supervisor import EngineSupervisor
from clawd.lifetime import Stage
from clawd.served import Policy


class Engines(Stage):
    def __init__(self, cfg: Config, policy: Policy):
        self.cfg = cfg
        self.supervisors = _supervisors(cfg, policy)
        # The policy replicas (one unless [engine] replicas/urls say more): a router sends each request to one.
        self.replicas = Replicas([e for e in self.supervisors if e.role == "policy"], policy)
        # LoRA mode: the replicas serve the base, and the trainer's adapters beside it (clawd.engine.lora).
        self.adapters = AdapterUse(policy) if cfg.train.lora.enabled else None
        # Judge and teacher calls go to the least loaded replica; in LoRA mode "policy" carries the policy's
        # adapter and "reference" is the same replicas asked without one: the frozen base.
        self.for_role: dict = {e.role: e.client for e in self.supervisors if e.role != "policy"}
        self.for_role["policy"] = Balanced(self.replicas, self.adapters)
        if self.adapters is not None:
            self.for_role["reference"] = Balanced(self.replicas)
        self._tasks: list[asyncio.Task] = []

    @property
    def ready(self) -> tuple[asyncio.Event, ...]:
        return tuple(e.ready for e in self.supervisors)

    async def open(self, exits: contextlib.AsyncExitStack) -> None:
        for engine in self.supervisors:
            await engine.client.start()
            exits.push_async_callback(engine.client.close)

    async def start(self, tasks: asyncio.TaskGroup) -> None:
        self._tasks = [tasks.create_task(e.run(), name=f"{e.name}-engine") for e in self.supervisors]
        if self.adapters is not None:
            self._tasks.append(tasks.create_task(self.adapters.unload_retired(
                self.replicas, self.cfg.learner.publish_timeout), name="adapter-unloader"))

    def stopping(self) -> None:
        for engine in self.supervisors:  # one that dies now stays down: we are leaving
            engine.hold_restarts()

    async def drain(self) -> None:
        for engine in self.supervisors:
            await engine.stop()
        for task in self._tasks:
            task.cancel()

    def cut_short(self) -> None:
        for engine in self.supervisors:
            engine.kill()
            engine.client.refuse("clawd is stopping")  # a new call would wait on the dead engine's socket

    def status(self) -> dict:
        return {"engines": {s.name: {"state": s.state.value, "ready": s.is_ready, "pid": s.pid, "restarts": s.restarts,
                                     "hangs": s.hangs, "hang_reason": s.hang_reason, "url": s.client.url,
                                     "output_dropped": s.output_dropped, "input_limit": s.input_limit}
                            for s in self.supervisors},
                "adapters": None if self.adapters is None else self.adapters.snapshot()}


def staged(cfg: Config) -> bool:
    """SGLang engines clawd launches start one after the other: each measures the GPU's free memory as it
    starts, and two at once (or a trainer joining) would each count the other's as free."""
    return cfg.engine.launch == "sglang"


def _supervisors(cfg: Config, policy: Policy) -> list[EngineSupervisor]:
    """The policy replicas' supervisors (each after the one before on GPUs), then the reference engine's when
    the mode needs one."""
    def client(url: str, priority: int | None = None) -> EngineClient:
        return EngineClient(url, api_key=cfg.engine.api_key, admin_api_key=cfg.engine.admin_api_key,
                            connect_timeout=cfg.engine.connect_timeout, request_timeout=cfg.engine.request_timeout,
                            first_byte_timeout=cfg.engine.first_byte_timeout, idle_timeout=cfg.engine.idle_timeout,
                            incremental_stream=cfg.engine.streams_deltas,
                            priority=priority)

    engines: list[EngineSupervisor] = []
    for i, url in enumerate(cfg.engine.policy_urls):
        after = (engines[-1].ready,) if engines and staged(cfg) else ()
        live = LIVE_PRIORITY if cfg.priority_scheduling else None  # only the policy engines schedule by it
        engines.append(EngineSupervisor(cfg, client(url, live), "policy", policy, after=after, index=i))
    if cfg.reference_engine_needed:
        after = (engines[-1].ready,) if staged(cfg) else ()
        engines.append(EngineSupervisor(cfg, client(cfg.engine.reference_url), "reference", after=after))
    return engines
