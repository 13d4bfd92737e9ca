"""The learner between a real trainer child (scripted handler), a fake SGLang engine and the real
journal: failed publishes are retried, a restarted trainer's lost samples wait again, and the
engine is moved onto what the trainer holds. Version numbers only go up."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time

import pytest

from clawd.config.learner import LearnerConfig
from clawd.engine.client import EngineError, EngineClient, EngineUnavailable
from clawd.learning.journal import Journal
from clawd.learning.learner import Learner
from clawd.learning.publisher import Publisher
from clawd.safety.versions import ROLLED_BACK
from clawd.served import Policy
from clawd.learning.store import SampleStore
from clawd.pauses import OPERATOR
from clawd.trainer.link import TrainerSupervisor
from tests.fake_sglang import FakeSGLang
from tests.trainer_handlers import build, calls, make_sample


async def until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def learning(tmp_path, *, script=None, batch=2, control="none", backlog=1, max_sample_tokens=8192,
                   groups=False):
    """A running learner; yields (learner, store, fake engine, trainer supervisor). `groups`: weight-update
    groups are configured (so the trainer's writes are deferred) but none applies: every publish is from disk."""
    async with FakeSGLang() as fake:
        engine = EngineClient(fake.url)
        await engine.start()
        journal = Journal(tmp_path / "journal")
        store = SampleStore(journal)
        await store.replay()
        trainer = TrainerSupervisor({"dir": str(tmp_path), "script": script or {}}, factory=build,
                                    backoff_initial=0.05)
        cfg = LearnerConfig(rollout_batch_size=batch, min_batch_size=1, stall_warn_interval=60, control=control,
                            backlog_batches=backlog)
        publisher = Publisher(engine, 10, groups=NoGroupApplies(trainer) if groups else None)
        learner = Learner(cfg, store, trainer, publisher, Policy(), tmp_path / "state", control_seed=7,
                          max_sample_tokens=max_sample_tokens)
        tasks = [asyncio.create_task(trainer.run()), asyncio.create_task(learner.run())]
        try:
            yield learner, store, fake, trainer
        finally:
            for t in tasks[::-1]:
                t.cancel()
            await trainer.stop(10)
            await asyncio.gather(*tasks, return_exceptions=True)
            await engine.close()
            await journal.close()


class NoGroupApplies:
    """clawd.learning.weight_groups.WeightGroups as it stands when no group can be used (one engine, or every
    group cooling down after a failure): pushes never apply, the trainer's `written` is reached through it."""

    def __init__(self, trainer):
        self.trainer = trainer

    def applies(self, replica: str, version: int) -> bool:
        return False


async def put(store: SampleStore, first: int, n: int, version: int = 0) -> None:
    for i in range(first, first + n):
        await store.put(dataclasses.replace(make_sample(i), policy_version=version))


async def test_a_failed_publish_is_retried_before_the_next_step(tmp_path):
    async with learning(tmp_path) as (learner, store, fake, trainer):
        fake.fail_next(500, {"error": "disk full"}, count=2, path="/update_weights_from_disk")
        await put(store, 0, 4)  # two batches' worth: the second must wait for the first's publish
        await until(lambda: learner.policy.version == 2)
        assert learner.stats.failed_publishes == 2 and learner.stats.publishes == 2
        assert [u["weight_version"] for u in fake.weight_updates] == ["1", "2"]
        assert learner.policy.weights_dir == str(tmp_path / "v2")
        first, second = calls(tmp_path)
        assert second["t"] - first["t"] > 0.9  # retried at once, then after 1 s; the second step waited for v1


async def test_a_candidate_whose_deferred_directory_died_with_the_trainer_is_lost_and_its_samples_train_again(
        tmp_path):
    # With weight-update groups a step's directory is written off the critical path. The child dies before it
    # is written (at its first `written`): v1 can never be loaded, so it never serves and is recorded lost; its
    # samples train again on the restarted child as v2, whose directory is on disk before it serves.
    async with learning(tmp_path, script={"written": "exit"}, groups=True) as (learner, store, fake, trainer):
        await put(store, 0, 2)
        await until(lambda: learner.policy.version == 2)
        one, two = calls(tmp_path)
        assert one["deferred"] and two["deferred"] and one["ids"] == two["ids"] and one["pid"] != two["pid"]
        assert [u["weight_version"] for u in fake.weight_updates] == ["2"] and trainer.restarts == 1
        lost = learner.versions.get(1)
        assert lost.status == ROLLED_BACK and "lost" in lost.detail and learner.stats.requeued_after_restart == 2
        assert learner.policy.weights_dir == str(tmp_path / "v2") and (tmp_path / "v2" / "config.json").exists()


async def test_samples_trained_after_the_checkpoint_are_trained_again_when_the_trainer_restarts(tmp_path):
    # Call 2 kills the child mid-step: the new child resumes without batch 1 (never checkpointed),
    # the supervisor sends batch 2 again, and batch 1's samples wait for another step.
    async with learning(tmp_path, script={"2": "exit"}) as (learner, store, fake, trainer):
        await put(store, 0, 2)
        await until(lambda: learner.policy.version == 1)
        await put(store, 2, 2)
        await until(lambda: learner.policy.version == 3)  # the third step's publish, not just its step
        assert learner.stats.steps == 3 and [c["n"] for c in calls(tmp_path)] == [2, 2, 2, 2]  # b1, b2 (killed), b2 again, b1 again
        assert learner.stats.requeued_after_restart == 2 and trainer.restarts == 1
        assert learner.policy.version == 3 and [u["weight_version"] for u in fake.weight_updates] == ["1", "2", "3"]


@pytest.mark.parametrize("published", [True, False])
async def test_the_engine_is_moved_onto_the_weights_the_trainer_resumed_with(tmp_path, published):
    # The trainer resumes holding v5 while the engine serves the base model (v0): before any
    # step, v5's directory is published if it is still there, else the same weights as v6.
    (tmp_path / "checkpoint.json").write_text(json.dumps({"step": 3, "version": 5}))
    if published:
        (tmp_path / "state" / "weights" / "v000005").mkdir(parents=True)
        (tmp_path / "state" / "weights" / "v000005" / "config.json").write_text("{}")
    async with learning(tmp_path) as (learner, store, fake, trainer):
        want = 5 if published else 6
        await until(lambda: learner.policy.version == want)
        path = tmp_path / "state" / "weights" / "v000005" if published else tmp_path / "v6"
        assert fake.weight_updates == [{"model_path": str(path), "weight_version": str(want)}]
        assert json.loads((tmp_path / "checkpoint.json").read_text())["version"] == want
        assert calls(tmp_path) == []  # nothing trained for it
        await put(store, 0, 2, version=0)  # sampled from the base model: too stale to train on
        await put(store, 2, 2, version=want)
        await until(lambda: learner.policy.version == want + 1)
        assert store.dropped_stale == 2


@pytest.mark.parametrize("backlog, sizes, dropped", [(1, [2, 2, 2, 2], 4), (3, [2, 6, 2, 2], 0)])
async def test_a_backlog_trains_in_one_step_up_to_backlog_batches(tmp_path, backlog, sizes, dropped):
    # Eight samples of v0 arrive while the first (slow) step trains. One step per rollout_batch_size publishes
    # v2 and v3 from four of them, and the other four, now 3 versions old (past max_staleness 2), are dropped
    # when the next batch is taken; with 3 batches' worth a step the backlog trains at once and none is dropped.
    async with learning(tmp_path, script={"1": "slow"}, backlog=backlog) as (learner, store, fake, trainer):
        await put(store, 0, 2)
        await until(lambda: len(calls(tmp_path)) == 1)
        await put(store, 2, 8)
        await until(lambda: learner.policy.version == 3)
        await put(store, 10, 2, version=3)  # the next batch: the line is swept for stale samples as it is taken
        await until(lambda: learner.policy.version == 4)
        assert [c["n"] for c in calls(tmp_path)] == sizes and store.dropped_stale == dropped
        assert learner.stats.samples_trained == 12 - dropped


async def test_stop_lets_the_step_finish_and_checkpoints_so_its_samples_are_acked(tmp_path):
    async with learning(tmp_path) as (learner, store, fake, trainer):
        await put(store, 0, 2)
        await until(lambda: learner.policy.version == 1)
        assert store.depth == 2  # trained, not yet covered by a checkpoint
        await learner.stop(10)
        assert store.depth == 0 and learner.paused
        assert json.loads((tmp_path / "checkpoint.json").read_text()) == {"step": 1, "version": 1}


async def test_busy_says_a_step_is_under_way_and_a_pause_lets_it_finish(tmp_path):
    # What an operator (or a bench) reads before measuring after a pause: one version, not one landing meanwhile.
    async with learning(tmp_path, script={"1": "slow"}) as (learner, store, fake, trainer):
        assert not learner.busy
        await put(store, 0, 2)
        await until(lambda: len(calls(tmp_path)) == 1)  # the step trains (1.5 s)
        assert learner.busy
        learner.pauses.hold(OPERATOR, "test")
        await until(lambda: not learner.busy)
        assert learner.policy.version == 1  # the step under way landed, then nothing more
        await put(store, 2, 2, version=1)
        await asyncio.sleep(0.3)
        assert not learner.busy and len(calls(tmp_path)) == 1


RESTART_SECTIONS = {"engine": {"launch": "local"},
                    "learner": {"enabled": True, "rollout_batch_size": 1, "min_batch_size": 1}}


@pytest.fixture(scope="module")
def trained_once(tiny_model, tmp_path_factory):
    """A daemon's state after one life that trained and published v1, then stopped cleanly: built once, and
    copied by each restart test (the life costs an engine, a trainer and a step)."""
    from .harness import Daemon
    import openai
    tmp = tmp_path_factory.mktemp("trained-once")
    sections = {"model": {"path": str(tiny_model), "max_tokens_cap": 4}, **RESTART_SECTIONS}
    daemon = Daemon(tmp, sections)
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
        messages = [{"role": "user", "content": "Hello"}]
        reply = client.chat.completions.create(model="m", messages=messages)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Thanks!"}]
        client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Session-Done": "1"})
        deadline = time.monotonic() + 120
        while daemon.get("/ready")[1].get("policy_version") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        assert daemon.stop() == 0
    return daemon.state


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["kept", "rotated out"])
def test_a_restarted_daemon_serves_the_trainers_version_again(tiny_model, trained_once, tmp_path, weights):
    from .harness import Daemon
    import openai
    import shutil
    sections = {"model": {"path": str(tiny_model), "max_tokens_cap": 4}, **RESTART_SECTIONS}
    shutil.copytree(trained_once, tmp_path / "state")  # the harness puts the state directory there
    if weights == "rotated out":  # the checkpoint's v1 is gone: its weights come back as v2
        shutil.rmtree(tmp_path / "state" / "weights" / "v000001")
    want = 1 if weights == "kept" else 2
    again = Daemon(tmp_path, sections)
    try:
        deadline = time.monotonic() + 120
        while again.get("/ready")[1].get("policy_version") != want:
            assert time.monotonic() < deadline, again.get("/ready")
            time.sleep(0.1)
        info = again.get("/debug/process")[1]["engines"]
        client = openai.OpenAI(base_url=again.url + "/v1", api_key="none", max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}],
                                       extra_headers={"X-Session-Done": "1"})
    finally:
        assert again.stop() == 0
    served = [t for t in again.records() if t["messages"][0]["content"] == "again"]
    assert [(t["policy_version"], t["weight_version"]) for t in served] == [(want, str(want))], info


@pytest.mark.slow
def test_a_restart_never_serves_a_version_its_gate_did_not_pass(tiny_model, trained_once, tmp_path):
    """A stop during v1's gate left it a candidate: the restart serves the base (the newest version the gate
    passed), with learning off too, where nothing would ever evaluate v1 (it used to serve it). Without a gate
    a candidate is a publish a stop cut short, and serves (tests/test_crash_safety.py)."""
    from .harness import Daemon
    from clawd.safety.versions import Versions
    import openai
    import shutil
    shutil.copytree(trained_once, tmp_path / "state")
    Versions(tmp_path / "state" / "versions.jsonl").update(1, status="candidate", gate=None)
    checks = tmp_path / "gate.jsonl"
    checks.write_text(json.dumps({"id": "p", "messages": [{"role": "user", "content": "Hi"}], "check": {"min_words": 1}}))
    again = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 4}, "engine": {"launch": "local"},
                              "learner": {"enabled": False}, "gate": {"enabled": True, "set": str(checks)}})
    try:
        assert again.get("/ready")[1].get("policy_version") == 0
        client = openai.OpenAI(base_url=again.url + "/v1", api_key="none", max_retries=0)
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}],
                                       extra_headers={"X-Session-Done": "1"})
    finally:
        assert again.stop() == 0
    served = [t for t in again.records() if t["messages"][0]["content"] == "again"]
    assert [(t["policy_version"], t["weight_version"]) for t in served] == [(0, "0")]


async def test_a_publish_waits_for_the_engine_to_be_ready_and_gives_up_after_its_timeout(tmp_path):
    """The daemon owns the engine's socket, so a starting engine already accepts: a publish sent then would be
    served once it is up, interleaved with the supervisor's own alignment. The publisher sends nothing until
    the supervisor says ready, and a publish that waited its whole timeout fails (to be retried) untouched."""
    async with FakeSGLang() as fake:
        engine = EngineClient(fake.url)
        await engine.start()
        try:
            ready = asyncio.Event()
            weights = tmp_path / "v000001"
            publishing = asyncio.create_task(Publisher(engine, 10, ready=ready).publish(str(weights), 1))
            await asyncio.sleep(0.3)
            assert not publishing.done() and fake.calls == []
            ready.set()
            await asyncio.wait_for(publishing, 10)
            assert [path for path, _ in fake.calls] == ["/pause_generation", "/update_weights_from_disk",
                                                       "/continue_generation"]
            fake.calls.clear()
            ready.clear()
            with pytest.raises(EngineUnavailable, match="not ready"):
                await Publisher(engine, 0.2, ready=ready).publish(str(weights), 2)
            assert fake.calls == []
        finally:
            await engine.close()


@pytest.mark.parametrize("status, body", [(503, {"error": "busy"}), (403, {"error": "Forbidden"})])
async def test_a_publish_whose_pause_fails_still_sends_continue(tmp_path, status, body):
    """A pause that failed on clawd's side may still have paused the engine (or the next one will find it
    paused): continue is sent all the same, and the update is not."""
    async with FakeSGLang() as fake:
        engine = EngineClient(fake.url)
        await engine.start()
        try:
            fake.fail_next(status, body, path="/pause_generation")
            with pytest.raises(EngineError):
                await Publisher(engine, 10).publish(str(tmp_path / "v000001"), 1)
            assert [path for path, _ in fake.calls] == ["/continue_generation"]
            assert not fake.paused
        finally:
            await engine.close()


@pytest.mark.parametrize("control", ["none", "shuffle_rewards", "zero_rewards"])
async def test_a_negative_control_changes_only_what_the_trainer_is_handed(tmp_path, control):
    """The journal's samples keep the judge's rewards and hints (and are acked as they are);
    the trainer gets them permuted across the batch, or zeroed, without the teacher signal."""
    rewards = [1.0, 1.0, 1.0, -1.0, -1.0, 0.0, 1.0, -1.0]
    async with learning(tmp_path, batch=len(rewards), control=control) as (learner, store, fake, trainer):
        for i, r in enumerate(rewards):
            hinted = i % 2 == 0
            await store.put(dataclasses.replace(make_sample(i), reward=r, mode="combine", has_hint=hinted,
                                                teacher_logprobs=[-0.5] * 4 if hinted else None))
        await until(lambda: learner.policy.version == 1)
        (call,) = calls(tmp_path)
    if control == "none":
        assert call["rewards"] == rewards and call["hints"] == [True, False] * 4
        return
    assert call["hints"] == [False] * 8
    if control == "zero_rewards":
        assert call["rewards"] == [0.0] * 8
    else:
        assert sorted(call["rewards"]) == sorted(rewards) and call["rewards"] != rewards


async def test_a_rollback_asked_during_a_step_keeps_that_steps_version_from_ever_serving(tmp_path):
    # The monitors ask for a rollback of v2 (serving) while the next step trains: that step's version
    # descends from v2 and is doomed; it must not be promoted first (it would serve everyone until the
    # rollback's own publish).
    async with learning(tmp_path, script={"3": "slow"}) as (learner, store, fake, trainer):
        await put(store, 0, 2)
        await until(lambda: learner.policy.version == 1)
        ckpt = tmp_path / "state" / "checkpoints" / "ckpt-00000001"  # v1 is a rollback target
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text(json.dumps({"step": 1, "version": 1}))
        (ckpt / "complete").write_text("")
        await put(store, 2, 2, version=1)
        await until(lambda: learner.policy.version == 2)
        await put(store, 4, 2, version=2)
        await until(lambda: len(calls(tmp_path)) == 3)  # step 3 (v3) is training
        assert await learner.rollback(1, reason="monitor: test") == 4
        assert [u["weight_version"] for u in fake.weight_updates] == ["1", "2", "4"]  # v3 never reached the engine
        assert [learner.versions.get(v).status for v in (2, 3)] == ["rolled_back", "rolled_back"]
        assert learner.versions.get(4).restored_from == 1


@pytest.mark.parametrize("fatal", [False, True])
async def test_a_step_out_of_memory_comes_back_split_and_a_sample_that_cannot_fit_alone_is_excluded(tmp_path, fatal):
    """A bad batch, never a loop: 4 samples run out of memory, then 2 of them, then 1 alone (excluded, reason
    oom); the other one of that pair trains, then the other pair. With a fatal out-of-memory (a world whose
    ranks must restart) the child is restarted each time and the batch still comes back split, not whole."""
    action = "oom_fatal" if fatal else "oom"
    async with learning(tmp_path, batch=4, script={"1": action, "2": action, "3": action}) as (
            learner, store, fake, trainer):
        await put(store, 0, 4)
        await until(lambda: learner.stats.samples_trained == 3)
        await learner.stop(10)
    assert [c["n"] for c in calls(tmp_path)] == [4, 2, 1, 1, 2]
    assert learner.limits.snapshot() == {"max_sample_tokens": 8192, "excluded": {"oom": 1}, "oom_steps": 3,
                                         "capped": 0}
    assert learner.stats.failed_steps == 3 and learner.stats.steps == 2
    assert len({c["pid"] for c in calls(tmp_path)}) == (4 if fatal else 1)
    # Never trained, and acknowledged with the checkpoint that followed: a restart does not replay it.
    assert store.in_flight == 0 and store.waiting == 0 and store.depth == 0


async def test_a_sample_longer_than_max_sample_tokens_is_excluded_and_never_sent(tmp_path):
    async with learning(tmp_path, batch=2, max_sample_tokens=8) as (learner, store, fake, trainer):
        for i, n in enumerate([4, 6, 5, 4]):  # 7, 9 (too long), 8 and 7 tokens
            await store.put(make_sample(i, response_length=n))
        await until(lambda: learner.stats.samples_trained == 3)
        await learner.stop(10)
    assert [c["n"] for c in calls(tmp_path)] == [1, 2]  # the first batch trains without it
    assert learner.limits.excluded == {"too_long": 1} and store.depth == 0
