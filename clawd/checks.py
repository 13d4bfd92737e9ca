"""Small predicates the configuration's sections share when they check their values."""
from __future__ import annotations

import ipaddress
import math
import re
from urllib.parse import urlsplit


def is_number(x) -> bool: return isinstance(x, (int, float)) and not isinstance(x, bool)
def is_int(x) -> bool: return isinstance(x, int) and not isinstance(x, bool)
def is_finite(x) -> bool: return is_number(x) and math.isfinite(x)


def is_group_name(name: str) -> bool:
    """A POSIX group name as shadow-utils accepts it (a trailing $ for Samba machine accounts)."""
    return re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*\$?", name) is not None


def is_import_path(value) -> bool:
    """"package.module:name", as a deployment names its code for the worker (clawd.rollouts.worker)."""
    return isinstance(value, str) and re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value) is not None


def below(section, floor: int, *names: str) -> dict[str, str]:
    return {n: f"must be at least {floor}" for n in names if getattr(section, n) < floor}


def not_positive(section, *names: str) -> dict[str, str]:
    return {n: "must be positive" for n in names if getattr(section, n) <= 0}


def ip_url_problem(url: str, names: bool = False) -> str | None:
    """None, or why `url` is not an http(s) URL whose host is an IP literal (a name too, with `names`)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http(s) URL"
    try:
        ipaddress.ip_address(parts.hostname)
    except ValueError:
        if not names:
            return "host must be an IP literal such as 127.0.0.1 (no name lookups in the daemon)"
    return None


def check_finite(section, name: str, ok, want: str, errors: dict) -> None:
    """Adds to `errors` when section.name is not a finite number that `ok` accepts."""
    value = getattr(section, name)
    if not (is_number(value) and math.isfinite(value) and ok(value)):
        errors[name] = f"must be a finite number {want}"

