"""The learning view on a live daemon: the real daemon learns on the tiny model with its gate and monitors on
and API keys set; headless chromium signs in with a key and draws the versions the daemon reports. The
page's own behaviour on made-up histories (gaps, escaping, headers): tests/test_dashboard_page.py."""
from __future__ import annotations

import json
import os
import time
import urllib.request

import openai
import pytest

from . import browser
from .harness import ROOT, Daemon

KEY = "sk-live-dashboard-0123"


def gate_set(path) -> str:
    lines = [{"id": f"talk-{i}", "messages": [{"role": "user", "content": f"Say something about {i}."}],
              "check": {"min_words": 2}} for i in range(8)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def data(daemon: Daemon) -> dict:
    request = urllib.request.Request(daemon.url + "/dashboard/data", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def points(svg: browser.Element) -> list[tuple[int, float]]:
    return [(int(c.attrs["data-version"]), float(c.attrs["data-value"])) for c in svg.all("circle")]


@pytest.mark.slow
async def test_the_dashboard_draws_a_live_daemons_versions(tiny_model, tmp_path):
    browser.require_chromium()
    daemon = Daemon(tmp_path, {
        "auth": {"keys": [{"name": "ops", "key": KEY, "operator": True}]},
        "model": {"path": str(tiny_model), "max_tokens_cap": 8}, "engine": {"launch": "local", "seed": 1},
        "learner": {"enabled": True, "rollout_batch_size": 4, "min_batch_size": 4},
        "train": {"checkpoint_every": 1, "optimizer": {"lr": 1e-2}},
        # A gate that scores but never rejects (margin 0.95): this test is about the view, not the verdicts.
        "gate": {"enabled": True, "set": gate_set(tmp_path / "gate.jsonl"), "samples_per_prompt": 2, "max_tokens": 8,
                 "margin": 0.95},
        # Monitors that alarm and never act: the tiny model's few replies a version are noise, and what the
        # view must show is the history as it is, alarms included.
        "monitors": {"enabled": True, "min_replies": 4, "interval": 0.5,
                     **{name: {"action": "alarm"} for name in ("empty_share", "one_word_share", "repeated_opening_share",
                                                               "top_reply_share", "distinct_2", "refusal_share",
                                                               "tool_error_share", "kl")}}})
    shot = ROOT / "docs" / "dashboard.png" if os.environ.get("CLAWD_WRITE_SCREENSHOT") == "1" else tmp_path / "page.png"
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key=KEY, max_retries=0)
        for version in range(1, 4):
            for i in range(4):
                messages = [{"role": "user", "content": f"Question {version}.{i}?"}]
                reply = client.chat.completions.create(model="m", messages=messages)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "Thanks, great answer!" if i % 2 else "No, that's wrong."}]
                client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Session-Done": "1"})
            deadline = time.monotonic() + 120
            while data(daemon)["policy"]["version"] < version and time.monotonic() < deadline:
                time.sleep(0.2)
        time.sleep(1.5)  # a monitors check of the last version
        live = data(daemon)
        dom = browser.parse_dom(await browser.render(f"http://ops:{KEY}@{daemon.url.removeprefix('http://')}/dashboard",
                                                     shot))
    finally:
        assert daemon.stop() == 0
    versions = live["versions"]
    assert [v["version"] for v in versions] == [0, 1, 2, 3] and live["policy"]["version"] == 3
    assert all(v["gate"] is not None for v in versions) and len(live["steps"]) == 3
    assert dom.one("body").attrs.get("data-drawn") == "1"
    assert dom.one(id="policy-version").text == "v3"
    # The page drew what the daemon reported: one point per version on the gate and the monitors' plots.
    assert points(dom.one("svg", data_series="gate_score")) == [(v["version"], v["gate"]["score"]) for v in versions]
    words = [(v["version"], v["monitors"]["mean_words"]) for v in versions if v["monitors"]["mean_words"] is not None]
    assert len(words) >= 3 and points(dom.one("svg", data_series="mean_words")) == words
    assert [(li.attrs["data-version"], li.attrs["data-status"]) for li in dom.one(id="versions").all("li")] == [
        (str(v["version"]), v["status"]) for v in versions]
    assert [r.attrs["data-step"] for r in dom.one("tbody").all("tr")] == ["3", "2", "1"]
    png = shot.read_bytes()
    assert browser.png_size(png) == (1280, 1600) and len(png) > 40_000
