"""The [server] section: where clawd listens and the limits every connection and request meets."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from clawd.checks import below, not_positive


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"              # the API's address: an IP literal (no name lookups)
    port: int = 8400                     # the API's TCP port
    max_concurrent_requests: int = 64    # chat requests in flight; above it, 429 with Retry-After
    max_body_bytes: int = 4 * 1024 * 1024  # largest request body (bytes); a larger one gets 413
    max_messages: int = 2048             # most messages in one request
    max_message_chars: int = 1_000_000   # most characters across one request's message text
    drain_timeout: float = 30.0          # seconds in-flight requests may take to finish on SIGTERM
    served_model_name: str = ""          # the model id in /v1/models and replies; "" = the model directory's name
    debug_routes: bool = False           # /debug/process (thread count, torch imported?) for tests and operators
    # A client that stalls holds a connection, never a request slot (clawd.serving.connections).
    header_timeout: float = 10.0         # seconds from a connection's first byte (or its last request) to all headers
    body_timeout: float = 30.0           # seconds to receive a whole request body
    keepalive_timeout: float = 15.0      # an idle keep-alive connection is closed after this
    write_timeout: float = 60.0          # seconds a client may take no byte of its reply (aiohttp has no bound)
    max_connections: int = 8192          # open connections; when full, the longest-stalled one is closed
    peer_connection_share: float = 0.5   # of max_connections one peer address may hold (1: no share)
    principal_request_share: float = 0.25  # of max_concurrent_requests kept for others (2+ API keys; 1: no share)
    allowed_hosts: tuple[str, ...] = ()  # Host names served (empty: the loopback names on loopback, else any)
    allowed_origins: tuple[str, ...] = ()  # web pages (scheme://host[:port]) that may call the API (CORS)

    def check(self) -> dict[str, str]:
        errors = below(self, 1, "max_concurrent_requests", "max_body_bytes", "max_messages", "max_message_chars",
                        "max_connections")
        bad = [o for o in self.allowed_origins if urlsplit(o).scheme not in ("http", "https") or not urlsplit(o).netloc
               or o != f"{urlsplit(o).scheme}://{urlsplit(o).netloc}"]
        if bad:
            errors["allowed_origins"] = f"each must be scheme://host[:port], as browsers send it, not {bad[0]!r}"
        errors |= below(self, 0, "drain_timeout") | not_positive(self, "header_timeout", "body_timeout",
                                                                    "keepalive_timeout", "write_timeout")
        errors |= {k: "must be above 0 and at most 1" for k in ("peer_connection_share", "principal_request_share")
                   if not 0 < getattr(self, k) <= 1}
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            errors["host"] = "must be an IP literal (no name lookups in the daemon)"
        if not 0 <= self.port <= 65535:
            errors["port"] = "must be in 0..65535"
        return errors

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback
