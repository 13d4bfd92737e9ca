"""Small predicates the configuration's sections share when they check their values."""
from __future__ import annotations

import math
import re


def is_number(x) -> bool: return isinstance(x, (int, float)) and not isinstance(x, bool)
def is_int(x) -> bool: return isinstance(x, int) and not isinstance(x, bool)
def is_finite(x) -> bool: return is_number(x) and math.isfinite(x)


def is_group_name(name: str) -> bool:
    """A POSIX group name as shadow-utils accepts it (a trailing $ for Samba machine accounts)."""
    return re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*\$?", name) is not None


def below(section, floor: int, *names: str) -> dict[str, str]:
    return {n: f"must be at least {floor}" for n in names if getattr(section, n) < floor}


def not_positive(section, *names: str) -> dict[str, str]:
    return {n: "must be positive" for n in names if getattr(section, n) <= 0}
