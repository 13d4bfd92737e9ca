"""clawd.serving.payload: the sampling params a chat request sends the engine, exact values (pure)."""
from __future__ import annotations

import pytest

from clawd.config.sampling import SamplingConfig
from clawd.serving.errors import ApiError
from clawd.serving.payload import engine_sampling
from clawd.serving.request import Sampling
from clawd.turns import SAMPLING_PARAMS

BASE = {"stop_token_ids": [2, 7], "no_stop_trim": True, "skip_special_tokens": False}
NEUTRAL = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
           "repetition_penalty": 1.0, "min_new_tokens": 0}


def sampling(s: Sampling, cfg: SamplingConfig = SamplingConfig(), *, prompt_len: int = 100, main: bool = True,
             input_limit: int | None = None):
    return engine_sampling(s, cfg, prompt_len=prompt_len, context_length=1000, input_limit=input_limit,
                           max_tokens_cap=256, eos_ids=(2, 7), main=main)


def test_a_main_turn_names_every_field_that_shapes_the_distribution():
    params, temperature, excluded = sampling(Sampling(temperature=0.7, max_tokens=10, stop=("END",)))
    assert params == {**NEUTRAL, **BASE, "max_new_tokens": 10, "stop": ["END"], "temperature": 0.7}
    assert (temperature, excluded) == (0.7, None)


def test_the_cap_and_the_room_bound_max_new_tokens_when_the_client_sets_none():
    assert sampling(Sampling())[0]["max_new_tokens"] == 256
    assert sampling(Sampling(), prompt_len=900)[0]["max_new_tokens"] == 100


def test_a_truncated_distribution_is_served_as_asked_and_never_trains():
    params, temperature, excluded = sampling(Sampling(temperature=0.5, top_p=0.9, top_k=40, seed=3,
                                                      logit_bias={"5": 1.0}))
    assert params == {**BASE, "max_new_tokens": 256, "temperature": 0.5, "top_p": 0.9, "top_k": 40,
                      "logit_bias": {"5": 1.0}, "sampling_seed": 3}
    assert excluded == SAMPLING_PARAMS
    assert sampling(Sampling(temperature=0.01))[2] == SAMPLING_PARAMS  # below min_train_temperature


def test_override_sampling_makes_a_main_turn_sample_at_the_train_temperature_but_not_a_side_turn():
    cfg = SamplingConfig(override_sampling=True, train_temperature=0.9)
    params, temperature, excluded = sampling(Sampling(temperature=0.2, top_p=0.5), cfg)
    assert (params["temperature"], params["top_p"], temperature, excluded) == (0.9, 1.0, 0.9, None)
    side, temperature, _ = sampling(Sampling(temperature=0.2, top_p=0.5), cfg, main=False)
    assert (side["temperature"], side["top_p"], temperature) == (0.2, 0.5, 0.2)
    assert "min_p" not in side  # a side turn is not sent the neutral fields


@pytest.mark.parametrize("kwargs, param", [({"prompt_len": 1000}, "messages"),
                                           ({"prompt_len": 500, "input_limit": 500}, "messages"),
                                           ({"prompt_len": 990, "s": Sampling(max_tokens=20)}, "max_tokens")])
def test_a_prompt_that_leaves_no_room_is_a_400(kwargs, param):
    s = kwargs.pop("s", Sampling())
    with pytest.raises(ApiError) as err:
        sampling(s, **kwargs)
    assert (err.value.status, err.value.code, err.value.param) == (400, "context_length_exceeded", param)
