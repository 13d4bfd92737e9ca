"""Who is asking: bearer API keys, and the principal a request is counted and trained under.

The principal is what the fairness cap (`scoring.fair_share`) counts and what records are kept
under. With keys, it is the key's name. With no keys there is nothing a client cannot choose, so
every request is the one principal "anonymous" unless the operator opts in to trusting the
request's `user` field (`auth.trust_user_field`): then one client that rotates `user` values can
fill every batch, which is the operator's call to accept (see the README).
"""
from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from clawd.config.schema import Config
from clawd.samples import PSEUDO_PRINCIPAL
from clawd.serving.errors import ApiError


ANONYMOUS = "anonymous"


def _digest(secret: bytes) -> bytes:
    # Compared as fixed-size digests: compare_digest on the raw keys would return early on a length
    # mismatch, telling a caller how long a key is.
    return hashlib.sha256(secret).digest()


class Authenticator:
    """Bearer keys, compared in constant time against every configured key."""

    def __init__(self, cfg: Config):
        self.trust_user_field = cfg.auth.trust_user_field
        self.max_user_chars = cfg.auth.max_user_chars
        self.set_keys(cfg.auth.keys)

    def set_keys(self, keys) -> None:
        """At start and on SIGHUP: the next request is checked against these."""
        self.keys = [(k.name, _digest(k.key.encode())) for k in keys]
        self.operators = frozenset(k.name for k in keys if k.operator)

    @property
    def open(self) -> bool:
        return not self.keys

    def principal(self, request: web.Request) -> str | None:
        """The key's name; None when keys are off (the caller picks a principal)."""
        if self.open:
            return None
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "Missing bearer token: send 'Authorization: Bearer <key>'", code="missing_api_key")
        found = self.matches(token.strip().encode("utf-8", "surrogateescape"))  # header bytes as sent
        if found is None:
            raise ApiError(401, "Invalid API key", code="invalid_api_key")
        return found

    def matches(self, secret: bytes) -> str | None:
        """The name of the key `secret` is, or None: digests compared in constant time, with no early exit, so
        timing reveals neither which key matched nor how long any is."""
        given = _digest(secret)
        found = None
        for name, key in self.keys:
            if hmac.compare_digest(given, key):
                found = name
        return found

    def principal_for(self, key_name: str | None, user: str | None) -> str:
        """The principal of an authenticated request: its key's name; with no keys, "anonymous", or the
        `user` field cut to max_user_chars when the operator trusts it."""
        if key_name is not None:
            return key_name
        if self.trust_user_field and user:
            if user.startswith(PSEUDO_PRINCIPAL):  # the active rollouts' own: a client cannot pose as them
                raise ApiError(400, f"user: names starting with {PSEUDO_PRINCIPAL!r} are reserved", code="invalid_user",
                               param="user")
            return user[:self.max_user_chars]
        return ANONYMOUS
