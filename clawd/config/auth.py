"""The [auth] section: API keys, the principals they name, and what each key may do."""
from __future__ import annotations

from dataclasses import dataclass

from clawd.samples import PSEUDO_PRINCIPAL


@dataclass(frozen=True)
class ApiKey:
    name: str           # the user principal recorded with each turn of this key's requests
    key: str = ""       # the bearer secret, at least 8 characters
    key_env: str = ""   # secrets: see clawd.credentials (resolved into `key` when the file is loaded)
    key_file: str = ""  # or a file holding it (a relative path: in systemd's credentials directory)
    train: bool = True  # false: this key's turns are served and never trained (consent; reason "consent")
    record: bool = True  # false: this key's turns leave no turn or judge record
    operator: bool = False  # true: this key opens /dashboard (and /metrics with require_metrics_key)

    def check(self) -> dict[str, str]:
        errors = {}
        if not self.name:
            errors["name"] = "must not be empty"
        elif self.name.startswith(PSEUDO_PRINCIPAL):
            errors["name"] = f"must not start with {PSEUDO_PRINCIPAL!r}: the active rollouts' principals"
        if len(self.key) < 8:
            errors["key"] = "must be at least 8 characters"
        return errors


@dataclass(frozen=True)
class AuthConfig:
    keys: tuple[ApiKey, ...] = ()        # bearer API keys; none: the API is open, all one principal "anonymous"
    # With no keys every request is the one principal "anonymous", unless the operator trusts the
    # client-chosen `user` field (then a principal is that field, cut to max_user_chars).
    trust_user_field: bool = False
    max_user_chars: int = 64             # a trusted `user` field is cut to this many characters (at least 1)
    allow_open: bool = False             # serve with no keys on an address other than loopback
    require_metrics_key: bool = False    # /metrics needs an operator key (it is open, like /health, otherwise)

    def check(self) -> dict[str, str]:
        if self.max_user_chars < 1:
            return {"max_user_chars": "must be at least 1"}
        names = [k.name for k in self.keys]
        if len(set(names)) != len(names):
            return {"keys": "key names must be unique"}
        secrets = [k.key for k in self.keys]
        if len(set(secrets)) != len(secrets):
            return {"keys": "two entries share one key"}
        return {}
