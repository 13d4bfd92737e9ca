"""`GET /metrics`: the exposition text of a status snapshot, the request middleware, and an
end-to-end run in which every required metric appears and the ones the run moves have moved."""
from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import urllib.error
import urllib.request

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from clawd.serving.api import make_app
from clawd.serving.completion import ChatStats
from clawd.config.auth import ApiKey, AuthConfig
from clawd.config.schema import Config
from clawd.learning.learner import LearnerStats
from clawd.ops.metrics import Metrics

from .harness import Daemon

# ---- a status snapshot: what Metrics reads (clawd.ops.status.Status.snapshot's shape) ------------

def snapshot(**parts) -> dict:
    """A daemon's snapshot at rest, with `parts` replacing whole sections."""
    snap = {
        "mode": "rl",
        "paused": {"learning": False, "serving": False, "reasons": []},
        "policy": {"version": 0, "weight_version": None, "published_at": None, "weights": None},
        "queue": {"waiting": 0, "in_flight": 0, "effective": 0, "batch_size": 8, "journal_live": 0,
                  "stale_dropped": 0, "acked": 0},
        "sessions": {"live": 0},
        "chat": dataclasses.asdict(ChatStats()),
        "scoring": {"turns": 0, "samples": 0, "pending": 0, "votes": {}, "kinds": {}, "excluded": {},
                    "hints_offered": 0, "hints_accepted": 0, "not_learned_while_paused": 0},
        "learner": None,
        "engines": {},
        "trainer": None,
        "journal": {"bytes": 0, "records": 0, "fsyncs": 0, "truncations": 0, "live": 0, "segments": 0,
                    "size_bytes": 0, "quarantined_records": 0, "quarantined_bytes": 0, "write_failures": 0,
                    "fsync_failures": 0, "quarantine_failures": 0},
    }
    snap.update(parts)
    return snap


def app_with_metrics(cfg: Config, metrics: Metrics):
    """The chat API with the metrics middleware and route, as the daemon wires them."""
    app = make_app(cfg, FakeChat(), outer_middlewares=[metrics.middleware])
    app.router.add_get("/metrics", metrics.handle)
    return app


class FakeChat:
    """make_app's chat service for routes that never reach it."""
    model_name = "m"


def values(text: str) -> dict[tuple, float]:
    """{(sample name, sorted label items): value} of an exposition page."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def families(text: str) -> set[str]:
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


# ---- the page on fake stages ----------------------------------------------------------------

def test_stage_metrics_are_read_at_scrape_time():
    snap = snapshot(
        mode="combine",
        chat=dataclasses.asdict(ChatStats(main_turns=5, side_turns=2, aborted=1, prompt_tokens=120,
                                          completion_tokens=48)),
        sessions={"live": 3},
        policy={"version": 4, "weight_version": "4", "published_at": 1_700_000_000.0, "weights": None},
        paused={"learning": True, "serving": False, "reasons": [
            {"reason": "disk", "since": 1.0, "detail": "full", "serving": False, "lifted_by": "free space"}]},
        scoring={"turns": 5, "samples": 3, "pending": 1, "excluded": {"no_next_state": 2},
                 "kinds": {"opd": 1, "opd+rl": 2}, "votes": {"+1": 2, "-1": 1, "failed": 1}, "hints_offered": 4,
                 "hints_accepted": 3, "not_learned_while_paused": 2},
        queue={"waiting": 1, "in_flight": 1, "effective": 1, "batch_size": 8, "journal_live": 2, "stale_dropped": 1,
               "acked": 1},
        journal={"bytes": 4096, "records": 7, "fsyncs": 6, "truncations": 0, "live": 2, "segments": 1,
                 "size_bytes": 4096, "quarantined_records": 1, "quarantined_bytes": 522, "write_failures": 2,
                 "fsync_failures": 0, "quarantine_failures": 0},
        learner=dataclasses.asdict(LearnerStats(
            steps=2, skipped_steps=1, publishes=1, samples_trained=2, stale_dropped=1,
            last_metrics={"loss": -0.25, "loss_policy": -0.5, "loss_kl": 0.25, "grad_norm": 1.5, "approx_kl": 0.125,
                          "skipped": False})) | {"limits": {"max_sample_tokens": 8192, "excluded": {"oom": 1},
                                                            "oom_steps": 3, "capped": 2}},
        engines={"policy": {"state": "ready", "ready": True, "pid": 1, "restarts": 1, "hangs": 1, "url": "u"},
                 "reference": {"state": "starting", "ready": False, "pid": 2, "restarts": 0, "hangs": 0, "url": "v"}},
        trainer={"alive": True, "pid": 3, "restarts": 2, "step": 2, "version": 1},
        replicas=[{"index": i, "url": "u", "state": "ready", "in_rotation": i == 0, "weight_version": v,
                   "in_flight": 2 - i, "sessions": 5, "failures": i, "retried_away": i, "swap_failures": 0,
                   "draining": False, "needs_realign": i == 1} for i, v in enumerate(["4", None])])
    metrics = Metrics(lambda: snap)
    snap["chat"]["main_turns"] += 1  # read when scraped, not when built
    metrics.observe_first_token(0.2)
    metrics.observe_publish(1.5, 0.02)

    text = metrics.render().text
    lines = set(text.splitlines())
    for line in [
        'clawd_turns_total{type="main"} 6.0',
        'clawd_turns_total{type="side"} 2.0',
        "clawd_prompt_tokens_total 120.0",
        "clawd_completion_tokens_total 48.0",
        "clawd_live_sessions 3.0",
        "clawd_aborted_requests_total 1.0",
        "clawd_policy_version 4.0",
        "clawd_policy_published_timestamp_seconds 1.7e+09",
        'clawd_paused{what="learning"} 1.0',
        'clawd_paused{what="serving"} 0.0',
        'clawd_pause_reason{reason="disk"} 1.0',
        'clawd_pause_reason{reason="operator"} 0.0',
        "clawd_turns_not_learned_total 2.0",
        'clawd_judge_votes_total{vote="+1"} 2.0',
        'clawd_judge_votes_total{vote="failed"} 1.0',
        'clawd_samples_total{kind="opd+rl",mode="combine"} 2.0',
        'clawd_samples_excluded_total{mode="combine",reason="no_next_state"} 2.0',
        "clawd_hints_offered_total 4.0",
        "clawd_hints_accepted_total 3.0",
        "clawd_scoring_pending 1.0",
        "clawd_queue_waiting 1.0",
        "clawd_queue_depth 2.0",
        "clawd_samples_stale_dropped_total 1.0",
        "clawd_journal_written_bytes_total 4096.0",
        "clawd_journal_quarantined_records_total 1.0",
        "clawd_journal_quarantined_bytes_total 522.0",
        'clawd_journal_failures_total{op="write"} 2.0',
        "clawd_train_steps_total 2.0",
        "clawd_train_steps_skipped_total 1.0",
        "clawd_publishes_total 1.0",
        "clawd_train_steps_out_of_memory_total 3.0",
        'clawd_samples_excluded_from_training_total{reason="oom"} 1.0',
        'clawd_samples_excluded_from_training_total{reason="too_long"} 0.0',
        'clawd_train_loss{part="total"} -0.25',
        'clawd_train_loss{part="policy"} -0.5',
        'clawd_train_loss{part="kl"} 0.25',
        "clawd_train_grad_norm 1.5",
        'clawd_engine_restarts_total{role="policy"} 1.0',
        'clawd_engine_hangs_total{role="policy"} 1.0',
        'clawd_engine_ready{role="reference"} 0.0',
        "clawd_trainer_restarts_total 2.0",
        'clawd_replica_weight_version{replica="0"} 4.0',
        'clawd_replica_weight_version{replica="1"} -1.0',
        'clawd_replica_in_rotation{replica="1"} 0.0',
        'clawd_replica_in_flight{replica="0"} 2.0',
        'clawd_replica_failures_total{replica="1"} 1.0',
        "clawd_trainer_up 1.0",
        'clawd_time_to_first_token_seconds_bucket{le="0.1"} 0.0',
        'clawd_time_to_first_token_seconds_bucket{le="0.25"} 1.0',
        "clawd_publish_duration_seconds_count 1.0",
        "clawd_publish_duration_seconds_sum 1.5",
        'clawd_publish_intake_held_seconds_bucket{le="0.025"} 1.0',
        "# HELP clawd_live_sessions Sessions open in the session table.",
        "# TYPE clawd_samples_total counter",
    ]:
        assert line in lines, line
    # No loss part the step did not report; no sample of a step metric it lacks; no _created series.
    assert 'part="entropy"' not in text and "_created" not in text
    assert not [line for line in lines if line.startswith("clawd_train_clip_fraction")]
    assert all(f"# HELP {name} " in text for name in families(text))


def test_stages_left_out_leave_their_metrics_out():
    text = Metrics(snapshot).render().text  # no learner, no trainer, nothing published
    assert "clawd_live_sessions 0.0" in text and "clawd_policy_published_timestamp_seconds" not in text
    assert not any(name.startswith(("clawd_train_", "clawd_trainer_")) for name in families(text))


def test_each_app_has_its_own_registry():
    a, b = Metrics(snapshot), Metrics(snapshot)
    a.observe_publish(1.0, 0.1)
    assert "clawd_publish_duration_seconds_count 1.0" in a.render().text
    assert "clawd_publish_duration_seconds_count 0.0" in b.render().text


# ---- the route and the middleware -----------------------------------------------------------

async def test_requests_are_counted_by_matched_route_and_final_status():
    cfg = Config(auth=AuthConfig(keys=(ApiKey("ops", "sk-metrics-test"),)))
    metrics = Metrics(snapshot)
    client = TestClient(TestServer(app_with_metrics(cfg, metrics)))
    await client.start_server()
    try:
        assert (await client.get("/health")).status == 200
        assert (await client.get("/v1/models")).status == 401            # the error middleware's answer
        for path in ("/nope", "/%ff/x?y", "/v1/models/../../etc"):        # random paths: one label
            assert (await client.get(path)).status == 404
        assert (await client.get("/v1/chat/completions")).status == 405
        resp = await client.get("/metrics")                               # no key needed, like /health
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/plain; version=1.0.0; charset=utf-8"
        got = values(await resp.text())
    finally:
        await client.close()
    assert got[("clawd_http_requests_total", (("route", "/health"), ("status", "200")))] == 1
    assert got[("clawd_http_requests_total", (("route", "/v1/models"), ("status", "401")))] == 1
    assert got[("clawd_http_requests_total", (("route", "unmatched"), ("status", "404")))] == 3
    assert got[("clawd_http_requests_total", (("route", "unmatched"), ("status", "405")))] == 1
    assert got[("clawd_http_request_duration_seconds_count", (("route", "unmatched"),))] == 4
    assert {dict(labels)["route"] for name, labels in got if name == "clawd_http_requests_total"} == {
        "/health", "/v1/models", "unmatched"}  # this scrape is counted once it is answered


async def test_requests_aiohttp_answers_itself_are_counted_as_unparsed():
    """Bad HTTP never reaches a route or the middleware: aiohttp answers 400 itself. It is still counted."""
    metrics = Metrics(snapshot)
    server = TestServer(app_with_metrics(Config(), metrics))
    await server.start_server(**metrics.runner_options())  # as the daemon starts its runner
    client = TestClient(server)
    try:
        for garbage in (b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/1.1\r\nBad Header Line\r\n\r\n"):
            reader, writer = await asyncio.open_connection(server.host, server.port)
            writer.write(garbage)
            assert (await reader.readline()).split()[1] == b"400"
            writer.close()
        assert (await client.get("/health")).status == 200
        got = values(await (await client.get("/metrics")).text())
    finally:
        await client.close()
    assert got[("clawd_http_requests_total", (("route", "unparsed"), ("status", "400")))] == 2
    assert got[("clawd_http_requests_total", (("route", "/health"), ("status", "200")))] == 1
    assert ("clawd_http_requests_total", (("route", "unparsed"), ("status", "200"))) not in got


async def test_no_metrics_route_without_metrics():
    client = TestClient(TestServer(make_app(Config(), FakeChat())))
    await client.start_server()
    try:
        assert (await client.get("/metrics")).status == 404
    finally:
        await client.close()


# ---- end to end -----------------------------------------------------------------------------

REQUIRED = [  # the metrics operators rely on (docs/OPERATING.md: metrics)
    "clawd_http_requests_total", "clawd_http_request_duration_seconds", "clawd_time_to_first_token_seconds",
    "clawd_prompt_tokens_total", "clawd_completion_tokens_total", "clawd_live_sessions", "clawd_turns_total",
    "clawd_judge_votes_total", "clawd_samples_total", "clawd_samples_excluded_total",
    "clawd_hints_offered_total", "clawd_hints_accepted_total", "clawd_queue_depth", "clawd_train_steps_total",
    "clawd_train_loss", "clawd_policy_version", "clawd_samples_stale_dropped_total",
    "clawd_publish_duration_seconds", "clawd_engine_restarts_total", "clawd_trainer_restarts_total",
    "clawd_feedback_ratings_total", "clawd_judge_rating_pairs_total",
]
THANKS = "Thanks, that's perfect."


def scrape(daemon: Daemon) -> str:
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def total(got: dict, name: str, **labels) -> float:
    """The sum over the samples of `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in got.items() if n == name and labels.items() <= dict(ls).items())


@pytest.mark.slow
def test_every_metric_appears_and_moves_with_a_run(tiny_model, tmp_path):
    daemon = Daemon(tmp_path, {
        "model": {"path": str(tiny_model), "max_tokens_cap": 8},
        "engine": {"launch": "local"},
        "learner": {"enabled": True, "rollout_batch_size": 1, "min_batch_size": 1}})
    try:
        before_text = scrape(daemon)
        before = values(before_text)
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "Say something short."}]
        reply = client.chat.completions.create(model="m", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": THANKS}]
        # The thanks judges the first turn (+1: a sample, trained and published); this streamed turn ends it.
        stream = client.chat.completions.create(model="m", messages=messages, stream=True,
                                                extra_headers={"X-Session-Done": "1"})
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) is not None
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "aside"}],
                                       extra_headers={"X-Turn-Type": "side"})
        try:
            urllib.request.urlopen(daemon.url + "/no/such/route", timeout=10)
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
        deadline = time.monotonic() + 120
        while daemon.get("/debug/process")[1]["learner"]["publishes"] < 1:
            assert time.monotonic() < deadline, daemon.get("/debug/process")[1]
            time.sleep(0.1)
        after_text = scrape(daemon)
        after = values(after_text)
        threads = daemon.get("/debug/process")[1]["threads"]
    finally:
        assert daemon.stop() == 0

    assert threads == 1  # prometheus_client started nothing
    assert [name for name in REQUIRED if name not in families(before_text)] == []
    assert [name for name in REQUIRED if name not in families(after_text)] == []

    def moved(name: str, **labels) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    chat = "/v1/chat/completions"
    assert moved("clawd_http_requests_total", route=chat, status="200") == 3
    assert moved("clawd_http_requests_total", route="unmatched", status="404") == 1
    assert moved("clawd_http_request_duration_seconds_count", route=chat) == 3
    assert moved("clawd_time_to_first_token_seconds_count") == 1
    assert moved("clawd_prompt_tokens_total") > 0 and moved("clawd_completion_tokens_total") > 0
    assert moved("clawd_turns_total", type="main") == 2 and moved("clawd_turns_total", type="side") == 1
    assert moved("clawd_judge_votes_total", vote="+1") == 1
    assert moved("clawd_samples_total", mode="rl") == 1
    assert moved("clawd_samples_excluded_total", mode="rl", reason="session_done") == 1  # its last turn
    assert moved("clawd_train_steps_total") >= 1
    assert moved("clawd_samples_trained_total") >= 1
    assert moved("clawd_policy_version") >= 1
    assert moved("clawd_publish_duration_seconds_count") >= 1 and moved("clawd_publish_intake_held_seconds_count") >= 1
    assert ("clawd_train_loss", (("part", "total"),)) in after
    assert total(after, "clawd_live_sessions") == 0  # the session ended with its last turn
    assert total(after, "clawd_engine_ready", role="policy") == 1 and total(after, "clawd_trainer_up") == 1


async def test_a_step_that_holds_the_event_loop_shows_as_lag():
    metrics = Metrics(snapshot)
    watcher = asyncio.create_task(metrics.watch_loop())
    await asyncio.sleep(0.12)  # a few quiet probes
    time.sleep(0.3)  # a synchronous step: nothing else runs meanwhile
    await asyncio.sleep(0.12)
    watcher.cancel()
    text = metrics.render().text
    worst = float(re.search(r"^clawd_event_loop_lag_max_seconds (\S+)$", text, re.M).group(1))
    assert worst >= 0.2
    over = float(re.search(r'^clawd_event_loop_lag_seconds_bucket\{le="0.1"\} (\S+)$', text, re.M).group(1))
    total = float(re.search(r"^clawd_event_loop_lag_seconds_count (\S+)$", text, re.M).group(1))
    assert total - over >= 1  # the held step is counted above 0.1 s
