"""The daemon: one process, one event loop, no threads (docs/ARCHITECTURE.md §1).

`run()` is the architecture in one place. It builds the stages in the order data flows through
them (engines, serving, scoring, learning, then ops, which only reads them), wires each stage to
the next in plain sight, runs every long-lived task in one TaskGroup, serves until the shutdown
trigger fires, and drains the stages in reverse order.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid

from aiohttp import web

from clawd.config import Config, JudgeConfig
from clawd.engine.client import EngineClient
from clawd.engine.lora import AdapterUse, adapter_name
from clawd.engine.replicas import Balanced, Replicas
from clawd.engine.supervisor import EngineSupervisor
from clawd.learning.journal import Journal
from clawd.learning.learner import Learner
from clawd.learning import weight_groups
from clawd.learning.publisher import Publisher
from clawd.learning.store import SampleStore
from clawd.ops import systemd
from clawd.ops.admin import AdminServer
from clawd.ops.commands import admin_commands
from clawd.ops.dashboard import Dashboard
from clawd.ops.disk import DiskBudget
from clawd.ops.learning_view import StepLog, learning_view
from clawd.ops.metrics import Metrics
from clawd.ops.reload import ReloadTargets, reload
from clawd.ops.status import Rate, Status
from clawd.ops.people import Holdings
from clawd.pauses import Pauses
from clawd.privacy import files
from clawd.privacy.policy import Privacy
from clawd.privacy.retention import Retention
from clawd.safety import evalset
from clawd.safety.gate import PromotionGate
from clawd.safety.monitors import Monitors
from clawd.safety.versions import REJECTED, ROLLED_BACK, SERVING, Versions
from clawd.safety.watch import Watch
from clawd.scoring.judges import CallPolicy, OpenAIJudge, SGLangJudge
from clawd.scoring.handover import TurnHandover
from clawd.scoring.teacher import Teacher
from clawd.scoring.scorer import Scorer
from clawd.served import Policy
from clawd.serving.api import CONNECTIONS, AdmissionGate, make_app
from clawd.serving.auth import Authenticator
from clawd.serving.completion import ChatService
from clawd.encoding import Encoder
from clawd.serving.connections import TrackedSite, raise_open_file_limit
from clawd.records import RecordWriter
from clawd.serving.sessions import SessionTable
from clawd.tokenizer import ChatTokenizer
from clawd.trainer.link import TrainerSupervisor, trainer_options
from clawd.turns import SHUTDOWN
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


async def run(cfg: Config, shutdown: Shutdown | None = None) -> int:
    state_dir = cfg.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    # The state is clawd's alone (the umask is cli's); what an earlier run left open is closed now.
    share_weights = files.secure_state(state_dir, cfg.admin.group, cfg.privacy.weights_group)
    max_connections = raise_open_file_limit(cfg.server.max_connections)  # the cap that fits the fd limit
    loop = asyncio.get_running_loop()
    if shutdown is None:
        shutdown = Shutdown()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, shutdown.request)
    systemd.notify(systemd.extend_timeout(_startup_budget(cfg)), "STATUS=starting: loading the model")

    # Engines: the policy engine serves chat and takes published weights; a reference engine (when a
    # judge or teacher needs the initial weights) is supervised the same way.
    tokenizer = ChatTokenizer(cfg.model_path)
    versions = Versions(state_dir / "versions.jsonl")  # a restart serves only what the gate passed
    policy = _restored_policy(state_dir, versions, cfg.gate.enabled)
    engines = _engine_supervisors(cfg, policy)
    # The policy replicas (one unless [engine] replicas/urls say more): a router sends each request to one.
    replicas = Replicas([e for e in engines if e.role == "policy"], policy)
    # LoRA mode: the replicas serve the base, and the trainer's adapters beside it (clawd.engine.lora).
    adapters = AdapterUse(policy) if cfg.train.lora else None

    # The durable end of learning opens first: its lock keeps a second clawd off this state directory,
    # and its replay brings back the samples not trained before the last stop.
    journal = Journal(state_dir / "journal", fsync=cfg.journal.fsync, fsync_interval=cfg.journal.fsync_interval,
                      segment_bytes=cfg.journal.segment_bytes)
    store = SampleStore(journal, fair_share=cfg.scoring.fair_share)
    replayed = await store.replay()
    if trained := store.drop_trained(checkpointed_samples(state_dir)):  # a stop came between checkpoint and ack
        log.warning("journal: %d sample(s) already in the checkpoint's weights are not trained again", trained)
    log.info("journal: %d sample(s) waiting from before", replayed - trained)
    # The version history: samples of versions rejected or rolled back before the stop are never trained.
    if doomed := store.drop_versions({v.version for v in versions if v.status in (REJECTED, ROLLED_BACK)}):
        log.warning("journal: %d sample(s) of rejected or rolled-back versions dropped", doomed)
    # Behaviour monitors per version: replies, the judge's verdicts and the trainer's steps feed them.
    monitors = Monitors(cfg.monitors) if cfg.monitors.enabled else None
    steps, samples_per_minute = StepLog(), Rate()

    def on_sample(sample) -> None:
        samples_per_minute.tick()
        if monitors is not None:
            monitors.observe_judgement(sample.policy_version, sample.reward, sample.has_hint)

    store.on_put = on_sample
    pauses = Pauses(state_dir / "pause.json", cfg.admin.start_paused)
    disk = DiskBudget(state_dir, cfg.state.min_free_bytes, pauses)  # a low disk pauses learning, not serving
    disk.poll()
    records_dir = state_dir / "records"
    turn_records = RecordWriter(records_dir, kind="turns", retention_days=cfg.records.retention_days)
    judge_records = RecordWriter(records_dir, kind="judge", retention_days=cfg.records.retention_days)
    turn_records.on_error = judge_records.on_error = disk.failed
    privacy = Privacy(cfg.privacy, cfg.auth.keys)

    # One group owns every long-lived task, the stages' own (aborts, scoring) included. It is entered once
    # every stage is built and started, so a failed start (a held admin socket) raises as itself.
    tasks = asyncio.TaskGroup()
    async with contextlib.AsyncExitStack() as exits:
        exits.push_async_callback(journal.close)
        exits.callback(turn_records.close)
        exits.callback(judge_records.close)
        for engine in engines:
            await engine.client.start()
            exits.push_async_callback(engine.client.close)

        # Scoring: a finished turn → judge votes / hint / teacher log-probs → a sample in the store.
        engine_for = {e.role: e.client for e in engines if e.role != "policy"}
        # Judge and teacher calls go to the least loaded replica; in LoRA mode "policy" carries the policy's
        # adapter and "reference" is the same replicas asked without one: the frozen base.
        engine_for["policy"] = Balanced(replicas, adapters)
        if adapters is not None:
            engine_for["reference"] = Balanced(replicas)
        encoder = Encoder(cfg.model_path)  # long prompts (and judge and teacher prompts) encoded off the loop
        exits.push_async_callback(encoder.close)
        judge = _judge(cfg, tokenizer, engine_for, encoder)
        if isinstance(judge, OpenAIJudge):
            await judge.start()
            exits.push_async_callback(judge.close)
        teacher, reference = _teachers(cfg, engine_for)
        scorer = Scorer(cfg, tokenizer=tokenizer, judge=judge, teacher=teacher, store=store, records=judge_records,
                        spawn=tasks.create_task, reference=reference, encoder=encoder)
        scorer.on_write_error = disk.failed
        scorer.record_view = privacy.judge_record
        if isinstance(judge, OpenAIJudge):  # a third party: PII replaced in what it is shown
            scorer.judge_view = privacy.for_judge

        # Learning: batches from the store → the trainer subprocess → weights published to the policy engine.
        trainer = learner = None
        if cfg.learner.enabled:
            trainer = TrainerSupervisor(trainer_options(cfg), ready_timeout=cfg.learner.trainer_ready_timeout)
            publisher = Publisher(replicas, cfg.learner.publish_timeout, adapters=adapters,  # one replica at a time
                                  base_dir=str(cfg.model_path), groups=weight_groups.for_config(cfg, trainer))
            publisher.before_load = share_weights  # [privacy] weights_group: an engine run as another user
            learner = Learner(cfg.learner, store, trainer, publisher, policy, state_dir, control_seed=cfg.train.seed,
                              pauses=pauses, versions=versions, lora=cfg.train.lora, gate=_gate(cfg, tokenizer,
                              Balanced(replicas), judge), max_sample_tokens=cfg.max_sample_tokens)
            def on_step(trained_from: int, trained, batch) -> None:
                steps.add(trained, batch)
                if monitors is not None:  # the step's metrics describe the policy its samples came from
                    monitors.observe_step(trained_from, trained.metrics)

            learner.on_step = on_step
            if cfg.learner.control != "none":
                log.warning("learner control %r: training on a reward cut off from the replies (an experiment)",
                            cfg.learner.control)

        # Serving: chat requests → the policy engine; each finished turn is handed over to scoring.
        turns_per_minute, requests_per_minute = Rate(), Rate()
        sessions = SessionTable(idle_timeout=cfg.sessions.session_idle_timeout,
                                max_turns=cfg.sessions.session_max_turns, max_sessions=cfg.sessions.max_sessions,
                                new_id=lambda: uuid.uuid4().hex, max_bytes=cfg.sessions.max_bytes)
        to_scoring = TurnHandover(turn_records, scorer, pauses, privacy, monitors, on_turn=turns_per_minute.tick,
                                  spawn=tasks.create_task)
        chat = ChatService(cfg, tokenizer, replicas, sessions, to_scoring, policy, spawn=tasks.create_task,
                           adapters=adapters, encoder=encoder)

        # The monitors' verdicts on the version serving: alarm, halt learning, or roll back (clawd.safety.watch).
        watcher = None if monitors is None else Watch(monitors, versions, policy, pauses, state_dir,
            None if learner is None else lambda target, reason: learner.rollback(target, reason=reason),
            interval=cfg.monitors.interval)

        # Retention that runs even when nothing is written: old records, journal segments, weights past use.
        retention = Retention(state_dir, (turn_records, judge_records), cfg.records.retention_days,
                              compact_journal=journal.compact, serving=lambda: policy.version,
                              keep_versions=cfg.train.keep_versions, interval=cfg.privacy.retention_interval,
                              pinned=lambda: {v.version for v in versions if v.status == SERVING})

        # Ops reads the stages through one snapshot and owns none of them.
        status = Status(cfg, policy, pauses, chat, store, scorer, engines, trainer, learner, started=time.time(),
                        requests=requests_per_minute, turns=turns_per_minute, disk=disk,
                        records=(turn_records, judge_records), versions=versions, watch=watcher,
                        privacy=privacy, retention=retention, handover=to_scoring)
        auth = Authenticator(cfg)
        metrics = Metrics(status.snapshot, auth if cfg.auth.require_metrics_key else None)
        chat.on_first_token = metrics.observe_first_token
        if learner is not None:
            learner.on_publish = metrics.observe_publish
        people = Holdings(state_dir, turn_records, judge_records, store, scorer, sessions, versions, monitors,
                          to_scoring)
        admin = AdminServer(cfg.admin.socket_path(state_dir), admin_commands(pauses, status, learner, versions, people),
                            group=cfg.admin.group)
        await admin.start()
        exits.push_async_callback(admin.close)
        loop.add_signal_handler(signal.SIGHUP, _reloader(cfg, ReloadTargets(
            set_log_level=lambda level: logging.getLogger().setLevel(level.upper()),
            set_api_keys=lambda keys: (auth.set_keys(keys), privacy.set_keys(keys)),
            set_judge=_judge_setter(judge, teacher, scorer))))

        async with tasks:
            engine_tasks = [tasks.create_task(e.run(), name=f"{e.name}-engine") for e in engines]
            learning_tasks = [] if learner is None else [
                tasks.create_task(_after(_trainer_waits_for(cfg, engines), trainer.run()), name="trainer"),
                tasks.create_task(learner.run(), name="learner")]
            sweeper = tasks.create_task(_expire_sessions(sessions, to_scoring, cfg.sessions.sweep_interval),
                                        name="session-sweeper")
            disk_watch = tasks.create_task(disk.run(), name="disk-budget")
            sweeps = tasks.create_task(retention.run(), name="retention")
            watch = None if watcher is None else tasks.create_task(watcher.run(), name="monitors")
            unloader = None if adapters is None else tasks.create_task(
                adapters.unload_retired(replicas, cfg.learner.publish_timeout), name="adapter-unloader")
            loop_lag = tasks.create_task(metrics.watch_loop(), name="loop-lag")
            watchdog = None
            if (interval := systemd.watchdog_interval()) is not None:  # a stalled loop stops the pings
                watchdog = tasks.create_task(systemd.watchdog(lambda: True, interval), name="watchdog")

            admission = AdmissionGate()
            app = make_app(cfg, chat, auth=auth, admission=admission, engines=engines,
                           serving_paused=lambda: pauses.serving,
                           on_request=requests_per_minute.tick, outer_middlewares=[metrics.middleware])
            # /metrics is open like /health (scraped from localhost) unless [auth] require_metrics_key.
            app.router.add_get("/metrics", metrics.handle)
            # The learning view; behind the operators' keys (a Basic password or a Bearer key) when keys are set.
            Dashboard(lambda: learning_view(status.snapshot(), versions, monitors, steps,
                                            samples_per_minute.per_minute()), auth).add_routes(app)
            if cfg.server.debug_routes:
                app.router.add_get("/debug/process", status.handle_debug_process)
            connections = app[CONNECTIONS]  # deadlines for headers and bodies, the connection cap
            connections.cap = max_connections
            connections.on_close = metrics.watch_connections(lambda: connections.open)
            runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=cfg.server.drain_timeout,
                                   **metrics.runner_options(), **connections.runner_options())
            await runner.setup()
            site = TrackedSite(runner, connections, cfg.server.host, cfg.server.port, backlog=1024)
            await site.start()
            host, port = runner.addresses[0][:2]
            log.info("listening on http://%s:%d (model %s, engine %s, mode %s, judge %s)", host, port,
                     cfg.model.path, cfg.engine.launch, cfg.scoring.mode, cfg.judge.backend)
            announce = tasks.create_task(_announce_ready(engines, trainer, policy, f"http://{host}:{port}"),
                                         name="announce-ready")

            async def drain() -> None:
                """The stages stop in reverse: serving, then scoring, learning, the trainer, the engines."""
                log.info("stopping: draining requests for up to %.0fs", cfg.server.drain_timeout)
                announce.cancel()
                admission.close()
                for child in filter(None, [trainer, *engines]):  # one that dies now stays down: we are leaving
                    child.hold_restarts()
                await runner.cleanup()  # stops listening, waits for in-flight handlers
                for finished in sessions.close_all(time.time(), SHUTDOWN):
                    to_scoring(finished)
                await to_scoring.flush()  # turns whose PII scan is under way
                sweeper.cancel()
                disk_watch.cancel()
                sweeps.cancel()
                if watch is not None:
                    watch.cancel()
                if unloader is not None:
                    unloader.cancel()
                await scorer.close(cfg.server.drain_timeout)  # turns being judged finish or are dropped
                if learner is not None:
                    await learner.stop(cfg.server.drain_timeout)  # the step in progress, then a checkpoint
                for task in learning_tasks[::-1]:  # a step cut short is replayed from the journal next start
                    task.cancel()
                if trainer is not None:
                    await trainer.stop()
                for engine in engines:
                    await engine.stop()
                for task in engine_tasks:
                    task.cancel()
                if watchdog is not None:
                    watchdog.cancel()
                loop_lag.cancel()

            await shutdown.drain.wait()
            systemd.notify("STOPPING=1", systemd.extend_timeout(3 * cfg.server.drain_timeout + 30), "STATUS=draining")
            draining = tasks.create_task(drain(), name="drain")
            second = tasks.create_task(shutdown.now.wait(), name="second-signal")
            await asyncio.wait([draining, second], return_when=asyncio.FIRST_COMPLETED)
            second.cancel()
            if not draining.done():
                await _cut_short(draining, trainer, engines, runner)
    log.info("stopped")
    return 0


async def _cut_short(draining: asyncio.Task, trainer: TrainerSupervisor | None, engines: list[EngineSupervisor],
                     runner: web.AppRunner) -> None:
    """The second stop signal: end the drain now. The exit stack still closes (and fsyncs) the journal,
    so what was not trained replays at the next start."""
    log.warning("second stop signal: stopping now, in-flight requests are cut")
    if trainer is not None:
        trainer.kill()
    for engine in engines:
        engine.kill()
        engine.client.refuse("clawd is stopping")  # a new call would wait on the dead engine's socket
    # Requests waiting on an engine end as its connection drops (a stream with an error event, a whole
    # reply with 502); the drain then goes on by itself.
    await asyncio.wait([draining], timeout=_FORCED_STOP_GRACE)
    if not draining.done() and runner.server is not None:
        # Still open: requests waiting on a client that does not read its reply. Cut their connections (aiohttp
        # ends their handlers as for a hang-up); cancelling its shutdown then would log an InvalidStateError.
        for connection in runner.server.connections:
            connection.force_close()
        await asyncio.wait([draining], timeout=_FORCED_STOP_GRACE)
    for task in asyncio.all_tasks() - {asyncio.current_task()}:  # the rest of the drain (judge, learner)
        task.cancel()


def _startup_budget(cfg: Config) -> float:
    """Seconds systemd should wait for READY: the engines' loads and the trainer's, one after the other
    where the start is staged (on GPUs), else the longest."""
    staged = (cfg.engine.replicas + cfg.reference_engine_needed) if _staged(cfg) else 1
    engines = cfg.engine.startup_seconds * staged
    trainer = cfg.learner.trainer_ready_timeout if cfg.learner.enabled else 0.0
    trainer_staged = cfg.learner.enabled and cfg.train.device.startswith("cuda")
    return (engines + trainer if trainer_staged else max(engines, trainer)) + 60


def _staged(cfg: Config) -> bool:
    """SGLang engines clawd launches start one after the other: each measures the GPU's free memory as it
    starts, and two at once (or a trainer joining) would each count the other's as free."""
    return cfg.engine.launch == "sglang"


def _trainer_waits_for(cfg: Config, engines: list[EngineSupervisor]) -> tuple[asyncio.Event, ...]:
    """A trainer on CUDA starts once the engines are up, for the same reason."""
    return tuple(e.ready for e in engines) if cfg.train.device.startswith("cuda") else ()


async def _after(events: tuple[asyncio.Event, ...], work) -> None:
    """Run the coroutine `work` once every event is set (closed unrun if cancelled first)."""
    try:
        for event in events:
            await event.wait()
    except BaseException:
        work.close()
        raise
    await work


async def _announce_ready(engines: list[EngineSupervisor], trainer: TrainerSupervisor | None, policy: Policy,
                          url: str) -> None:
    """READY=1 once every engine answers and the trainer has resumed: the service works end to end."""
    for engine in engines:
        await engine.ready.wait()
    if trainer is not None:
        await trainer.ready_info()
    log.info("ready: serving policy v%d on %s", policy.version, url)
    systemd.notify("READY=1", f"STATUS=serving on {url}, policy v{policy.version}")


def _reloader(cfg: Config, targets: ReloadTargets):
    """The SIGHUP handler: the file read again, what can change live applied, the rest named."""
    running = cfg

    def on_reload() -> None:
        nonlocal running
        running, line = reload(cfg.source, running, targets)
        log.log(logging.WARNING if line.startswith("reload failed") else logging.INFO, "SIGHUP: %s", line)
        systemd.notify(f"STATUS={line}")

    return on_reload


def _judge_setter(judge, teacher: Teacher | None, scorer: Scorer):
    def set_judge(j: JudgeConfig) -> None:
        for backend in (judge, teacher):
            if backend is not None:
                backend.reconfigure(_call_policy(j), temperature=j.temperature, max_tokens=j.max_new_tokens)
        scorer.text_chars = j.record_text_chars

    return set_judge


def _gate(cfg: Config, tokenizer: ChatTokenizer, engine: Balanced, judge) -> PromotionGate | None:
    """The gate before promotion, on the evaluation set (`[gate] set`, or the one clawd ships); None when off.
    A bad set stops the start with its file and line, as a bad config does."""
    if not cfg.gate.enabled:
        return None
    path = cfg.gate.set or evalset.default_path()
    prompts = evalset.load(path)
    gate = PromotionGate(cfg.gate, prompts[:cfg.gate.prompts or len(prompts)], tokenizer, engine, judge)
    if gate.needs_judge and judge is None:
        raise evalset.EvalSetError(f"{path}: rubric checks need a judge model: judge.backend is \"rules\"")
    log.info("gate: %d prompt(s) from %s, %d sample(s) each, margin %.0f%%", len(gate.prompts), path,
             cfg.gate.samples_per_prompt, 100 * cfg.gate.margin)
    return gate


def _restored_policy(state_dir, versions: Versions, gated: bool) -> Policy:
    """What a restart serves: the trainer's version if the gate passed it, else the newest one it did."""
    restored = restored_weights(state_dir, lambda version: versions.servable(version, gated))
    if restored is None:
        return Policy()
    version, path = restored
    log.info("serving v%d from %s at start", version, path)
    return Policy(version=version, weight_version=str(version), weights_dir=str(path),
                  adapter=adapter_name(version) if is_adapter(path) else None)


def _engine_supervisors(cfg: Config, policy: Policy) -> list[EngineSupervisor]:
    """The policy replicas' supervisors (each after the one before on GPUs), then the reference engine's when
    the mode needs one."""
    def client(url: str) -> EngineClient:
        return EngineClient(url, api_key=cfg.engine.api_key, admin_api_key=cfg.engine.admin_api_key,
                            connect_timeout=cfg.engine.connect_timeout, request_timeout=cfg.engine.request_timeout,
                            first_byte_timeout=cfg.engine.first_byte_timeout, idle_timeout=cfg.engine.idle_timeout,
                            incremental_stream=cfg.engine.streams_deltas)

    engines: list[EngineSupervisor] = []
    for i, url in enumerate(cfg.engine.policy_urls):
        after = (engines[-1].ready,) if engines and _staged(cfg) else ()
        engines.append(EngineSupervisor(cfg, client(url), "policy", policy, after=after, index=i))
    if cfg.reference_engine_needed:
        after = (engines[-1].ready,) if _staged(cfg) else ()
        engines.append(EngineSupervisor(cfg, client(cfg.engine.reference_url), "reference", after=after))
    return engines


def _call_policy(j: JudgeConfig) -> CallPolicy:
    return CallPolicy(timeout=j.timeout, retries=j.retries, backoff_initial=j.backoff_initial,
                      backoff_max=j.backoff_max, concurrency=j.concurrency)


def _judge(cfg: Config, tokenizer: ChatTokenizer, engine_for: dict[str, EngineClient], encoder: Encoder):
    """The judge backend; None for the rules judge (scored in-process)."""
    j = cfg.judge
    if j.backend == "rules":
        return None
    if j.backend == "openai":
        return OpenAIJudge(j.url, j.api_key, j.model, temperature=j.temperature, max_tokens=j.max_new_tokens,
                           policy=_call_policy(j), ca_file=j.ca_file, nameserver=j.nameserver)
    # The reference engine holds the initial weights: the policy's tokenizer fits it.
    return SGLangJudge(engine_for[j.engine], tokenizer, temperature=j.temperature,
                       max_new_tokens=j.max_new_tokens, policy=_call_policy(j), encoder=encoder)


def _teachers(cfg: Config, engine_for: dict[str, EngineClient]) -> tuple[Teacher | None, Teacher | None]:
    """The teacher of a hinted response (None in rl mode), and the reference's scorer for a full fine-tune's KL term."""
    if cfg.scoring.mode != "rl" and cfg.judge.teacher_engine == "policy" and not cfg.train.lora:
        log.warning("judge.teacher_engine = \"policy\": the policy being trained is its own teacher; the frozen "
                    "reference (\"reference\", the default) does not drift with it")  # LoRA: the base is frozen
    kl = cfg.train.kl_loss_coef > 0 and not cfg.train.lora  # LoRA: the trainer turns its adapters off instead
    on = lambda role: Teacher(engine_for[role], policy=_call_policy(cfg.judge))  # noqa: E731
    return None if cfg.scoring.mode == "rl" else on(cfg.judge.teacher_engine), on("reference") if kl else None


async def _expire_sessions(sessions: SessionTable, to_scoring: TurnHandover, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        for finished in sessions.expire(time.time()):
            to_scoring(finished)
