"""A new version's way to serving everyone through the gate (docs/ARCHITECTURE.md §17).

The candidate is scored where it can be held apart: in LoRA mode as an adapter loaded beside the one
serving, which no chat request carries; with full weights on several replicas on one replica taken out of
rotation (a canary no chat request reaches). One full-weight engine holds one set of weights: there the
candidate is promoted first and checked at once, and a rejection rolls it back (the learner's part).
The version it would replace and the baseline are scored once each, on the same prompts and seeds; the
verdict is `clawd.safety.gate.decide`'s and goes into the version's record.
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable

from clawd.engine.client import EngineError
from clawd.learning.publisher import Publisher
from clawd.safety.gate import GateUnavailable, PromotionGate, decide
from clawd.safety.versions import GOOD, Versions
from clawd.served import Policy

log = logging.getLogger("clawd.gate")

Publish = Callable[..., Awaitable[bool]]  # the learner's: (weights_dir, version, promote=True) -> confirmed


class Promotion:
    def __init__(self, gate: PromotionGate, versions: Versions, publisher: Publisher, policy: Policy, *,
                 lora: bool):
        self.gate, self.versions, self.publisher, self.policy, self.lora = gate, versions, publisher, policy, lora
        self.outcomes: dict[int, list[float]] = {}  # per version, scored once
        self.passed = self.rejected = self.failures = 0

    def snapshot(self) -> dict:
        return {"prompts": len(self.gate.prompts), "passed": self.passed, "rejected": self.rejected,
                "failures": self.failures, "margin": self.gate.cfg.margin}

    async def deliver(self, weights: str, version: int, publish: Publish) -> dict | None:
        """Score the candidate against the version it would replace, decide, and promote it when it passes
        (`publish`). The verdict; None when the evaluation or a publish failed while the candidate serves
        nowhere (the caller tries again). A candidate that had to serve to be checked (one engine) and could
        not be evaluated is rejected: never left serving unchecked. A rejected candidate no longer serves
        anywhere unless it had to serve to be checked; then the caller's rollback replaces it."""
        parent = self.versions.get(version).parent
        canary = None
        try:
            incumbent = await self._scored(parent, self.policy.adapter if parent == self.policy.version else
                                           self.publisher.adapter_of(parent))
            if self.lora:
                await self.publisher.stage(weights, version)
            elif self.policy.version != version:
                canary = await self.publisher.hold_apart(weights, version)
                if canary is None and not await publish(weights, version, promote=False):
                    return None
            candidate = await self._scored(version, self.publisher.adapter_of(version), canary)
        except (GateUnavailable, EngineError) as exc:
            self.failures += 1
            if not self.lora and canary is None and self.policy.version == version:
                # One engine: the candidate already serves everyone, unchecked. Trying again (for as long as the
                # judge is down) would leave it there: it is rejected instead, and the learner rolls back, pauses
                # learning with reason "gate" and keeps the batch in state/rejected/.
                verdict = {"passed": False, "unevaluated": True,
                           "detail": f"could not be evaluated while it served: {type(exc).__name__}: {exc}"}
                self.versions.update(version, gate={**verdict, "against": parent})
                self.rejected += 1
                log.error("the gate could not evaluate v%d, which serves unchecked: rejecting it: %s", version, exc)
                return verdict
            log.error("the gate could not evaluate v%d (trying again; it serves nowhere meanwhile): %s", version, exc)
            await self.publisher.release(self._serving())
            return None
        baseline = self._baseline(version) if self.gate.cfg.baseline else None
        verdict = decide(candidate, incumbent, baseline, margin=self.gate.cfg.margin, level=self.gate.cfg.level)
        self.versions.update(version, gate={**verdict, "outcomes": candidate, "against": parent})
        if not verdict["passed"]:
            await self.publisher.release(self._serving())
            if self.lora:
                self.publisher.unstage(version)
            self.rejected += 1
            log.error("the gate rejected v%d: %s", version, verdict["detail"])
            return verdict
        if (self.lora or canary is not None) and not await publish(weights, version):
            await self.publisher.release(self._serving())
            return None
        await self.publisher.release(None)
        self.passed += 1
        self.versions.promote(version, f"gate passed: {verdict['detail']}")
        log.info("the gate passed v%d: %s", version, verdict["detail"])
        return verdict

    def _baseline(self, candidate: int) -> list[float] | None:
        """The outcomes of the first version scored (kept in its record): the fixed point drift is measured
        from. None when the candidate is that version's first successor and the incumbent is it anyway."""
        for record in self.versions:
            kept = (record.gate or {}).get("outcomes")
            if (record.version != candidate and record.status in GOOD and kept is not None
                    and len(kept) == len(self.gate.prompts)):
                return kept
        return None

    def _serving(self) -> tuple[str, str]:
        """(weights directory, weight_version) of the version serving: where a canary goes back to."""
        return self.policy.weights_dir or self.publisher.base_dir, self.policy.weight_version

    async def _scored(self, version: int, adapter: str | None, engine=None) -> list[float]:
        """A version's outcomes, scored once (its record keeps them across restarts)."""
        if version not in self.outcomes:
            record = self.versions.get(version)
            kept = (record.gate or {}).get("outcomes") if record is not None else None
            if kept is None or len(kept) != len(self.gate.prompts):
                kept = await self.gate.outcomes(adapter, engine)
                if record is not None and record.gate is None:
                    self.versions.update(version, gate={"score": sum(kept) / max(len(kept), 1), "outcomes": kept,
                                                        "passed": True, "detail": "scored as the incumbent"})
            self.outcomes[version] = kept
        return self.outcomes[version]
