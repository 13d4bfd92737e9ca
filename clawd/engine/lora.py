"""LoRA serving: which adapter chat requests carry, and unloading the ones they no longer use.

In LoRA mode (`[train.lora] rank > 0`) every policy engine serves the frozen base model and holds the
trainer's adapters beside it. A publish loads the new version's adapter directory under its own name
(`adapter_name`) on every replica; once all confirm, the policy names it and new chat requests carry it
(`/generate`'s `lora_path`), while requests already running finish on the adapter they started with.
The previous adapter is then retired: `AdapterUse.unload_retired` unloads it from every replica once no
request of clawd's uses it, off the publish path (SGLang's own unload would wait for such requests).
Judge and teacher requests carry no adapter: the base is the frozen reference.
"""
from __future__ import annotations

import asyncio
import collections
import logging

from clawd.engine.client import EngineError
from clawd.served import Policy

log = logging.getLogger("clawd.engine")

_RETRY_INITIAL = 1.0  # seconds before a failed unload is tried again; doubles up to _RETRY_MAX
_RETRY_MAX = 60.0


def adapter_name(version: int) -> str:
    """The engine-side name of version's adapter: never reused, since versions never repeat."""
    return f"clawd-v{version}"


class AdapterUse:
    """Requests in flight per adapter name, and the retired names still loaded on some replica."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.in_use: collections.Counter[str] = collections.Counter()
        self.retired: dict[str, set[int]] = {}  # name → replicas that may still hold it
        self.unloaded = 0
        self.failed_unloads = 0
        self._changed = asyncio.Event()

    def snapshot(self) -> dict:
        """For status and metrics."""
        return {"serving": self.policy.adapter, "in_use": dict(self.in_use), "retired": sorted(self.retired),
                "unloaded": self.unloaded, "failed_unloads": self.failed_unloads}

    def begin(self, principal: str | None = None) -> str | None:
        """The adapter a new request carries (None: the base, or a full fine-tune), counted until `end`: the
        principal's own when they have one that serves (adapters per principal), else the policy's."""
        name = self.policy.of(principal).adapter
        if name is not None:
            self.in_use[name] += 1
        return name

    def serving(self, name: str) -> bool:
        """Whether a policy serves adapter `name` now: the shared one's, or a principal's own."""
        return name == self.policy.adapter or any(p.adapter == name for p in self.policy.principals.values())

    def end(self, name: str | None) -> None:
        if name is None:
            return
        self.in_use[name] -= 1
        if self.in_use[name] <= 0:
            del self.in_use[name]
            if name in self.retired:
                self._changed.set()

    def retire(self, name: str | None, replicas: range) -> None:
        """`name` is no longer the policy's (call after the policy moved): unload it once unused."""
        if name is not None and not self.serving(name):
            self.retired[name] = set(replicas)
            self._changed.set()

    async def unload_retired(self, replicas, timeout: float) -> None:
        """Forever (a task the daemon owns): unload every retired adapter no request uses from each replica
        that is up. A failed unload is retried with backoff; a replica that restarted holds none of them."""
        delay = _RETRY_INITIAL
        while True:
            await self._changed.wait()
            self._changed.clear()
            failed = False
            for name in [n for n in self.retired if n not in self.in_use]:
                for i in sorted(self.retired[name]):
                    sup = replicas.supervisors[i]
                    if not sup.is_ready:  # a restart drops every adapter; a down engine holds none to free
                        self.retired[name].discard(i)
                        continue
                    try:
                        if name in await sup.client.loaded_adapters():  # not after the engine restarted
                            await sup.client.unload_adapter(name, timeout)
                    except EngineError as exc:
                        failed = True
                        self.failed_unloads += 1
                        log.warning("could not unload adapter %s from %s (retrying): %s", name, sup.name, exc)
                        continue
                    self.retired[name].discard(i)
                    self.unloaded += 1
                if not self.retired[name]:
                    del self.retired[name]
            if failed:
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX)
                self._changed.set()
            else:
                delay = _RETRY_INITIAL
