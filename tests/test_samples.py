"""The training sample's sources (clawd/samples.py): live turns and rollout samples, and the journal's JSON."""
import dataclasses
import json

import pytest

from clawd.samples import Sample

from .trainer_handlers import make_sample


def test_a_sample_journaled_before_sources_reads_as_a_live_turn():
    old = json.loads(make_sample(1).to_json())
    del old["sample"]["source"], old["sample"]["advantage"]
    back = Sample.from_json(json.dumps(old).encode())
    assert (back.source, back.advantage) == ("live", None) and back == make_sample(1)


def test_a_rollout_sample_round_trips_with_its_source_and_advantage():
    s = dataclasses.replace(make_sample(2), source="env", reward=0.25, advantage=-0.125)
    assert Sample.from_json(s.to_json()) == s


@pytest.mark.parametrize("change, problem", [
    ({"source": "web"}, "source 'web' is not one of"),
    ({"advantage": 0.5}, "a live turn's advantage comes from its batch"),
    ({"reward": 0.5}, "reward 0.5 is not -1, 0 or +1"),                     # live: the judge's vote
    ({"source": "set"}, "a rollout needs a finite advantage, not None"),
    ({"source": "set", "advantage": float("nan")}, "a rollout needs a finite advantage"),
    ({"source": "set", "advantage": 0.0, "reward": 1.5}, "a rollout's reward 1.5 is not a number in [-1, 1]"),
])
def test_what_a_sample_of_each_source_must_hold(change, problem):
    with pytest.raises(ValueError, match=problem.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        dataclasses.replace(make_sample(3), **change)
    assert dataclasses.replace(make_sample(3), source="set", reward=0.5, advantage=0.25).problems() == []
