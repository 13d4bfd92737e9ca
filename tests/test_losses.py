"""The loss functions against hand computations (docs/ARCHITECTURE.md §3).

Float64 wherever the claim is a value; torch.equal wherever the claim is exactness. Log-probs are
written as log(probability) so the ratios in the comments are the ones on paper.
"""
from __future__ import annotations

import math

import pytest
import torch

from clawd.config.train import LossConfig
from clawd.trainer.worker import head, losses

F64 = torch.float64
NAN, INF = math.nan, math.inf
ln = math.log


def t(values, dtype=F64, **kw):
    return torch.tensor(values, dtype=dtype, **kw)


def lp(*probs):
    """Log-probs written as the probabilities they come from."""
    return t([ln(p) if p is not None else NAN for p in probs])


def close(a, b, atol=1e-12):
    b = torch.as_tensor(b, dtype=a.dtype)
    return torch.allclose(a, b, rtol=0, atol=atol, equal_nan=False)


# --- log-probs at the sample's temperature ---------------------------------------------------

def test_token_logprobs_divide_by_each_rows_temperature():
    # row 0 at T = 2: [0, 2·ln2, 0] / 2 = [0, ln2, 0] → softmax [1/4, 2/4, 1/4]; target 0 → ln(1/4)
    # row 1 at T = ½: [0, ½·ln3, 0] / ½ = [0, ln3, 0] → softmax [1/5, 3/5, 1/5]; target 1 → ln(3/5)
    logits = t([[[0.0, 2 * ln(2), 0.0]], [[0.0, 0.5 * ln(3), 0.0]]])  # [B=2, T=1, V=3]
    targets = torch.tensor([[0], [1]])
    temps = t([2.0, 0.5])
    out = losses.token_logprobs(logits, targets, temps)
    assert out.shape == (2, 1)
    assert close(out, [[ln(1 / 4)], [ln(3 / 5)]])
    manual = torch.log_softmax(logits / temps[:, None, None], dim=-1).gather(-1, targets[..., None])[..., 0]
    assert close(out, manual)
    # a plain number is one temperature for all: row 0 at T = 1 → softmax [1/6, 4/6, 1/6] → ln(1/6)
    assert close(losses.token_logprobs(logits, targets, 1.0)[0], [ln(1 / 6)])
    # packed 1-D tokens with a temperature per token give the same numbers
    assert close(losses.token_logprobs(logits[:, 0], targets[:, 0], temps), out[:, 0])


def test_token_logprobs_are_at_least_float32():
    logits = torch.randn(2, 3, 7).to(torch.bfloat16)
    targets = torch.randint(0, 7, (2, 3))
    out = losses.token_logprobs(logits, targets, 0.7)
    assert out.dtype == torch.float32
    assert torch.allclose(out, torch.log_softmax(logits.float() / 0.7, -1).gather(-1, targets[..., None])[..., 0])
    assert losses.token_logprobs(logits.to(F64), targets).dtype == F64


def test_entropy_at_temperature():
    logits = t([[0.0, 2 * ln(2), 0.0]])
    # T = 2: p = [1/4, 1/2, 1/4] → H = 2·(1/4)·ln4 + (1/2)·ln2 = 1.5·ln2
    assert close(losses.entropy(logits, 2.0), [1.5 * ln(2)])
    # T = 1: p = [1/6, 4/6, 1/6] → H = 2·(1/6)·ln6 + (4/6)·ln(6/4)
    assert close(losses.entropy(logits, 1.0), [ln(6) / 3 + (2 / 3) * ln(1.5)])
    # uniform: ln V at any temperature
    assert close(losses.entropy(torch.zeros(2, 4, dtype=F64), t([0.3, 1.7])), [ln(4), ln(4)])


# --- the same from hidden states, in chunks --------------------------------------------------

def _full_head(hidden, weight, bias, targets, temps):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return (losses.token_logprobs(logits, targets, temps), losses.entropy(logits, temps),
            losses.token_logprobs(logits, targets, 1.0))


@pytest.mark.parametrize("chunk", [1, 4, 7, 100])
def test_head_logprobs_in_chunks_equal_the_full_logits_path(chunk):
    # [B=3, R=5] positions, V = 11, rows at T 0.7, 1 and 1.3; chunks of 4 and 7 cut rows in two.
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 6, dtype=F64, generator=gen, requires_grad=True)
    weight = torch.randn(11, 6, dtype=F64, generator=gen, requires_grad=True)
    bias = torch.randn(11, dtype=F64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5), generator=gen)
    temps = t([0.7, 1.0, 1.3])
    a, c = torch.randn(3, 5, dtype=F64, generator=gen), torch.randn(3, 5, dtype=F64, generator=gen)
    want = _full_head(hidden, weight, bias, targets, temps)
    got = head.head_logprobs(hidden, weight, targets, temps, bias=bias, with_t1=True, chunk_tokens=chunk)
    assert all(close(x, y, atol=1e-13) for x, y in zip(got, want))
    assert not got[2].requires_grad  # the T = 1 log-probs only ever feed the (detached) OPD term
    # gradients through the log-probs, the entropy, and both (float64: rounding only)
    for f in (lambda lp, ent: (a * lp).sum(), lambda lp, ent: (c * ent).sum(),
              lambda lp, ent: (a * lp).sum() + (c * ent).sum()):
        g_want = torch.autograd.grad(f(*_full_head(hidden, weight, bias, targets, temps)[:2]), (hidden, weight, bias))
        lp, ent, _ = head.head_logprobs(hidden, weight, targets, temps, bias=bias, chunk_tokens=chunk)
        g_got = torch.autograd.grad(f(lp, ent), (hidden, weight, bias))
        assert all(close(x, y, atol=1e-12) for x, y in zip(g_got, g_want))


def test_head_logprobs_gradcheck_and_without_t1():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 3, 4, dtype=F64, generator=gen, requires_grad=True)
    weight = torch.randn(6, 4, dtype=F64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 6, (2, 3), generator=gen)
    temps = t([0.5, 2.0])
    assert head.head_logprobs(hidden, weight, targets, temps)[2] is None
    assert torch.autograd.gradcheck(
        lambda h, w: head.head_logprobs(h, w, targets, temps, chunk_tokens=4)[:2], (hidden, weight))


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_head_logprobs_at_ids_equal_the_full_logits_path_with_gradients(chunk):
    # top-K distillation's student side: T = 1 log-probs at K ids a position (duplicates allowed), with grad
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 11, (2, 5, 3))
    ids[0, 0] = torch.tensor([4, 4, 7])
    upstream = torch.randn(2, 5, 3, dtype=torch.float64)
    want = torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias), -1).gather(-1, ids)
    got = head.head_logprobs_at(hidden, weight, ids, bias=bias, chunk_tokens=chunk)
    assert got.shape == (2, 5, 3) and torch.allclose(got, want, atol=1e-13, rtol=0)
    grads = torch.autograd.grad((want * upstream).sum(), (hidden, weight, bias))
    for a, b in zip(torch.autograd.grad((got * upstream).sum(), (hidden, weight, bias)), grads):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)
    # K = 1 at the sampled ids is the token log-prob at T = 1 (the KL's side), now with a gradient
    targets = ids[..., 0]
    lp1 = head.head_logprobs(hidden, weight, targets, 1.0, bias=bias, with_t1=True)[2]
    at = head.head_logprobs_at(hidden, weight, targets[..., None], bias=bias)[..., 0]
    assert torch.allclose(at, lp1, atol=1e-13, rtol=0) and at.requires_grad and not lp1.requires_grad
    assert torch.autograd.gradcheck(lambda h, w: head.head_logprobs_at(h, w, ids[:1, :3], chunk_tokens=2),
                                    (hidden.detach()[:1, :3].requires_grad_(), weight))


def test_head_logprobs_in_bfloat16_are_those_of_autocast_logits():
    # The trainer on CUDA: bf16 logits (what autocast's linear gives), log-softmax in float32.
    gen = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(2, 9, 16, generator=gen), torch.randn(50, 16, generator=gen)
    targets, temps = torch.randint(0, 50, (2, 9), generator=gen), torch.tensor([0.7, 1.0])
    logits = torch.nn.functional.linear(hidden.bfloat16(), weight.bfloat16())
    lp, ent, _ = head.head_logprobs(hidden, weight, targets, temps, chunk_tokens=5, compute_dtype=torch.bfloat16)
    assert lp.dtype == ent.dtype == torch.float32
    # float32 after the same bf16 logits: only the reductions' order may differ (|lp| ~ 5, |H| ~ 3)
    assert torch.allclose(lp, losses.token_logprobs(logits, targets, temps), rtol=0, atol=1e-6)
    assert torch.allclose(ent, losses.entropy(logits, temps), rtol=0, atol=1e-6)


# --- advantages ------------------------------------------------------------------------------

REWARD = t([1.0, -1.0, 0.0])
LP_OLD_T1 = t([[-1.0, -2.0], [-0.5, -3.0], [-1.0, -1.0]])
TEACHER = t([[-0.5, -4.0], [NAN, NAN], [-1.25, -0.25]])  # row 1 has no hint: its slot is garbage
HAS_HINT = torch.tensor([True, False, True])
# teacher − lp_old_t1 = [[0.5, −2.0], [·, ·], [−0.25, 0.75]]: dyadic, so every line below is exact


def test_rl_advantage_is_the_reward_on_every_token():
    a = losses.advantages("rl", REWARD, LP_OLD_T1)
    assert torch.equal(a, t([[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]]))


def test_the_batch_mean_baseline_counts_scored_samples_only_and_centres_them():
    assert losses.reward_baseline([1.0, 1.0, -1.0, 0.0]) == 1 / 3   # the 0 is "no score" (a hint alone)
    assert losses.reward_baseline([0.0, 0.0]) == 0.0 and losses.reward_baseline([]) == 0.0
    r = torch.tensor([1.0, 1.0, -1.0, 0.0], dtype=torch.float64)
    assert losses.centre_rewards(r, 1 / 3).tolist() == [1 - 1 / 3, 1 - 1 / 3, -1 - 1 / 3, 0.0]
    # all equal (or zeroed): nothing is pushed either way
    same = torch.tensor([-1.0, -1.0, -1.0])
    assert losses.centre_rewards(same, losses.reward_baseline(same.tolist())).tolist() == [0.0, 0.0, 0.0]
    # a shuffle changes which reply gets which reward, never the baseline
    assert losses.reward_baseline([-1.0, 1.0, 1.0, 0.0]) == losses.reward_baseline([1.0, 1.0, -1.0, 0.0])


def test_a_rollouts_group_advantage_is_never_centred_again():
    r = torch.tensor([1.0, 0.25, -1.0, 0.0], dtype=torch.float64)  # rows 1 and 3 hold group advantages
    preset = torch.tensor([False, True, False, True])
    assert losses.centre_rewards(r, 0.5, preset).tolist() == [0.5, 0.25, -1.5, 0.0]
    assert losses.centre_rewards(r, 0.5).tolist() == [0.5, -0.25, -1.5, 0.0]  # without preset: all live
    assert (losses.centred(1.0, 0.5), losses.centred(0.0, 0.5), losses.centred(1.0, 0.5, -0.75)) == (0.5, 0.0, -0.75)
    assert losses.centred(0.0, 0.5, 0.0) == 0.0  # an answer exactly at its group's mean


def test_opd_advantage_is_teacher_minus_old_and_zero_without_a_hint():
    a = losses.advantages("opd", REWARD, LP_OLD_T1, TEACHER, HAS_HINT)
    assert torch.equal(a, t([[0.5, -2.0], [0.0, 0.0], [-0.25, 0.75]]))


def test_opd_clip_bounds_the_gap_on_both_sides():
    # clip 1.0: −2.0 → −1.0; 0.5, −0.25, 0.75 are inside
    a = losses.advantages("opd", REWARD, LP_OLD_T1, TEACHER, HAS_HINT, opd_clip=1.0)
    assert torch.equal(a, t([[0.5, -1.0], [0.0, 0.0], [-0.25, 0.75]]))
    # clip 0.5: 0.75 → 0.5 on the upper side as well
    a = losses.advantages("opd", REWARD, LP_OLD_T1, TEACHER, HAS_HINT, opd_clip=0.5)
    assert torch.equal(a, t([[0.5, -0.5], [0.0, 0.0], [-0.25, 0.5]]))


def test_combine_advantage_weights_both_terms():
    # w_rl = 0.5, w_opd = 2:
    #   row 0:  0.5·1    + 2·[0.5, −2]      = [1.5, −3.5]
    #   row 1:  0.5·(−1) + 0 (no hint)      = [−0.5, −0.5]
    #   row 2:  0.5·0    + 2·[−0.25, 0.75]  = [−0.5, 1.5]
    a = losses.advantages("combine", REWARD, LP_OLD_T1, TEACHER, HAS_HINT, w_rl=0.5, w_opd=2.0)
    assert torch.equal(a, t([[1.5, -3.5], [-0.5, -0.5], [-0.5, 1.5]]))


@pytest.mark.parametrize("garbage", [NAN, INF, -INF, 1e30, 0.0])
def test_combine_opd_term_is_exactly_zero_without_a_hint(garbage):
    # A (teacher − old)·0 would give NaN for NaN/inf slots and a garbage slot of 0.0 gives −lp_old:
    # only a term that is never computed for these rows is exactly 0. float32, as in training.
    lp_old_t1 = torch.randn(3, 5, dtype=torch.float32) - 2
    reward = torch.tensor([1.0, -1.0, 1.0])
    teacher = torch.full((3, 5), garbage)
    for w_rl, w_opd in [(1.0, 1.0), (0.3, 7.0)]:
        a = losses.advantages("combine", reward, lp_old_t1, teacher, torch.tensor([False] * 3), w_rl=w_rl, w_opd=w_opd)
        assert torch.equal(a, (w_rl * reward)[:, None].expand(3, 5))
        assert torch.equal(losses.opd_term(lp_old_t1, teacher, torch.tensor([False] * 3)), torch.zeros(3, 5))


def test_advantages_are_detached_and_modes_are_checked():
    lp_old_t1 = LP_OLD_T1.clone().requires_grad_()
    teacher = t([[-0.5, -4.0], [0.0, 0.0], [-1.25, -0.25]]).requires_grad_()
    for mode in losses.MODES:
        assert not losses.advantages(mode, REWARD, lp_old_t1, teacher, HAS_HINT).requires_grad
    with pytest.raises(ValueError):
        losses.advantages("grpo", REWARD, LP_OLD_T1)
    with pytest.raises(ValueError):
        losses.advantages("combine", REWARD, LP_OLD_T1)  # no teacher


# --- ratio, clip, TIS ------------------------------------------------------------------------

def test_ppo_surrogate_clips_on_both_sides():
    # ε = 0.2, ε_high = 0.28: clip(ratio) ∈ [0.8, 1.28]; loss = −min(r·A, clip(r)·A)
    ratio = t([1.5, 0.5, 0.5, 1.5, 1.1], requires_grad=True)
    adv = t([2.0, 2.0, -1.0, -1.0, 3.0])
    loss = losses.ppo_surrogate(ratio, adv, 0.2, 0.28)
    assert close(loss, [
        -2.56,  # A > 0, r above 1+ε_high: min(3.0, 1.28·2 = 2.56) → clipped branch
        -1.0,   # A > 0, r below 1−ε:      min(1.0, 0.8·2 = 1.6)   → unclipped (the worse side)
        0.8,    # A < 0, r below 1−ε:      min(−0.5, 0.8·−1 = −0.8) → clipped branch
        1.5,    # A < 0, r above 1+ε_high: min(−1.5, 1.28·−1)     → unclipped
        -3.3,   # inside the range:        1.1·3
    ])
    loss.sum().backward()
    # d/dratio: 0 where the clipped branch is taken, −A elsewhere
    assert close(ratio.grad, [0.0, -2.0, 0.0, 1.0, -3.0])


def test_tis_weight_is_the_capped_ratio_to_the_rollout_and_detached():
    lp_old = lp(0.75, 0.9, 0.4, 0.25).requires_grad_()
    lp_rollout = lp(0.5, 0.3, 0.8, 0.25)
    # π_old/π_rollout = [1.5, 3 → capped at 2, 0.5, 1]
    w = losses.tis_weight(lp_old, lp_rollout, cap=2.0)
    assert close(w, [1.5, 2.0, 0.5, 1.0])
    assert not w.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_ratio_and_tis_weight_are_exactly_one_when_all_logprobs_agree(dtype):
    lps = torch.log_softmax(torch.randn(3, 6, 11, dtype=dtype), -1).max(-1).values - 0.1
    lp_new = lps.clone().requires_grad_()
    lp_old, lp_rollout = lp_new.detach(), lps.clone()
    assert torch.equal(losses.ppo_ratio(lp_new, lp_old), torch.ones_like(lps))
    assert torch.equal(losses.tis_weight(lp_old, lp_rollout), torch.ones_like(lps))
    # then the loss is −aggregate(A), bit for bit, and no token is clipped
    adv = torch.randn(3, 6, dtype=dtype)
    mask = torch.ones(3, 6)
    mask[1, 4:] = 0
    loss = losses.policy_loss(lp_new, lp_old, lp_rollout, adv, mask)
    assert torch.equal(loss, -losses.aggregate(adv, mask))
    m = losses.loss_metrics(lp_new, lp_old, lp_rollout, adv, mask)
    assert (m["clip_fraction"], m["tis_mean"], m["tis_clipped_fraction"], m["approx_kl"],
            m["rollout_lp_abs_diff"]) == (0.0, 1.0, 0.0, 0.0, 0.0)


# --- aggregation -----------------------------------------------------------------------------

def test_aggregations_by_hand():
    x = t([[1.0, 2.0, 3.0], [4.0, NAN, INF]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # sample_mean: (mean[1, 2, 3] + mean[4]) / 2 samples = (2 + 4) / 2
    assert close(losses.aggregate(x, mask), 3.0)
    # token_mean: (1 + 2 + 3 + 4) / 4 tokens
    assert close(losses.aggregate(x, mask, aggregation="token_mean"), 2.5)
    # the whole batch had 4 samples: this half is (2 + 4) / 4
    assert close(losses.aggregate(x, mask, normaliser=4.0), 1.5)
    # a sample without a loss token adds 0 and still counts: (1.5 + 0) / 2
    assert close(losses.aggregate(t([[1.0, 2.0], [5.0, 5.0]]), torch.tensor([[1, 1], [0, 0]])), 0.75)
    with pytest.raises(ValueError):
        losses.aggregate(x, mask, aggregation="seq_sum")


def test_batch_normaliser_and_token_sum():
    assert losses.batch_normaliser(2, 7, "sample_mean") == 2.0
    assert losses.batch_normaliser(2, 7, "token_mean") == 7.0
    assert losses.batch_normaliser(2, 7, "token_sum", 256) == 512.0
    assert losses.batch_normaliser(0, 0, "token_sum", 256) == 1.0  # never 0
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # every token weighs 1 / (2 samples x 4): the long sample's tokens as much as the short one's
    assert float(losses.aggregate(x, mask, aggregation="token_sum", normaliser=8.0)) == 10.0 / 8.0
    assert float(losses.aggregate(x, mask, aggregation="sample_mean")) == (2.0 + 4.0) / 2
    # the length bias, exactly: one -1 advantage on every token; sample_mean pushes each token of the
    # 1-token reply 3 times as hard as each of the 3-token reply's, token_sum the same on both
    lp = torch.zeros(2, 3, requires_grad=True)
    for aggregation, norm, want in (("sample_mean", 2.0, [[1 / 6] * 3, [1 / 2, 0, 0]]),
                                    ("token_sum", 8.0, [[1 / 8] * 3, [1 / 8, 0, 0]])):
        lp.grad = None
        losses.policy_loss(lp, lp.detach(), lp.detach(), -torch.ones(2, 3), mask, aggregation=aggregation,
                           normaliser=norm).backward()
        assert torch.allclose(lp.grad, torch.tensor(want)), aggregation


@pytest.mark.parametrize("mode, rewards, hints, kw, signal", [
    ("rl", [0.0, 0.0], [False, False], {}, False),
    ("rl", [0.5, -0.5], [False, False], {}, True),
    ("rl", [0.0, 0.0], [True, True], {}, False),            # a hint is no rl signal
    ("opd", [0.0], [True], {}, True),
    ("opd", [0.0], [False], {}, False),
    ("combine", [0.0, 0.0], [False, False], {}, False),
    ("combine", [0.0, 0.0], [False, True], {}, True),
    ("combine", [0.0, 0.0], [False, True], {"w_opd": 0.0}, False),
    ("combine", [1.0], [False], {"w_rl": 0.0}, False),
    ("rl", [0.0], [False], {"kl_coef": 0.1}, True),          # a KL or entropy term has a gradient anyway
    ("rl", [0.0], [False], {"entropy_coef": 0.01}, True),
])
def test_carries_signal(mode, rewards, hints, kw, signal):
    assert losses.carries_signal(mode, rewards, hints, **kw) is signal


def test_centred():
    assert [losses.centred(r, 0.5) for r in (1.0, -1.0, 0.0)] == [0.5, -1.5, 0.0]


def test_whole_batch_normaliser():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert losses.whole_batch_normaliser(mask, "sample_mean") == 2.0
    assert losses.whole_batch_normaliser(mask, "token_mean") == 2.0
    assert losses.whole_batch_normaliser(torch.zeros(3, 4), "token_mean") == 1.0  # never 0
    with pytest.raises(ValueError):
        losses.whole_batch_normaliser(mask, "mean")


# --- the policy loss -------------------------------------------------------------------------

# Two samples, three slots; sample 1 has two tokens and one padded slot full of garbage.
#   sample 0: ratio [1.5, 1, 0.5]   w = π_old/π_rollout [1, 2, 1]   A [1, 1, −1]
#       t0  −min(1.5·1, 1.28·1)   · 1 = −1.28      (clipped branch)
#       t1  −(1·1)                · 2 = −2
#       t2  −min(−0.5, 0.8·−1)    · 1 =  0.8       (clipped branch)
#       sum −2.48, token mean −2.48/3
#   sample 1: ratio [1, 1.1]        w [4 → 2, 1]                     A [−1, −1]
#       t0  −(1·−1)               · 2 =  2
#       t1  −(1.1·−1)             · 1 =  1.1       (inside the range)
#       sum 3.1, token mean 1.55
LP_NEW = lp(0.75, 0.5, 0.25, 0.5, 0.55, 0.9).reshape(2, 3)
LP_OLD = lp(0.5, 0.5, 0.5, 0.5, 0.5, None).reshape(2, 3)
LP_ROLLOUT = lp(0.5, 0.25, 0.5, 0.125, 0.5, None).reshape(2, 3)
ADV = t([[1.0, 1.0, -1.0], [-1.0, -1.0, NAN]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_policy_loss_sample_mean_by_hand():
    lp_new = LP_NEW.clone().requires_grad_()
    loss = losses.policy_loss(lp_new, LP_OLD, LP_ROLLOUT, ADV, MASK)
    assert close(loss, (-2.48 / 3 + 1.55) / 2)
    loss.backward()
    # d/dlp_new = −w·A·ratio / (sample length · 2 samples), 0 where the clipped branch is taken
    #   sample 0: [0, −2·1·1/6, 0];  sample 1: [−2·(−1)·1/4, −1·(−1)·1.1/4, 0 (padding)]
    assert close(lp_new.grad, [[0.0, -1 / 3, 0.0], [0.5, 0.275, 0.0]])


def test_policy_loss_token_mean_by_hand():
    lp_new = LP_NEW.clone().requires_grad_()
    loss = losses.policy_loss(lp_new, LP_OLD, LP_ROLLOUT, ADV, MASK, aggregation="token_mean")
    assert close(loss, (-2.48 + 3.1) / 5)
    loss.backward()
    # the same per-token gradients, each over 5 tokens
    assert close(lp_new.grad, [[0.0, -2 / 5, 0.0], [2 / 5, 1.1 / 5, 0.0]])


def test_one_pass_gradient_is_the_tis_weighted_policy_gradient():
    # ppo_epochs = 1: lp_old is lp_new detached, ratio 1, no clip: ∂loss/∂lp_new = −w·A / (len·B)
    torch.manual_seed(0)
    lp_new = (torch.rand(3, 4, dtype=F64).log()).requires_grad_()
    lp_rollout = lp_new.detach() + 0.5 * torch.randn(3, 4, dtype=F64)
    adv = torch.randn(3, 4, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 0], [1, 1, 0, 0]])
    losses.policy_loss(lp_new, lp_new.detach(), lp_rollout, adv, mask).backward()
    w = torch.exp(lp_new.detach() - lp_rollout).clamp(max=2.0)
    assert close(lp_new.grad, -w * adv * mask / (mask.sum(-1, keepdim=True) * 3))


def test_padding_contributes_nothing_whatever_it_holds():
    def run(pad):
        lp_new = LP_NEW.clone().requires_grad_()
        filled = [x.clone() for x in (LP_OLD, LP_ROLLOUT, ADV, LP_OLD, t([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))]
        for x in filled:
            x[1, 2] = pad
        lp_old, lp_rollout, adv, lp_ref, ent = filled
        loss, parts = losses.total_loss(lp_new, lp_old, lp_rollout, adv, MASK,
                                        LossConfig(aggregation="sample_mean", kl_coef=0.1,
                                                   entropy_coef=0.01), lp_ref=lp_ref, entropy=ent)
        loss.backward()
        return loss, parts, lp_new.grad

    clean = run(0.0)
    assert torch.isfinite(clean[0]) and torch.isfinite(clean[2]).all()
    for pad in (NAN, INF, -INF, 1e30, -1e30):
        loss, parts, grad = run(pad)
        assert torch.equal(loss, clean[0]) and parts == clean[1] and torch.equal(grad, clean[2]), pad
        assert grad[1, 2] == 0.0


@pytest.mark.parametrize("aggregation", losses.AGGREGATIONS)
def test_micro_batches_add_up_to_the_whole_batch(aggregation):
    """Two micro-batches, each padded to its own length, with the whole batch's normaliser: the
    summed losses, the summed parts and the accumulated gradients equal one big batch's."""
    torch.manual_seed(1)
    B, T, V = 4, 5, 7
    lengths = [3, 1, 5, 2]
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    mask[2, 1] = 0  # a loss_mask 0 inside a sample
    logits = torch.randn(B, T, V, dtype=F64, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    temps = t([1.0, 0.7, 1.3, 1.0])
    reward = t([1.0, -1.0, 0.0, 1.0])
    teacher = torch.randn(B, T, dtype=F64) - 2
    has_hint = torch.tensor([True, False, True, False])
    with torch.no_grad():  # an earlier policy (ppo_epochs > 1), so some ratios leave the clip range
        lp_old = losses.token_logprobs(logits + 0.3 * torch.randn(B, T, V, dtype=F64), targets, temps)
        lp_ref = losses.token_logprobs(logits + 0.2 * torch.randn(B, T, V, dtype=F64), targets, temps)
    lp_rollout = lp_old + 0.4 * torch.randn(B, T, dtype=F64)
    norm = losses.whole_batch_normaliser(mask, aggregation)
    cfg = LossConfig(aggregation=aggregation, kl_coef=0.1, entropy_coef=0.01)

    def step(rows, width, normaliser=norm):
        lg, tg, tp = logits[rows, :width], targets[rows, :width], temps[rows]
        lp_new = losses.token_logprobs(lg, tg, tp)
        with torch.no_grad():
            lp_old_t1 = losses.token_logprobs(lg, tg, 1.0)
        adv = losses.advantages("combine", reward[rows], lp_old_t1, teacher[rows, :width], has_hint[rows])
        return losses.total_loss(lp_new, lp_old[rows, :width], lp_rollout[rows, :width], adv, mask[rows, :width], cfg,
                                 normaliser=normaliser, lp_ref=lp_ref[rows, :width], entropy=losses.entropy(lg, tp))

    whole, whole_parts = step(slice(0, 4), T)
    whole.backward()
    whole_grad, logits.grad = logits.grad.clone(), None
    assert losses.loss_metrics(losses.token_logprobs(logits, targets, temps), lp_old, lp_rollout, torch.ones(B, T),
                          mask)["clip_fraction"] > 0  # the clip is exercised

    first, first_parts = step(slice(0, 2), 3)   # widest sample of the pair: 3 tokens
    second, second_parts = step(slice(2, 4), 5)
    first.backward()
    second.backward()
    assert close(first + second, whole)
    assert all(math.isclose(first_parts[k] + second_parts[k], whole_parts[k], rel_tol=1e-12) for k in whole_parts)
    assert close(logits.grad, whole_grad)
    # each micro-batch normalised by itself would not add up
    assert not close(step(slice(0, 2), 3, None)[0] + step(slice(2, 4), 5, None)[0], whole, atol=1e-6)


# --- KL, entropy bonus, total loss -----------------------------------------------------------

def test_kl_k3_by_hand():
    lp_new = lp(0.5, 0.5, 0.5).requires_grad_()
    lp_ref = lp(1.0, 0.5, 0.25)
    # d = lp_ref − lp_new = [ln2, 0, −ln2];  exp(d) − d − 1 = [1 − ln2, 0, ln2 − 1/2]
    k3 = losses.kl_k3(lp_new, lp_ref)
    assert close(k3, [1 - ln(2), 0.0, ln(2) - 0.5])
    assert k3[1].item() == 0.0  # exactly, where the two agree
    k3.sum().backward()
    # ∂/∂lp_new = 1 − exp(d) = [−1, 0, 1/2]
    assert close(lp_new.grad, [-1.0, 0.0, 0.5])


def test_total_loss_without_its_extra_terms_is_the_policy_loss():
    loss, parts = losses.total_loss(LP_NEW, LP_OLD, LP_ROLLOUT, ADV, MASK, LossConfig(aggregation="sample_mean"))
    assert torch.equal(loss, losses.policy_loss(LP_NEW, LP_OLD, LP_ROLLOUT, ADV, MASK))
    assert parts == {"policy_loss": loss.item()}


def test_total_loss_with_kl_and_entropy_by_hand():
    # one sample, two tokens, ratio 1, w 1, A [1, −1] → policy loss mean[−1, 1] = 0
    lp_new = lp(0.5, 0.5).reshape(1, 2).requires_grad_()
    lp_ref = lp(1.0, 0.25).reshape(1, 2)          # k3 = [1 − ln2, ln2 − 1/2] → mean 1/4
    ent = t([[1.0, 2.0]], requires_grad=True)     # mean 1.5
    adv, mask = t([[1.0, -1.0]]), torch.ones(1, 2)
    loss, parts = losses.total_loss(lp_new, lp_new.detach(), lp_new.detach(), adv, mask,
                                    LossConfig(aggregation="sample_mean", kl_coef=0.5,
                                               entropy_coef=0.1), lp_ref=lp_ref, entropy=ent)
    # 0 + 0.5·0.25 − 0.1·1.5
    assert close(loss, -0.025)
    assert parts.keys() == {"policy_loss", "kl", "entropy"}
    assert math.isclose(parts["policy_loss"], 0.0, abs_tol=1e-15)
    assert math.isclose(parts["kl"], 0.25, rel_tol=1e-12) and parts["entropy"] == 1.5
    loss.backward()
    # the entropy bonus pushes entropy up: ∂loss/∂H = −0.1 / 2 tokens
    assert close(ent.grad, [[-0.05, -0.05]])
    with pytest.raises(ValueError):
        losses.total_loss(lp_new, lp_new.detach(), lp_new.detach(), adv, mask, LossConfig(aggregation="sample_mean",
                                                                                          kl_coef=0.1))
    with pytest.raises(ValueError):
        losses.total_loss(lp_new, lp_new.detach(), lp_new.detach(), adv, mask, LossConfig(aggregation="sample_mean",
                                                                                          entropy_coef=0.1))


# --- metrics ---------------------------------------------------------------------------------

def test_loss_metrics_by_hand():
    # the five tokens of the surrogate test, plus a masked sixth full of NaN
    lp_new = lp(0.75, 0.25, 0.25, 0.75, 0.55, None)   # over π_old = 0.5: ratio [1.5, .5, .5, 1.5, 1.1]
    lp_old = lp(0.5, 0.5, 0.5, 0.5, 0.5, None)
    lp_rollout = lp(0.5, 0.4, 0.125, 0.5, 0.5, None)  # π_old/π_rollout = [1, 1.25, 4, 1, 1]
    adv = t([2.0, 2.0, -1.0, -1.0, 3.0, NAN])
    ent = t([0.5, 1.0, 1.5, 2.0, 2.5, NAN])
    mask = torch.tensor([1, 1, 1, 1, 1, 0])
    m = losses.loss_metrics(lp_new, lp_old, lp_rollout, adv, mask, entropy=ent)
    expected = {
        "tokens": 5.0,
        "clip_fraction": 2 / 5,                    # tokens 0 and 2 take the clipped branch
        # Σ (r − 1 − ln r): 2·(0.5 − ln1.5) + 2·(−0.5 + ln2) + (0.1 − ln1.1)
        "approx_kl": (2 * ln(4 / 3) + 0.1 - ln(1.1)) / 5,
        "rollout_lp_abs_diff": (ln(1.25) + ln(4)) / 5,  # = ln5 / 5
        "tis_mean": (1 + 1.25 + 2 + 1 + 1) / 5,    # 4 capped at 2
        "tis_clipped_fraction": 1 / 5,
        "adv_mean": 1.0,                           # (2 + 2 − 1 − 1 + 3) / 5
        "adv_std": math.sqrt(14 / 5),              # deviations [1, 1, −2, −2, 2]
        "adv_min": -1.0,
        "adv_max": 3.0,
        "entropy": 1.5,
    }
    assert m.keys() == expected.keys()
    for k, v in expected.items():
        assert math.isclose(m[k], v, rel_tol=1e-12, abs_tol=1e-15), k
        assert type(m[k]) is float


def test_loss_metrics_without_tokens_are_nan():
    x = t([[0.0, 0.0]])
    m = losses.loss_metrics(x, x, x, x, torch.zeros(1, 2))
    assert m["tokens"] == 0.0 and math.isnan(m["clip_fraction"]) and math.isnan(m["adv_min"])


def test_grad_norm():
    a = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(1, 1, dtype=torch.bfloat16))
    c = torch.nn.Parameter(torch.zeros(3))  # no gradient: skipped
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([[4.0]], dtype=torch.bfloat16)
    assert losses.grad_norm([a, b, c]) == 5.0       # sqrt(3² + 4²)
    assert losses.grad_norm([c]) == 0.0
    a.grad[1] = INF
    assert losses.grad_norm([a, b]) == INF
    a.grad[1] = NAN
    assert math.isnan(losses.grad_norm([a, b]))


# --- top-K distillation ----------------------------------------------------------------------

def test_topk_opd_advantage_by_hand():
    # The student's subset log-probs ln[1/2, 1/4, 1/8]: inside the subset, probabilities [4, 2, 1] / 7.
    old = t([[[ln(0.5), ln(0.25), ln(0.125)]]])
    teacher = t([[[ln(0.5), ln(0.25) + 3.0, ln(0.125) - 0.5]]])  # gaps [0, 3, -0.5]; clip 1 → [0, 1, -0.5]
    adv = losses.topk_opd_advantages(old, teacher, clip=1.0)
    assert close(adv, [[[0.0, 2 / 7, -0.5 / 7]]])
    assert close(losses.topk_opd_advantages(old, teacher, clip=None), [[[0.0, 6 / 7, -0.5 / 7]]])
    assert not adv.requires_grad


def test_topk_opd_loss_by_hand_and_its_gradient_is_minus_the_advantage():
    # two samples of two positions, K = 2; the second sample carries no top-k rows (NaN in its slots)
    lp_new = t([[[ln(0.5), ln(0.25)], [ln(0.25), ln(0.25)]],
                [[math.nan, math.nan], [math.nan, math.nan]]]).requires_grad_()
    teacher = t([[[ln(0.5) + 0.5, ln(0.25) - 2.0], [ln(0.25), ln(0.25) + 0.25]],
                 [[math.nan, math.nan], [math.nan, math.nan]]])
    rows, mask = torch.tensor([True, False]), t([[1.0, 1.0], [1.0, 1.0]])
    loss = losses.topk_opd_loss(lp_new, lp_new.detach(), teacher, rows, mask, clip=1.0)
    # position 0: weights [2/3, 1/3], gaps [0.5, -1 (clipped)] → A [1/3, -1/3]; position 1: [1/2, 1/2]·[0, 0.25]
    a = [[1 / 3, -1 / 3], [0.0, 0.125]]
    # ratio 1: per position −Σ_k A_k = [0, −0.125]; sample_mean: (0 − 0.125) / 2 positions / 2 samples
    assert close(loss, -0.125 / 4)
    loss.backward()
    assert close(lp_new.grad[0], [[-x / 4 for x in a[0]], [-x / 4 for x in a[1]]])
    assert torch.equal(lp_new.grad[1], torch.zeros(2, 2))  # no top-k rows: nothing, NaN slots or not
    # in total_loss it is a part of its own, weighted by w_opd
    zero = torch.zeros(2, 2)
    total, parts = losses.total_loss(zero, zero, zero, zero, mask, LossConfig(aggregation="sample_mean"),
                                     topk=losses.TopK(
        lp_new.detach(), lp_new.detach(), teacher, rows, weight=2.0, clip=1.0))
    assert close(total, 2 * -0.125 / 4) and math.isclose(parts["opd_topk"], -0.125 / 4, rel_tol=1e-12)


def test_the_kl_term_reads_its_own_logprobs_on_the_rows_that_have_a_reference():
    # the reference is at T = 1: the trainer passes its T = 1 log-probs as kl_lp, and rows without one drop out
    lp_new = lp(0.5, 0.5, 0.5, 0.5).reshape(2, 2)
    kl_lp = lp(0.5, 0.5, 0.5, 0.5).reshape(2, 2).requires_grad_()
    lp_ref = t([[ln(1.0), ln(0.25)], [math.nan, math.nan]])
    mask = torch.ones(2, 2)
    loss, parts = losses.total_loss(lp_new, lp_new, lp_new, torch.zeros(2, 2), mask,
                                    LossConfig(aggregation="sample_mean", kl_coef=1.0),
                                    lp_ref=lp_ref, kl_lp=kl_lp, kl_rows=torch.tensor([True, False]))
    # row 0: k3 = [1 − ln2, ln2 − 1/2], its mean 1/4; row 1 adds 0; sample_mean over 2 samples
    assert math.isclose(parts["kl"], 0.125, rel_tol=1e-12)
    loss.backward()
    assert close(kl_lp.grad, [[-1 / 4, 1 / 8], [0.0, 0.0]])  # 1 − exp(d), / 2 tokens / 2 samples
