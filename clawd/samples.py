"""The training sample: the currency between scoring, the journal, the learner and the trainer.

One finished main turn that scoring kept becomes one `Sample` (docs/ARCHITECTURE.md §3):
`tokens = prompt ids + response ids` exactly as the engine consumed and
produced them; `loss_mask`, `rollout_logprobs` and (with a hint)
`teacher_logprobs` have the response's length. `has_hint = False` makes the
OPD term of the loss exactly zero.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from typing import Any

FORMAT_VERSION = 1  # bumped when a field changes meaning; the journal stores it with every sample

MODES = ("rl", "opd", "combine")


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
        if self.reward not in (-1.0, 0.0, 1.0):
            out.append(f"reward {self.reward} is not -1, 0 or +1")
        if not 0 < self.temperature <= 2:
            out.append(f"temperature {self.temperature} is outside (0, 2]")
        return out

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
