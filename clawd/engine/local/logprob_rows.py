"""SGLang's per-position log-prob rows: `top_logprobs_num` (top-k) and `token_ids_logprob` (chosen ids).

Pure functions from rows of log-probs over the vocabulary to plain [log-prob, id]
pairs, which the scheduler keeps per position and renders as SGLang's
[log-prob, id, text|null] triples (docs/ARCHITECTURE.md §10).
"""
from __future__ import annotations

import torch

# SGLang clamps output log-probs to this before reading them (logprob_processor.py), so a banned
# token's -inf comes out finite: json.dumps would write -Infinity, which is not JSON.
FLOOR = torch.finfo(torch.float32).min

Pairs = list[list]  # [[log-prob, id], ...]


def top_pairs(rows: torch.Tensor, k: int) -> list[Pairs]:
    """The k most likely ids of each row [m, V], highest first, equal values lowest id first.

    torch.topk leaves the order of equal values open (SGLang's fused kernel puts the lowest
    id first), so each row's pick is re-sorted by (value desc, id asc), and a row whose k-th
    value is shared by an id left out is picked again from every id at or above that value.
    """
    rows = rows.clamp(min=FLOOR)
    vals, idx = rows.topk(k, dim=-1)
    idx, by_id = idx.sort(dim=-1)
    vals = vals.gather(-1, by_id)
    order = vals.sort(dim=-1, descending=True, stable=True).indices
    vals, idx = vals.gather(-1, order), idx.gather(-1, order)
    straddles = (rows >= vals[:, -1:]).sum(-1) > k
    for r in straddles.nonzero()[:, 0].tolist():
        cand = (rows[r] >= vals[r, -1]).nonzero()[:, 0]  # ascending ids
        pick = cand[rows[r, cand].sort(descending=True, stable=True).indices[:k]]
        idx[r], vals[r] = pick, rows[r, pick]
    return [[[v, i] for v, i in zip(vs, ids)] for vs, ids in zip(vals.tolist(), idx.tolist())]


def id_pairs(rows: torch.Tensor, ids: tuple[int, ...]) -> list[Pairs]:
    """Each row's log-probs of `ids`, in the request's order, duplicates kept."""
    vals = rows.clamp(min=FLOOR)[:, torch.tensor(ids, dtype=torch.long)]
    return [[[v, i] for v, i in zip(vs, ids)] for vs in vals.tolist()]


def select_rows(rows: torch.Tensor, k: int, ids: tuple[int, ...] | None) -> tuple[list[Pairs], list[Pairs]]:
    """(top-k pairs, chosen-id pairs) per row of `rows` [m, V]; a list is empty where not asked for."""
    return (top_pairs(rows, k) if k > 0 and len(rows) else [],
            id_pairs(rows, ids) if ids and len(rows) else [])
