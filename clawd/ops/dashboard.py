"""`GET /dashboard` and `GET /dashboard/data`: the learning view, one self-contained page.

The page (`dashboard.html`, beside this module: no CDN, no external font or script) fetches
`/dashboard/data` every 5 s and redraws its SVG plots from it. `data()` is the daemon's: it returns
the dict below, and this module only serves it (non-finite floats become null, as in every JSON
clawd writes). The contract, every key always present:

    {"generated": float,                      # unix time the dict was made
     "policy": {"version": int},              # the version serving now
     "learning": {"paused": bool,
                  "reasons": [{"reason": str, "detail": str, "since": float}]},   # clawd.pauses
     "queue": {"waiting": int, "batch": int}, # samples waiting to train; the rollout batch size
     "samples_per_minute": float,
     "rollouts": null | {"running": bool,     # the active rollouts (null: off): drawing groups, or paused
                         "groups": int, "answers": int, "solved": int,   # drawn, scored, scored 1
                         "backlog": int},     # their samples waiting for the learner
     "own_adapters": null | {"adapters": int, "max": int,   # adapters per principal (null: one shared adapter)
                             "versions": {str: int}},         # each principal's pseudonym: the version serving them
     "feedback": null | {"ratings": int,     # users' ratings of replies received (null: feedback off)
                         "judged": int,       # rated turns the judge also scored +1 or -1
                         "agreement": float | null, "low": float | null, "high": float | null,  # 95 % interval
                         "alarms": [{"scope": "all" | "version" | "principal", "key": str,
                                     "agreement": float, "judged": int}]},
     "versions": [                            # oldest first: the last versions of state/versions.jsonl
       {"version": int, "parent": int | null, "created": float,
        "status": "candidate" | "serving" | "retired" | "rejected" | "rolled_back",
        "steps": int, "samples": int,         # training steps and samples that made it
        "gate": null | {"score": float,       # its mean score on the evaluation set
                        "incumbent": float | null,   # the replaced version's, same prompts and seeds
                        "diff": float | null,        # score - incumbent, paired (clawd.safety.paired.compare)
                        "low": float | null, "high": float | null,   # diff's interval at gate.level
                        "passed": bool, "detail": str},
        "monitors": {"replies": int,          # live replies the figures below are over
                     "mean_words": float | null, "empty_share": float | null,
                     "one_word_share": float | null, "repeated_opening_share": float | null,
                     "top_reply_share": float | null, "distinct_2": float | null,
                     "refusal_share": float | null, "tool_error_share": float | null,
                     "reward_mean": float | null, "hint_share": float | null,
                     "kl": float | null, "entropy": float | null},
        "judge_agreement": float | null,      # the judge's ±1 verdicts its users' ratings confirmed
        "alarms": [{"monitor": str, "action": str, "detail": str}]}],
     "steps": [                               # the last training steps (at most 50), oldest first
       {"step": int, "version": int | null, "time": float, "samples": int,
        "sources": {"live" | "set" | "env": int},   # the step's samples by where they came from
        "loss": float | null, "reward_mean": float | null, "kl": float | null,
        "entropy": float | null}]}

null means "not measured" (no replies yet, no gate run): the page draws a gap, never a zero. Keys
beyond these are ignored (a gate verdict may carry its baseline comparison), so records can pass
through as they are; leave out what is large (a gate's per-prompt outcomes, a tally's kept texts):
the page is fetched every 5 s. The page draws every version it is given (the daemon sends the
last 200) and the last 20 steps.

Protection a browser can use: with API keys configured (`auth.open` False) both routes take HTTP
Basic whose password is an operator's API key (any user name), or `Authorization: Bearer <key>`;
a user's key gets 403, anything else 401 with `WWW-Authenticate: Basic`, so a browser asks for it. The keys are the
Authenticator's own (reloaded on SIGHUP), compared as digests in constant time. With no keys the
page is open, like /metrics. The handlers return their 401s rather than raise them: the API's error
middleware would rebuild a raised one without its WWW-Authenticate header.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import importlib.resources
import json
import logging
import re
from typing import Callable

from aiohttp import web

from clawd.ops.status import finite
from clawd.serving.auth import Authenticator
from clawd.serving.errors import ApiError

log = logging.getLogger("clawd.dashboard")

PAGE = "/dashboard"
DATA = "/dashboard/data"
CHALLENGE = 'Basic realm="clawd", charset="UTF-8"'


def load_page() -> str:
    return importlib.resources.files("clawd.ops").joinpath("dashboard.html").read_text(encoding="utf-8")


def csp_for(page: str) -> str:
    """A policy that runs exactly the page's own inline <script> and <style> blocks (by hash) and
    lets it fetch only its own origin: no other origin, no injected script or style."""
    def hashes(tag: str) -> str:
        blocks = re.findall(rf"<{tag}(?:\s[^>]*)?>(.*?)</{tag}>", page, re.S)
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b.encode()).digest()).decode()}'"
                        for b in blocks) or "'none'"
    return (f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
            "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def presented_secret(header: str) -> bytes | None:
    """The key a request's Authorization header presents: a Bearer token, or a Basic password (the
    user name is ignored). None when there is none or the header is malformed (bad base64, no colon)."""
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    if not token:
        return None
    if scheme.lower() == "bearer":
        return token.encode("utf-8", "surrogateescape")  # header bytes as sent, as the Authenticator reads them
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(token.encode("ascii"), validate=True)
    except (binascii.Error, ValueError):  # ValueError: a non-ASCII header
        return None
    user, colon, password = decoded.partition(b":")
    return password if colon else None


def operator(auth: Authenticator, request: web.Request) -> bool | None:
    """Whether the request may see operators' pages: True when no keys are set or it presents an operator's
    key (HTTP Basic's password or a Bearer key); None for a user's key; False for none or a wrong one."""
    if auth.open:
        return True
    secret = presented_secret(request.headers.get("Authorization", ""))
    name = None if secret is None else auth.matches(secret)  # the Authenticator's constant-time comparison
    if name is None:
        return False
    return True if name in auth.operators else None


class Dashboard:
    """The two routes over `data` (the contract above), behind `auth`'s keys when it has any."""

    def __init__(self, data: Callable[[], dict], auth: Authenticator):
        self.data, self.auth = data, auth
        self.page = load_page()
        self.page_headers = {"Content-Security-Policy": csp_for(self.page), **self._common()}
        self.data_headers = {"Content-Security-Policy": "default-src 'none'; frame-ancestors 'none'",
                             **self._common()}

    @staticmethod
    def _common() -> dict[str, str]:
        return {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(PAGE, self.handle_page)
        app.router.add_get(DATA, self.handle_data)

    def allowed(self, request: web.Request) -> bool | None:
        """True: open, or an operator's key; False: no key, or a wrong one (401); None: a user's key (403): it
        shows every version's replies and alarms, which are not a user's to see."""
        return operator(self.auth, request)

    def refuse(self, headers: dict[str, str], known: bool = False) -> web.Response:
        if known:
            resp = ApiError(403, "The dashboard needs an operator's key: this key is a user's (give a key "
                                 "operator = true in [auth] keys)", code="operator_key_required").response()
            resp.headers.update(headers)
            return resp
        resp = ApiError(401, "The dashboard needs an operator's API key: as the password of HTTP Basic (any user "
                             "name) or as 'Authorization: Bearer <key>'", code="invalid_api_key").response()
        resp.headers.update(headers)
        resp.headers["WWW-Authenticate"] = CHALLENGE
        return resp

    async def handle_page(self, request: web.Request) -> web.Response:
        if not (allowed := self.allowed(request)):
            return self.refuse(self.page_headers, known=allowed is None)
        return web.Response(text=self.page, content_type="text/html", charset="utf-8", headers=self.page_headers)

    async def handle_data(self, request: web.Request) -> web.Response:
        if not (allowed := self.allowed(request)):
            return self.refuse(self.data_headers, known=allowed is None)
        try:
            body = json.dumps(finite(self.data()), allow_nan=False)
        except Exception as exc:  # a stage that cannot be read now: the page keeps its last drawing
            log.exception("dashboard data failed")
            resp = ApiError(503, f"The dashboard's data is not available: {type(exc).__name__}",
                            code="dashboard_unavailable", retry_after=5).response()
            resp.headers.update(self.data_headers)
            return resp
        return web.Response(text=body, content_type="application/json", headers=self.data_headers)
