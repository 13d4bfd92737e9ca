"""The output layer and its log-softmax a chunk of positions at a time (docs/ARCHITECTURE.md §3).

The trainer's log-probs come from here: the decoder's hidden states at the response positions go through the
output layer and the log-softmax in chunks, and the backward recomputes a chunk's logits, so the [b, R, V]
logits never exist (Qwen's vocabulary: 0.6 MB a position in float32). Per position the values are those of
`clawd.trainer.worker.losses.token_logprobs` and `entropy` on full logits; `ResponseScorer` is the model's forward
that ends in them. Runs in the trainer process only.
"""
from __future__ import annotations

import torch
from torch import Tensor

from clawd.trainer.worker.memory import HEAD_CHUNK_ELEMENTS




def head_chunk_tokens(vocab: int) -> int:
    """Positions per chunk for a vocabulary of `vocab` entries (HEAD_CHUNK_ELEMENTS logits)."""
    return max(1, HEAD_CHUNK_ELEMENTS // vocab)


def head_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float | Tensor = 1.0, *,
                  bias: Tensor | None = None, with_t1: bool = False, chunk_tokens: int | None = None,
                  compute_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """`token_logprobs`, `entropy` and (with_t1) `token_logprobs` at T = 1 of the logits
    linear(hidden, weight, bias), without ever holding them whole: [..., H] hidden states and [...]
    target ids → three [...] tensors in at least float32 (the third None without with_t1).

    The output layer and the softmax run on `chunk_tokens` positions at a time (default
    `head_chunk_tokens(V)`), and the backward recomputes each chunk's logits instead of keeping them,
    so memory is chunk × V rather than tokens × V (Qwen's vocabulary: 0.6 MB a position in float32).
    Per position the operations are those of the unchunked functions on linear(hidden, weight, bias):
    only the matmul's rounding may differ with the number of rows. `compute_dtype` is the logits'
    dtype (bfloat16 for the trainer on CUDA, as autocast gives); None: the weight's. Gradients reach
    hidden, weight and bias through the log-probs at T and the entropy; the T = 1 ones carry none."""
    lead, size = targets.shape, hidden.shape[-1]
    dtype = compute_dtype or weight.dtype
    acc = torch.promote_types(dtype, torch.float32)
    t = torch.as_tensor(temperature, dtype=acc, device=hidden.device)
    t = t.reshape(t.shape + (1,) * (len(lead) - t.dim())).expand(lead).reshape(-1)
    chunk = chunk_tokens or head_chunk_tokens(weight.shape[0])
    lp, ent, lp1 = _ChunkedHead.apply(hidden.reshape(-1, size), weight, bias, targets.reshape(-1), t,
                                      chunk, dtype, with_t1)
    return lp.view(lead), ent.view(lead), lp1.view(lead) if with_t1 else None


def _tempered_logsoftmax(logits: Tensor, t: Tensor) -> Tensor:
    """log_softmax(logits / t) in t's dtype, as `token_logprobs` computes it: the division promotes
    bf16 logits to float32 in the same pass (the values of logits.float() / t)."""
    return torch.log_softmax(logits / t[:, None], dim=-1)


def _head_grad_buffers(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype):
    """A chunked head's backward: (grad of hidden, of weight, of bias: None where not wanted, the weight and the
    bias in the logits' dtype)."""
    want_h, want_w, want_b = ctx.needs_input_grad[:3]
    return (torch.empty_like(hidden) if want_h else None, torch.zeros_like(weight) if want_w else None,
            torch.zeros_like(bias) if want_b and bias is not None else None,
            weight.to(dtype), None if bias is None else bias.to(dtype))


class _ChunkedHead(torch.autograd.Function):
    """The autograd side of head_logprobs. Saves the hidden states, the weight and the entropy, never
    logits; the backward recomputes a chunk's logits and log-softmax and forms their gradient directly:

        d lp / d z_k = [k = y] − p_k        d H / d z_k = −p_k (log p_k + H)        z = logits / T"""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, t, chunk, dtype, with_t1):
        acc = t.dtype
        n = hidden.shape[0]
        lp, ent = hidden.new_empty(n, dtype=acc), hidden.new_empty(n, dtype=acc)
        lp1 = hidden.new_empty(n if with_t1 else 0, dtype=acc)
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit here
            for s in range(0, n, chunk):
                rows, y = slice(s, s + chunk), targets[s:s + chunk, None]
                logits = torch.nn.functional.linear(hidden[rows].to(dtype), w, b)
                if with_t1:
                    lp1[rows] = torch.log_softmax(logits, dim=-1, dtype=acc).gather(1, y)[:, 0]
                logp = _tempered_logsoftmax(logits, t[rows])
                del logits
                lp[rows] = logp.gather(1, y)[:, 0]
                ent[rows] = -(logp.exp().mul_(logp)).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, t, ent)
        ctx.chunk, ctx.dtype = chunk, dtype
        ctx.mark_non_differentiable(lp1)
        ctx.set_materialize_grads(False)  # an unused output (the entropy, as a metric) sends None
        return lp, ent, lp1

    @staticmethod
    def backward(ctx, g_lp, g_ent, _):
        hidden, weight, bias, targets, t, ent = ctx.saved_tensors
        chunk, dtype, acc = ctx.chunk, ctx.dtype, t.dtype
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        if g_lp is None and g_ent is None:
            return (None,) * 8
        gh, gw, gb, w, b = _head_grad_buffers(ctx, hidden, weight, bias, dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                rows, y = slice(s, s + chunk), targets[s:s + chunk, None]
                h = hidden[rows].to(dtype)
                logp = _tempered_logsoftmax(torch.nn.functional.linear(h, w, b), t[rows])
                g, t_rows = None if g_lp is None else g_lp[rows, None], t[rows, None]
                # d/dlogits = −q / T with q = p·(g_lp + g_ent·(log p + H)) − g_lp·[k = y]; one id a
                # row, so scatter_ needs no accumulation. Written in place over p and log p.
                if g_ent is None:
                    q = logp.exp_()
                    q.scatter_(1, y, q.gather(1, y) - 1)
                    scale = -g / t_rows  # q above is p − [k = y]: g_lp joins the final product
                else:
                    q = logp.exp()
                    coef = logp.add_(ent[rows, None]).mul_(g_ent[rows, None])
                    q.mul_(coef if g is None else coef.add_(g))
                    del coef
                    if g is not None:
                        q.scatter_(1, y, q.gather(1, y) - g)
                    scale = -1 / t_rows
                del logp
                if q.dtype == dtype:
                    dlogits = q.mul_(scale)
                else:  # the product written straight in dtype: one pass, no float32 copy to cast
                    dlogits = torch.mul(q, scale, out=torch.empty_like(q, dtype=dtype))
                del q
                if want_h:
                    gh[rows] = dlogits @ w
                if want_w:  # a chunk's share: in dtype (as autocast's would be), summed in the weight's
                    if gw.dtype == dtype:
                        gw.addmm_(dlogits.t(), h)
                    else:
                        gw.add_(dlogits.t() @ h)
                if want_b:
                    gb.add_(dlogits.sum(0, dtype=acc))
        return gh, gw, gb, None, None, None, None, None


def head_logprobs_at(hidden: Tensor, weight: Tensor, ids: Tensor, *, bias: Tensor | None = None,
                     chunk_tokens: int | None = None, compute_dtype: torch.dtype | None = None) -> Tensor:
    """log_softmax(linear(hidden, weight, bias)) at T = 1 at K ids per position, with gradients: [..., H]
    hidden states and [..., K] ids → [..., K] log-probs in at least float32. What top-K distillation needs of
    the student (its log-probs at its own top-k ids, or at the teacher's) and what a KL to a reference
    scored at T = 1 needs (K = 1, the sampled ids). Chunked like `head_logprobs`: the logits never exist
    whole, and the backward recomputes a chunk's: d lp_k / d z_j = [j = y_k] − p_j."""
    lead, size = ids.shape[:-1], hidden.shape[-1]
    chunk = chunk_tokens or head_chunk_tokens(weight.shape[0])
    out = _ChunkedHeadAt.apply(hidden.reshape(-1, size), weight, bias, ids.reshape(-1, ids.shape[-1]), chunk,
                               compute_dtype or weight.dtype)
    return out.view(*lead, ids.shape[-1])


class _ChunkedHeadAt(torch.autograd.Function):
    """The autograd side of head_logprobs_at: saves hidden, weight and ids, never logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, chunk, dtype):
        acc = torch.promote_types(dtype, torch.float32)
        out = hidden.new_empty(ids.shape, dtype=acc)
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                rows = slice(s, s + chunk)
                logits = torch.nn.functional.linear(hidden[rows].to(dtype), w, b)
                out[rows] = torch.log_softmax(logits, dim=-1, dtype=acc).gather(1, ids[rows])
        ctx.save_for_backward(hidden, weight, bias, ids)
        ctx.chunk, ctx.dtype = chunk, dtype
        return out

    @staticmethod
    def backward(ctx, g):
        hidden, weight, bias, ids = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        acc = torch.promote_types(dtype, torch.float32)
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        gh, gw, gb, w, b = _head_grad_buffers(ctx, hidden, weight, bias, dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                rows = slice(s, s + chunk)
                h = hidden[rows].to(dtype)
                gr = g[rows].to(acc)
                # Σ_k g_k (onehot(y_k) − p): −p scaled by the row's Σ g, then each g_k added at its id
                d = torch.softmax(torch.nn.functional.linear(h, w, b), dim=-1, dtype=acc).mul_(-gr.sum(-1, keepdim=True))
                d.scatter_add_(1, ids[rows], gr)
                d = d.to(dtype)
                if want_h:
                    gh[rows] = d @ w
                if want_w:
                    gw.add_(d.t() @ h)
                if want_b:
                    gb.add_(d.sum(0, dtype=acc))
        return gh, gw, gb, None, None, None


class ResponseScorer(torch.nn.Module):
    """The model's log-probs at the response positions, as one module call: the decoder's last hidden
    states there, then `head_logprobs` over the output layer. One call, so that FSDP's root
    (this module, holding the embeddings, the final norm and the output layer) gathers its
    parameters before them and reduces their gradients after."""

    def __init__(self, model, autocast):
        super().__init__()
        self.model = model
        self.autocast = autocast

    def forward(self, input_ids, positions, targets, temperature, with_t1, chunk_tokens, compute_dtype, at_ids=None):
        with self.autocast():
            hidden = self.model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
        hidden = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
        layer = self.model.get_output_embeddings()
        lp, ent, lp1 = head_logprobs(hidden, layer.weight, targets, temperature, bias=layer.bias, with_t1=with_t1,
                                     chunk_tokens=chunk_tokens, compute_dtype=compute_dtype)
        at = None if at_ids is None else head_logprobs_at(hidden, layer.weight, at_ids, bias=layer.bias,
                                                          chunk_tokens=chunk_tokens, compute_dtype=compute_dtype)
        return lp, ent, lp1, at
