"""A batch of samples as the trainer's forwards take it: packed into micro-batches of padded tensors.

Packing. Samples are sorted by length and grouped greedily into micro-batches whose padded size
(rows × longest input) stays within `micro_batch_tokens` and is at most a quarter padding; rows are right-padded and no attention
mask is passed. With right padding the causal mask alone keeps every real token from seeing a
pad (pads come after it), so a row's logits are those of the sample forwarded alone, up to
float rounding (matmul shapes differ: ~3e-7 on the tiny model's logits with sdpa on CPU). This
works with sdpa, eager and flash kernels alike, needs no 4-D mask (an [L, L] block-diagonal mask
costs memory quadratic in the whole pack) and, sorted by length, wastes little padding.
Logits are computed only at the response positions: the decoder's last hidden states are
gathered there and only those go through the output layer, so memory scales with response
tokens, not with prompt tokens × vocabulary. Even those never exist whole: `head.head_logprobs`
runs the output layer and the log-softmax a chunk of positions at a time and recomputes a chunk's
logits in the backward (a [b, R, V] float32 tensor is 0.6 MB a position at Qwen's vocabulary).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from clawd.samples import Sample


# --- packing (pure) --------------------------------------------------------------------------

def pack(lengths: list[int], budget: int, max_padding: float = 0.25) -> list[list[int]]:
    """Group sample indices into micro-batches of similar length: sorted by length (ties by
    index), each group grown while rows × longest length stays within `budget` and padding stays
    within `max_padding` of that size (a long sample joining short ones pads every one of them:
    a skewed batch at a large budget was 57% padding without this bound). A sample longer than
    the budget goes alone. Deterministic: the same lengths always give the same groups."""
    groups: list[list[int]] = []
    real = 0  # tokens of the open group
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        n = lengths[i]
        padded = (len(groups[-1]) + 1) * n if groups else 0  # ascending: i is the longest
        if groups and padded <= budget and real + n >= (1 - max_padding) * padded:
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            real = n
    return groups


def mini_batches(n: int, k: int) -> list[list[int]]:
    """The indices 0..n-1 of a batch dealt into min(k, n) mini-batches (one optimizer step each), round
    robin: sample i goes to mini-batch i % k, so each holds every k-th sample of the (canonically ordered)
    batch, not a run of similar ones."""
    k = max(1, min(k, n))
    return [list(range(j, n, k)) for j in range(k)]


@dataclass
class MicroBatch:
    """Right-padded tensors for a group of samples; per-token tensors are [b, R] over responses."""
    rows: list[int]               # indices into the step's sample list
    input_ids: torch.Tensor       # [b, L]: tokens[:-1], right-padded with 0
    positions: torch.Tensor       # [b, R]: where in the input the logits score each response token
    targets: torch.Tensor         # [b, R]: the response ids (0 on padding)
    mask: torch.Tensor            # [b, R]: loss_mask (0 on padding)
    temperature: torch.Tensor     # [b]
    reward: torch.Tensor          # [b]: the reward, or a rollout's group advantage where `preset`
    preset: torch.Tensor          # [b] bool: the row's reward is its group advantage, never centred again
    has_hint: torch.Tensor        # [b] bool
    lp_rollout: torch.Tensor      # [b, R]
    teacher_lp: torch.Tensor      # [b, R], 0 where there is no hint
    tokens: int                   # real input tokens (no padding)
    keep: torch.Tensor            # flat indices into [b, R] of the loss tokens (mask 1), built on the host
    needs_t1: bool                # a hinted row sampled at T != 1: the OPD term needs log-probs at T = 1
    ref_lp: torch.Tensor          # [b, R]: the reference's journaled log-probs at T = 1, 0 where there are none
    has_ref: torch.Tensor         # [b] bool: the sample carries reference_logprobs
    top_ids: torch.Tensor | None  # [b, R, K]: the policy's top-k ids at rollout (top-K OPD); None: no row has them
    teacher_top: torch.Tensor | None  # [b, R, K]: the teacher's log-probs at those ids
    has_top: torch.Tensor         # [b] bool: the sample's top-k rows are in top_ids (a hinted sample of width K)
    # (lp_old, lp_old_t1, lp_old at the `at` ids or None) when an update runs on moved weights
    old: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = field(default=None)


def micro_batch(samples: list[Sample], rows: list[int], device: torch.device) -> MicroBatch:
    group = [samples[i] for i in rows]
    L = max(len(s.tokens) - 1 for s in group)
    R = max(s.response_length for s in group)
    b = len(group)
    input_ids = torch.zeros(b, L, dtype=torch.long)
    positions = torch.zeros(b, R, dtype=torch.long)
    targets = torch.zeros(b, R, dtype=torch.long)
    mask = torch.zeros(b, R)
    lp_rollout = torch.zeros(b, R)
    teacher_lp = torch.zeros(b, R)
    ref_lp = torch.zeros(b, R)
    K = max(s.top_k for s in group)
    top_ids = torch.zeros(b, R, K, dtype=torch.long)
    teacher_top = torch.zeros(b, R, K)
    has_top = [s.top_k == K > 0 for s in group]  # another width (the setting changed): token-level OPD
    for r, s in enumerate(group):
        n, p = s.response_length, len(s.tokens) - s.response_length
        input_ids[r, :len(s.tokens) - 1] = torch.tensor(s.tokens[:-1])
        positions[r, :n] = torch.arange(p - 1, p - 1 + n)  # logits at i score token i + 1
        positions[r, n:] = p - 1                           # padding: any valid position
        targets[r, :n] = torch.tensor(s.response_ids)
        mask[r, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        lp_rollout[r, :n] = torch.tensor(s.rollout_logprobs)
        if s.has_hint:
            teacher_lp[r, :n] = torch.tensor(s.teacher_logprobs)
        if s.reference_logprobs is not None:
            ref_lp[r, :n] = torch.tensor(s.reference_logprobs)
        if has_top[r]:
            top_ids[r, :n] = torch.tensor(s.top_ids)
            teacher_top[r, :n] = torch.tensor(s.teacher_top_logprobs)
    to = lambda x: x.to(device)
    return MicroBatch(
        rows=rows, input_ids=to(input_ids), positions=to(positions), targets=to(targets), mask=to(mask),
        temperature=to(torch.tensor([s.temperature for s in group])),
        reward=to(torch.tensor([s.reward if s.advantage is None else s.advantage for s in group])),
        preset=to(torch.tensor([s.advantage is not None for s in group])),
        has_hint=to(torch.tensor([s.has_hint for s in group])),
        lp_rollout=to(lp_rollout), teacher_lp=to(teacher_lp),
        tokens=sum(len(s.tokens) - 1 for s in group),
        keep=to(mask.flatten().nonzero()[:, 0]),  # indexing by it later needs no device sync
        needs_t1=any(s.has_hint and s.temperature != 1 for s in group),
        ref_lp=to(ref_lp), has_ref=to(torch.tensor([s.reference_logprobs is not None for s in group])),
        top_ids=to(top_ids) if K else None, teacher_top=to(teacher_top) if K else None,
        has_top=to(torch.tensor(has_top)))
