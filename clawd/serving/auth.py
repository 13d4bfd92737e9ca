"""Who is asking: bearer API keys, and the principal a request is counted and trained under."""
from __future__ import annotations

import hmac

from aiohttp import web

from clawd.config import Config
from clawd.serving.errors import ApiError


class Authenticator:
    """Bearer keys, compared in constant time against every configured key."""

    def __init__(self, cfg: Config):
        self.set_keys(cfg.auth.keys)

    def set_keys(self, keys) -> None:
        """At start and on SIGHUP: the next request is checked against these."""
        self.keys = [(k.name, k.key.encode()) for k in keys]

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
        given = token.strip().encode("utf-8", "surrogateescape")  # header bytes as sent
        found = None
        for name, key in self.keys:  # no early exit: timing does not reveal which key matched
            if hmac.compare_digest(given, key):
                found = name
        if found is None:
            raise ApiError(401, "Invalid API key", code="invalid_api_key")
        return found
