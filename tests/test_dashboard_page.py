"""The learning view: `/dashboard` and `/dashboard/data` behind Basic or Bearer keys, with the page's
security headers; and the page itself, drawn by headless chromium from a realistic history (every
series' points are the data's values, gaps stay gaps, outside text stays text)."""
from __future__ import annotations

import base64
import math
import os
import time
from pathlib import Path

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from clawd.config.loading import config_from_dict
from clawd.ops.dashboard import CHALLENGE, Dashboard, csp_for, presented_secret
from clawd.serving.api import AUTH, make_app
from clawd.serving.auth import Authenticator

from . import browser

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-dash-0123456789"
OTHER_KEY = "sk-other-abcdefgh"
SCRIPT = "<script>alert(1)</script>"
T0 = time.time() - 4000  # the history ends about now (the screenshot reads so)

MONITORS = ("mean_words", "empty_share", "one_word_share", "repeated_opening_share", "top_reply_share",
            "distinct_2", "refusal_share", "tool_error_share", "reward_mean", "hint_share", "kl", "entropy")


def monitors(replies: int, **values) -> dict:
    return {"replies": replies, **dict.fromkeys(MONITORS), **values}


def gate(score, incumbent, low, high, passed, detail="") -> dict:
    diff = None if incumbent is None else score - incumbent
    return {"score": score, "incumbent": incumbent, "diff": diff, "low": low, "high": high, "passed": passed,
            "detail": detail}


def version(n, status, parent, gate_=None, mons=None, alarms=(), agreement=None) -> dict:
    return {"version": n, "parent": parent, "created": T0 + 600 * n, "status": status, "steps": 4 * n,
            "samples": 32 * n, "gate": gate_, "monitors": mons or monitors(0), "alarms": list(alarms),
            "judge_agreement": agreement}


def history() -> dict:
    """Six versions: v2 failed its gate (never served: no monitors, a gap), v3 served and was rolled
    back by an alarm whose detail carries markup, v4 serves (its kl not measured: a gap), v5 waits."""
    base = dict(empty_share=0.0, one_word_share=0.02, repeated_opening_share=0.05, top_reply_share=0.01,
                distinct_2=0.81, refusal_share=0.01, tool_error_share=0.0, hint_share=0.1, entropy=1.9)
    return {
        "generated": T0 + 4000,
        "policy": {"version": 4},
        "learning": {"paused": True, "reasons": [{"reason": "monitor", "since": T0 + 2000,
                                                  "detail": "one_word_share rose <img src=x onerror=alert(2)>"}]},
        "queue": {"waiting": 13, "batch": 8},
        "samples_per_minute": 6.5,
        "rollouts": {"running": True, "groups": 12, "answers": 48, "solved": 9, "backlog": 4},
        "own_adapters": {"adapters": 2, "max": 16, "versions": {"p-aaaaaaaaaaaaaaaa": 7, "p-bbbbbbbbbbbbbbbb": 0}},
        "feedback": {"ratings": 61, "judged": 40, "agreement": 0.625, "low": 0.47, "high": 0.76,
                     "alarms": [{"scope": "principal", "key": f"carol {SCRIPT}", "agreement": 0.2, "judged": 25}]},
        "versions": [
            version(0, "retired", None, None, monitors(120, mean_words=41.5, reward_mean=0.12, kl=0.0, **base)),
            version(1, "retired", 0, gate(0.61, 0.58, -0.01, 0.07, True),
                    monitors(96, mean_words=38.25, reward_mean=0.2, kl=0.05, **base), agreement=0.8),
            version(2, "rejected", 1, gate(0.42, 0.61, -0.27, -0.11, False, "worse than v1 by 0.19")),
            version(3, "rolled_back", 1, gate(0.64, 0.61, -0.02, 0.08, True),
                    monitors(40, mean_words=3.1, reward_mean=0.31, kl=0.4,
                             **(base | {"one_word_share": 0.45, "distinct_2": 0.3})),
                    alarms=[{"monitor": "one_word_share", "action": "rollback", "detail": f"0.45 vs 0.02 {SCRIPT}"},
                            {"monitor": "mean_words", "action": "alarm", "detail": "3.1 words vs 39.9"}],
                    agreement=0.45),
            version(4, "serving", 1, gate(0.66, 0.61, 0.01, 0.09, True),
                    monitors(30, mean_words=37.0, reward_mean=0.28, **base)),
            version(5, "candidate", 4),
        ],
        "steps": [{"step": s, "version": s // 4, "time": T0 + 150 * s, "samples": 8,
                   "sources": {"live": 5, "set": 3} if s % 2 else {"live": 8},
                   "loss": None if s == 7 else 0.5 - 0.01 * s, "reward_mean": 0.1 + 0.01 * s,
                   "kl": 0.01 * s, "entropy": 2.0 - 0.01 * s} for s in range(1, 23)],
    }


SERIES = {"gate_score": lambda v: v["gate"] and v["gate"]["score"],
          "gate_diff": lambda v: v["gate"] and v["gate"]["diff"],
          "judge_agreement": lambda v: v["judge_agreement"],
          **{name: (lambda v, name=name: v["monitors"][name]) for name in MONITORS}}


def auth(*keys: str) -> Authenticator:
    return Authenticator(config_from_dict({"auth": {"keys": [{"name": f"k{i}", "key": k}
                                                             for i, k in enumerate(keys)]}}))


class FakeChat:
    """make_app's chat service for routes that never reach it."""
    model_name = "m"


def app_with_dashboard(data, *keys: str, seen: list | None = None, users: tuple[str, ...] = (),
                       metrics_key: bool = False) -> web.Application:
    """The chat API with the dashboard's routes added after make_app, as the daemon adds /metrics: `keys` are
    operators' keys, `users` users' keys (they chat, never see the dashboard)."""
    @web.middleware
    async def record(request, handler):  # what reached clawd: path, its Authorization scheme, the status
        resp = await handler(request)
        if seen is not None:
            seen.append((request.path, request.headers.get("Authorization", "").partition(" ")[0], resp.status))
        return resp
    cfg = config_from_dict({"auth": {"keys": [{"name": f"k{i}", "key": k, "operator": True} for i, k in enumerate(keys)]
                                     + [{"name": f"u{i}", "key": k} for i, k in enumerate(users)],
                                     "require_metrics_key": metrics_key}})
    app = make_app(cfg, FakeChat(), outer_middlewares=[record])
    Dashboard(data, app[AUTH]).add_routes(app)
    from clawd.ops.metrics import Metrics

    class Guarded(Metrics):  # its guard is the point here, not the figures of a status this app has none of
        def render(self):
            return web.Response(text="# metrics\n")
    app.router.add_get("/metrics", Guarded(dict, app[AUTH] if metrics_key else None).handle)
    return app


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# ---- the pure parts -----------------------------------------------------------------------------

def test_presented_secret_reads_bearer_and_basic_and_nothing_malformed():
    assert presented_secret(f"Bearer {KEY}") == KEY.encode()
    assert presented_secret(f"bearer   {KEY}  ") == KEY.encode()
    assert presented_secret(basic("anyone", KEY)) == KEY.encode()
    assert presented_secret(basic("", "pa:ss")) == b"pa:ss"  # the first colon ends the user name
    assert presented_secret("Basic " + base64.b64encode(b"no-colon").decode()) is None
    assert presented_secret("Basic !!not-base64!!") is None
    assert presented_secret("Basic c2s=x") is None          # trailing garbage after padding
    assert presented_secret("Basic \udce9t\udce9") is None  # non-ASCII header bytes
    assert [presented_secret(h) for h in ("", "Basic", "Bearer ", "Digest abc", KEY)] == [None] * 5


def test_key_matches_only_a_configured_key():
    a = auth(KEY, OTHER_KEY)
    assert a.matches(KEY.encode()) and a.matches(OTHER_KEY.encode())
    assert not any(a.matches(k) for k in (b"", KEY[:-1].encode(), KEY.encode() + b" ", KEY.upper().encode()))


async def test_a_users_key_chats_but_never_opens_the_dashboard_or_a_guarded_metrics():
    client = await client_for(app_with_dashboard(history, KEY, users=(OTHER_KEY,), metrics_key=True))
    try:
        for path in ("/dashboard", "/dashboard/data", "/metrics"):
            resp = await client.get(path, headers={"Authorization": f"Bearer {OTHER_KEY}"})
            assert resp.status == 403 and (await resp.json())["error"]["code"] == "operator_key_required", path
            assert (await client.get(path)).status == 401, path
            assert (await client.get(path, headers={"Authorization": f"Bearer {KEY}"})).status == 200, path
        resp = await client.get("/dashboard", headers={"Authorization": basic("u", OTHER_KEY)})
        assert resp.status == 403 and "WWW-Authenticate" not in resp.headers  # no password prompt: a known key
    finally:
        await client.close()
    client = await client_for(app_with_dashboard(history, KEY))  # without require_metrics_key: open, like /health
    try:
        assert (await client.get("/metrics")).status == 200
    finally:
        await client.close()


def test_the_policy_runs_the_pages_own_blocks_by_hash_and_nothing_else():
    page = "<style>b{}</style><script>go()</script><script>x</script>"
    assert csp_for(page) == (
        "default-src 'none'; script-src 'sha256-5KYv+PUboo5h+0+YAtGRPbwv5d/QxzHslP4YGnUaxRw=' "
        "'sha256-LXEWQrcmsEQBYnyp+6wy9chTD7GQPMTbAiWHF5IaSIE='; "
        "style-src 'sha256-7yqHVAesot11p6HczDsgKRipvI5UPgs97z80zNXlans='; connect-src 'self'; img-src data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    assert "script-src 'none'" in csp_for("<p>no script</p>")


# ---- HTTP ---------------------------------------------------------------------------------------

async def client_for(app) -> TestClient:
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def test_with_keys_both_routes_need_one_as_basic_password_or_bearer():
    client = await client_for(app_with_dashboard(history, KEY, OTHER_KEY))
    try:
        for path in ("/dashboard", "/dashboard/data"):
            for header in (None, basic("u", "wrong-key-123"), "Bearer wrong-key-123", "Basic %%%",
                           "Basic " + base64.b64encode(KEY.encode()).decode(), f"Digest {KEY}"):
                resp = await client.get(path, headers={"Authorization": header} if header else {})
                assert resp.status == 401, (path, header)
                assert resp.headers["WWW-Authenticate"] == CHALLENGE
                assert resp.headers["Cache-Control"] == "no-store"
                assert (await resp.json())["error"]["type"] == "authentication_error"
            for header in (basic("anyone", KEY), basic("", OTHER_KEY), f"Bearer {KEY}"):
                resp = await client.get(path, headers={"Authorization": header})
                assert resp.status == 200, (path, header)
        data = await (await client.get("/dashboard/data", headers={"Authorization": f"Bearer {KEY}"})).json()
        assert data == history()
    finally:
        await client.close()


async def test_without_keys_the_dashboard_is_open_with_its_security_headers():
    client = await client_for(app_with_dashboard(history))
    try:
        page = await client.get("/dashboard")
        assert page.status == 200 and page.content_type == "text/html"
        csp = page.headers["Content-Security-Policy"]
        assert "script-src 'sha256-" in csp and "style-src 'sha256-" in csp and "connect-src 'self'" in csp
        assert "unsafe" not in csp and "http" not in csp and "*" not in csp
        data = await client.get("/dashboard/data")
        assert data.status == 200 and data.content_type == "application/json"
        for resp in (page, data):
            assert resp.headers["Cache-Control"] == "no-store"
            assert resp.headers["X-Content-Type-Options"] == "nosniff"
            assert resp.headers["Content-Security-Policy"].startswith("default-src 'none'")
    finally:
        await client.close()


async def test_data_is_strict_json_and_a_failing_source_is_a_503():
    calls = []

    def data():
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("versions file unreadable")
        return {"samples_per_minute": math.nan, "versions": [{"monitors": {"kl": math.inf}}]}
    client = await client_for(app_with_dashboard(data))
    try:
        resp = await client.get("/dashboard/data")
        assert await resp.text() == '{"samples_per_minute": null, "versions": [{"monitors": {"kl": null}}]}'
        resp = await client.get("/dashboard/data")
        assert resp.status == 503 and resp.headers["Retry-After"] == "5"
        assert (await resp.json())["error"]["code"] == "dashboard_unavailable"
    finally:
        await client.close()


def test_the_page_loads_nothing_from_elsewhere():
    page = (ROOT / "clawd/ops/dashboard.html").read_text()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    assert "innerHTML" not in page and "insertAdjacentHTML" not in page and "document.write" not in page


# ---- the page in chromium ------------------------------------------------------------------------

async def serve(app) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


def points(svg: browser.Element) -> list[tuple[int, float]]:
    return [(int(c.attrs["data-version"]), float(c.attrs["data-value"])) for c in svg.all("circle")]


async def test_chromium_draws_the_history_signed_in_from_the_url(tmp_path):
    browser.require_chromium()
    seen: list = []
    runner, port = await serve(app_with_dashboard(history, KEY, seen=seen))
    # CLAWD_WRITE_SCREENSHOT=1: the picture docs/ shows.
    shot = ROOT / "docs" / "dashboard.png" if os.environ.get("CLAWD_WRITE_SCREENSHOT") == "1" else tmp_path / "page.png"
    try:
        dom = browser.parse_dom(await browser.render(f"http://user:{KEY}@127.0.0.1:{port}/dashboard", shot))
    finally:
        await runner.cleanup()
    # Chromium signs in with the URL's credentials once challenged, and its fetch of the data sends
    # them again (the same origin, under the challenged path).
    assert seen == [("/dashboard", "", 401), ("/dashboard", "Basic", 200), ("/dashboard/data", "Basic", 200)]
    data = history()
    versions = data["versions"]
    assert dom.one("body").attrs.get("data-drawn") == "1"
    assert "hidden" in dom.one(id="error").attrs
    assert dom.one(id="policy-version").text == "v4"
    assert dom.one(id="learning").attrs["data-state"] == "paused"
    assert dom.one(id="queue").text == "13 / 8" and dom.one(id="samples-per-minute").text == "6.5"
    for key, get in SERIES.items():
        expected = [(v["version"], get(v)) for v in versions if get(v) is not None]
        assert points(dom.one("svg", data_series=key)) == expected, key
    assert points(dom.one("svg", data_series="kl")) == [(0, 0.0), (1, 0.05), (3, 0.4)]  # v2, v4, v5: gaps
    diff = dom.one("svg", data_series="gate_diff")
    assert [(c.attrs["data-version"], float(c.attrs["data-low"]), float(c.attrs["data-high"]))
            for c in diff.all("line", class_="interval")] == [("1", -0.01, 0.07), ("2", -0.27, -0.11),
                                                                ("3", -0.02, 0.08), ("4", 0.01, 0.09)]
    score = dom.one("svg", data_series="gate_score")
    assert score.one("circle", data_version="2").attrs["data-passed"] == "false"
    assert [p.attrs["data-version"] for p in score.all("path", data_rejected="true")] == ["2"]
    assert {r.attrs["data-version"]: r.attrs["data-status"] for r in score.all("rect")} == {
        "2": "rejected", "3": "rolled_back"}
    assert [(li.attrs["data-version"], li.attrs["data-status"]) for li in dom.one(id="versions").all("li")] == [
        (str(v["version"]), v["status"]) for v in versions]
    alarms = dom.one(id="alarms").all("li")
    assert [a.attrs["data-monitor"] for a in alarms] == ["judge_agreement", "one_word_share", "mean_words"]
    assert alarms[0].attrs["data-scope"] == "principal" and SCRIPT in alarms[0].text and SCRIPT in alarms[1].text
    assert points(dom.one("svg", data_series="judge_agreement")) == [(1, 0.8), (3, 0.45)]
    assert dom.one(id="judge-agreement").text == "63% of 40 agree (47–76%)"
    assert dom.one(id="judge-agreement").attrs["data-state"] == "alarm"
    assert dom.one(id="own-adapters").text == "2 of 16 principals"
    assert len(dom.all("script")) == 1 and dom.all("img") == []  # outside markup stayed text
    assert "<img src=x onerror=alert(2)>" in dom.one(id="pause-reasons").text
    assert [r.attrs["data-step"] for r in dom.one("tbody").all("tr")] == [str(s) for s in range(22, 2, -1)]
    rows = dom.one("tbody").all("tr")
    assert [rows[0].all("td")[4].text, rows[1].all("td")[4].text] == ["live 8", "live 5 · set 3"]  # steps 22, 21
    assert dom.one(id="rollouts").attrs["data-state"] == "running"
    assert dom.one(id="rollouts").text == "running · 9/48 solved · 4 waiting"

    png = shot.read_bytes()
    assert browser.png_size(png) == (1280, 1600)
    assert browser.png_idat_bytes(png) >= 1280 * 1600 * 3
    assert len(png) > 40_000  # a blank page of that size compresses to a few kB
    colours = browser.png_colours(shot)
    assert colours is None or colours > 50, colours


async def test_chromium_draws_no_version_and_one_version():
    browser.require_chromium()
    current = {"data": {**history(), "versions": [], "steps": []}}
    runner, port = await serve(app_with_dashboard(lambda: current["data"], KEY))
    url = f"http://user:{KEY}@127.0.0.1:{port}/dashboard"
    try:
        dom = browser.parse_dom(await browser.render(url))
        assert dom.one("body").attrs.get("data-drawn") == "1"
        assert dom.all("circle") == [] and dom.all("path", class_="series") == []
        assert "no versions yet" in dom.one("svg", data_series="gate_score").text
        assert dom.one("tbody").text == "no steps yet"
        assert dom.one(id="rollouts").attrs["data-state"] == "running"
        current["data"] = {**history(), "rollouts": None}
        dom = browser.parse_dom(await browser.render(url))
        assert dom.one(id="rollouts").text == "off" and dom.one(id="rollouts").attrs["data-state"] == "off"
        current["data"] = {**history(), "feedback": None}
        dom = browser.parse_dom(await browser.render(url))
        assert dom.one(id="judge-agreement").text == "off"
        assert dom.one(id="judge-agreement").attrs["data-state"] == "off"
        current["data"] = {**history(), "own_adapters": None}
        dom = browser.parse_dom(await browser.render(url))
        assert dom.one(id="own-adapters").text == "shared only"

        current["data"] = {**history(), "versions": [history()["versions"][1]]}
        dom = browser.parse_dom(await browser.render(url))
        assert points(dom.one("svg", data_series="mean_words")) == [(1, 38.25)]
        assert points(dom.one("svg", data_series="gate_score")) == [(1, 0.61)]
    finally:
        await runner.cleanup()
