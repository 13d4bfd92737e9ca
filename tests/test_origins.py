"""Web pages cannot chat with clawd or train it (clawd.serving.origins): the pure refusal rules, exactly, and a
real headless chromium on two other origins against a live daemon: the page whose origin is not listed
leaves no turn, record or sample, whatever it tries (a no-cors text/plain POST, a CORS JSON POST); the
listed one is served and reads its reply (the control that the browser reached clawd at all)."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from multidict import CIMultiDict

from clawd.serving import origins

from . import browser
from .harness import Daemon

LOCAL = origins.allowed_hosts((), "127.0.0.1", True)


def refused(hosts=LOCAL, allowed=frozenset(), **headers):
    head = CIMultiDict({"Host": "127.0.0.1:8400", "Content-Type": "application/json"})
    for name, value in headers.items():
        name = name.replace("_", "-")
        if value is None:
            head.pop(name, None)
        else:
            head[name] = value
    problem = origins.refusal(head, hosts, frozenset(allowed), "http") or origins.not_json(head)
    return None if problem is None else (problem.status, problem.body()["error"]["code"])


def test_host_names_and_the_hosts_allowed():
    assert [origins.host_name(h) for h in ("localhost:8400", "[::1]:8400", "LOCALHOST.", "::1", "127.0.0.1")] == \
        ["localhost", "::1", "localhost", "::1", "127.0.0.1"]
    assert LOCAL == {"localhost", "127.0.0.1", "::1"}
    assert origins.allowed_hosts((), "0.0.0.0", False) is None  # listening on all addresses, no names: any
    assert origins.allowed_hosts(("Chat.Example.com:443",), "10.0.0.5", False) == {"chat.example.com", "10.0.0.5"}


def test_what_a_page_can_send_is_refused_and_what_a_client_sends_is_not():
    assert refused() is None  # the openai client: JSON, a loopback Host, no Origin
    assert refused(Host="localhost:8400") is None and refused(Host="[::1]:8400") is None
    assert refused(Host=None) is None  # HTTP/1.0 without a Host: no browser sends that
    assert refused(Host="evil.example:8400") == (403, "host_not_allowed")  # DNS rebinding
    assert refused(Host="evil.example", hosts=None) is None  # not on loopback, no names configured
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        assert refused(Content_Type=content_type) == (415, "unsupported_media_type"), content_type
    assert refused(Content_Type="application/json; charset=utf-8") is None
    assert refused(Content_Type="Application/JSON") is None and refused(Content_Type="application/vnd.x+json") is None
    assert refused(Origin="http://evil.example") == (403, "origin_not_allowed")
    assert refused(Origin="null") == (403, "origin_not_allowed")  # a sandboxed frame or a file:// page
    assert refused(Origin="http://app.example", allowed={"http://app.example"}) is None
    assert refused(Origin="http://127.0.0.1:8400") is None  # clawd's own page (the dashboard)
    assert refused(Origin="http://127.0.0.1:9999") == (403, "origin_not_allowed")  # another port, another origin
    # The origin is judged before the body's type: a listed page's text/plain POST still gets 415.
    assert refused(Origin="http://app.example", allowed={"http://app.example"}, Content_Type="text/plain") == \
        (415, "unsupported_media_type")


PAGE = """<!doctype html><html><body><script>
const url = "{url}/v1/chat/completions";
const body = JSON.stringify({{model: "m", max_tokens: 2, messages: [{{role: "user", content: "{canary}"}}]}});
async function attempt(name, init) {{
  try {{
    const r = await fetch(url, init);
    return name + ":" + r.status + ":" + (r.type === "opaque" ? "opaque" : (await r.text()).slice(0, 60));
  }} catch (e) {{ return name + ":" + e.name; }}
}}
(async () => {{
  const out = [await attempt("simple", {{method: "POST", mode: "no-cors", headers: {{"Content-Type": "text/plain"}}, body}}),
               await attempt("cors", {{method: "POST", headers: {{"Content-Type": "application/json"}}, body}})];
  document.body.setAttribute("data-out", out.join("|"));
}})();
</script></body></html>"""


async def page_server(html_for):
    app = web.Application()

    async def page(request):
        return web.Response(text=html_for(request.url.port), content_type="text/html")
    app.router.add_get("/", page)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def test_a_page_on_another_origin_leaves_no_turn_and_a_listed_one_is_served(tiny_model, tmp_path):
    browser.require_chromium()
    urls = {}
    pages = [await page_server(lambda port: PAGE.format(url=urls["clawd"], canary=f"canary-{port}")) for _ in range(2)]
    (stranger, stranger_port), (listed, listed_port) = pages
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 4},
                               "engine": {"launch": "local"},
                               "server": {"allowed_origins": [f"http://127.0.0.1:{listed_port}"]},
                               "sessions": {"session_idle_timeout": 1.0, "sweep_interval": 0.5},  # one-turn sessions end, their turns recorded
                               "learner": {"enabled": True, "rollout_batch_size": 1, "min_batch_size": 1}})
    try:
        urls["clawd"] = daemon.url
        outs = {}
        for name, port in (("stranger", stranger_port), ("listed", listed_port)):
            dom = browser.parse_dom(await browser.render(f"http://127.0.0.1:{port}/", budget_ms=20000))
            outs[name] = dom.one("body").attrs.get("data-out", "")
        print(json.dumps(outs, indent=1))
        deadline = asyncio.get_running_loop().time() + 20
        while f"canary-{listed_port}" not in (texts := json.dumps(daemon.records())) and \
                f"canary-{stranger_port}" not in texts:
            assert asyncio.get_running_loop().time() < deadline, f"no page's turn was recorded: {outs}"
            await asyncio.sleep(0.2)
        assert f"canary-{stranger_port}" not in texts  # the stranger was never served, nor trained on
        assert f"canary-{listed_port}" in texts
        # The stranger's no-cors POST reaches clawd (the browser does not ask first) and is refused there; its
        # JSON POST fails at the preflight. The listed page's JSON POST is answered and readable.
        assert outs["stranger"].startswith("simple:0:opaque|cors:TypeError"), outs
        assert outs["listed"].split("|")[1].startswith("cors:200:"), outs
    finally:
        assert daemon.stop() == 0
        for runner, _ in pages:
            await runner.cleanup()
    assert not any(f"canary-{stranger_port}" in json.dumps(s.to_json()) for s in daemon.samples())
    refusals = [line for line in daemon.lines if "origin_not_allowed" in line or "unsupported_media_type" in line]
    assert not any("Traceback" in line for line in daemon.lines), refusals


def test_config_checks_origins_as_browsers_send_them():
    from clawd.config.loading import config_from_dict, ConfigError

    config_from_dict({"server": {"allowed_origins": ["https://chat.example.com", "http://a:8080"]}})
    for bad in ("*", "chat.example.com", "https://chat.example.com/", "ftp://x"):
        with pytest.raises(ConfigError, match="allowed_origins"):
            config_from_dict({"server": {"allowed_origins": [bad]}})
