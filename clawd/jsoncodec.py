"""JSON on the serving hot path: orjson where it gives what the standard library gives, the standard library
where it would not.

Why orjson: one engine chunk decodes ~4x faster and one SSE event encodes ~15x faster than with `json`
(measured on this project's shapes; bench/serve.py has the figures in context), and a streamed reply does
both once per token. Where the two differ, the standard library's behaviour is kept:

- `loads`: orjson refuses what is not strict RFC 8259 JSON (NaN, Infinity, -Infinity, lone surrogate
  escapes, a number too large for a float); `json` accepts those, so a refused text is decoded again by
  `json`, which raises its own `ValueError` for what neither accepts. One difference remains: orjson reads
  an integer past 64 bits as a float, `json` as an int. So `loads` reads the engine's answers (token ids,
  counts, log-probs: never that large); a client's request body is read by `json`.
- `dumps`: orjson writes a non-finite float as `null`, `json` as `NaN`/`Infinity`. `dumps(obj, finite=True)`
  is the caller's word that `obj` holds no non-finite float (the reply builder checks its log-probs as they
  arrive); without it, an output holding `null` has its floats checked (`finite_throughout`: a list of numbers
  summed in C) and one that holds a NaN or an infinity is encoded again by `json`, so that a NaN stays a NaN.
  Output is compact UTF-8, as `json.dumps(obj, ensure_ascii=False, separators=(",", ":"))` writes it, but for
  a float's spelling (orjson `0.00001`, `json` `1e-05`: the same number). What orjson cannot encode (a key that
  is not a string, a lone surrogate: escaped, as UTF-8 cannot hold it) goes to `json` too.
"""
from __future__ import annotations

import json
import math
from itertools import chain
from typing import Any

import orjson


def loads(data: bytes | str) -> Any:
    """`json.loads`, faster where orjson reads the text the same way."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def dumps(obj: Any, *, finite: bool = False, sort_keys: bool = False) -> bytes:
    """Compact UTF-8 JSON of `obj`; `finite`: the caller knows it holds no NaN or infinity; `sort_keys`: keys in
    order (orjson's order, by UTF-8 bytes, where `json` falls back: by code point; the same for ASCII keys)."""
    try:
        out = orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) if sort_keys else orjson.dumps(obj)
    except orjson.JSONEncodeError:
        return _stdlib(obj, sort_keys)
    if finite or b"null" not in out or finite_throughout(obj):
        return out
    return _stdlib(obj, sort_keys)  # a NaN or an infinity, which orjson wrote as null


def finite_throughout(obj: Any) -> bool:
    """No NaN or infinity anywhere in `obj`: dicts, lists and tuples walked, a list of numbers summed in C, and
    a list of such lists (a turn's top-k ids) summed as one in C. Never True when one is there; False also
    for finite numbers whose sum overflows (`json` then writes them)."""
    kind = type(obj)
    if kind is str or kind is int or obj is None:  # the common leaves first, by exact type (a subclass walks on)
        return True
    if kind is float:
        return math.isfinite(obj)
    if kind is dict:
        return all(map(finite_throughout, obj.values()))
    if kind is list or kind is tuple:
        if obj:
            first = type(obj[0])
            try:  # a NaN or an infinity makes the sum one (a finite sum that overflows only sends it to `json`)
                if first is int or first is float:
                    return math.isfinite(sum(obj))
                if (first is list or first is tuple) and set(map(type, obj)) <= _ROWS:
                    return math.isfinite(sum(chain.from_iterable(obj)))
            except (TypeError, OverflowError):  # not only numbers (None, strings, containers), or an int past a float
                pass
        return all(map(finite_throughout, obj))
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, dict):
        return all(map(finite_throughout, obj.values()))
    if isinstance(obj, (list, tuple)):
        return all(map(finite_throughout, obj))
    return True


_ROWS = {list, tuple}


def _stdlib(obj: Any, sort_keys: bool = False) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys)
    try:
        return text.encode()
    except UnicodeEncodeError:  # a lone surrogate: escaped, as `json` does by default
        return json.dumps(obj, separators=(",", ":"), sort_keys=sort_keys).encode()
