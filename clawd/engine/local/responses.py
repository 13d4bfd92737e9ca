"""The local engine's responses: what a /generate answer (or stream chunk) says about one sequence.

SGLang's meta_info fields, in its order and with its omissions; the scheduler (scheduler.py) keeps the
sequence's state and the server (server.py) sends what this renders.
"""
from __future__ import annotations

import time

from clawd.engine.local.sequences import Cursor, Req


def decode(tokenizer, ids: list[int], p) -> str:
    return tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens,
                            spaces_between_special_tokens=p.spaces_between_special_tokens)


def text(tokenizer, req: Req, n: int, final: bool) -> str:
    """The output text after n tokens: trimmed at the stop on the final chunk, and with an
    incomplete UTF-8 character held back on the others."""
    p, ids = req.params, req.output_ids[:n]
    reason = req.finish if final else None
    trim = reason is not None and reason.get("type") == "stop" and not p.no_stop_trim
    if trim and isinstance(reason["matched"], int):
        ids = ids[:-1]
    out = decode(tokenizer, ids, p)
    if trim and isinstance(reason["matched"], str):
        at = out.find(reason["matched"])
        out = out if at < 0 else out[:at]
    if not final:
        out = out.rstrip("\ufffd")
    return out


def render(tokenizer, weight_version: str, req: Req, n: int, final: bool, cursor: Cursor | None = None) -> dict:
    """A /generate response object (or stream chunk) for `req` after n tokens, served by `weight_version`.

    With a cursor (incremental streaming) ids, text and output log-probs hold
    only what is new since the cursor; input log-probs go in every chunk, as in SGLang.
    """
    it = req.item
    since = cursor.n if cursor is not None else 0
    out_text = text(tokenizer, req, n, final)
    entry = lambda lp, tok: [lp, tok, tokenizer.decode([tok]) if it.return_text_in_logprobs else None]  # noqa: E731
    # [log-prob, id] pairs per position -> SGLang's triples; a position without a row is null
    rows_of = lambda rows: [[entry(lp, tok) for lp, tok in row] if row else None for row in rows]  # noqa: E731
    # SGLang omits the token counts of a request aborted before it left the waiting queue
    waiting_abort = final and not req.started and req.finish.get("type") == "abort"
    meta = {"id": req.rid, "finish_reason": req.finish if final else None}
    if not waiting_abort:
        meta["prompt_tokens"] = len(req.prompt)
    meta["weight_version"] = weight_version
    if not waiting_abort:
        meta["num_retractions"] = req.num_retractions
    if it.return_logprob:
        scored = req.prompt[it.logprob_start_len:] if it.logprob_start_len >= 0 else []
        meta["input_token_logprobs"] = [entry(lp, tok) for lp, tok in zip(req.input_logprobs or [], scored)]
        meta["output_token_logprobs"] = [entry(lp, tok) for lp, tok in
                                         zip(req.output_logprobs[since:n], req.output_ids[since:n])]
        # A prefill-only request has one output row and no output token: SGLang keeps max(n, 1).
        rows = slice(since, max(n, 1))
        if it.top_logprobs_num > 0:
            meta["input_top_logprobs"] = rows_of(req.input_top)
            meta["output_top_logprobs"] = rows_of(req.output_top[rows])
        if it.logprob_ids:
            meta["input_token_ids_logprobs"] = rows_of(req.input_chosen)
            meta["output_token_ids_logprobs"] = rows_of(req.output_chosen[rows])
    meta["completion_tokens"] = n
    if not waiting_abort:
        meta["cached_tokens"] = 0
        meta["reasoning_tokens"] = 0
    meta["weight_versions"] = [{**s, "end": min(s["end"], n)} for s in req.versions if s["start"] < n]
    meta["e2e_latency"] = time.perf_counter() - req.t0
    if cursor is not None:
        new = out_text[len(cursor.text):] if out_text.startswith(cursor.text) else ""
        cursor.n, cursor.text = n, out_text
        out_text = new
    return {"text": out_text, "output_ids": req.output_ids[since:n], "meta_info": meta}
