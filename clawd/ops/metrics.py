"""`GET /metrics`: the daemon in Prometheus text format (docs/ARCHITECTURE.md §8).

Two kinds of metric. Events are recorded as they happen: HTTP requests (by
matched route and status) and their latency, time to first token, publish
durations. State the stages already count (chat, scoring, the sample store,
the learner, the supervisors, the pause) is read at scrape time by
`SnapshotCollector` from the status snapshot (`clawd.ops.status`), so no number is counted twice and
`/metrics` never disagrees with `clawctl status`.

Each app gets its own registry (tests run several daemons in one process), and
nothing here starts a thread: the page is rendered inside the request handler.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Iterator

from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.abc import AbstractAccessLogger
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from clawd.ops.dashboard import operator
from clawd.pauses import LIFTED_BY as PAUSE_REASONS
from clawd.serving.auth import Authenticator
from clawd.serving.errors import ApiError

# Seconds. Requests include whole streamed replies, so the latency buckets reach minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
FIRST_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
PUBLISH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
HELD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
LAG_PROBE = 0.05  # seconds between two looks at the loop's lag

UNMATCHED = "unmatched"  # the route label of a request no route matched (404, 405)
UNPARSED = "unparsed"    # the route label of a request aiohttp answered itself, before any route (bad HTTP: 400)
CLIENT_CLOSED = "499"    # the status label of a request whose client left first (nginx's code for it)

# The last step's loss and its parts (trainer.train_step's metric keys) → the `part` label.
LOSS_PARTS = {"loss": "total", "loss_policy": "policy", "loss_kl": "kl", "loss_entropy": "entropy"}
STEP_GAUGES = {"grad_norm": ("clawd_train_grad_norm", "Gradient norm of the last training step, before clipping."),
               "approx_kl": ("clawd_train_approx_kl", "Approximate KL(old || new) over the last step's tokens."),
               "clip_fraction": ("clawd_train_clip_fraction", "Fraction of the last step's tokens whose ratio was "
                                                              "clipped."),
               "entropy": ("clawd_train_entropy", "Mean per-token entropy of the policy on the last step's samples."),
               "response_tokens_mean": ("clawd_train_response_tokens", "Mean response length, in tokens, of the "
                                                                       "last step's samples.")}

# A `_created` series per counter and histogram child doubles the series for nothing a scrape of
# clawd needs (the process start is known). The switch is process-wide; only clawd uses the library here.
disable_created_metrics()

COUNTED = web.RequestKey("clawd_metrics_counted", bool)  # set by the middleware on the requests it counts


def route_label(request: web.Request) -> str:
    """The matched route's canonical path: bounded, whatever paths clients send."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else UNMATCHED


class Metrics:
    """One registry per app: the event metrics, plus the stages read at scrape time from `snapshot`
    (`Status.snapshot`: the same numbers `clawctl status` shows)."""

    def __init__(self, snapshot: Callable[[], dict], auth: Authenticator | None = None):
        self.auth = auth  # set: /metrics needs an operator's key ([auth] require_metrics_key)
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("clawd_http_requests", "HTTP requests by matched route and final status.",
                                ["route", "status"], registry=reg)
        self.latency = Histogram("clawd_http_request_duration_seconds", "HTTP request time until the handler "
                                 "returned (streamed replies: the whole stream).", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=reg)
        self.first_token = Histogram("clawd_time_to_first_token_seconds", "Streamed chat: from the request "
                                     "reaching the chat service to its first token written.",
                                     buckets=FIRST_TOKEN_BUCKETS, registry=reg)
        self.publish = Histogram("clawd_publish_duration_seconds", "Publishing new weights to the policy "
                                 "engine, start to served.", buckets=PUBLISH_BUCKETS, registry=reg)
        self.intake_held = Histogram("clawd_publish_intake_held_seconds", "Per publish, how long the policy "
                                     "engine held new requests.", buckets=HELD_BUCKETS, registry=reg)
        self.connections_closed = Counter("clawd_connections_closed", "Client connections clawd closed itself, by "
                                          "reason (header_timeout, body_timeout, write_timeout, evicted, refused).",
                                          ["reason"], registry=reg)
        self.connections_open = Gauge("clawd_connections_open", "Client connections open now.", registry=reg)
        self.loop_lag = Histogram("clawd_event_loop_lag_seconds", f"How late the event loop woke a {LAG_PROBE}s "
                                  "sleep: a synchronous step that held the loop (every request waits on it).",
                                  buckets=LAG_BUCKETS, registry=reg)
        self.loop_lag_max = Gauge("clawd_event_loop_lag_max_seconds", "The longest event loop lag since start.",
                                  registry=reg)
        reg.register(SnapshotCollector(snapshot))

    async def watch_loop(self) -> None:
        """Sleeps `LAG_PROBE` seconds over and over and records how late each wake-up came."""
        loop, worst = asyncio.get_running_loop(), 0.0
        while True:
            start = loop.time()
            await asyncio.sleep(LAG_PROBE)
            lag = max(0.0, loop.time() - start - LAG_PROBE)
            self.loop_lag.observe(lag)
            if lag > worst:
                worst = lag
                self.loop_lag_max.set(lag)

    def watch_connections(self, open_now: Callable[[], int]) -> Callable[[str], None]:
        """The connection tracker's numbers: the gauge reads `open_now` at scrape; the returned callable
        counts a connection closed for a reason."""
        self.connections_open.set_function(open_now)
        return lambda reason: self.connections_closed.labels(reason).inc()

    def observe_first_token(self, seconds: float) -> None:
        self.first_token.observe(seconds)

    def observe_publish(self, seconds: float, held: float) -> None:
        self.publish.observe(seconds)
        self.intake_held.observe(held)

    def render(self) -> web.Response:
        resp = web.Response(body=generate_latest(self.registry))
        resp.headers["Content-Type"] = CONTENT_TYPE_LATEST  # carries a charset: aiohttp's content_type= refuses it
        return resp

    async def handle(self, request: web.Request) -> web.Response:
        """`GET /metrics`."""
        if self.auth is not None and not (allowed := operator(self.auth, request)):
            raise ApiError(403 if allowed is None else 401, "/metrics needs an operator's API key ('Authorization: "
                           "Bearer <key>' of a key with operator = true)", code="operator_key_required")
        return self.render()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Outermost: it sees the status the client gets, error middleware and 404s included."""
        started = time.monotonic()
        request[COUNTED] = True
        status = "500"  # an exception no middleware turned into a response: aiohttp answers 500
        try:
            resp = await handler(request)
            status = str(resp.status)
            return resp
        except web.HTTPException as exc:
            status = str(exc.status)
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            status = CLIENT_CLOSED
            raise
        finally:
            route = route_label(request)
            self.requests.labels(route, status).inc()
            self.latency.labels(route).observe(time.monotonic() - started)

    def runner_options(self) -> dict:
        """AppRunner options that count what the middleware never sees: requests aiohttp answers itself
        because they are not HTTP it can parse. Its access-log hook is the one place those replies pass
        (it is called only when given a logger; this one writes nothing)."""
        requests = self.requests

        class CountUnparsed(AbstractAccessLogger):
            def log(self, request, response, time) -> None:
                if COUNTED not in request:
                    requests.labels(UNPARSED, str(response.status)).inc()

        return {"access_log": logging.getLogger("clawd.access"), "access_log_class": CountUnparsed}


class SnapshotCollector(Collector):
    """The stages' own counters and gauges, read from one status snapshot per scrape. A stage the
    snapshot carries as None (no learner, no trainer) leaves its metrics out."""

    def __init__(self, snapshot: Callable[[], dict]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        chat, policy, paused = snap["chat"], snap["policy"], snap["paused"]
        yield counter("clawd_prompt_tokens_total", "Prompt tokens of answered chat requests.", chat["prompt_tokens"])
        yield counter("clawd_completion_tokens_total", "Tokens generated for answered chat requests.",
                      chat["completion_tokens"])
        yield gauge("clawd_live_sessions", "Sessions open in the session table.", snap["sessions"]["live"])
        yield labelled(CounterMetricFamily, "clawd_turns_total", "Chat turns by type (main: captured for "
                       "learning; side: served only).", "type",
                       {"main": chat["main_turns"], "side": chat["side_turns"]})
        yield counter("clawd_aborted_requests_total", "Chat requests whose client left before the reply was done.",
                      chat["aborted"])
        yield counter("clawd_engine_errors_total", "Chat requests the policy engine failed or refused.",
                      chat["engine_errors"])
        if (enc := snap.get("encoder")) is not None:
            yield counter("clawd_encoder_pieces_total", "Prompt pieces too long to encode on the event loop, "
                          "encoded by the encoder worker (prompts, judge and teacher prompts).", enc["pieces"])
            yield counter("clawd_encoder_fallbacks_total", "Long pieces encoded on the event loop after all: the "
                          "encoder worker died or stalled.", enc["fallbacks"])
            yield counter("clawd_encoder_starts_total", "Encoder workers started (on first use, and after one "
                          "failed).", enc["starts"])
        yield gauge("clawd_policy_version", "The policy version being served.", policy["version"])
        if policy["published_at"] is not None:
            yield gauge("clawd_policy_published_timestamp_seconds", "When the served policy version was "
                        "published (Unix time).", policy["published_at"])
        yield labelled(GaugeMetricFamily, "clawd_paused", "1 while learning (for any reason) or serving (by "
                       "the operator) is paused.", "what", {"learning": paused["learning"], "serving": paused["serving"]})
        held = {p["reason"] for p in paused["reasons"]}
        yield labelled(GaugeMetricFamily, "clawd_pause_reason", "1 while this reason holds learning paused.",
                       "reason", {reason: reason in held for reason in PAUSE_REASONS})
        yield counter("clawd_turns_not_learned_total", "Finished turns not scored because learning was paused.",
                      snap["scoring"]["not_learned_while_paused"])
        yield from _scoring(snap["mode"], snap["scoring"])
        if (feedback := snap.get("feedback")) is not None:
            yield from _feedback(feedback)
        yield from _queue(snap["queue"], snap["journal"])
        if snap["learner"] is not None:
            yield from _learner(snap["learner"])
        restarts = CounterMetricFamily("clawd_engine_restarts", "Engine restarts by role.", labels=["role"])
        hangs = CounterMetricFamily("clawd_engine_hangs", "Times an engine was found hung (no answer to liveness "
                                    "polls or calls) by role.", labels=["role"])
        ready = GaugeMetricFamily("clawd_engine_ready", "1 while the engine answers as ready.", labels=["role"])
        for role, engine in snap["engines"].items():
            restarts.add_metric([role], engine["restarts"])
            hangs.add_metric([role], engine["hangs"])
            ready.add_metric([role], float(engine["ready"]))
        yield restarts
        yield hangs
        yield ready
        yield counter("clawd_engine_retries_total", "Chat calls tried again on another policy replica after "
                      "failing before any byte was sent.", chat.get("retries", 0))
        yield from _replicas(snap.get("replicas") or [])
        if (safety := snap.get("safety")) is not None:
            yield from _safety(safety)
        if (privacy := snap.get("privacy")) is not None:
            yield from _privacy(privacy)
        if (rollouts := snap.get("rollouts")) is not None:
            yield from _rollouts(rollouts)
        if (adapters := snap.get("adapters")) is not None:  # LoRA mode
            yield gauge("clawd_adapters_retired", "Retired LoRA adapters still loaded on some replica, waiting for "
                        "their requests to end.", len(adapters["retired"]))
            yield counter("clawd_adapter_unloads_total", "Retired LoRA adapters unloaded from a replica.",
                          adapters["unloaded"])
            yield counter("clawd_adapter_unload_failures_total", "Unloads of a retired LoRA adapter that failed "
                          "(retried with backoff).", adapters["failed_unloads"])
        if (lineages := snap.get("lineages")) is not None:  # adapters per principal
            yield gauge("clawd_principal_adapters", "Principals with an adapter of their own.", lineages["adapters"])
            yield gauge("clawd_principal_adapters_refused", "Principals who qualified for an adapter of their own "
                        "beyond [train] max_adapters (served the shared one).", lineages["refused"])
        if (trainer := snap["trainer"]) is not None:
            yield counter("clawd_trainer_restarts_total", "Trainer subprocess restarts.", trainer["restarts"])
            yield gauge("clawd_trainer_up", "1 while the trainer subprocess is alive.", trainer["alive"])


def _replicas(replicas: list[dict]) -> Iterator[Metric]:
    """The policy replicas, by a `replica` label (its index)."""
    families = [
        (GaugeMetricFamily, "clawd_replica_in_rotation", "1 while the router sends requests to this replica.",
         lambda r: float(r["in_rotation"])),
        (GaugeMetricFamily, "clawd_replica_in_flight", "Requests this replica is serving now.",
         lambda r: r["in_flight"]),
        (GaugeMetricFamily, "clawd_replica_sessions", "Sessions homed on this replica.", lambda r: r["sessions"]),
        (GaugeMetricFamily, "clawd_replica_weight_version", "The weight version this replica last reported "
         "(-1: not a number).", lambda r: _version_number(r["weight_version"])),
        (CounterMetricFamily, "clawd_replica_failures", "Requests that found this replica broken (refused, "
         "reset, died).", lambda r: r["failures"]),
        (CounterMetricFamily, "clawd_replica_retried_away", "Requests that failed on this replica before any "
         "byte was sent and were retried on another.", lambda r: r["retried_away"]),
        (CounterMetricFamily, "clawd_replica_swap_failures", "Rolling-publish swaps this replica failed (then "
         "realigned out of rotation).", lambda r: r["swap_failures"]),
    ]
    for kind, name, text, value in families:
        family = kind(name, text, labels=["replica"])
        for r in replicas:
            family.add_metric([str(r["index"])], value(r))
        yield family


def _version_number(version) -> float:
    try:
        return float(int(version))
    except (TypeError, ValueError):
        return -1.0


def _scoring(mode: str, st: dict) -> Iterator[Metric]:
    yield counter("clawd_scoring_turns_total", "Finished main turns handed to scoring.", st["turns"])
    yield gauge("clawd_scoring_pending", "Turns being judged now.", st["pending"])
    yield labelled(CounterMetricFamily, "clawd_judge_votes_total", "Judge votes by value (failed: no valid "
                   "vote).", "vote", st["votes"])
    samples = CounterMetricFamily("clawd_samples", "Samples made (judge outcome: a sample), by scoring mode "
                                  "and kind.", labels=["mode", "kind"])
    for kind, n in sorted(st["kinds"].items()):
        samples.add_metric([mode, kind], n)
    yield samples
    excluded = CounterMetricFamily("clawd_samples_excluded", "Turns that made no sample (judge outcome: "
                                   "excluded), by scoring mode and reason.", labels=["mode", "reason"])
    for reason, n in sorted(st["excluded"].items()):
        excluded.add_metric([mode, reason], n)
    yield excluded
    yield counter("clawd_hints_offered_total", "Hints offered by positive hint votes.", st["hints_offered"])
    yield counter("clawd_hints_accepted_total", "Turns whose hint was accepted.", st["hints_accepted"])
    yield counter("clawd_reference_failed_total", "Samples kept without the reference's log-probs (left out of "
                  "the KL term).", st.get("reference_failed", 0))


def _feedback(st: dict) -> Iterator[Metric]:
    """Users' ratings of replies, and the judge's agreement with them (no principal label: names stay out)."""
    yield labelled(CounterMetricFamily, "clawd_feedback_ratings", "Ratings of replies by what became of them "
                   "(pending: counted for training; late: its turn already scored; not_trainable).", "status",
                   st["received"])
    yield counter("clawd_feedback_unknown_total", "Ratings naming no reply of their principal's that is remembered "
                  "(answered 404).", st["unknown"])
    yield counter("clawd_feedback_trained_total", "Ratings a turn's sample was decided on.", st["trained"])
    yield counter("clawd_feedback_alone_total", "Of those, turns the judge could not score (the rating alone).",
                  st["alone"])
    yield counter("clawd_feedback_unused_total", "Pending ratings whose turn was never scored.", st["unused"])
    cal = st["calibration"]
    pairs = CounterMetricFamily("clawd_judge_rating_pairs", "Rated turns the judge also scored, by the judge's "
                                "verdict (none: no valid vote) and the rating.", labels=["judge", "rating"])
    for judge, row in cal["all"]["counts"].items():
        for rating, n in row.items():
            pairs.add_metric([judge, rating], n)
    yield pairs
    agreement = GaugeMetricFamily("clawd_judge_agreement", "Share of the judge's +1/-1 verdicts the users' "
                                  "ratings confirmed, overall (version=\"all\") and per policy version.",
                                  labels=["version"])
    for version, summary in [("all", cal["all"]), *cal["versions"].items()]:
        if summary["agreement"] is not None:
            agreement.add_metric([version], summary["agreement"])
    yield agreement
    yield gauge("clawd_judge_calibration_alarms", "Scopes (all, a version, a principal) whose agreement interval "
                "lies wholly below [feedback] alarm_below.", len(cal["alarms"]))


def _queue(queue: dict, j: dict) -> Iterator[Metric]:
    yield gauge("clawd_queue_waiting", "Samples waiting for a training batch.", queue["waiting"])
    yield gauge("clawd_queue_in_flight", "Samples taken by a step, not yet acknowledged.", queue["in_flight"])
    yield gauge("clawd_queue_depth", "Journal entries a restart would replay.", queue["journal_live"])
    yield counter("clawd_samples_stale_dropped_total", "Samples dropped as too stale to train on.",
                  queue["stale_dropped"])
    yield counter("clawd_samples_acked_total", "Samples acknowledged in the journal after a checkpoint.",
                  queue["acked"])
    yield counter("clawd_journal_written_bytes_total", "Bytes appended to the journal.", j["bytes"])
    yield counter("clawd_journal_records_total", "Records appended to the journal.", j["records"])
    yield counter("clawd_journal_fsyncs_total", "Journal fsyncs.", j["fsyncs"])
    yield counter("clawd_journal_truncations_total", "Torn journal tails cut off.", j["truncations"])
    yield gauge("clawd_journal_segments", "Journal segment files.", j["segments"])
    yield counter("clawd_journal_quarantined_records_total", "Damaged journal spans set aside at replay (each "
                  "one lost record or more, kept in journal/quarantine/).", j["quarantined_records"])
    yield counter("clawd_journal_quarantined_bytes_total", "Bytes of damaged journal spans set aside at replay.",
                  j["quarantined_bytes"])
    yield labelled(CounterMetricFamily, "clawd_journal_failures", "Journal operations that failed (a full "
                   "disk, an I/O error); their callers were told, nothing else was lost.", "op",
                   {"write": j["write_failures"], "fsync": j["fsync_failures"],
                    "quarantine": j["quarantine_failures"]})


def _safety(st: dict) -> Iterator[Metric]:
    """The gate, the monitors and the version history (docs/ARCHITECTURE.md §17)."""
    if (gate := st["gate"]) is not None:
        yield counter("clawd_gate_passed_total", "New versions the gate passed.", gate["passed"])
        yield counter("clawd_gate_rejected_total", "New versions the gate rejected (rolled back, learning paused).",
                      gate["rejected"])
        yield counter("clawd_gate_failures_total", "Gate evaluations that could not finish (tried again).",
                      gate["failures"])
    if (monitors := st["monitors"]) is not None:
        yield counter("clawd_monitor_rollbacks_total", "Rollbacks the behaviour monitors made.", monitors["rollbacks"])
        yield counter("clawd_monitor_halts_total", "Times the behaviour monitors halted learning.", monitors["halts"])
        yield gauge("clawd_monitor_alarms", "Monitors in alarm on the version serving.", len(monitors["alarms"]))
    family = GaugeMetricFamily("clawd_versions", "Policy versions in the history, by status.", labels=["status"])
    for status in ("candidate", "serving", "retired", "rejected", "rolled_back"):
        family.add_metric([status], st["versions"].get(status, 0))
    yield family


def _privacy(st: dict) -> Iterator[Metric]:
    """PII found in finished turns, and the retention sweep (docs/ARCHITECTURE.md §18)."""
    pii = st["pii"]
    yield counter("clawd_pii_turns_scanned_total", "Finished turns scanned for PII.", pii["turns_scanned"])
    yield counter("clawd_pii_turns_total", "Finished turns with PII in them (messages, reply or next state).",
                  pii["turns_with_pii"])
    yield labelled(CounterMetricFamily, "clawd_pii_findings", "PII found in finished turns, by category.",
                   "category", {c: pii["found"].get(c, 0) for c in pii["categories"]})
    yield counter("clawd_records_redacted_total", "Turn records written with their PII replaced.",
                  pii["redacted_records"])
    yield counter("clawd_pii_phones_unread_total", "Possible phone numbers reported as PII unread: the turn's "
                  "budget for the phone matcher was spent (digit-dense text).", pii["phones_unread"])
    if (scans := pii["scans"]) is not None:
        yield gauge("clawd_pii_scans_waiting", "Finished turns waiting for their PII scan.", scans["waiting"])
        yield counter("clawd_pii_scans_deferred_total", "Turns whose PII scan needed more than one slice of "
                      "the event loop (run in slices, in turn order).", scans["deferred"])
        yield counter("clawd_pii_scans_failed_total", "Turns lost to an error in their PII scan.", scans["failed"])
    yield counter("clawd_turns_unrecorded_total", "Turns of API keys with record = false (no record kept).",
                  st["unrecorded_turns"])
    if (ret := st["retention"]) is not None:
        yield counter("clawd_retention_sweeps_total", "Retention sweeps run.", ret["sweeps"])
        yield labelled(CounterMetricFamily, "clawd_retention_removed", "What the retention sweeps removed: "
                       "record files, rejected batches, journal segments, published weights, staged exports.",
                       "part", ret["removed"])
        yield counter("clawd_retention_failures_total", "Retention sweep parts that failed (tried again).",
                      ret["failures"])


def _rollouts(st: dict) -> Iterator[Metric]:
    """The active rollouts beside live chat (docs/ARCHITECTURE.md §19)."""
    yield gauge("clawd_rollouts_running", "1 while the active rollouts draw groups (clawctl rollouts pause: 0).",
                st["running"])
    yield counter("clawd_rollout_groups_total", "Rollout groups drawn (N answers to one prompt or seed).",
                  st["groups"])
    yield counter("clawd_rollout_groups_dropped_total", "Rollout groups dropped: every answer scored the same.",
                  st["dropped_agree"])
    yield counter("clawd_rollout_samples_total", "Rollout samples put in the store.", st["samples"])
    yield counter("clawd_rollout_answers_total", "Rollout answers (episodes) scored.", st["answers"])
    yield counter("clawd_rollout_solved_total", "Rollout answers (episodes) that scored 1.", st["solved"])
    yield gauge("clawd_rollout_backlog", "Rollout samples waiting for the learner.", st["backlog"])
    yield labelled(CounterMetricFamily, "clawd_rollout_failures", "Rollout failures: a deployment checker that "
                   "raised or timed out, a rubric the judge gave no answer to, an environment that timed out or died, "
                   "a malformed action or raising tool, a group lost to an error (the engine's, say).", "kind",
                   {"checker": st["checker_failures"], "judge": st["judge_failures"], "environment": st["env_failed"],
                    "action": st["action_errors"], "group": st["failed_groups"]})
    yield labelled(CounterMetricFamily, "clawd_rollout_waits", "Times the rollouts waited: for live requests to "
                   "drop to [rollouts] live_headroom, for the learner to take their samples.", "for",
                   {"live": st["waited_live"], "learner": st["waited_backlog"]})


def _learner(st: dict) -> Iterator[Metric]:
    yield counter("clawd_train_steps_total", "Training steps done, skipped ones included.", st["steps"])
    yield counter("clawd_train_steps_skipped_total", "Steps skipped (non-finite loss or gradient).",
                  st["skipped_steps"])
    yield counter("clawd_train_steps_failed_total", "Steps the trainer failed; their batch was retried.",
                  st["failed_steps"])
    yield counter("clawd_samples_trained_total", "Samples trained on.", st["samples_trained"])
    yield counter("clawd_samples_requeued_total", "Trained samples queued again after a trainer restart.",
                  st["requeued_after_restart"])
    yield counter("clawd_publishes_total", "Policy versions published.", st["publishes"])
    yield counter("clawd_publishes_failed_total", "Publishes that failed (retried).", st["failed_publishes"])
    yield counter("clawd_trainer_writes_failed_total", "Weights or checkpoint writes of the trainer that failed; "
                  "each was retried alone, never by training again.", st["failed_writes"])
    if sync := st.get("weight_sync"):
        yield counter("clawd_weight_sync_pushes_total", "Replica publishes whose weights went over a torch.distributed "
                      "group rather than from disk.", sync["pushes"])
        yield counter("clawd_weight_sync_fallbacks_total", "Pushes over a group that failed; the replica loaded the "
                      "published directory instead.", sync["fallbacks"])
    limits = st["limits"]
    yield counter("clawd_train_steps_out_of_memory_total", "Steps that ran out of memory; their batch was split.",
                  limits["oom_steps"])
    yield labelled(CounterMetricFamily, "clawd_samples_excluded_from_training", "Samples never trained, by reason "
                   "(too_long: over max_sample_tokens; oom: too big for the trainer's memory alone).", "reason",
                   {reason: limits["excluded"].get(reason, 0) for reason in ("too_long", "oom")})
    last = st["last_metrics"]
    yield labelled(GaugeMetricFamily, "clawd_train_loss", "The last step's loss (total) and its parts.", "part",
                   {part: last[key] for key, part in LOSS_PARTS.items() if _number(last.get(key))})
    for key, (name, doc) in STEP_GAUGES.items():  # no sample before the first step
        metric = GaugeMetricFamily(name, doc)
        if _number(last.get(key)):
            metric.add_metric([], float(last[key]))
        yield metric


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=float(value))


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def labelled(family: type, name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
    metric = family(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        metric.add_metric([key], float(value))
    return metric


def _number(value: Any) -> bool:
    """A step metric that is a value (NaN included: Prometheus carries it); None and flags are not."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
