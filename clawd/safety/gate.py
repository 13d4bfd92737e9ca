"""The gate before promotion: a new version is scored on an evaluation set and compared, prompt by prompt,
with the version it would replace and with the baseline (docs/ARCHITECTURE.md §17).

Scoring: every prompt of the set (clawd.safety.evalset) is answered `samples_per_prompt` times with fixed
sampling seeds (the same seeds for every version, so two versions' answers to a prompt are a pair); a
prompt's outcome is the share of its answers that pass its check. A version's score is the mean outcome.

The decision (`decide`, pure): a candidate is rejected when, against the incumbent or against the baseline
(the first version scored: without it, many small steps each within the margin could drift far), its mean
paired difference is below -margin AND the paired bootstrap interval lies wholly below zero. Both: a drop
within the margin is noise the operator accepted, and a drop past it that the interval does not confirm
is not evidence enough to stop learning on. Outcomes are kept per version, so the incumbent and the
baseline are scored once.
"""
from __future__ import annotations

import asyncio
import logging
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

from clawd import quoting
from clawd.safety import evalset, paired
from clawd.config.gate import GateConfig

log = logging.getLogger("clawd.gate")


class GateUnavailable(Exception):
    """The evaluation could not run (the engine or the judge failed): no verdict, the candidate waits."""


def decide(candidate: Sequence[float], incumbent: Sequence[float], baseline: Sequence[float] | None, *,
           margin: float, level: float) -> dict[str, Any]:
    """The verdict on a candidate's outcomes, paired with the incumbent's (and the baseline's when given).
    Returns {"passed", "score", "incumbent", "baseline", "diff", "low", "high", "baseline_diff",
    "baseline_low", "baseline_high", "detail"}."""
    versus = paired.compare(incumbent, candidate, level=level)
    out: dict[str, Any] = {"score": versus["after"], "incumbent": versus["before"], "diff": versus["diff"],
                           "low": versus["low"], "high": versus["high"], "baseline": None, "baseline_diff": None,
                           "baseline_low": None, "baseline_high": None}
    worse = []
    if _worse(versus, margin):
        worse.append(paired.describe("against the incumbent", versus))
    if baseline is not None:
        base = paired.compare(baseline, candidate, level=level)
        out.update(baseline=base["before"], baseline_diff=base["diff"], baseline_low=base["low"],
                   baseline_high=base["high"])
        if _worse(base, margin):
            worse.append(paired.describe("against the baseline", base))
    out["passed"] = not worse
    out["detail"] = ("; ".join(worse) + f": worse by more than the margin ({margin:.0%}), interval below 0"
                     if worse else paired.describe("gate score", versus))
    return out


def _worse(result: dict, margin: float) -> bool:
    return bool(result["n"]) and result["diff"] < -margin and result["high"] < 0


def seed_of(prompt_id: str, sample: int) -> int:
    """The sampling seed of a prompt's k-th answer: the same for every version (the pairing)."""
    return zlib.crc32(f"{prompt_id}/{sample}".encode())


@dataclass
class PromotionGate:
    """Scores versions on the evaluation set through an engine (`generate(payload)`: a policy replica, or
    the balanced set of them), with a judge for rubric checks (`complete(messages) -> str`) when any."""
    cfg: GateConfig
    prompts: tuple[evalset.Prompt, ...]
    tokenizer: Any
    engine: Any
    judge: Any = None

    @property
    def needs_judge(self) -> bool:
        return any(p.check.rubric for p in self.prompts)

    async def outcomes(self, adapter: str | None, engine=None) -> list[float]:
        """Each prompt's share of passing answers from the version an engine call with `adapter` reaches
        (None: the engine's own weights), on `engine` (a canary replica) or the gate's own. GateUnavailable
        when the evaluation cannot finish."""
        engine = engine or self.engine
        limit = asyncio.Semaphore(self.cfg.concurrency)

        async def one(prompt: evalset.Prompt, k: int) -> bool:
            async with limit:
                text = await self._answer(engine, prompt, k, adapter)
                rubric = None
                if prompt.check.rubric and text is not None:
                    rubric = evalset.parse_rubric(await self.judge.complete(evalset.rubric_messages(
                        prompt.check.rubric, prompt.chat(), text, nonce=quoting.new_nonce())))
                return evalset.verdict(prompt.check, text, rubric)

        k = self.cfg.samples_per_prompt
        try:
            async with asyncio.timeout(self.cfg.timeout):
                passed = await asyncio.gather(*(one(p, j) for p in self.prompts for j in range(k)))
        except TimeoutError:
            raise GateUnavailable(f"the evaluation took over {self.cfg.timeout:.0f}s") from None
        except GateUnavailable:
            raise
        except Exception as exc:  # the engine's or the judge's failure: contained, the candidate waits
            raise GateUnavailable(f"{type(exc).__name__}: {exc}") from exc
        return [sum(passed[i * k:(i + 1) * k]) / k for i in range(len(self.prompts))]

    async def _answer(self, engine, prompt: evalset.Prompt, k: int, adapter: str | None) -> str | None:
        ids = self.tokenizer.encode_chat(prompt.chat(), None)
        payload: dict[str, Any] = {
            "input_ids": ids, "rid": f"gate-{prompt.id}-{k}-{adapter or 'base'}",
            "sampling_params": {"temperature": self.cfg.temperature, "max_new_tokens": self.cfg.max_tokens,
                                "sampling_seed": seed_of(prompt.id, k)}}
        if adapter is not None:
            payload["lora_path"] = adapter
        out = await engine.generate(payload)
        output_ids = out.get("output_ids") if isinstance(out, dict) else None
        if not isinstance(output_ids, list):
            raise GateUnavailable(f"the engine's answer to {prompt.id} has no output_ids")
        return self.tokenizer.decode(output_ids)
