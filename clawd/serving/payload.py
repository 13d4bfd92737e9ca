"""The request → engine payload of one chat completion, pure: the sampling params the engine is sent, the
temperature the turn is sampled at, and whether it can train (docs/ARCHITECTURE.md §14: only the untruncated
distribution at a temperature in [min_train_temperature, 2] trains; a main turn with `override_sampling`
is sampled at `train_temperature` whatever the client asked).
"""
from __future__ import annotations

from typing import Any, Sequence

from clawd.config.sampling import SamplingConfig
from clawd.engine.client import NEUTRAL_SAMPLING
from clawd.serving.errors import ApiError
from clawd.serving.request import Sampling
from clawd.turns import SAMPLING_PARAMS


def engine_sampling(s: Sampling, cfg: SamplingConfig, *, prompt_len: int, context_length: int,
                    input_limit: int | None, max_tokens_cap: int, eos_ids: Sequence[int],
                    main: bool) -> tuple[dict, float, str | None]:
    """(the engine's sampling params, the temperature sampled at, the reason the turn cannot train or None).
    `input_limit`: the engine's own bound on a prompt, a few tokens under the context (SGLang); None: none.
    ApiError 400 when the prompt leaves no room or max_tokens asks for more than it leaves."""
    room = context_length - prompt_len
    if room < 1:
        raise ApiError(400, f"The prompt is {prompt_len} tokens, which leaves no room in the model's "
                       f"context of {context_length} tokens", param="messages",
                       code="context_length_exceeded")
    if input_limit is not None and prompt_len >= input_limit:
        raise ApiError(400, f"The prompt is {prompt_len} tokens; the model engine accepts prompts of fewer "
                       f"than {input_limit}", param="messages", code="context_length_exceeded")
    if s.max_tokens is not None and s.max_tokens > room:
        raise ApiError(400, f"max_tokens is {s.max_tokens}, but the prompt ({prompt_len} tokens) leaves "
                       f"{room} of the model's {context_length}", param="max_tokens",
                       code="context_length_exceeded")
    max_new = s.max_tokens or min(max_tokens_cap, room)
    params: dict[str, Any] = {"max_new_tokens": max_new, "stop_token_ids": list(eos_ids),
                              "no_stop_trim": True, "skip_special_tokens": False}
    if s.stop:
        params["stop"] = list(s.stop)
    excluded = None
    if main and cfg.override_sampling:
        temperature = cfg.train_temperature
        params.update(temperature=temperature, top_p=1.0, top_k=-1)
    else:
        temperature = cfg.default_temperature if s.temperature is None else s.temperature
        params.update(temperature=temperature, top_p=1.0 if s.top_p is None else s.top_p,
                      top_k=s.top_k or -1)
        for key in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if getattr(s, key) is not None:
                params[key] = getattr(s, key)
        if s.logit_bias:
            params["logit_bias"] = dict(s.logit_bias)
        if s.seed is not None:
            params["sampling_seed"] = s.seed
        if not s.full_distribution() or not cfg.min_train_temperature <= temperature <= 2.0:
            excluded = SAMPLING_PARAMS
    if main and excluded is None:
        # A trainable turn names every field that shapes the distribution, at its neutral value: an
        # engine's --preferred-sampling-params fill only the fields a request leaves out.
        params = {**NEUTRAL_SAMPLING, **params}
    return params, temperature, excluded
