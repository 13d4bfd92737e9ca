"""The captured turn: what one main chat request leaves behind for training.

A `Turn` holds the prompt ids exactly as sent to the engine and the response
ids and log-probs exactly as the engine returned them (docs/ARCHITECTURE.md §3). A
`FinishedTurn` pairs it with its next state (the messages that followed the
reply) or with the reason it has none.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# Why a finished turn has no next state, or why it cannot become a sample.
SESSION_DONE = "session_done"        # closed by X-Session-Done on this turn
IDLE_TIMEOUT = "idle_timeout"        # the session went quiet
MAX_TURNS = "max_turns"              # session_max_turns reached
SHUTDOWN = "shutdown"                # daemon stopped
EVICTED = "evicted"                  # pushed out by the live-session cap
REGENERATED = "regenerated"          # the user asked again; this branch was abandoned
SAMPLING_PARAMS = "sampling_params"  # not sampled from the full distribution (docs/ARCHITECTURE.md §14)
NO_TRAIN = "no_train"                # X-Clawd-No-Train / no_train
LOGPROB_MISMATCH = "logprob_mismatch"  # engine log-prob ids disagree with output ids


@dataclass(frozen=True)
class Turn:
    session_id: str
    turn_index: int
    principal: str
    request_id: str
    rid: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    temperature: float
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    reply: dict[str, Any]
    finish_reason: str
    policy_version: int
    weight_version: str
    created: float
    excluded: str | None = None  # set at serve time: SAMPLING_PARAMS, NO_TRAIN, ...
    response_top_ids: list[list[int]] | None = None  # each response token's top-k ids (top-K distillation)


@dataclass(frozen=True)
class FinishedTurn:
    turn: Turn
    next_state: list[dict[str, Any]] | None
    reason: str | None  # why next_state is None, or why the turn is excluded
    finished: float

    @property
    def trainable(self) -> bool:
        return self.next_state is not None and self.turn.excluded is None and self.reason is None

    def to_record(self) -> dict[str, Any]:
        # A shallow dict: dataclasses.asdict would deep-copy every id and log-prob.
        return {
            **{f.name: getattr(self.turn, f.name) for f in fields(self.turn)},
            "next_state": self.next_state,
            "reason": self.reason,  # why there is no next state (the turn's own exclusion is "excluded")
            "finished": self.finished,
        }
