"""The training objective: pure functions from log-probs to a loss (docs/ARCHITECTURE.md §3).

This module imports torch: it runs in the trainer subprocess and the daemon never imports it.

Layout. Every per-token tensor is padded `[B, T]`: row b holds the response tokens of sample b
(no prompt), and `mask` is the sample's loss_mask, 0 on padding. Padded slots may hold anything,
NaN included: the loss functions replace them with 0 before they meet a gradient. Per-sample
values (reward, has_hint, temperature) are `[B]`. The element-wise functions (log-probs,
entropy, ratio, surrogate, TIS, k3, metrics) accept any shape; `advantages` and `aggregate` read
the rows as samples.

The log-probs, by name:
    lp_new      this forward, at the sample's temperature T, with grad
    lp_old      the policy before this update, at T, no grad: `lp_new.detach()` with one optimizer
                pass per batch (ppo_epochs = 1, the default; the ratio is then exactly 1), a separate
                no-grad forward before the first pass when ppo_epochs > 1
    lp_old_t1   lp_old at temperature 1, read only by the OPD term (it is lp_old when T = 1)
    lp_rollout  the engine's, at T (Sample.rollout_logprobs)
    teacher_lp  the teacher's prefill log-probs, always at T = 1 (Sample.teacher_logprobs)
    lp_ref      the frozen reference policy at T, read only by the optional KL term

One optimizer step in the trainer, sketched:
    norm = whole_batch_normaliser(batch_mask, aggregation)      # the WHOLE batch, once
    for mb in micro_batches:
        lp_new = token_logprobs(logits, targets, mb.temperature)
        with torch.no_grad():
            lp_old_t1 = token_logprobs(logits, targets, 1.0)
        adv = advantages(mode, mb.reward, lp_old_t1, mb.teacher_lp, mb.has_hint)
        loss, parts = total_loss(lp_new, lp_new.detach(), mb.lp_rollout, adv, mb.mask, cfg.loss, normaliser=norm)
        loss.backward()        # micro-batch losses and gradients add up to the whole batch's
    metrics = loss_metrics(...) | {"grad_norm": grad_norm(model.parameters())}

The trainer takes lp_new, the entropy and lp_old_t1 from one `clawd.trainer.worker.head.head_logprobs` call on the
decoder's hidden states: the same values as the functions above on the full logits, computed a chunk of
positions at a time, so the [B, T, V] logits never exist (152k entries a position for Qwen).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor

from clawd.config.train import AGGREGATIONS, LossConfig
from clawd.samples import MODES


# --- log-probs and entropy -------------------------------------------------------------------

def _tempered(logits: Tensor, temperature: float | Tensor) -> Tensor:
    """logits / T in at least float32. T is a number, or a tensor over the leading dims ([B] for [B, T, V])."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    t = torch.as_tensor(temperature, dtype=dtype, device=logits.device)
    t = t.reshape(t.shape + (1,) * (logits.dim() - t.dim()))
    return logits.to(dtype) / t


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float | Tensor = 1.0) -> Tensor:
    """log_softmax(logits / T) at the target ids: [..., V] scores and [...] ids → [...] log-probs.

    This is what SGLang reports for a token sampled at T, so ratios against rollout log-probs are
    like for like. logits[..., i, :] must already score targets[..., i] (the shift is the
    caller's), and padded targets must be valid ids (0 will do)."""
    logp = torch.log_softmax(_tempered(logits, temperature), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy(logits: Tensor, temperature: float | Tensor = 1.0) -> Tensor:
    """Entropy −Σ p·log p of softmax(logits / T) at each position: [..., V] → [...]."""
    logp = torch.log_softmax(_tempered(logits, temperature), dim=-1)
    return -(logp.exp() * logp).sum(-1)


# --- advantages ------------------------------------------------------------------------------

def reward_baseline(rewards: Iterable[float]) -> float:
    """The batch-mean baseline: the mean of the batch's ±1 rewards (0 when it has none). A reward of 0 is
    "no score" (a hint alone, in combine mode), not a score of zero, so it is not counted."""
    scored = [r for r in rewards if r != 0]
    return math.fsum(scored) / len(scored) if scored else 0.0


def centre_rewards(reward: Tensor, baseline: float, preset: Tensor | None = None) -> Tensor:
    """r − baseline where r ≠ 0; 0 stays 0. With `[train.loss] reward_baseline = "batch_mean"` the RL term
    is then centred per batch: replies better than the batch's average are pushed up, worse ones down,
    and a batch whose rewards say nothing about its replies (all equal, or shuffled) has no mean push.
    Without it (a baseline of 0.0) every reward is returned exactly. Rows where `preset` ([B] bool) is true
    hold a rollout's group advantage already (clawd.rollouts.groups): returned exactly too."""
    live = torch.where(reward != 0, reward - baseline, torch.zeros_like(reward))
    return live if preset is None else torch.where(preset, reward, live)


def centred(reward: float, baseline: float, advantage: float | None = None) -> float:
    """`centre_rewards` of one sample, on the host: its group advantage when it has one, else r − baseline
    where r ≠ 0, else 0."""
    if advantage is not None:
        return advantage
    return reward - baseline if reward != 0 else 0.0


def carries_signal(mode: str, centred_rewards: Iterable[float], has_hint: Iterable[bool], *, w_rl: float = 1.0,
                   w_opd: float = 1.0, kl_coef: float = 0.0, entropy_coef: float = 0.0) -> bool:
    """Does a batch's loss have a gradient? False exactly when every advantage is 0 and no KL or entropy
    term is on: every centred reward 0 (rl, combine: all rewards agree, or none) and no hint (opd, combine).
    Such a batch must take no optimizer step: AdamW would still move every weight through its momentum."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    if kl_coef or entropy_coef:
        return True
    rl = mode in ("rl", "combine") and w_rl != 0 and any(r != 0 for r in centred_rewards)
    opd = mode in ("opd", "combine") and w_opd != 0 and any(has_hint)
    return rl or opd


def opd_term(lp_old_t1: Tensor, teacher_lp: Tensor, has_hint: Tensor, clip: float | None = None) -> Tensor:
    """teacher_lp − lp_old_t1 per token, clipped to [−clip, clip] if asked, and exactly 0 on the
    rows of samples without a hint. Both sides are at temperature 1 (the teacher's prefill
    log-probs always are). torch.where picks the 0 without reading the teacher slot, so whatever
    fills it (NaN, zeros) cannot leak; multiplying by a 0/1 mask would not do (NaN·0 is NaN)."""
    gap = teacher_lp.detach() - lp_old_t1.detach()
    if clip is not None:
        gap = gap.clamp(-clip, clip)
    hinted = torch.as_tensor(has_hint, dtype=torch.bool, device=gap.device)[:, None]
    return torch.where(hinted, gap, torch.zeros_like(gap))


def advantages(mode: str, reward: Tensor, lp_old_t1: Tensor, teacher_lp: Tensor | None = None,
               has_hint: Tensor | None = None, *, w_rl: float = 1.0, w_opd: float = 1.0,
               opd_clip: float | None = None) -> Tensor:
    """Per-token advantages, shaped like lp_old_t1 ([B, T]) and detached (docs/ARCHITECTURE.md §3):

        rl       A = r
        opd      A = opd_term             (teacher_lp − lp_old_t1, optionally clipped; 0 without a hint)
        combine  A = w_rl·r + w_opd·opd_term

    reward is [B] in {-1, 0, +1}. No group normalisation: each turn is its own group of one.
    In rl mode lp_old_t1 only gives the shape. Rows without a hint may hold anything in teacher_lp."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    r = torch.as_tensor(reward, dtype=lp_old_t1.dtype, device=lp_old_t1.device)
    rl = r[:, None].expand_as(lp_old_t1).clone()  # the reward on every token of its sample
    if mode == "rl":
        return rl
    if teacher_lp is None or has_hint is None:
        raise ValueError(f"mode {mode!r} needs teacher_lp and has_hint")
    opd = opd_term(lp_old_t1, teacher_lp, has_hint, opd_clip)
    if mode == "opd":
        return opd
    return w_rl * rl + w_opd * opd  # w_opd·0.0 is 0.0 and x + 0.0 is x: exact without a hint


def topk_opd_advantages(lp_old_k: Tensor, teacher_k: Tensor, clip: float | None = 1.0) -> Tensor:
    """Top-K distillation's advantage of each of the student's top-k ids at each position ([..., K] → [..., K],
    detached): the teacher − student gap at T = 1, clipped to [−clip, clip], weighted by the student's
    probability inside its top-k subset,

        A_k = softmax_k(lp_old_k) · clip(teacher_k − lp_old_k)

    so an id the student barely considers moves little, and one confident disagreement cannot dominate a
    step. Its gradient, −Σ_k A_k ∇lp_k, is that of the subset's reverse KL to the teacher (up to the clip)."""
    old = lp_old_k.detach()
    gap = teacher_k.detach() - old
    if clip is not None:
        gap = gap.clamp(-clip, clip)
    return torch.softmax(old, dim=-1) * gap


def topk_opd_loss(lp_new_k: Tensor, lp_old_k: Tensor, teacher_k: Tensor, rows: Tensor, mask: Tensor, *,
                  clip: float | None = 1.0, eps_clip: float = 0.2, eps_clip_high: float = 0.28,
                  aggregation: str = "sample_mean", normaliser: float | None = None) -> Tensor:
    """Top-K OPD: the clipped PPO surrogate of every top-k id, summed over the k ids of a position, then
    aggregated like the policy loss. lp_*_k and teacher_k are [B, T, K] at T = 1; `rows` [B] (bool) marks the
    samples that carry top-k rows (the others add exactly 0, whatever their slots hold). The ratio is each
    id's own exp(lp_new − lp_old): with one update it is 1 and the gradient is −Σ_k A_k ∇lp_k."""
    keep = mask.bool() & torch.as_tensor(rows, dtype=torch.bool, device=mask.device)[:, None]
    slot = keep[..., None]
    lp_new_k = torch.where(slot, lp_new_k, 0.0)
    lp_old_k, teacher_k = (torch.where(slot, x.detach(), 0.0) for x in (lp_old_k, teacher_k))
    adv = topk_opd_advantages(lp_old_k, teacher_k, clip)
    per_position = ppo_surrogate(ppo_ratio(lp_new_k, lp_old_k), adv, eps_clip, eps_clip_high).sum(-1)
    return aggregate(torch.where(keep, per_position, 0.0), mask, aggregation=aggregation, normaliser=normaliser)


def warmup_lr(base: float, step: int, warmup_steps: int) -> float:
    """The learning rate of step `step` (1 for the first): base × step / warmup_steps over the first
    warmup_steps steps, then base. With few informative samples per step, the first steps' Adam moments
    come from one or two batches; a ramp keeps those steps small."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return base
    return base * max(step, 1) / warmup_steps


# --- the PPO pieces --------------------------------------------------------------------------

def ppo_ratio(lp_new: Tensor, lp_old: Tensor) -> Tensor:
    """π_new/π_old per token, exp(lp_new − lp_old): exactly 1.0 when lp_old is lp_new detached."""
    return torch.exp(lp_new - lp_old)


def ppo_surrogate(ratio: Tensor, adv: Tensor, eps_clip: float = 0.2, eps_clip_high: float = 0.28) -> Tensor:
    """Per-token clipped surrogate loss −min(ratio·A, clip(ratio, 1−ε, 1+ε_high)·A).

    The min keeps the pessimistic branch: once the ratio has moved past the clip in the direction
    A pushes it, the token's gradient is zero; moving the other way is never clipped."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * adv
    return -torch.minimum(unclipped, clipped)


def tis_weight(lp_old: Tensor, lp_rollout: Tensor, cap: float = 2.0) -> Tensor:
    """Truncated importance weight min(exp(lp_old − lp_rollout), C), detached.

    The engine sampled from π_rollout (other kernels, maybe older weights), the surrogate assumes
    π_old: the weight corrects for that gap, and the cap C bounds the variance it adds."""
    return torch.exp(lp_old.detach() - lp_rollout.detach()).clamp(max=cap)


def kl_k3(lp_new: Tensor, lp_ref: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π_new ‖ π_ref) from tokens sampled by π_new:
    exp(d) − d − 1 with d = lp_ref − lp_new. Never negative; 0 exactly where the two agree."""
    d = lp_ref - lp_new
    return torch.exp(d) - d - 1


# --- aggregation -----------------------------------------------------------------------------

def batch_normaliser(samples: int, loss_tokens: int, aggregation: str = "sample_mean",
                     norm_tokens: int = 1) -> float:
    """The aggregate's denominator for a whole batch of `samples` holding `loss_tokens`, at least 1:

        sample_mean  samples                    each sample's token mean, averaged over samples
        token_mean   loss_tokens                every loss token of the batch weighs the same
        token_sum    samples × norm_tokens      every loss token weighs the same, whatever the lengths

    Compute it once per update, before splitting into micro-batches."""
    if aggregation == "sample_mean":
        n = samples
    elif aggregation == "token_mean":
        n = loss_tokens
    elif aggregation == "token_sum":
        n = samples * norm_tokens
    else:
        raise ValueError(f"aggregation {aggregation!r} is not one of {AGGREGATIONS}")
    return float(max(n, 1))


def whole_batch_normaliser(mask: Tensor, aggregation: str = "sample_mean", norm_tokens: int = 1) -> float:
    """`batch_normaliser` of a padded [B, T] batch's loss mask."""
    return batch_normaliser(mask.shape[0], int(mask.sum()), aggregation, norm_tokens)


def aggregate(x: Tensor, mask: Tensor, *, aggregation: str = "sample_mean",
              normaliser: float | None = None) -> Tensor:
    """Per-token values [B, T] → one number.

        sample_mean  Σ_b (Σ_t m·x / Σ_t m) / normaliser    each sample's token mean, averaged over samples
        token_mean   Σ_b Σ_t m·x / normaliser              every loss token weighs the same
        token_sum    Σ_b Σ_t m·x / normaliser              the same sum; the normaliser is a constant per sample

    sample_mean weighs a token by 1 / its sample's length: the end of a short reply is pushed 10 times as hard
    as that of a reply 10 times longer, so when most advantages are negative short replies are pushed out
    (every rl run on SmolLM2 lengthened its answers). token_mean divides by the batch's tokens, which its
    lengths still set; token_sum divides by samples × `[train.loss] aggregation_tokens`, a constant (as Dr. GRPO
    does), so no length enters the weights (normaliser: None computes it from the mask, with norm_tokens 1).

    normaliser is the WHOLE batch's (batch_normaliser), not this call's: then the values of
    micro-batches add up to the batch's, and so do their gradients. A sample with no loss token
    adds 0 and still counts as a sample."""
    if normaliser is None:
        normaliser = whole_batch_normaliser(mask, aggregation)
    x = torch.where(mask.bool(), x, 0.0)
    if aggregation == "sample_mean":
        return (x.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / normaliser
    if aggregation in ("token_mean", "token_sum"):
        return x.sum() / normaliser
    raise ValueError(f"aggregation {aggregation!r} is not one of {AGGREGATIONS}")


# --- the loss --------------------------------------------------------------------------------

def policy_loss(lp_new: Tensor, lp_old: Tensor, lp_rollout: Tensor, adv: Tensor, mask: Tensor, *,
                eps_clip: float = 0.2, eps_clip_high: float = 0.28, tis_cap: float = 2.0,
                aggregation: str = "sample_mean", normaliser: float | None = None) -> Tensor:
    """The PPO clipped surrogate, each token weighted by its TIS weight, aggregated:

        ratio = exp(lp_new − lp_old)
        loss  = aggregate( tis_weight(lp_old, lp_rollout) · ppo_surrogate(ratio, A) )

    lp_old, lp_rollout and adv carry no gradient; the gradient reaches the model through lp_new."""
    keep = mask.bool()
    # Padding may hold anything, NaN included: make it 0 before it meets a gradient (ratio 1, A 0).
    lp_new = torch.where(keep, lp_new, 0.0)
    lp_old, lp_rollout, adv = (torch.where(keep, x.detach(), 0.0) for x in (lp_old, lp_rollout, adv))
    ratio = ppo_ratio(lp_new, lp_old)
    per_token = tis_weight(lp_old, lp_rollout, tis_cap) * ppo_surrogate(ratio, adv, eps_clip, eps_clip_high)
    return aggregate(per_token, mask, aggregation=aggregation, normaliser=normaliser)


@dataclass(frozen=True)
class TopK:
    """What `topk_opd_loss` reads, for total_loss: [B, T, K] log-probs at T = 1 and the [B] rows that carry them."""
    lp_new: Tensor
    lp_old: Tensor
    teacher: Tensor
    rows: Tensor
    weight: float = 1.0          # w_opd
    clip: float | None = 1.0     # opd_clip


def total_loss(lp_new: Tensor, lp_old: Tensor, lp_rollout: Tensor, adv: Tensor, mask: Tensor,
               cfg: LossConfig, *, normaliser: float | None = None, lp_ref: Tensor | None = None,
               kl_lp: Tensor | None = None, kl_rows: Tensor | None = None, entropy: Tensor | None = None,
               topk: TopK | None = None) -> tuple[Tensor, dict[str, float]]:
    """policy_loss + w_opd·topk_opd_loss + kl_coef·aggregate(kl_k3(kl_lp, lp_ref)) − entropy_coef·aggregate(entropy),
    with `cfg` the train section's loss settings (`TrainConfig.loss`).

    With no topk and both coefficients 0 the loss is policy_loss itself.
    The KL compares `kl_lp` (with grad; default lp_new) with the reference's `lp_ref` on the rows `kl_rows`
    marks ([B] bool; default all): the reference's log-probs are at T = 1, journaled at scoring, so the
    trainer passes its own at T = 1 and leaves out samples scored without them. `entropy` is per token
    (with grad when entropy_coef > 0). The parts come back as floats: this call's share of the whole batch's
    values (same normaliser), so the parts of micro-batches add up. "kl", "entropy" and "opd_topk" appear
    only when their term is on."""
    loss, parts = total_loss_terms(lp_new, lp_old, lp_rollout, adv, mask, cfg, normaliser=normaliser, lp_ref=lp_ref,
                                   kl_lp=kl_lp, kl_rows=kl_rows, entropy=entropy, topk=topk)
    return loss, {k: float(v) for k, v in parts.items()}


def total_loss_terms(lp_new: Tensor, lp_old: Tensor, lp_rollout: Tensor, adv: Tensor, mask: Tensor,
                     cfg: LossConfig, *, normaliser: float | None = None,
                     lp_ref: Tensor | None = None, kl_lp: Tensor | None = None, kl_rows: Tensor | None = None,
                     entropy: Tensor | None = None, topk: TopK | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """`total_loss` with its parts as detached 0-d tensors: reading them as floats waits for the
    device, which the trainer does once per step, not once per micro-batch."""
    eps_clip, eps_clip_high, kl_coef, entropy_coef = cfg.eps_clip, cfg.eps_clip_high, cfg.kl_coef, cfg.entropy_coef
    aggregation, tis_cap = cfg.aggregation, cfg.tis_cap
    kw = dict(aggregation=aggregation, normaliser=normaliser)
    pg = policy_loss(lp_new, lp_old, lp_rollout, adv, mask, eps_clip=eps_clip,
                     eps_clip_high=eps_clip_high, tis_cap=tis_cap, **kw)
    loss, parts = pg, {"policy_loss": pg.detach()}
    if topk is not None:
        opd = topk_opd_loss(topk.lp_new, topk.lp_old, topk.teacher, topk.rows, mask, clip=topk.clip,
                            eps_clip=eps_clip, eps_clip_high=eps_clip_high, **kw)
        loss = loss + topk.weight * opd
        parts["opd_topk"] = opd.detach()
    keep = mask.bool()
    if kl_coef:
        if lp_ref is None:
            raise ValueError("kl_coef > 0 needs lp_ref")
        kl_lp = lp_new if kl_lp is None else kl_lp
        if kl_rows is not None:
            keep = keep & torch.as_tensor(kl_rows, dtype=torch.bool, device=keep.device)[:, None]
        kl = aggregate(kl_k3(torch.where(keep, kl_lp, 0.0), torch.where(keep, lp_ref.detach(), 0.0)), mask, **kw)
        loss = loss + kl_coef * kl
        parts["kl"] = kl.detach()
        keep = mask.bool()
    if entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs entropy")
        ent = aggregate(torch.where(keep, entropy, 0.0), mask, **kw)
        loss = loss - entropy_coef * ent  # a bonus: higher entropy, lower loss
        parts["entropy"] = ent.detach()
    return loss, parts


# --- metrics ---------------------------------------------------------------------------------

def loss_metrics(lp_new: Tensor, lp_old: Tensor, lp_rollout: Tensor, adv: Tensor, mask: Tensor, *,
                 eps_clip: float = 0.2, eps_clip_high: float = 0.28, tis_cap: float = 2.0,
                 entropy: Tensor | None = None) -> dict[str, float]:
    """Diagnostics as plain floats, each a plain mean over the loss tokens (mask = 1):

        clip_fraction         tokens where the clipped branch of the surrogate is the one taken
        approx_kl             k3 estimate of KL(π_old ‖ π_new): (ratio − 1) − log ratio
        rollout_lp_abs_diff   |lp_old − lp_rollout|: engine vs trainer numerics, plus staleness
        tis_mean, tis_clipped_fraction   the TIS weight, and how often the cap C bit
        adv_mean, adv_std (population), adv_min, adv_max
        entropy               when given (per token, from `entropy`)
        tokens                how many loss tokens these are

    Any shape with a mask alike: a padded [B, T] batch, or the loss tokens of all micro-batches
    concatenated (1-D) with a mask of ones. With no loss token the means are NaN."""
    keep = mask.bool()
    with torch.no_grad():
        new, old, rollout, a = (x.detach()[keep].double() for x in (lp_new, lp_old, lp_rollout, adv))
        n = a.numel()
        ratio = ppo_ratio(new, old)
        clipped_taken = ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * a < ratio * a
        raw_w = torch.exp(old - rollout)

        def mean(x: Tensor) -> float:
            return float(x.double().sum()) / n if n else math.nan

        out = {
            "tokens": float(n),
            "clip_fraction": mean(clipped_taken),
            "approx_kl": mean(kl_k3(old, new)),
            "rollout_lp_abs_diff": mean((old - rollout).abs()),
            "tis_mean": mean(raw_w.clamp(max=tis_cap)),
            "tis_clipped_fraction": mean(raw_w > tis_cap),
            "adv_mean": mean(a),
            "adv_std": float(a.std(unbiased=False)) if n else math.nan,
            "adv_min": float(a.min()) if n else math.nan,
            "adv_max": float(a.max()) if n else math.nan,
        }
        if entropy is not None:
            out["entropy"] = mean(entropy.detach()[keep])
    return out


def grad_norm(parameters: Iterable[torch.nn.Parameter]) -> float:
    """The L2 norm of all gradients taken together (parameters without one are skipped). Inf or
    NaN when a gradient is not finite: the trainer's signal to skip the step. One process; a
    trainer world sums `squared_norm` over every rank's shards (`clawd.trainer.worker.sharding`)."""
    squares = [squared_norm(p.grad.detach()) for p in parameters if p.grad is not None]
    return float(torch.stack(squares).sum().sqrt()) if squares else 0.0  # one read-back


def squared_norm(x: Tensor, chunk: int = 1 << 24) -> Tensor:
    """Σ x² accumulated in float64, a chunk at a time (a float64 copy of a whole embedding's gradient
    would be gigabytes). float32 accumulation was off by 2.5e-5 relative on the tiny model's 262k-entry
    embedding gradient: more than the difference between one rank and a sharded world."""
    flat = x.reshape(-1)
    parts = [torch.linalg.vector_norm(c, dtype=torch.float64) ** 2 for c in flat.split(chunk)]
    return torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=x.device)


_PART_NAMES = {"loss": "loss", "policy_loss": "loss_policy", "kl": "loss_kl", "entropy": "loss_entropy",
               "opd_topk": "loss_opd_topk"}


def update_diagnostics(done: list[dict], cfg) -> dict[str, float]:
    """A step's diagnostics from its updates (each: its per-token values `seen` and loss parts `totals`):
    `loss_metrics` over every update's loss tokens, and each loss part averaged over the updates."""
    cat = {k: torch.cat([d["seen"][k] for d in done]) for k in done[0]["seen"]}
    metrics = loss_metrics(cat["new"], cat["old"], cat["rollout"], cat["adv"], torch.ones_like(cat["adv"]),
                           entropy=cat["entropy"], eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high,
                           tis_cap=cfg.tis_cap)
    for k in done[0]["totals"]:
        metrics[_PART_NAMES[k]] = math.fsum(d["totals"][k] for d in done) / len(done)
    return metrics
