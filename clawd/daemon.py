"""The daemon: one process, one event loop, no threads (docs/ARCHITECTURE.md §1).

`run()` is the architecture in one place. It opens the state directory (`Home`: what every stage shares), then
builds the stages downstream first, each from the config and the edges it needs (the engines; scoring, which
asks them; learning, which the store feeds and which publishes to them; safety, which watches what serves;
privacy's sweeps; serving, which hands turns to scoring; ops, which reads them all), starts them in that order
inside one TaskGroup, serves until the shutdown trigger fires, and drains them in reverse
(`clawd.lifetime.Stage`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time
from pathlib import Path
from typing import Callable

from clawd.config.schema import Config
from clawd.engine.lora import adapter_name
from clawd.engine.stage import Engines, staged
from clawd.learning.journal import Journal
from clawd.learning.stage import Learning
from clawd.learning.store import SampleStore
from clawd.lifetime import Stage
from clawd.ops import systemd
from clawd.ops.dashboard import Dashboard
from clawd.ops.disk import DiskBudget
from clawd.ops.learning_view import StepLog, learning_view
from clawd.ops.metrics import Metrics
from clawd.ops.people import Holdings
from clawd.ops.stage import Ops, Vitals
from clawd.ops.status import Rate, Status, shared
from clawd.pauses import Pauses
from clawd.privacy import files
from clawd.privacy.policy import Privacy
from clawd.privacy.stage import PrivacyStage
from clawd.records import RecordWriter
from clawd.rollouts.stage import Rollouts
from clawd.safety.monitors import Monitors
from clawd.safety.stage import Safety
from clawd.safety.versions import REJECTED, ROLLED_BACK, SERVING, Versions
from clawd.scoring.stage import Scoring
from clawd.served import Policy
from clawd.serving.auth import Authenticator
from clawd.serving.connections import raise_open_file_limit
from clawd.serving.feedback import FeedbackDesk
from clawd.serving.stage import Serving
from clawd.tokenizer import ChatTokenizer
from clawd.weights import checkpointed_samples, is_adapter, restored_weights

log = logging.getLogger("clawd")

_FORCED_STOP_GRACE = 1.0  # after a second stop signal: seconds for each stage of cutting the drain short


class Shutdown:
    """The stop trigger: the first `request()` drains, a second cuts the drain short. `run()` wires one to
    SIGTERM and SIGINT unless its caller passes its own (tests do, and call `request()`)."""

    def __init__(self) -> None:
        self.drain = asyncio.Event()
        self.now = asyncio.Event()

    def request(self) -> None:
        (self.now if self.drain.is_set() else self.drain).set()

    @classmethod
    def on_signals(cls) -> Shutdown:
        shutdown = cls()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, shutdown.request)
        return shutdown


async def run(cfg: Config, shutdown: Shutdown | None = None) -> int:
    shutdown = shutdown or Shutdown.on_signals()
    systemd.notify(systemd.extend_timeout(_startup_budget(cfg)), "STATUS=starting: loading the model")
    async with contextlib.AsyncExitStack() as exits:
        home = await Home.open(cfg, exits)
        # One group owns every long-lived task, the stages' own (aborts, scoring) included. It is entered once
        # every stage is built and opened, so a failed start (a held admin socket) raises as itself.
        tasks = asyncio.TaskGroup()
        stages = Stages(exits)
        auth = Authenticator(cfg)
        status = Status(home.status, stages, started=time.time())
        metrics = Metrics(status.snapshot, auth if cfg.auth.require_metrics_key else None)
        await stages.add(Vitals(metrics, home.disk))  # the loop's lag, the disk, systemd's watchdog: to the end

        # Engines: the policy replicas (chat, published weights) and the reference engine, supervised.
        engines = await stages.add(Engines(cfg, home.policy))
        # Scoring: a finished turn → judge votes / hint / teacher log-probs → a sample in the store.
        scoring = await stages.add(Scoring(
            cfg, tokenizer=home.tokenizer, engine_for=engines.for_role, store=home.store,
            turn_records=home.turn_records, judge_records=home.judge_records, privacy=home.privacy,
            pauses=home.pauses, monitors=home.monitors, on_write_error=home.disk.failed, on_turn=home.turns.tick,
            spawn=tasks.create_task))
        # Learning: batches from the store → the trainer subprocess → weights published to the policy engines.
        learning = None if not cfg.learner.enabled else await stages.add(Learning(
            cfg, store=home.store, versions=home.versions, policy=home.policy, pauses=home.pauses, engines=engines,
            tokenizer=home.tokenizer, judge=scoring.judge, share_weights=home.share_weights, on_step=home.on_step,
            on_publish=metrics.observe_publish, spawn=tasks.create_task, monitors=home.monitors))
        # Safety: the monitors' verdicts on the version serving: alarm, halt learning, or roll back.
        await stages.add(Safety(cfg, monitors=home.monitors, versions=home.versions, policy=home.policy,
                                pauses=home.pauses, rollback=learning and learning.rollback,
                                promotion=learning and learning.learner.promotion))
        # Privacy: sweeps that run even when nothing is written (old records, journal segments, old weights).
        await stages.add(PrivacyStage(cfg, privacy=home.privacy, records=home.records,
                                      compact_journal=home.journal.compact, serving=lambda: home.policy.version,
                                      pinned=home.pinned, scans=scoring.handover))
        # Serving: chat requests → the policy engines; each finished turn is handed over to scoring.
        feedback = FeedbackDesk(scoring.scorer.ratings, home.feedback_records, home.privacy.feedback_record) \
            if cfg.feedback.enabled else None  # users' ratings of replies, beside the judge
        dashboard = Dashboard(lambda: learning_view(status.snapshot(), home.versions, home.monitors, home.steps,
                                                    home.samples.per_minute()), auth)
        serving = await stages.add(Serving(
            cfg, tokenizer=home.tokenizer, engines=engines, policy=home.policy, pauses=home.pauses,
            handover=scoring.handover, encoder=scoring.encoder, auth=auth, metrics=metrics,
            mount=lambda app: _mount_ops(cfg, app, metrics, dashboard, status), on_request=home.requests.tick,
            max_connections=home.max_connections, spawn=tasks.create_task, feedback=feedback))
        # Rollouts: groups from a prompt set and environments, scored, into the store beside live turns.
        rollouts = None if not cfg.rollouts.enabled else await stages.add(Rollouts(
            cfg, tokenizer=home.tokenizer, generate=engines.for_role["policy"].generate, store=home.store,
            policy=home.policy, live=lambda: serving.admission.in_flight, judge=scoring.judge))
        # Ops reads the stages and owns none of them: clawctl's socket, SIGHUP's reload, READY.
        people = Holdings(cfg.state_dir, home.turn_records, home.judge_records, home.store, scoring.scorer,
                          serving.sessions, home.versions, home.monitors, scoring.handover, home.feedback_records,
                          learning and learning.lineages)
        await stages.add(Ops(cfg, status=status, pauses=home.pauses, versions=home.versions, people=people,
                             learning=learning, engines=engines, serving=serving, policy=home.policy, auth=auth,
                             privacy=home.privacy, set_judge=scoring.set_judge, rollouts=rollouts))

        async with tasks:
            await stages.start(tasks)
            await shutdown.drain.wait()
            await stages.stop(shutdown, tasks, serving)
    log.info("stopped")
    return 0


@dataclasses.dataclass
class Home:
    """The state directory and what every stage shares: the journal and the sample store (whose lock keeps a
    second clawd off this directory), the records, the version history and the policy it restores, the pauses
    and the disk budget, the privacy policy, the monitors and the counts ops shows."""
    cfg: Config
    share_weights: Callable[[str], None] | None
    max_connections: int
    tokenizer: ChatTokenizer
    versions: Versions
    policy: Policy
    journal: Journal
    store: SampleStore
    pauses: Pauses
    disk: DiskBudget
    turn_records: RecordWriter
    judge_records: RecordWriter
    feedback_records: RecordWriter
    privacy: Privacy
    monitors: Monitors | None
    steps: StepLog
    requests: Rate
    turns: Rate
    samples: Rate

    @classmethod
    async def open(cls, cfg: Config, exits: contextlib.AsyncExitStack) -> Home:
        state_dir = cfg.state_dir
        state_dir.mkdir(parents=True, exist_ok=True)
        # The state is clawd's alone (the umask is cli's); what an earlier run left open is closed now.
        share_weights = files.secure_state(state_dir, cfg.admin.group, cfg.privacy.weights_group)
        max_connections = raise_open_file_limit(cfg.server.max_connections)  # the cap that fits the fd limit
        versions = Versions(state_dir / "versions.jsonl")  # a restart serves only what the gate passed
        monitors = Monitors(cfg.monitors) if cfg.monitors.enabled else None
        samples = Rate()

        def on_sample(sample) -> None:
            samples.tick()
            if monitors is not None:
                monitors.observe_sample(sample)

        # The durable end of learning opens first: its lock keeps a second clawd off this state directory,
        # and its replay brings back the samples not trained before the last stop.
        journal = Journal(state_dir / "journal", fsync=cfg.journal.fsync, fsync_interval=cfg.journal.fsync_interval,
                          segment_bytes=cfg.journal.segment_bytes)
        exits.push_async_callback(journal.close)
        store = SampleStore(journal, fair_share=cfg.scoring.fair_share, on_put=on_sample)
        await _replay(store, state_dir, versions)
        pauses = Pauses(state_dir / "pause.json", cfg.admin.start_paused)
        disk = DiskBudget(state_dir, cfg.state.min_free_bytes, pauses)  # a low disk pauses learning, not serving
        disk.poll()
        records = [RecordWriter(state_dir / "records", kind=kind, retention_days=cfg.records.retention_days,
                                on_error=disk.failed) for kind in ("turns", "judge", "feedback")]
        for writer in records:
            exits.callback(writer.close)
        return cls(cfg, share_weights, max_connections, ChatTokenizer(cfg.model_path), versions,
                   _restored_policy(state_dir, versions, cfg.gate.enabled), journal, store, pauses, disk, *records,
                   Privacy(cfg.privacy, cfg.auth.keys), monitors, StepLog(), Rate(), Rate(), samples)

    @property
    def records(self) -> tuple[RecordWriter, RecordWriter, RecordWriter]:
        return self.turn_records, self.judge_records, self.feedback_records

    def status(self) -> dict:
        return shared(self.cfg, self.policy, self.pauses, self.store, self.disk, self.records, self.requests,
                      self.turns)

    def on_step(self, trained_from: int, trained, batch) -> None:
        """A training step: the learning view's log, and the monitors (its metrics describe the policy its
        samples came from)."""
        self.steps.add(trained, batch)
        if self.monitors is not None:
            self.monitors.observe_step(trained_from, trained.metrics)

    def pinned(self) -> set[int]:
        return {v.version for v in self.versions if v.status == SERVING}


class Stages(list):
    """The daemon's stages in build order: each opened as it is added, started in that order in the one
    TaskGroup, told `stopping` all at once, drained in reverse; the status reads each one's part."""

    def __init__(self, exits: contextlib.AsyncExitStack):
        super().__init__()
        self.exits = exits

    async def add(self, stage: Stage):
        await stage.open(self.exits)
        self.append(stage)
        return stage

    async def start(self, tasks: asyncio.TaskGroup) -> None:
        for stage in self:
            await stage.start(tasks)

    async def stop(self, shutdown: Shutdown, tasks: asyncio.TaskGroup, serving: Serving) -> None:
        """The drain; a second stop signal cuts it short."""
        drain_timeout = serving.cfg.server.drain_timeout
        systemd.notify("STOPPING=1", systemd.extend_timeout(3 * drain_timeout + 30), "STATUS=draining")
        draining = tasks.create_task(self._drain(), name="drain")
        second = tasks.create_task(shutdown.now.wait(), name="second-signal")
        await asyncio.wait([draining, second], return_when=asyncio.FIRST_COMPLETED)
        second.cancel()
        if not draining.done():
            await self._cut_short(draining, serving)

    async def _drain(self) -> None:
        for stage in self:
            stage.stopping()
        for stage in reversed(self):
            await stage.drain()

    async def _cut_short(self, draining: asyncio.Task, serving: Serving) -> None:
        """The second stop signal: end the drain now. The exit stack still closes (and fsyncs) the journal,
        so what was not trained replays at the next start."""
        log.warning("second stop signal: stopping now, in-flight requests are cut")
        for stage in self:
            stage.cut_short()
        # Requests waiting on an engine end as its connection drops (a stream with an error event, a whole
        # reply with 502); the drain then goes on by itself.
        await asyncio.wait([draining], timeout=_FORCED_STOP_GRACE)
        if not draining.done():
            serving.cut_connections()  # still open: requests waiting on a client that does not read its reply
            await asyncio.wait([draining], timeout=_FORCED_STOP_GRACE)
        for task in asyncio.all_tasks() - {asyncio.current_task()}:  # the rest of the drain (judge, learner)
            task.cancel()


def _mount_ops(cfg: Config, app, metrics: Metrics, dashboard: Dashboard, status: Status) -> None:
    """ops' routes on the chat server: /metrics (open like /health, scraped from localhost, unless [auth]
    require_metrics_key), the learning view (behind the operators' keys when keys are set), /debug/process."""
    app.router.add_get("/metrics", metrics.handle)
    dashboard.add_routes(app)
    if cfg.server.debug_routes:
        app.router.add_get("/debug/process", status.handle_debug_process)


async def _replay(store: SampleStore, state_dir: Path, versions: Versions) -> None:
    """The samples not trained before the last stop, back in the store."""
    replayed = await store.replay()
    if trained := store.drop_trained(checkpointed_samples(state_dir)):  # a stop came between checkpoint and ack
        log.warning("journal: %d sample(s) already in the checkpoint's weights are not trained again", trained)
    log.info("journal: %d sample(s) waiting from before", replayed - trained)
    # The version history: samples of versions rejected or rolled back before the stop are never trained.
    if doomed := store.drop_versions({v.version for v in versions if v.status in (REJECTED, ROLLED_BACK)}):
        log.warning("journal: %d sample(s) of rejected or rolled-back versions dropped", doomed)


def _startup_budget(cfg: Config) -> float:
    """Seconds systemd should wait for READY: the engines' loads and the trainer's, one after the other
    where the start is staged (on GPUs), else the longest."""
    engines = cfg.engine.startup_seconds * ((cfg.engine.replicas + cfg.reference_engine_needed) if staged(cfg) else 1)
    trainer = cfg.learner.trainer_ready_timeout if cfg.learner.enabled else 0.0
    trainer_staged = cfg.learner.enabled and cfg.train.world.device.startswith("cuda")
    return (engines + trainer if trainer_staged else max(engines, trainer)) + 60


def _restored_policy(state_dir, versions: Versions, gated: bool) -> Policy:
    """What a restart serves: the trainer's version if the gate passed it, else the newest one it did."""
    restored = restored_weights(state_dir, lambda version: versions.servable(version, gated))
    if restored is None:
        return Policy()
    version, path = restored
    log.info("serving v%d from %s at start", version, path)
    return Policy(version=version, weight_version=str(version), weights_dir=str(path),
                  adapter=adapter_name(version) if is_adapter(path) else None)
