"""The training sample: the currency between scoring, the journal, the learner and the trainer.

One finished main turn that scoring kept becomes one `Sample` (docs/ARCHITECTURE.md §3):
`tokens = prompt ids + response ids` exactly as the engine consumed and
produced them; `loss_mask`, `rollout_logprobs` and (with a hint)
`teacher_logprobs` have the response's length. `has_hint = False` makes the
OPD term of the loss exactly zero.

Optional, each None when not collected (and in samples journaled before they existed):
`reference_logprobs`, the frozen reference's T = 1 log-probs of the response (the KL term's, so
the trainer needs no second copy of the model); `top_ids` and `teacher_top_logprobs`, the
policy's top-k ids at each response position as the engine reported them at rollout and the
teacher's T = 1 log-probs at those ids (top-K distillation; hinted samples only).

`source` says where the turn came from: "live" chat (the default, and every sample journaled before
sources existed), or an active rollout of a prompt "set" or an "env"ironment (clawd.rollouts). A rollout
sample carries its `advantage` within its group (clawd.rollouts.groups), which the trainer uses as it
is; its `reward` is the checker's score in [-1, 1], kept for the records.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

FORMAT_VERSION = 1  # bumped when a field changes meaning; the journal stores it with every sample

MODES = ("rl", "opd", "combine")
SOURCES = ("live", "set", "env")
# The principals of active rollouts ("@rollouts/set", "@rollouts/env"): no person, so never a key's or a user's.
PSEUDO_PRINCIPAL = "@rollouts/"


@dataclass(frozen=True)
class Sample:
    sample_id: str
    mode: str
    session_id: str
    turn_index: int
    principal: str                       # the API key's name, or the `user` field on an open API
    tokens: list[int]                    # prompt ids + response ids
    response_length: int
    loss_mask: list[int]                 # one 0/1 per response token
    rollout_logprobs: list[float]        # the engine's, at `temperature`
    temperature: float
    reward: float                        # -1, 0 or +1 (0 when only the hint speaks)
    teacher_logprobs: list[float] | None  # one per response token, at T = 1; None without a hint
    has_hint: bool
    policy_version: int
    created: float                       # when the turn was served
    scored: float                        # when scoring finished
    reference_logprobs: list[float] | None = None        # the frozen reference's, at T = 1, one per response token
    top_ids: list[list[int]] | None = None               # the policy's top-k ids at each response position
    teacher_top_logprobs: list[list[float]] | None = None  # the teacher's at T = 1 at those ids
    source: str = "live"                                 # one of SOURCES
    advantage: float | None = None                       # a rollout's, within its group; None for live turns

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ValueError(f"invalid sample {self.sample_id}: " + "; ".join(problems))

    def problems(self) -> list[str]:
        out = []
        n = self.response_length
        if self.mode not in MODES:
            out.append(f"mode {self.mode!r} is not one of {MODES}")
        if not 0 < n < len(self.tokens):
            out.append(f"response_length {n} must be in 1..{len(self.tokens) - 1} (a prompt and a response)")
        if len(self.loss_mask) != n or any(m not in (0, 1) for m in self.loss_mask):
            out.append("loss_mask must hold one 0/1 per response token")
        if len(self.rollout_logprobs) != n or not all(math.isfinite(x) for x in self.rollout_logprobs):
            out.append("rollout_logprobs must hold one finite value per response token")
        if self.has_hint:
            if self.teacher_logprobs is None or len(self.teacher_logprobs) != n \
                    or not all(math.isfinite(x) for x in self.teacher_logprobs):
                out.append("a hinted sample needs one finite teacher log-prob per response token")
        elif self.teacher_logprobs is not None:
            out.append("teacher_logprobs without has_hint")
        if self.reference_logprobs is not None and (len(self.reference_logprobs) != n or not all(
                math.isfinite(x) for x in self.reference_logprobs)):
            out.append("reference_logprobs must hold one finite value per response token")
        out += self._top_problems()
        out += self._reward_problems()
        if not 0 < self.temperature <= 2:
            out.append(f"temperature {self.temperature} is outside (0, 2]")
        return out

    def _reward_problems(self) -> list[str]:
        if self.source not in SOURCES:
            return [f"source {self.source!r} is not one of {SOURCES}"]
        if self.source == "live":
            if self.advantage is not None:
                return ["a live turn's advantage comes from its batch: it carries none"]
            return [] if self.reward in (-1.0, 0.0, 1.0) else [f"reward {self.reward} is not -1, 0 or +1"]
        out = []
        if not (isinstance(self.reward, (int, float)) and math.isfinite(self.reward) and -1 <= self.reward <= 1):
            out.append(f"a rollout's reward {self.reward} is not a number in [-1, 1]")
        if not (isinstance(self.advantage, (int, float)) and math.isfinite(self.advantage)):
            out.append(f"a rollout needs a finite advantage, not {self.advantage!r}")
        return out

    def _top_problems(self) -> list[str]:
        ids, lps, n = self.top_ids, self.teacher_top_logprobs, self.response_length
        if ids is None and lps is None:
            return []
        if ids is None or lps is None or not self.has_hint:
            return ["top_ids and teacher_top_logprobs go together, on a hinted sample"]
        k = len(ids[0]) if ids else 0
        if len(ids) != n or len(lps) != n or k < 1:
            return ["top_ids and teacher_top_logprobs must hold one row per response token"]
        if any(len(r) != k or not all(isinstance(t, int) and t >= 0 for t in r) for r in ids):
            return [f"every top_ids row must hold {k} token ids"]
        if any(len(r) != k or not all(math.isfinite(x) for x in r) for r in lps):
            return [f"every teacher_top_logprobs row must hold {k} finite values"]
        return []

    @property
    def top_k(self) -> int:
        """The width of the top-k rows (0 without them)."""
        return len(self.top_ids[0]) if self.top_ids else 0

    @property
    def prompt_ids(self) -> list[int]:
        return self.tokens[:-self.response_length]

    @property
    def response_ids(self) -> list[int]:
        return self.tokens[-self.response_length:]

    def to_json(self) -> bytes:
        body = {f.name: getattr(self, f.name) for f in fields(self)}
        return json.dumps({"v": FORMAT_VERSION, "sample": body}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Sample":
        obj: dict[str, Any] = json.loads(raw)
        if obj.get("v") != FORMAT_VERSION:
            raise ValueError(f"sample format {obj.get('v')!r} is not {FORMAT_VERSION}")
        return cls(**obj["sample"])
