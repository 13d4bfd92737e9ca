"""POST /v1/feedback against a live daemon on the real CPU engine: only the principal whose turn it was may rate
it; a rating overrules the judge, trains a turn nothing followed, is late once its turn was scored, is
recorded, exported and forgotten like the turn, and shows in status and metrics."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from .harness import Daemon
from .test_clawctl import clawctl, settle, status

KEYS = [{"name": "alice", "key": "alice-key-1234"}, {"name": "bob", "key": "bob-key-12345"}]


def rate(daemon: Daemon, key: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(daemon.url + "/v1/feedback", data=data, method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.slow
def test_ratings_on_a_live_daemon(tiny_model, tmp_path):
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 4}, "engine": {"launch": "local"},
                               "auth": {"keys": KEYS},
                               "sessions": {"session_idle_timeout": 1.0, "sweep_interval": 0.2}})
    try:
        alice = openai.OpenAI(base_url=daemon.url + "/v1", api_key="alice-key-1234", max_retries=0)
        bob = openai.OpenAI(base_url=daemon.url + "/v1", api_key="bob-key-12345", max_retries=0)
        messages = [{"role": "user", "content": "Tell me about otters"}]
        first = alice.chat.completions.create(model="m", messages=messages)
        side = alice.chat.completions.create(model="m", messages=messages, extra_headers={"X-Turn-Type": "side"})

        # Another principal, a side turn, a bad body: refused, and nothing recorded.
        code, body = rate(daemon, "bob-key-12345", {"id": first.id, "rating": -1})
        assert code == 404 and body["error"]["code"] == "reply_not_found" and body["error"]["param"] == "id"
        assert rate(daemon, "alice-key-1234", {"id": side.id, "rating": -1})[0] == 404
        code, body = rate(daemon, "alice-key-1234", {"id": first.id, "rating": 0})
        assert code == 400 and body["error"]["param"] == "rating"
        assert rate(daemon, "alice-key-1234", b"{")[0] == 400
        assert rate(daemon, "wrong-key", {"id": first.id, "rating": 1})[0] == 401

        # Alice rates her reply down before she thanks it: the rules judge says +1, her rating replaces it.
        assert rate(daemon, "alice-key-1234", {"id": first.id, "rating": -1, "text": "Too long."}) == \
            (200, {"object": "feedback", "id": first.id, "rating": -1, "status": "pending"})
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Thanks!"}]
        alice.chat.completions.create(model="m", messages=messages, extra_headers={"X-Session-Done": "1"})

        # Bob's one-turn conversation: nothing follows his reply (the session idles out), his rating trains it.
        only = bob.chat.completions.create(model="m", messages=[{"role": "user", "content": "Tell me about seals"}])
        assert rate(daemon, "bob-key-12345", {"id": only.id, "rating": 1})[1]["status"] == "pending"
        snap = settle(daemon, samples=2)

        assert rate(daemon, "alice-key-1234", {"id": first.id, "rating": 1})[1]["status"] == "late"
        judged = {(r["principal"], r["turn_index"]): r for r in daemon.records("judge")}
        assert judged[("alice", 0)]["votes"] == [1] and judged[("alice", 0)]["rating"] == -1
        assert judged[("alice", 0)]["reward"] == -1.0 and judged[("bob", 0)]["rating"] == 1
        assert judged[("bob", 0)]["votes"] == [] and judged[("bob", 0)]["reward"] == 1.0
        assert judged[("alice", 1)]["emitted"] is False  # her closing turn: nothing followed, no rating
        feedback = snap["feedback"]
        assert feedback["received"] == {"pending": 2, "late": 0, "not_trainable": 0}
        assert feedback["unknown"] == 2 and feedback["trained"] == 2 and feedback["alone"] == 1
        cal = status(daemon)["feedback"]["calibration"]
        assert cal["all"]["counts"]["+1"] == {"+1": 1, "-1": 1}  # the late rating is a pair too
        assert cal["principals"]["alice"]["judged"] == 2 and "bob" not in cal["principals"]
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert 'clawd_feedback_ratings_total{status="pending"} 2.0' in metrics
        assert 'clawd_judge_rating_pairs_total{judge="+1",rating="-1"} 1.0' in metrics
        assert 'clawd_judge_agreement{version="all"} 0.5' in metrics

        records = daemon.records("feedback")
        assert [(r["principal"], r["rating"], r["status"]) for r in records] == \
            [("alice", -1, "pending"), ("bob", 1, "pending"), ("alice", 1, "late")]
        assert records[0]["text"] == "Too long." and records[0]["session_id"] == judged[("alice", 0)]["session_id"]

        out = tmp_path / "alice-export"
        assert clawctl(daemon, "export", "alice", str(out)).returncode == 0
        assert json.loads((out / "manifest.json").read_text())["files"]["feedback.jsonl"]["lines"] == 2
        forgotten = json.loads(clawctl(daemon, "forget", "alice", "--json").stdout)
        assert forgotten["removed"]["feedback_records"] == 2 and forgotten["removed"]["replies_rated_or_rateable"] == 2
        assert [r["principal"] for r in daemon.records("feedback")] == ["bob"]
        assert rate(daemon, "alice-key-1234", {"id": first.id, "rating": 1})[0] == 404  # forgotten
        assert "alice" not in status(daemon)["feedback"]["calibration"]["principals"]
    finally:
        assert daemon.stop() == 0
    assert sorted((s.principal, s.reward) for s in daemon.samples()) == [("bob", 1.0)]
