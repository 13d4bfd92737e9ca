"""What a web page can send to clawd, refused (docs/ARCHITECTURE.md §8, "Browser origins").

A browser lets any page POST to any address without asking the server first, provided the request is
"simple" (a text/plain, form or multipart body, no custom header), and a page whose name was re-pointed at
127.0.0.1 (DNS rebinding) may even read the answers. With an open API (no keys, the default on loopback)
either would chat with the model and train it as `anonymous`. So, before any handler runs:

- POSTs to the API must say `Content-Type: application/json`: a simple request cannot (415, checked by the
  route once authenticated);
- the `Host` must be one of `[server] allowed_hosts`, by default the loopback names when clawd listens on
  loopback (a rebound name arrives with the page's host name), any host otherwise (403);
- a request that carries an `Origin` (browsers add it to every cross-origin request and to every POST)
  must come from `[server] allowed_origins` (empty by default) or from clawd's own origin (403). Listed
  origins get CORS: preflights are answered and replies carry Access-Control-Allow-Origin.

`refusal` and `not_json` are pure; `guard` is the middleware and `cors_headers` the response-prepare hook.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from aiohttp import web

from clawd.serving.errors import ApiError

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ALLOWED_HEADERS = "Authorization, Content-Type, X-Session-Id, X-Turn-Type, X-Session-Done, X-Clawd-No-Train"
PREFLIGHT_MAX_AGE = "600"


def host_name(host: str) -> str:
    """The name in a Host header, without its port, lower-cased, without a trailing dot: "[::1]:8400" -> "::1"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return name.rstrip(".")


def allowed_hosts(names: tuple[str, ...], listen: str, loopback: bool) -> frozenset[str] | None:
    """The Host names accepted: the configured ones (plus the address listened on), else the loopback names
    on loopback; None (any) when listening elsewhere with none configured."""
    if names:
        return frozenset(host_name(n) for n in names) | {listen.lower()}
    return LOOPBACK_NAMES | {listen.lower()} if loopback else None


def refusal(headers, hosts: frozenset[str] | None, origins: frozenset[str], scheme: str) -> ApiError | None:
    """Why this request is refused before any handler, or None. `headers`: a case-insensitive mapping."""
    host = headers.get("Host")
    if hosts is not None and host is not None and host_name(host) not in hosts:
        return ApiError(403, f"Host {host!r} is not one of this server's names; a page served under another name "
                             "cannot reach clawd (list the name in [server] allowed_hosts)", code="host_not_allowed")
    origin = headers.get("Origin")
    if origin is not None and origin not in origins and not _same_origin(origin, scheme, host):
        return ApiError(403, f"Origin {origin!r} is not allowed: requests made by web pages are refused unless "
                             "their origin is listed in [server] allowed_origins", code="origin_not_allowed")
    return None


def not_json(headers) -> ApiError | None:
    """A body a page could send without asking first (anything but JSON): the API's POST routes answer 415,
    after routing and authentication (an unknown route is still 404, a missing key still 401)."""
    mime = headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json")):
        return None
    return ApiError(415, "The request body must be JSON: send the header Content-Type: application/json",
                    code="unsupported_media_type")


def _same_origin(origin: str, scheme: str, host: str | None) -> bool:
    """clawd's own pages (the dashboard) fetching it: the Origin names the host the request was sent to."""
    if host is None:
        return False
    parts = urlsplit(origin)
    return parts.scheme == scheme and parts.netloc.lower() == host.strip().lower()


def guard(hosts: frozenset[str] | None, origins: frozenset[str]):
    """The middleware: refusals in OpenAI's error shape, and CORS preflights of listed origins answered."""
    @web.middleware
    async def middleware(request: web.Request, handler):
        problem = refusal(request.headers, hosts, origins, request.scheme)
        if problem is not None:
            return problem.response()
        origin = request.headers.get("Origin")
        if request.method == "OPTIONS" and origin in origins and "Access-Control-Request-Method" in request.headers:
            return web.Response(status=204, headers={
                "Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": ALLOWED_HEADERS, "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
                "Vary": "Origin"})
        return await handler(request)
    return middleware


def cors_headers(origins: frozenset[str]):
    """An on_response_prepare hook: a listed origin may read the reply, streamed ones included."""
    async def prepare(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin in origins:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
    return prepare
