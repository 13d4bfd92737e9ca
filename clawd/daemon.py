"""The daemon: one process, one event loop, no threads (DESIGN §1).

`run()` is the architecture in one place: it builds each stage, owns every
long-lived task in one TaskGroup, serves until SIGTERM/SIGINT, and shuts the
stages down in reverse order.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import time
import uuid

from aiohttp import web

from clawd.ops.admin import AdminServer, argument
from clawd.ops import systemd
from clawd.serving.api import SERVING, Authenticator, make_app
from clawd.serving.completion import ChatService
from clawd.config import Config
from clawd.engine.client import EngineClient
from clawd.engine.supervisor import EngineSupervisor
from clawd.learning.journal import Journal
from clawd.scoring.judges import CallPolicy, OpenAIJudge, SGLangJudge, Teacher
from clawd.learning.learner import Learner, Publisher
from clawd.ops.metrics import Metrics
from clawd.ops.pause import PauseState
from clawd.served import Policy
from clawd.serving.records import RecordWriter
from clawd.ops.reload import ReloadTargets, reload
from clawd.learning.store import SampleStore
from clawd.scoring.scorer import Scorer
from clawd.serving.sessions import SessionTable
from clawd.ops.status import Status
from clawd.serving.tokenizer import ChatTokenizer
from clawd.trainer.link import TrainerSupervisor
from clawd.turns import SHUTDOWN, FinishedTurn
from clawd.weights import restored_weights

log = logging.getLogger("clawd")

_FORCED_STOP_GRACE = 1.0  # after a second stop signal: seconds for each stage of cutting the drain short


async def run(cfg: Config) -> int:
    state_dir = cfg.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)

    # Stages, upstream to downstream:
    # model → engines → chat API → sessions → turn records → scoring → journal → sample store.
    tokenizer = ChatTokenizer(cfg.model_path)
    policy = _restored_policy(state_dir)
    policy_engine = _engine_client(cfg, cfg.engine.url)
    supervisors = [EngineSupervisor(cfg, policy_engine, "policy", policy)]
    reference_engine = None
    if cfg.reference_engine_needed:
        reference_engine = _engine_client(cfg, cfg.engine.reference_url)
        supervisors.append(EngineSupervisor(cfg, reference_engine, "reference"))
    sessions = SessionTable(idle_timeout=cfg.sessions.session_idle_timeout,
                            max_turns=cfg.sessions.session_max_turns,
                            max_sessions=cfg.sessions.max_sessions,
                            new_id=lambda: uuid.uuid4().hex)
    records_dir = state_dir / "records"
    turn_records = RecordWriter(records_dir, kind="turns", retention_days=cfg.records.retention_days)
    judge_records = RecordWriter(records_dir, kind="judge", retention_days=cfg.records.retention_days)
    journal = Journal(state_dir / "journal", fsync=cfg.journal.fsync, fsync_interval=cfg.journal.fsync_interval,
                      segment_bytes=cfg.journal.segment_bytes)
    store = SampleStore(journal, fair_share=cfg.scoring.fair_share)
    replayed = await store.replay()  # opens the journal
    log.info("journal: %d sample(s) waiting from before", replayed)
    judge = _judge(cfg, tokenizer, engine_for={"policy": policy_engine, "reference": reference_engine})
    teacher = None
    if cfg.scoring.mode != "rl":
        teacher_engine = reference_engine if cfg.judge.teacher_engine == "reference" else policy_engine
        teacher = Teacher(teacher_engine, policy=_call_policy(cfg))
    scorer = Scorer(cfg, tokenizer=tokenizer, judge=judge, teacher=teacher, store=store, records=judge_records)
    trainer = learner = None
    if cfg.learner.enabled:
        trainer = TrainerSupervisor(_trainer_options(cfg), ready_timeout=cfg.learner.trainer_ready_timeout)
        publisher = Publisher(policy_engine, cfg.learner.publish_timeout, ready=supervisors[0].ready)
        learner = Learner(cfg.learner, store, trainer, publisher, policy, state_dir)

    pause = PauseState(state_dir / "pause.json", cfg.admin.start_paused)
    if learner is not None and pause.learning:
        learner.pause(pause.current.reason)
    status = Status(cfg, policy, pause, sessions, store, journal, scorer, supervisors, trainer, learner,
                    started=time.time())

    admin = AdminServer(cfg.admin.socket_path(state_dir), _admin_commands(pause, learner, status),
                        group=cfg.admin.group)

    def on_finished(finished: FinishedTurn) -> None:
        turn_records.write_turn(finished)
        status.turns.tick()
        if pause.learning:  # served and recorded, never a sample
            pause.turns_not_learned += 1
            return
        scorer.submit(finished)

    stop, stop_now = asyncio.Event(), asyncio.Event()

    def on_stop_signal() -> None:  # the first drains; a second cuts the drain short
        (stop_now if stop.is_set() else stop).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop_signal)
    auth = Authenticator(cfg)
    loop.add_signal_handler(signal.SIGHUP, _reloader(cfg, ReloadTargets(
        set_log_level=lambda level: logging.getLogger().setLevel(level.upper()),
        set_api_keys=auth.set_keys, set_judge=_judge_setter(judge, teacher, scorer))))
    systemd.notify(systemd.extend_timeout(_startup_budget(cfg)), "STATUS=starting: loading the model")

    async with contextlib.AsyncExitStack() as exits:
        for client in {policy_engine, reference_engine} - {None}:
            await client.start()
            exits.push_async_callback(client.close)
        if isinstance(judge, OpenAIJudge):
            await judge.start()
            exits.push_async_callback(judge.close)
        exits.push_async_callback(journal.close)
        await admin.start()  # after the journal's lock: a second clawd on this state dir has stopped already
        exits.push_async_callback(admin.close)
        exits.callback(turn_records.close)
        exits.callback(judge_records.close)
        async with asyncio.TaskGroup() as tasks:
            watchdog = None
            if (interval := systemd.watchdog_interval()) is not None:  # a stalled loop stops the pings
                watchdog = tasks.create_task(systemd.watchdog(lambda: True, interval), name="watchdog")
            chat = ChatService(cfg, tokenizer, policy_engine, supervisors[0], sessions, on_finished, policy,
                               spawn=tasks.create_task)
            metrics = Metrics(chat, scorer=scorer, store=store, learner=learner, supervisors=supervisors,
                              trainer=trainer, pause=pause)
            engine_tasks = [tasks.create_task(s.run(), name=f"{s.role}-engine") for s in supervisors]
            learning = []
            if learner is not None:
                learning = [tasks.create_task(trainer.run(), name="trainer"),
                            tasks.create_task(learner.run(), name="learner")]
            sweeper = tasks.create_task(_expire_sessions(sessions, on_finished, cfg.sessions.sweep_interval),
                                        name="session-sweeper")
            app = make_app(cfg, chat, scorer=scorer, store=store, supervisors=supervisors, learner=learner,
                           pause=pause, status=status, metrics=metrics, auth=auth)
            runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=cfg.server.drain_timeout,
                                   **metrics.runner_options())
            await runner.setup()
            site = web.TCPSite(runner, cfg.server.host, cfg.server.port, backlog=1024)
            await site.start()
            host, port = runner.addresses[0][:2]
            log.info("listening on http://%s:%d (model %s, engine %s, mode %s, judge %s)", host, port,
                     cfg.model.path, cfg.engine.launch, cfg.scoring.mode, cfg.judge.backend)
            announce = tasks.create_task(_announce_ready(supervisors, trainer, policy, f"http://{host}:{port}"),
                                         name="announce-ready")

            async def drain() -> None:
                log.info("stopping: draining requests for up to %.0fs", cfg.server.drain_timeout)
                announce.cancel()
                app[SERVING]["accepting"] = False
                await runner.cleanup()  # stops listening, waits for in-flight handlers
                for finished in sessions.close_all(time.time(), SHUTDOWN):
                    on_finished(finished)
                sweeper.cancel()
                await scorer.close(cfg.server.drain_timeout)  # turns being judged finish or are dropped
                if learner is not None:
                    await learner.stop(cfg.server.drain_timeout)  # the step in progress, then a checkpoint
                for task in learning[::-1]:  # a step cut short is replayed from the journal next start
                    task.cancel()
                if trainer is not None:
                    await trainer.stop()
                for supervisor in supervisors:
                    await supervisor.stop()
                for task in engine_tasks:
                    task.cancel()
                if watchdog is not None:
                    watchdog.cancel()

            await stop.wait()
            systemd.notify("STOPPING=1", systemd.extend_timeout(3 * cfg.server.drain_timeout + 30), "STATUS=draining")
            draining = tasks.create_task(drain(), name="drain")
            second = tasks.create_task(stop_now.wait(), name="second-signal")
            await asyncio.wait([draining, second], return_when=asyncio.FIRST_COMPLETED)
            second.cancel()
            if not draining.done():
                await _cut_short(draining, trainer, supervisors, {policy_engine, reference_engine} - {None}, runner)
    log.info("stopped")
    return 0


async def _cut_short(draining: asyncio.Task, trainer: TrainerSupervisor | None, supervisors, engine_clients,
                     runner: web.AppRunner) -> None:
    """The second stop signal: end the drain now. The exit stack still closes (and fsyncs) the journal,
    so what was not trained replays at the next start."""
    log.warning("second stop signal: stopping now, in-flight requests are cut")
    if trainer is not None:
        trainer.kill()
    for supervisor in supervisors:
        supervisor.kill()
    for client in engine_clients:
        client.refuse("clawd is stopping")  # a new call would wait on the dead engine's socket
    # Requests waiting on an engine end as its connection drops (a stream with an error event, a whole
    # reply with 502); the drain then goes on by itself.
    await asyncio.wait([draining], timeout=_FORCED_STOP_GRACE)
    if not draining.done() and runner.server is not None:
        # Still open: requests that wait on their client (a body never finished, a stream not read). Cut
        # their connections; aiohttp ends their handlers as for a client that hung up. Cancelling its
        # shutdown while a handler still runs would instead make it log an InvalidStateError traceback.
        for connection in runner.server.connections:
            connection.force_close()
        await asyncio.wait([draining], timeout=_FORCED_STOP_GRACE)
    for task in asyncio.all_tasks() - {asyncio.current_task()}:  # the rest of the drain (judge, learner)
        task.cancel()


def _startup_budget(cfg: Config) -> float:
    """Seconds systemd should wait for READY: the engine's load, then the trainer's."""
    trainer = cfg.learner.trainer_ready_timeout if cfg.learner.enabled else 0.0
    return max(cfg.engine.startup_timeout, trainer) + 60


async def _announce_ready(supervisors, trainer: TrainerSupervisor | None, policy: Policy, url: str) -> None:
    """READY=1 once every engine answers and the trainer has resumed: the service works end to end."""
    for supervisor in supervisors:
        await supervisor.ready.wait()
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
    def set_judge(j) -> None:
        policy = CallPolicy(timeout=j.timeout, retries=j.retries, backoff_initial=j.backoff_initial,
                            backoff_max=j.backoff_max, concurrency=j.concurrency)
        for backend in (judge, teacher):
            if backend is not None:
                backend.reconfigure(policy, temperature=j.temperature, max_tokens=j.max_new_tokens)
        scorer.text_chars = j.record_text_chars

    return set_judge


def _admin_commands(pause: PauseState, learner: Learner | None, status: Status) -> dict:
    """What `clawctl` can ask: pause (learning; with serving=true, chat too), resume, status."""
    async def pause_cmd(request: dict) -> dict:
        paused = pause.pause(serving=argument(request, "serving", bool, False),
                             reason=argument(request, "reason", str))
        if learner is not None:
            learner.pause(paused.reason)
        log.warning("paused by clawctl: %s%s", "learning and serving" if paused.serving else "learning",
                    f" ({paused.reason})" if paused.reason else "")
        return dataclasses.asdict(paused)

    async def resume_cmd(request: dict) -> dict:
        resumed = pause.resume()
        if learner is not None:
            learner.resume()
        log.warning("resumed by clawctl")
        return dataclasses.asdict(resumed)

    async def status_cmd(request: dict) -> dict:
        return status.snapshot()

    return {"pause": pause_cmd, "resume": resume_cmd, "status": status_cmd}


def _restored_policy(state_dir) -> Policy:
    """The newest checkpointed version, served again after a restart (the trainer resumes from it)."""
    restored = restored_weights(state_dir)
    if restored is None:
        return Policy()
    version, path = restored
    log.info("serving v%d from %s (the trainer's checkpoint)", version, path)
    return Policy(version=version, weight_version=str(version), weights_dir=str(path))


def _trainer_options(cfg: Config) -> dict:
    train = dataclasses.asdict(cfg.train)
    train["opd_clip"] = train["opd_clip"] or None  # 0 in the config file means off
    return {"mode": cfg.scoring.mode, "model_dir": str(cfg.model_path.resolve()),
            "state_dir": str(cfg.state_dir.resolve()), "train": train}


def _engine_client(cfg: Config, url: str) -> EngineClient:
    return EngineClient(url, api_key=cfg.engine.api_key, connect_timeout=cfg.engine.connect_timeout,
                        request_timeout=cfg.engine.request_timeout, incremental_stream=cfg.engine.streams_deltas)


def _call_policy(cfg: Config) -> CallPolicy:
    j = cfg.judge
    return CallPolicy(timeout=j.timeout, retries=j.retries, backoff_initial=j.backoff_initial,
                      backoff_max=j.backoff_max, concurrency=j.concurrency)


def _judge(cfg: Config, tokenizer: ChatTokenizer, engine_for: dict[str, EngineClient | None]):
    j = cfg.judge
    if j.backend == "rules":
        return None
    if j.backend == "openai":
        return OpenAIJudge(j.url, j.api_key, j.model, temperature=j.temperature, max_tokens=j.max_new_tokens,
                           policy=_call_policy(cfg))
    # The reference engine holds the initial weights: the policy's tokenizer fits it.
    return SGLangJudge(engine_for[j.engine], tokenizer, temperature=j.temperature,
                       max_new_tokens=j.max_new_tokens, policy=_call_policy(cfg))


async def _expire_sessions(sessions: SessionTable, on_finished, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        for finished in sessions.expire(time.time()):
            on_finished(finished)
