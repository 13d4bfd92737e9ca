"""Token selection for the local engine: pure tensor functions over rows of logits.

SGLang's sampling semantics (docs/ARCHITECTURE.md §10): penalties and logit bias,
top-k / top-p / min-p truncation, and the log-probs it reports for sampled and
prompt tokens. No state: the scheduler passes each request's params, history and
generator in.
"""
from __future__ import annotations

import math

import torch

from clawd.engine.local.wire import SamplingParams


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
                    banned: list[int]) -> torch.Tensor:
    """Penalties, logit bias and the min_new_tokens ban applied to one row of logits.

    As in SGLang: repetition covers prompt and output tokens, frequency and
    presence the output only; `banned` (stop ids before min_new_tokens) -> -inf.
    """
    z = logits
    vocab = z.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(prompt + output, dtype=torch.long)] = True
        scaled = torch.where(z > 0, z / p.repetition_penalty, z * p.repetition_penalty)
        z = torch.where(seen, scaled, z)
    if output and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).to(z.dtype)
        z = z - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(z.dtype)
    if p.logit_bias:
        z = z.clone()
        for tok, bias in p.logit_bias:
            if 0 <= tok < vocab:
                z[tok] += bias
    if banned:
        z = z.clone()
        z[torch.tensor(banned, dtype=torch.long)] = -math.inf
    return z


def truncate_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float):
    """Probabilities sorted high to low with the top-k / top-p / min-p tail zeroed, and their ids.

    All three cut the original distribution (not one another's renormalised
    result), and the most likely token always survives.
    """
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        keep &= (sorted_p.cumsum(0) - sorted_p) < top_p  # mass strictly before this token
    if min_p > 0.0:
        keep &= sorted_p >= min_p * sorted_p[0]
    keep[0] = True
    return sorted_p * keep, order


def pick_token(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
               banned: list[int], generator: torch.Generator) -> tuple[int, float, torch.Tensor]:
    """Choose the next token from one row of float32 logits; return (id, log-prob, log-prob row).

    The log-prob is SGLang's: log_softmax(z / T) over the whole vocabulary, not
    renormalised after truncation; greedy requests report T = 1. The row is that
    whole distribution, which SGLang's output top-k and id log-probs also read.
    """
    z = apply_penalties(logits, p, prompt, output, banned)
    if p.greedy:
        tok = int(torch.argmax(z))
        logprobs = torch.log_softmax(z, -1)
        return tok, float(logprobs[tok]), logprobs
    logprobs = torch.log_softmax(z / p.temperature, -1)
    probs = logprobs.exp()
    if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
        kept, order = truncate_probs(probs, p.top_k, p.top_p, p.min_p)
        tok = int(order[torch.multinomial(kept, 1, generator=generator)])
    else:
        tok = int(torch.multinomial(probs, 1, generator=generator))
    return tok, float(logprobs[tok]), logprobs


def next_token_row(logits: torch.Tensor, p: SamplingParams, prompt: list[int]) -> torch.Tensor:
    """A prefill-only request's one output row: log_softmax(z) at T = 1 after the whole prompt,
    with penalties and bias applied (SGLang's compute_logprobs_only; nothing is sampled)."""
    return torch.log_softmax(apply_penalties(logits, p, prompt, [], []), -1)


def prompt_rows(logits: torch.Tensor, n: int, start: int) -> torch.Tensor:
    """T = 1 log-prob rows over the vocabulary for a prompt of n ids scored from `start`:
    row i predicts ids[start+1+i] (n - start - 1 rows). `logits` as in prompt_logprobs."""
    return torch.log_softmax(logits[: max(n - start - 1, 0)], -1)


def prompt_logprobs(logits: torch.Tensor, ids: list[int], start: int) -> list[float | None]:
    """SGLang's input log-probs of `ids` from position `start` on: len(ids) - start values.

    `logits` are the model's outputs at positions start .. len(ids)-1 (one row
    each). Entry i is log P(ids[start+i] | ids[:start+i]) at T = 1; entry 0 is
    always None, as SGLang's shifted window leaves it.
    """
    n = len(ids)
    if start >= n:
        return []
    rows = prompt_rows(logits, n, start)
    targets = torch.tensor(ids[start + 1:], dtype=torch.long)
    return [None] + rows.gather(1, targets[:, None])[:, 0].tolist()
