"""TOML for clawd's config tables: what the demo launcher and the tests write for a daemon to load."""
from __future__ import annotations

import json
from typing import Any


def to_toml(sections: dict[str, dict[str, Any]]) -> str:
    """TOML for a config of tables of scalars, lists and inline tables (all clawd's config needs)."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string is a TOML basic string
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        raise TypeError(f"no TOML for {v!r}")
    out = []
    for name, table in sections.items():
        out.append(f"[{name}]")
        out += [f"{k} = {value(v)}" for k, v in table.items()]
        out.append("")
    return "\n".join(out)


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over`'s keys written over `base`'s, tables merged key by key at every depth: a caller's [train.loss]
    opd_top_k keeps the other [train.loss] keys a default config set."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
