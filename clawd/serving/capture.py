"""The captured turn of one main chat completion, pure: what the session table keeps and scoring learns from
(docs/ARCHITECTURE.md §3): the prompt ids sent, the engine's own output ids and log-probs, the reply as the
client got it, the versions that produced it, and why it cannot train, if it cannot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clawd.serving.reply import ReplyBuilder
from clawd.serving.request import ChatRequest
from clawd.turns import LOGPROB_MISMATCH, Turn


@dataclass
class Capture:
    """What a main turn's request knew before the engine answered."""
    admission: Any          # the session table's admission of this turn (clawd.serving.sessions.Admission)
    principal: str
    temperature: float      # the temperature it was sampled at (clawd.serving.payload)
    excluded: str | None    # why it cannot train, known before the reply (sampling params, no_train)
    version: int            # the policy version serving when it began
    req: ChatRequest


def captured_turn(cap: Capture, rid: str, prompt_ids: list[int], out: ReplyBuilder, *, top_k: int,
                  weight_version: str, now: float) -> Turn:
    """The turn; excluded (LOGPROB_MISMATCH) when the engine's log-prob ids are not its output ids or a
    log-prob is missing: training on them would teach the wrong tokens. `weight_version`: the policy's, for a
    reply whose replica named none."""
    excluded = cap.excluded
    if out.logprob_ids != out.ids or any(lp is None for lp in out.logprobs):
        excluded = LOGPROB_MISMATCH
    return Turn(
        session_id=cap.admission.session_id, turn_index=cap.admission.turn_index, principal=cap.principal,
        request_id=out.completion_id, rid=rid, prompt_ids=prompt_ids, response_ids=out.ids,
        response_logprobs=[float(lp) if lp is not None else float("nan") for lp in out.logprobs],
        response_top_ids=top_ids_of(out, top_k),
        temperature=cap.temperature, messages=cap.req.render_messages, tools=cap.req.tools,
        reply=out.reply_message(), finish_reason=out.finish_reason, policy_version=out.version(cap.version),
        weight_version=out.weight_version or weight_version, created=now, excluded=excluded)


def top_ids_of(out: ReplyBuilder, k: int) -> list[list[int]] | None:
    """The reply's top-k ids at each token (top-K distillation), or None: not asked for, or not k a token
    (an engine that leaves them out: the teacher then scores the sampled tokens only)."""
    if not k or len(out.top_ids) != len(out.ids) or any(len(row) != k for row in out.top_ids):
        return None
    return out.top_ids
