"""The trainer on the tiny model, on CPU (docs/ARCHITECTURE.md §3, §6): packing, one step, skips, publishing,
checkpoints, and resume after SIGKILL bit for bit."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clawd.config.train import (REGROUPED, LoraConfig, LossConfig, OptimizerConfig, TrainConfig, WorldConfig,
                                regroup)
from clawd.samples import Sample
from clawd.trainer.worker import losses
from clawd.trainer.worker.handler import train_config
from clawd.trainer.worker.batches import mini_batches, pack
from clawd.trainer.worker.step import Trainer, TrainingPaused
from clawd.trainer.worker.losses import warmup_lr
from clawd.weights import restored_weights

REPO = Path(__file__).resolve().parent.parent


def sample(seed: int, length: int, response: int, *, reward: float = 1.0, temperature: float = 1.0,
           hint: bool = False, mask: list[int] | None = None) -> Sample:
    rng = random.Random(seed)
    return Sample(
        sample_id=f"s{seed}", mode="combine", session_id="s", turn_index=0, principal="p",
        tokens=[rng.randrange(4096) for _ in range(length)], response_length=response,
        loss_mask=mask or [1] * response, rollout_logprobs=[-8.0 + rng.random() for _ in range(response)],
        temperature=temperature, reward=reward,
        teacher_logprobs=[-7.0 - rng.random() for _ in range(response)] if hint else None, has_hint=hint,
        policy_version=0, created=0.0, scored=0.0)


def mixed_batch() -> list[Sample]:
    return [sample(1, 12, 5, reward=1.0, temperature=0.7, hint=True),
            sample(2, 30, 9, reward=-1.0),
            sample(3, 7, 3, reward=0.0, temperature=1.3, hint=True),
            sample(4, 21, 14, reward=1.0, mask=[1, 0] * 7)]


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# The step's mechanisms one at a time: one update a batch, each sample's token mean, token-level OPD, no clip,
# unless a test asks for more (the shipped defaults are etc/clawd.toml's, measured there).
UNIT = {"lr": 1e-3, "ppo_mini_batches": 1, "aggregation": "sample_mean", "opd_top_k": 0, "opd_clip": 0.0}
GROUPS = {"optimizer": OptimizerConfig, "loss": LossConfig, "world": WorldConfig, "lora": LoraConfig}


def flat_config(**keys) -> TrainConfig:
    """A TrainConfig from [train] keys named flat (lr=, lora_rank=), regrouped as the loader reads an old file:
    the tests' trainers differ from each other in a key or two, whatever its group."""
    table, _, twice = regroup(keys)
    assert not twice, twice
    return TrainConfig(**{k: GROUPS[k](**v) if k in GROUPS else v for k, v in table.items()})


@pytest.fixture
def make(tiny_model, tmp_path):
    def make(name: str = "state", **cfg) -> Trainer:
        return Trainer(tiny_model, tmp_path / name, flat_config(**{**UNIT, **cfg}))
    return make


# --- config and packing ----------------------------------------------------------------------

def test_config_defaults_and_validation(tiny_model, tmp_path):
    cfg = TrainConfig()
    assert (cfg.optimizer.betas, cfg.optimizer.lr, cfg.micro_batch_tokens, cfg.loss.opd_clip) == \
        ((0.9, 0.999), 1e-5, 8192, 1.0)
    assert (cfg.loss.aggregation, cfg.ppo_mini_batches, cfg.loss.opd_top_k) == ("token_sum", 2,
                                                                                4)  # etc/clawd.toml: why
    for bad in (dict(lr=0), dict(betas=(0.9, 1.0)), dict(aggregation="mean"), dict(ppo_epochs=0),
                dict(device="tpu"), dict(opd_clip=-1.0), dict(keep_versions=0), dict(micro_batch_tokens=1.5),
                dict(grad_clip=math.nan), dict(checkpoint_every=0), dict(tis_cap=0.5), dict(seed=2**32)):
        assert list(flat_config(**bad).check()) == [".".join(REGROUPED.get(k, (k,))) for k in bad]
    with pytest.raises(ValueError, match="tis_cap"):
        Trainer(tiny_model, tmp_path / "state", TrainConfig(loss=LossConfig(tis_cap=0.5)))
    assert not (tmp_path / "state").exists()  # refused before loading or writing anything


def test_the_handler_takes_a_config_or_a_train_table():
    cfg = TrainConfig(micro_batch_tokens=512, optimizer=OptimizerConfig(betas=(0.9, 0.95)),
                      loss=LossConfig(opd_clip=0.5))
    assert train_config(cfg) is cfg
    assert train_config(dataclasses.asdict(cfg)) == cfg      # tuples as the config file's lists
    assert train_config(None) == TrainConfig()
    with pytest.raises(ValueError, match="train.loss.tis_cap: must be a finite number >= 1"):
        train_config({"tis_cap": 0.5})
    with pytest.raises(ValueError, match="train.momentum: unknown key"):
        train_config({"momentum": 0.9})


def test_pack_sorts_by_length_and_keeps_rows_times_longest_within_budget():
    assert pack([5, 3, 9, 4, 3], 12) == [[1, 4, 3], [0], [2]]  # 3·4 = 12; then 5 alone (2·9 > 12)
    assert pack([5, 3, 9, 4, 3], 100) == [[1, 4, 3, 0], [2]]  # 9 would make 21 of 45 padding
    assert pack([5, 3, 9, 4, 3], 100, max_padding=0.5) == [[1, 4, 3, 0, 2]]  # 21/45 <= 0.5
    assert pack([4, 4, 5], 100, max_padding=0.0) == [[0, 1], [2]]
    assert pack([50, 3], 10) == [[1], [0]]                      # too long for the budget: alone
    assert pack([], 10) == []


# --- the forward -----------------------------------------------------------------------------

def test_packed_logprobs_equal_one_sample_per_forward(make):
    trainer = make()
    samples = mixed_batch()
    groups = pack([len(s.tokens) - 1 for s in samples], trainer.cfg.micro_batch_tokens)
    assert groups == [[2, 0], [3, 1]]  # two rows of unequal length each: padding is exercised
    packed = trainer.logprobs(samples)
    with torch.no_grad():
        for s, got in zip(samples, packed):
            logits = trainer.model(torch.tensor([s.tokens])).logits[0, :-1]   # position i scores token i + 1
            want = torch.log_softmax(logits / s.temperature, -1)[-s.response_length:]
            want = want.gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(got), want, rtol=0, atol=1e-6)
    # micro-batches of one or two rows give the same values
    small = Trainer(trainer.model_dir, trainer.state_dir.with_name("small"), TrainConfig(micro_batch_tokens=30))
    for got, want in zip(small.logprobs(samples), packed):
        assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)


def full_logits_path(trainer: Trainer, mb) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unchunked reference: [b, R, V] logits, then losses.token_logprobs / entropy on them."""
    hidden = trainer.model.get_decoder()(input_ids=mb.input_ids, use_cache=False).last_hidden_state
    hidden = hidden.gather(1, mb.positions[..., None].expand(-1, -1, hidden.shape[-1]))
    logits = trainer.model.get_output_embeddings()(hidden)
    return (losses.token_logprobs(logits, mb.targets, mb.temperature), losses.entropy(logits, mb.temperature),
            losses.token_logprobs(logits, mb.targets, 1.0))


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_the_chunked_output_layer_equals_full_logits_on_the_tiny_model(make, chunk):
    # Rows at T 0.7, 1, 1.3 and 1, right-padded in both micro-batches; chunks of 5 cut rows in two.
    trainer = make()
    trainer.head_chunk_tokens = chunk
    gen = torch.Generator().manual_seed(0)
    for mb in trainer._micro_batches(mixed_batch()):
        weights_lp, weights_ent = (torch.randn(mb.mask.shape, generator=gen) * mb.mask for _ in range(2))
        want = full_logits_path(trainer, mb)
        g_want = torch.autograd.grad((weights_lp * want[0]).sum() + (weights_ent * want[1]).sum(), trainer.params)
        got = trainer._forward(trainer.scorer, mb, mb.temperature, with_t1=True)
        g_got = torch.autograd.grad((weights_lp * got[0]).sum() + (weights_ent * got[1]).sum(), trainer.params)
        # float32 rounding only (the matmul's with another row count, the analytic backward's): values
        # within 5e-6 (|lp| ~ 8.3); each gradient within 1e-5 of its largest entry (seen: up to 1e-6)
        assert all(torch.allclose(x, y, rtol=0, atol=5e-6) for x, y in zip(got, want))
        assert all(float((x - y).abs().max()) <= 1e-5 * float(y.abs().max()) for x, y in zip(g_got, g_want))


def test_attention_gets_no_mask_so_sdpa_may_pick_its_flash_kernel(make, monkeypatch):
    # Right-padded rows need only the causal mask; transformers then calls SDPA with is_causal and no
    # attn_mask, the one form its flash kernel takes (any explicit mask rules flash out).
    trainer = make()
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def spy(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **kw):
        calls.append((attn_mask is None, is_causal, enable_gqa))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    trainer.train_step(mixed_batch(), "combine")
    assert len(calls) == 2 * 2 and set(calls) == {(True, True, True)}  # 2 micro-batches × 2 layers; GQA 4:2


def test_cuda_options_memory_fraction_before_loading_and_sdpa(tiny_model, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    calls = []

    def load(*args, **kwargs):
        calls.append(("load", kwargs["attn_implementation"]))
        raise RuntimeError("no GPU here: stop before moving the model")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append(("fraction", f, d)))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load)
    for fraction, want in ((0.4, [("fraction", 0.4, torch.device("cuda")), ("load", "sdpa")]),
                           (0.0, [("load", "sdpa")])):  # 0: the whole device, nothing set
        calls.clear()
        with pytest.raises(RuntimeError, match="stop before"):
            Trainer(tiny_model, tmp_path / "state", TrainConfig(world=WorldConfig(device="cuda",
                                                                                  memory_fraction=fraction)))
        assert calls == want


def test_on_cpu_adamw_is_not_fused_and_the_head_is_one_chunk(make):
    trainer = make()
    assert trainer.optimizer.defaults["fused"] is None and trainer.compute_dtype is None
    assert trainer.head_chunk_tokens == (1 << 28) // 4096  # the tiny vocabulary: 65,536 positions a chunk


# --- one step --------------------------------------------------------------------------------

def test_train_step_changes_the_weights_and_reports_finite_metrics(make):
    trainer = make()
    before = weights(trainer)
    m = trainer.train_step(mixed_batch(), "combine")
    assert not same(before, weights(trainer))
    assert not m["skipped"] and trainer.step == 1 and m["samples"] == 4
    assert m["tokens"] == 5 + 9 + 3 + 7                       # loss tokens
    assert m["forward_tokens"] == 11 + 29 + 6 + 20 and m["micro_batches"] == 2
    assert m["approx_kl"] == 0.0 and m["clip_fraction"] == 0.0  # ppo_epochs = 1: ratio exactly 1
    for key in ("loss", "loss_policy", "grad_norm", "entropy", "tis_mean", "adv_mean", "seconds"):
        assert isinstance(m[key], float) and m[key] == m[key] and abs(m[key]) < 1e6, key
    json.dumps(m)  # plain values for the pipe


def grads_at_step(trainer: Trainer) -> list[torch.Tensor]:
    """The gradients the optimizer is handed on the next step (clipped, accumulated)."""
    seen: list[torch.Tensor] = []
    step = trainer.optimizer.step

    def spy(*a, **kw):
        seen.extend(p.grad.clone() for p in trainer.params)
        return step(*a, **kw)

    trainer.optimizer.step = spy
    return seen


@pytest.mark.parametrize("lora", [0, 8])
def test_layer_recompute_leaves_the_step_alike_and_keeps_a_fraction_of_the_activations(make, lora):
    """`[train] recompute = "on"`: each decoder layer is run again in the backward. The step's gradients and
    weights equal those without it (asserted: 1e-6 relative; measured exactly equal on CPU), parameter names
    are unchanged (checkpoints, publishes and adapters alike), and the tensors autograd saves for the
    backward shrink (measured on the same micro-batch: the layers' intermediates are gone)."""
    from clawd.trainer.worker import recompute

    lr = {"lora_rank": lora, "lora_lr": 1e-3} if lora else {}
    runs = {}
    for mode in ("off", "on"):
        trainer = make(mode, recompute=mode, **lr)
        grads = grads_at_step(trainer)
        trainer.train_step(mixed_batch(), "combine")
        mb = trainer._micro_batches(mixed_batch())[-1]
        scorer = trainer.scorer
        saved = recompute.saved_bytes(lambda: scorer(mb.input_ids, mb.positions, mb.targets, 1.0, False, None, None),
                                      scorer.parameters())
        runs[mode] = (list(grads), weights(trainer), saved, [n for n, _ in trainer.model.named_parameters()])
    (g0, w0, saved_off, names0), (g1, w1, saved_on, names1) = runs["off"], runs["on"]
    rel = lambda a, b: float((a - b).norm() / max(float(b.norm()), 1e-30))
    assert len(g0) == len(g1) and max(rel(a, b) for a, b in zip(g1, g0)) <= 1e-6
    assert w0.keys() == w1.keys() and max(rel(w1[k], w0[k]) for k in w0) <= 1e-6 and names0 == names1
    print(f"\nsaved for the backward: {saved_off} bytes without recompute, {saved_on} with")
    assert saved_on < saved_off / 2
    assert recompute.wanted("auto", torch.device("cuda")) and not recompute.wanted("auto", torch.device("cpu"))
    assert recompute.wanted("on", torch.device("cpu")) and not recompute.wanted("off", torch.device("cuda"))
    assert list(TrainConfig(recompute="sometimes").check()) == ["recompute"]


@pytest.mark.parametrize("where", ["trainer.step.forward", "trainer.step.after_optimizer"])
def test_a_step_out_of_memory_is_reported_as_such_and_fatal_only_once_the_weights_moved(make, where):
    """Running out of memory before the batch's first update leaves the trainer as it was (gradients dropped):
    it carries on, and the next step trains. After an update (the second mini-batch's), its state has moved:
    fatal, restarted from the checkpoint. The wire says "oom" either way, so the daemon splits the batch."""
    from clawd import faults
    from clawd.trainer.child import error_reply
    from clawd.trainer.worker.failures import OutOfMemory

    trainer = make(ppo_mini_batches=2)
    before = weights(trainer)
    faults.arm(where, "oom", at=1)
    try:
        with pytest.raises(OutOfMemory, match="ran out of memory on 4 sample") as caught:
            trainer.train_step(mixed_batch(), "combine")
    finally:
        faults.reset()
    moved = where.endswith("after_optimizer")
    assert caught.value.fatal is moved and trainer.step == 0
    assert same(before, weights(trainer)) is not moved
    assert all(p.grad is None for p in trainer.params)
    reply = error_reply("b1", caught.value)
    assert (reply["kind"], reply["retryable"], reply["fatal"]) == ("oom", False, moved)
    if not moved:
        assert not trainer.train_step(mixed_batch(), "combine")["skipped"] and trainer.step == 1


def test_micro_batches_add_up_to_the_whole_batch(make):
    # The loss is normalised over the whole batch, so splitting it changes nothing but rounding.
    # (Gradients, not weights, are compared: Adam's first step is lr·sign(g), which turns rounding
    # in a near-zero gradient into a full lr.)
    for aggregation in ("sample_mean", "token_mean"):
        one = make(f"one-{aggregation}", aggregation=aggregation, grad_clip=0.0)
        many = make(f"many-{aggregation}", aggregation=aggregation, grad_clip=0.0, micro_batch_tokens=24)
        g1, g2 = grads_at_step(one), grads_at_step(many)
        m1, m2 = one.train_step(mixed_batch(), "combine"), many.train_step(mixed_batch(), "combine")
        assert m1["micro_batches"] == 2 and m2["micro_batches"] == 3  # [6, 11], [20, 29] and [6, 11], [20], [29]
        assert m1["loss"] == pytest.approx(m2["loss"], abs=1e-6)
        assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
        assert len(g1) == len(g2) == len(one.params)
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(g1, g2))


def test_gradients_are_clipped_to_grad_clip(make):
    trainer = make(grad_clip=0.5)
    seen = grads_at_step(trainer)
    m = trainer.train_step(mixed_batch(), "combine")
    # Measured in float64: a float32 norm of the embedding's gradient is itself off by ~2e-5 (losses.squared_norm).
    clipped = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64)
                                                          for g in seen])))
    assert m["grad_norm"] > 1.0 and clipped == pytest.approx(0.5, rel=1e-5)  # metrics report the norm before


@pytest.mark.parametrize("reward", [1.0, -1.0])
def test_reward_moves_the_response_logprob_its_way(make, reward):
    trainer = make(lr=1e-3, reward_baseline="none")
    s = [sample(7, 16, 6, reward=reward)]
    before = sum(trainer.logprobs(s)[0])
    trainer.train_step(s, "rl")
    after = sum(trainer.logprobs(s)[0])
    assert (after - before) * reward > 0.01


def test_with_the_batch_mean_baseline_rewards_move_replies_against_the_batchs_average(make):
    """The default baseline: of a +1 and a -1 reply, the +1 goes up and the -1 down (centred at ±1);
    a batch whose rewards all agree has nothing to tell apart and leaves the weights as they were."""
    trainer = make(lr=1e-3)
    good, bad = sample(7, 16, 6, reward=1.0), sample(8, 16, 6, reward=-1.0)
    before = [sum(lp) for lp in trainer.logprobs([good, bad])]
    m = trainer.train_step([good, bad], "rl")
    after = [sum(lp) for lp in trainer.logprobs([good, bad])]
    assert m["reward_baseline"] == 0.0 and after[0] - before[0] > 0.01 and before[1] - after[1] > 0.01
    fresh = make("fresh", lr=1e-3)  # (a trainer that has stepped before moves on its optimizer's momentum)
    weights = [p.detach().clone() for p in fresh.model.parameters()]
    m = fresh.train_step([good, sample(9, 16, 6, reward=1.0)], "rl")
    assert m["reward_baseline"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(weights, fresh.model.parameters()))


def rollout(s: Sample, reward: float, advantage: float) -> Sample:
    return dataclasses.replace(s, source="set", reward=reward, advantage=advantage)


def test_a_rollouts_group_advantage_is_used_as_is_and_stays_out_of_the_live_baseline(make):
    """A rollout sample's advantage (clawd.rollouts.groups) stands exactly where a live turn's centred reward
    does: the same gradients, bit for bit. It is never centred again, so a group whose checker scores agree
    but whose advantages differ still trains, and its scores do not move the live turns' baseline."""
    a, b = sample(7, 16, 6, reward=1.0), sample(8, 16, 6, reward=-1.0)
    live = make("live")
    seen_live = grads_at_step(live)
    live.train_step([a, b], "rl")  # batch mean 0: centred +1, -1
    sets = make("set")
    seen_set = grads_at_step(sets)
    m = sets.train_step([rollout(a, 1.0, 1.0), rollout(b, 1.0, -1.0)], "rl")  # scores agree, advantages not
    assert not m["skipped"] and seen_set and all(torch.equal(x, y) for x, y in zip(seen_live, seen_set))
    mixed = make("mixed").train_step([a, sample(9, 16, 6, reward=1.0), rollout(b, -1.0, 0.5)], "rl")
    assert mixed["reward_baseline"] == 1.0  # the live turns' mean alone (with the rollout's score: 1/3)


def test_ppo_epochs_take_several_steps_against_a_fixed_lp_old(make):
    trainer = make(ppo_epochs=2)
    m = trainer.train_step(mixed_batch(), "combine")
    assert m["epochs"] == 2 and trainer.step == 1
    assert m["approx_kl"] > 0  # the second epoch's ratio is no longer 1
    assert int(trainer.optimizer.state[trainer.params[0]]["step"]) == 2


def test_mini_batches_and_warmup_lr():
    assert mini_batches(5, 2) == [[0, 2, 4], [1, 3]]
    assert mini_batches(2, 4) == [[0], [1]] and mini_batches(3, 1) == [[0, 1, 2]]
    assert [warmup_lr(1.0, s, 4) for s in (1, 2, 3, 4, 9)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert warmup_lr(1.0, 1, 0) == 1.0


def test_a_batch_without_signal_takes_no_optimizer_step(make):
    # rl with the batch-mean baseline: rewards that all agree centre to 0, so every advantage is 0. AdamW would
    # still move every weight by about lr through its momentum after one real step: no step at all.
    trainer = make()
    trainer.train_step([sample(1, 12, 5, reward=1.0), sample(2, 30, 9, reward=-1.0)], "rl")
    before, state = weights(trainer), optimizer_state(trainer)
    m = trainer.train_step([sample(3, 12, 5, reward=1.0), sample(4, 30, 9, reward=1.0)], "rl")
    assert m["skipped"] and m["no_signal"] and m["updates"] == 0 and m["skip_reason"].startswith("no signal")
    assert same(weights(trainer), before) and all(map(torch.equal, optimizer_state(trainer), state))
    assert trainer.step == 2 and trainer.skipped_steps == 0 and trainer.consecutive_skips == 0  # not a fault
    # a hint is a signal in opd and combine, whatever the rewards
    assert not trainer.train_step([sample(5, 12, 5, reward=1.0, hint=True)], "combine")["skipped"]
    assert not trainer.train_step([sample(6, 12, 5, reward=0.0, hint=True)], "opd")["skipped"]


def test_mini_batches_take_one_step_each_and_the_ratio_moves(make):
    trainer = make(ppo_mini_batches=2)
    m = trainer.train_step(mixed_batch(), "combine")
    assert m["mini_batches"] == 2 and m["updates"] == 2 and trainer.step == 1
    assert int(trainer.optimizer.state[trainer.params[0]]["step"]) == 2
    assert m["approx_kl"] > 0  # the second mini-batch's ratio is no longer 1
    # the baseline is the whole batch's: a part whose rewards all agree still carries signal against it
    trainer = make("agree", ppo_mini_batches=2)
    m = trainer.train_step([sample(i, 12, 5, reward=1.0) for i in range(3)] + [sample(9, 12, 5, reward=-1.0)], "rl")
    assert m["updates"] == 2  # {s0, s2} and {s1, s9}: centred +0.5 each, both carry signal
    trainer = make("none", ppo_mini_batches=3)
    m = trainer.train_step([sample(i, 12, 5, reward=0.0, hint=i == 1) for i in range(3)], "combine")
    assert m["updates"] == 1 and int(trainer.optimizer.state[trainer.params[0]]["step"]) == 1  # only the hinted
    # part: rewards of 0 and no hint elsewhere, so those parts take no step


def test_warmup_ramps_the_learning_rate_over_the_first_steps(make):
    trainer = make(warmup_steps=4, lr=1e-3)
    lrs = [trainer.train_step(mixed_batch(), "combine")["lr"] for _ in range(5)]
    assert lrs == [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3]
    assert trainer.optimizer.param_groups[0]["lr"] == 1e-3


def test_the_step_reports_its_answer_length(make):
    assert make().train_step(mixed_batch(), "combine")["response_tokens_mean"] == (5 + 9 + 3 + 14) / 4


def test_an_entropy_bonus_reaches_the_weights_through_the_chunked_head(make):
    # entropy_coef > 0 sends a gradient through the entropy output (it is a detached metric otherwise);
    # token_mean, so the entropy term is the plain per-token mean that the metric reports
    plain, bonus = make("plain", aggregation="token_mean"), make("bonus", aggregation="token_mean", entropy_coef=10.0)
    g_plain, g_bonus = grads_at_step(plain), grads_at_step(bonus)
    m0, m1 = plain.train_step(mixed_batch(), "combine"), bonus.train_step(mixed_batch(), "combine")
    assert "loss_entropy" not in m0 and m1["loss_entropy"] == pytest.approx(m0["entropy"], rel=1e-6)
    assert m1["loss"] == pytest.approx(m0["loss"] - 10.0 * m1["loss_entropy"], rel=1e-6)
    assert not torch.equal(g_plain[0], g_bonus[0])


def with_reference(samples: list[Sample], logprobs: list[list[float]]) -> list[Sample]:
    return [dataclasses.replace(s, reference_logprobs=lps) for s, lps in zip(samples, logprobs)]


def test_the_kl_term_reads_the_journaled_reference_at_t1_and_grows_from_zero(make):
    """A full fine-tune keeps no second copy of the model: the KL's reference log-probs come with the samples
    (the reference engine's at scoring, at T = 1), and the trainer compares its own at T = 1 with them."""
    trainer = make(kl_loss_coef=0.5, aggregation="token_mean")
    reference = trainer.logprobs(mixed_batch(), temperature=1.0)  # the initial weights are the reference
    batch = with_reference(mixed_batch(), reference)
    assert abs(trainer.train_step(batch, "combine")["loss_kl"]) <= 1e-12
    assert trainer.train_step(batch, "combine")["loss_kl"] > 1e-6  # step 1 moved the weights
    # samples scored without reference log-probs add no KL, however far the policy moved
    assert trainer.train_step(mixed_batch(), "combine")["loss_kl"] == 0.0


def test_the_kl_term_equals_k3_of_the_t1_logprobs(make):
    trainer = make(kl_loss_coef=1.0, aggregation="token_mean")
    batch = mixed_batch()
    reference = [[lp - 0.3 * (i % 3) for i, lp in enumerate(row)] for row in trainer.logprobs(batch, temperature=1.0)]
    now = trainer.logprobs(batch, temperature=1.0)
    kl = [math.exp(r - p) - (r - p) - 1 for s, ps, rs in zip(batch, now, reference)
          for p, r, keep in zip(ps, rs, s.loss_mask) if keep]
    m = trainer.train_step(with_reference(batch, reference), "combine")
    assert m["loss_kl"] == pytest.approx(sum(kl) / len(kl), rel=1e-5)


def with_top(s: Sample, ids: list[list[int]], teacher: list[list[float]]) -> Sample:
    return dataclasses.replace(s, top_ids=ids, teacher_top_logprobs=teacher)


def test_top_k_opd_is_the_subset_distillation_of_the_full_logits(make):
    """The top-K term's value and gradient against the same formula on the model's full logits: for each
    hinted position, A_k = softmax(lp_k)·clip(teacher_k − lp_k, ±1) over the student's top-k ids, loss −Σ_k A_k."""
    trainer = make(opd_clip=1.0, opd_top_k=3, grad_clip=0.0)  # the gradient as computed
    batch = [s for s in mixed_batch() if s.has_hint]
    tops, targets = [], []
    with torch.no_grad():
        for s in batch:
            logits = trainer.model(torch.tensor([s.tokens])).logits[0, :-1][-s.response_length:]
            ids = torch.log_softmax(logits, -1).topk(3).indices
            g = torch.Generator().manual_seed(len(s.tokens))
            teacher = torch.log_softmax(logits, -1).gather(-1, ids) + torch.randn(ids.shape, generator=g)
            tops.append(with_top(s, ids.tolist(), teacher.tolist()))
    seen = grads_at_step(trainer)
    m = trainer.train_step(tops, "opd")
    # the same loss on full logits, by autograd, from the same starting weights
    fresh = make("fresh", opd_clip=1.0, opd_top_k=3, grad_clip=0.0)
    total = 0.0
    for s in tops:
        logits = fresh.model(torch.tensor([s.tokens])).logits[0, :-1][-s.response_length:]
        lp_k = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.top_ids))
        old = lp_k.detach()
        adv = torch.softmax(old, -1) * (torch.tensor(s.teacher_top_logprobs) - old).clamp(-1, 1)
        total = total + (-(adv * torch.exp(lp_k - old)).sum(-1)).mean() / len(tops)  # sample_mean
    total.backward()
    total = total.detach()
    assert m["loss_opd_topk"] == pytest.approx(total.item(), rel=1e-5)
    assert m["loss_policy"] == 0.0  # the hinted rows with top-k leave the token-level term
    want = [p.grad for p in fresh.params]
    assert max(float((a - b).abs().max() / (b.abs().max() + 1e-12)) for a, b in zip(seen, want)) < 1e-4


def test_mini_batches_with_and_without_top_k_rows_report_the_same_parts(make):
    """One mini-batch holds the top-k rows, the other none: each update reports every part (a rank or an update
    without top-k rows adds 0), so the step's averages and a world's sum see the same names. This step raised
    KeyError: 'opd_topk' and the trainer restarted on it forever in a combine run."""
    trainer = make(opd_top_k=2, ppo_mini_batches=2, kl_loss_coef=0.1)
    hinted, plain = [s for s in mixed_batch() if s.has_hint][0], [s for s in mixed_batch() if not s.has_hint][0]
    hinted = with_top(hinted, [[1, 2]] * hinted.response_length, [[-1.0, -2.0]] * hinted.response_length)
    m = trainer.train_step([hinted, plain], "combine")  # dealt round robin: one sample a mini-batch
    assert m["updates"] == 2 and m["loss_opd_topk"] != 0.0 and not m["skipped"]
    assert {"loss_policy", "loss_opd_topk", "loss_kl", "loss"} <= m.keys()
    # with opd_top_k = 0 the same rows are distilled token by token
    assert "loss_opd_topk" not in make("plain").train_step([hinted, plain], "combine")


def test_top_k_rows_of_another_width_fall_back_to_the_token_level_term(make):
    trainer = make(opd_top_k=2)
    a, b = [s for s in mixed_batch() if s.has_hint]
    a = with_top(a, [[1, 2]] * a.response_length, [[-1.0, -2.0]] * a.response_length)
    b = with_top(b, [[1, 2, 3]] * b.response_length, [[-1.0, -2.0, -3.0]] * b.response_length)
    m = trainer.train_step([a, b], "opd")
    assert m["loss_policy"] != 0.0 and m["loss_opd_topk"] != 0.0  # b (width 3) is in the top-k term, a is not


# --- non-finite steps ------------------------------------------------------------------------

def optimizer_state(trainer: Trainer) -> list[torch.Tensor]:
    return [v.clone() for st in trainer.optimizer.state.values() for v in st.values()]


def test_a_non_finite_loss_skips_the_step_and_three_in_a_row_pause(make):
    trainer = make()
    trainer.train_step(mixed_batch(), "rl")  # optimizer state exists
    before, opt_before = weights(trainer), optimizer_state(trainer)
    poison = mixed_batch() + [sample(9, 10, 4, temperature=1e-40)]  # logits / T overflow: NaN log-probs
    for k in range(1, 4):
        m = trainer.train_step(poison, "rl")
        assert m["skipped"] and "non-finite loss" in m["skip_reason"]
        assert m["skipped_total"] == k and m["paused"] == (k == 3)
        assert same(before, weights(trainer))
        assert all(torch.equal(a, b) for a, b in zip(opt_before, optimizer_state(trainer)))
        assert all(p.grad is None for p in trainer.params)
    assert "3 non-finite steps in a row" in trainer.pause_reason and trainer.step == 4
    with pytest.raises(TrainingPaused):
        trainer.train_step(mixed_batch(), "rl")
    trainer.unpause()
    assert not trainer.train_step(mixed_batch(), "rl")["skipped"]


def test_a_non_finite_gradient_skips_and_a_good_step_resets_the_count(make):
    trainer = make()
    before = weights(trainer)
    hook = trainer.params[-1].register_hook(lambda g: torch.full_like(g, float("nan")))
    for _ in range(2):
        m = trainer.train_step(mixed_batch(), "rl")
        assert m["skipped"] and "gradient" in m["skip_reason"] and m["loss"] == m["loss"]
    assert same(before, weights(trainer))
    hook.remove()
    assert not trainer.train_step(mixed_batch(), "rl")["skipped"] and trainer.consecutive_skips == 0
    hook = trainer.params[-1].register_hook(lambda g: torch.full_like(g, float("inf")))
    assert trainer.train_step(mixed_batch(), "rl")["skipped"] and not trainer.paused  # 1 in a row, not 3


# --- publishing ------------------------------------------------------------------------------

def test_publish_writes_a_loadable_directory_and_keeps_the_last_versions(make, tiny_model):
    from transformers import AutoModelForCausalLM

    trainer = make(keep_versions=2)
    trainer.train_step(mixed_batch(), "combine")
    path = trainer.publish(1)
    assert path == trainer.state_dir / "weights" / "v000001" and trainer.version == 1
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (path / name).is_file(), name
    assert (path / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert same(weights(trainer), {k: v for k, v in loaded.state_dict().items()})
    for bad in (1, 0):
        with pytest.raises(ValueError, match="must be an integer above"):
            trainer.publish(bad)
    trainer.publish(2)
    trainer.publish(5)
    assert sorted(p.name for p in (trainer.state_dir / "weights").iterdir()) == ["v000002", "v000005"]
    trainer.checkpoint()  # holds v5: kept while newer versions rotate, since a restart serves it again
    for v in (6, 7, 8):
        trainer.publish(v)
    assert sorted(p.name for p in (trainer.state_dir / "weights").iterdir()) == ["v000005", "v000007", "v000008"]


def test_a_failed_publish_leaves_no_directory(make, monkeypatch):
    trainer = make()

    def broken(dest, **kw):
        (Path(dest) / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(trainer.model, "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        trainer.publish(1)
    assert list((trainer.state_dir / "weights").iterdir()) == [] and trainer.version == 0


# --- checkpoints -----------------------------------------------------------------------------

def test_checkpoint_resume_restores_state_and_skips_incomplete_ones(make):
    trainer = make(checkpoint_every=2)
    trainer.train_step(mixed_batch(), "combine")
    trainer.publish(1)
    assert not trainer.checkpoint_due
    trainer.publish(2)
    assert trainer.checkpoint_due
    trainer.checkpoint({"segment": 3, "offset": 120})
    assert not trainer.checkpoint_due
    trainer.checkpoint({"segment": 3, "offset": 121})
    trainer.checkpoint({"segment": 4, "offset": 0})
    ckpts = trainer.state_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["ckpt-00000002", "ckpt-00000003"]
    (ckpts / "ckpt-00000004").mkdir()                        # no `complete` marker: ignored
    (ckpts / ".ckpt-00000005.tmp-x").mkdir()                 # a crashed write: removed
    trainer.publish(3)                                        # after the checkpoint, then "crash"

    again = make()
    assert again.journal_position == {"segment": 4, "offset": 0} and again.step == 1
    assert again.version == 3                                 # v3 exists on disk: never reused
    assert again.weights_version == 2                         # but its weights are the checkpoint's
    assert restored_weights(trainer.state_dir) == (2, trainer.state_dir / "weights" / "v000002")
    assert same(weights(trainer), weights(again))
    assert not (ckpts / ".ckpt-00000005.tmp-x").exists()
    again.checkpoint("next")                                  # keeps the 2 newest complete ones
    assert sorted(p.name for p in ckpts.iterdir()) == ["ckpt-00000003", "ckpt-00000005"]
    s1, s2 = trainer.optimizer.state_dict()["state"], again.optimizer.state_dict()["state"]
    assert all(torch.equal(s1[i][k], s2[i][k]) for i in s1 for k in s1[i])
    shutil.rmtree(trainer.state_dir / "weights" / "v000002")  # rotated out: the daemon cannot serve it
    assert restored_weights(trainer.state_dir) is None


@pytest.mark.slow
def test_resume_after_sigkill_matches_a_straight_run_bit_for_bit(tiny_model, tmp_path):
    n = 3

    def run(state: Path, count: int, out: str, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "tests.trainer_run", str(tiny_model), str(state),
                                 str(count), str(tmp_path / out), *extra],
                                cwd=REPO, stdout=subprocess.PIPE, text=True)

    def finish(proc: subprocess.Popen, out: str) -> tuple[dict, dict]:
        from safetensors.torch import load_file
        assert proc.wait(timeout=120) == 0
        proc.stdout.close()
        return json.loads((tmp_path / f"{out}.json").read_text()), load_file(tmp_path / f"{out}.safetensors")

    straight = run(tmp_path / "a", 2 * n, "straight")
    first = run(tmp_path / "b", n, "first", "--extra-then-hang")
    assert first.stdout.readline() == "ready\n"  # n steps checkpointed, one more trained and published
    os.kill(first.pid, signal.SIGKILL)
    assert first.wait(timeout=30) == -signal.SIGKILL
    first.stdout.close()
    whole, whole_w = finish(straight, "straight")
    head = json.loads((tmp_path / "first.json").read_text())
    tail, tail_w = finish(run(tmp_path / "b", n, "second"), "second")

    assert tail["start_step"] == n and tail["journal_position"] == n
    assert tail["start_version"] == n + 1                     # the lost step's v4 is never reused
    assert tail["versions"] == [f"v{v:06d}" for v in range(n + 2, 2 * n + 2)]
    assert head["losses"] + tail["losses"] == whole["losses"]  # exact float equality
    assert whole_w.keys() == tail_w.keys() and all(torch.equal(whole_w[k], tail_w[k]) for k in whole_w)
