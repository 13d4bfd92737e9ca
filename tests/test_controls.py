"""clawd.learning.controls: the negative-control batches, exact values."""
from __future__ import annotations

import dataclasses
import random

import pytest

from clawd.config.loading import config_from_dict, ConfigError
from clawd.learning import controls
from tests.trainer_handlers import make_sample

REWARDS = [1.0, -1.0, 0.0, 1.0, 1.0]


def batch() -> list:
    out = []
    for i, r in enumerate(REWARDS):
        hinted = i < 2
        out.append(dataclasses.replace(make_sample(i), mode="combine", reward=r, has_hint=hinted,
                                       teacher_logprobs=[-0.25] * 4 if hinted else None))
    return out


def test_none_is_the_batch_itself():
    b = batch()
    assert controls.apply("none", b, random.Random(0)) is b


def test_zero_rewards_keeps_every_token_and_drops_every_signal():
    b = batch()
    out = controls.apply("zero_rewards", b, random.Random(0))
    assert [s.reward for s in out] == [0.0] * 5
    assert [(s.has_hint, s.teacher_logprobs) for s in out] == [(False, None)] * 5
    assert [dataclasses.replace(s, reward=0.0, has_hint=False, teacher_logprobs=None) for s in b] == out
    assert [s.reward for s in b] == REWARDS  # the journal's samples are untouched


@pytest.mark.parametrize("control", ["shuffle_rewards", "zero_rewards"])
def test_a_control_drops_the_top_k_teacher_rows_with_the_hint(control):
    """Top-K OPD (opd_top_k > 0, the default) puts top-k rows on hinted samples; a sample without its hint
    cannot keep them, and the control once raised building it (ValueError: every control run in combine mode
    with top-K died at its first hinted batch)."""
    b = [dataclasses.replace(s, top_ids=[[5, 6]] * 4, teacher_top_logprobs=[[-0.5, -1.5]] * 4) if s.has_hint
         else s for s in batch()]
    out = controls.apply(control, b, random.Random(0))
    assert [(s.has_hint, s.teacher_logprobs, s.top_ids, s.teacher_top_logprobs) for s in out] == \
        [(False, None, None, None)] * 5
    assert [s.tokens for s in out] == [s.tokens for s in b]


def test_shuffle_rewards_is_a_seeded_permutation_of_the_batchs_rewards():
    out = controls.apply("shuffle_rewards", batch(), random.Random(0))
    expected = list(REWARDS)
    random.Random(0).shuffle(expected)
    assert [s.reward for s in out] == expected == [0.0, -1.0, 1.0, 1.0, 1.0]
    assert [s.sample_id for s in out] == [f"s{i}" for i in range(5)]
    assert not any(s.has_hint for s in out)


def test_shuffle_rewards_does_not_depend_on_the_order_samples_reached_the_batch():
    b = [dataclasses.replace(s, tokens=[7 - i] + s.tokens[1:]) for i, s in enumerate(batch())]  # s4 sorts first
    forward = {s.sample_id: s.reward for s in controls.apply("shuffle_rewards", b, random.Random(3))}
    backward = {s.sample_id: s.reward for s in controls.apply("shuffle_rewards", b[::-1], random.Random(3))}
    dealt = list(REWARDS[::-1])  # the canonical order: by tokens, s4 first
    random.Random(3).shuffle(dealt)
    assert forward == backward == {f"s{4 - k}": r for k, r in enumerate(dealt)}


def test_an_unknown_control_is_refused_here_and_in_the_config():
    with pytest.raises(ValueError, match="one of"):
        controls.apply("invert", batch(), random.Random(0))
    with pytest.raises(ConfigError, match="learner.control: must be one of"):
        config_from_dict({"learner": {"control": "invert"}})
    assert config_from_dict({"learner": {"control": "shuffle_rewards"}}).learner.control == "shuffle_rewards"


def test_a_zero_reward_batch_leaves_the_weights_exactly_as_they_were(tiny_model, tmp_path):
    """The zero-reward control through the real trainer: no advantage anywhere, so no update at all
    (AdamW's first step from zero gradients is zero); the same batch with its rewards moves them."""
    from clawd.config.train import OptimizerConfig, TrainConfig
    from clawd.trainer.worker.step import Trainer
    import torch

    b = [dataclasses.replace(s, tokens=[100 + i + j for j in range(len(s.tokens))]) for i, s in enumerate(batch())]
    trainer = Trainer(tiny_model, tmp_path / "zero", TrainConfig(optimizer=OptimizerConfig(lr=1e-3)))
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train_step(controls.apply("zero_rewards", b, random.Random(0)), "combine")
    assert all(torch.equal(a, p) for a, p in zip(weights, trainer.model.parameters()))
    trainer = Trainer(tiny_model, tmp_path / "real", TrainConfig(optimizer=OptimizerConfig(lr=1e-3)))
    trainer.train_step(b, "combine")
    assert not all(torch.equal(a, p) for a, p in zip(weights, trainer.model.parameters()))


def test_the_learner_trains_a_batch_in_an_order_of_its_own():
    from clawd.learning.limits import canonical

    b = [dataclasses.replace(s, tokens=[9 - i % 3] + s.tokens[1:]) for i, s in enumerate(batch())]
    assert [s.sample_id for s in canonical(b)] == ["s2", "s1", "s4", "s0", "s3"]  # by tokens, then id
    assert canonical(b[::-1]) == canonical(b)


def test_a_control_deals_a_rollouts_score_and_advantage_together():
    """Rollout samples (clawd.rollouts) carry their group advantage: shuffled, it travels with its score; zeroed,
    it is 0. A live turn dealt a rollout's pair keeps a live reward (the advantage's sign), and the other way
    round a rollout takes the live reward as its advantage."""
    live = [dataclasses.replace(make_sample(i), reward=r) for i, r in enumerate([1.0, -1.0])]
    sets = [dataclasses.replace(make_sample(i + 2), source="set", reward=r, advantage=a)
            for i, (r, a) in enumerate([(1.0, 0.5), (0.0, -0.5)])]
    out = controls.apply("zero_rewards", live + sets, random.Random(0))
    assert [(s.reward, s.advantage) for s in out] == [(0.0, None), (0.0, None), (0.0, 0.0), (0.0, 0.0)]
    out = controls.apply("shuffle_rewards", sets, random.Random(1))
    assert sorted((s.reward, s.advantage) for s in out) == [(0.0, -0.5), (1.0, 0.5)]
    crossed = controls._scored(live[0], 1.0, -0.5), controls._scored(sets[0], -1.0, None)
    assert [(s.source, s.reward, s.advantage) for s in crossed] == [("live", -1.0, None), ("set", 0.0, -1.0)]
