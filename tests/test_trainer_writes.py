"""A training step is taken once; its writes (the weights directory, the checkpoint) fail and are retried
alone. The real trainer on the tiny model under the real learner, a fake SGLang engine and the real journal,
with faults injected in the trainer child through CLAWD_FAULTS (inherited through the spawn); the
trained-steps ledger (state/trainer/steps.jsonl) and its `lineage` say how many optimizer steps each batch got."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from clawd import faults
from clawd.config.learner import LearnerConfig
from clawd.config.model import ModelConfig
from clawd.config.schema import Config
from clawd.config.scoring import ScoringConfig
from clawd.config.state import StateConfig
from clawd.config.train import LossConfig, OptimizerConfig, TrainConfig
from clawd.config.versions import VersionsConfig
from clawd.engine.client import EngineClient
from clawd.learning.journal import Journal
from clawd.learning.learner import Learner
from clawd.learning.publisher import Publisher
from clawd.learning.store import SampleStore
from clawd.pauses import DISK
from clawd.served import Policy
from clawd.trainer.worker import checkpoints
from clawd.trainer.link import TrainerSupervisor
from clawd.trainer.options import trainer_options
from clawd.trainer.worker.step import Trainer
from clawd.weights import Ledger, checkpointed_samples, is_published, lineage, read_ledger
from tests.fake_sglang import FakeSGLang
from tests.test_learner import until
from tests.test_trainer import flat_config
from tests.trainer_handlers import make_sample


# --- the ledger (pure) -----------------------------------------------------------------------

def line(step, batch, version, samples, skipped=False):
    return {"step": step, "batch_id": batch, "version": version, "samples": samples, "skipped": skipped}


def test_lineage_takes_the_last_line_of_each_step_up_to_the_final_checkpoints():
    lines = [line(1, "a", 1, ["s0", "s1"]),
             line(2, "b", None, ["s2"]),                   # its publish failed ...
             line(2, "b", 2, ["s2"]),                      # ... and was retried: the same step, now published
             line(3, "c", 3, ["s3"]), line(4, "d", 4, ["s4"]),  # lost: the trainer resumed from step 2
             line(3, "d", 5, ["s4"]),                      # step 3 again, on the batch the learner sent next
             line(4, "e", None, ["s5"], skipped=True)]     # after the final checkpoint: not in its weights
    assert lineage(lines, 3) == [line(1, "a", 1, ["s0", "s1"]), line(2, "b", 2, ["s2"]), line(3, "d", 5, ["s4"])]
    assert lineage(lines, 4)[-1] == line(4, "e", None, ["s5"], skipped=True)
    assert lineage(lines, 0) == [] and lineage([], 5) == []
    assert lineage([line(2, "b", 2, ["s2"])], 3) == [line(2, "b", 2, ["s2"])]  # a step without a line is absent


def test_the_ledger_cuts_a_torn_last_line_before_appending(tmp_path):
    path = tmp_path / "trainer" / "steps.jsonl"
    ledger = Ledger(path)
    assert read_ledger(path) == [] and not path.exists()  # nothing written until a line is
    ledger.add(line(1, "a", 1, ["s0"]))
    ledger.sync()
    with open(path, "ab") as f:
        f.write(b'{"step": 2, "batch_')                   # a power cut mid-append
    assert read_ledger(path) == [line(1, "a", 1, ["s0"])]
    again = Ledger(path)
    again.add(line(2, "b", None, ["s1"]))
    again.flush()
    assert read_ledger(path) == [line(1, "a", 1, ["s0"]), line(2, "b", None, ["s1"])]
    assert again.last_line(1) == line(1, "a", 1, ["s0"]) and again.last_line(3) is None


# --- the trainer alone -----------------------------------------------------------------------

@pytest.fixture
def armed():
    """In-process fault points, disarmed afterwards."""
    faults.reset()
    yield faults.arm
    faults.reset()


def test_a_write_failing_midway_leaves_no_temporary_and_the_step_stays_owed(tiny_model, tmp_path, armed):
    trainer = Trainer(tiny_model, tmp_path / "state",  # +1, +1: a step
                      TrainConfig(optimizer=OptimizerConfig(lr=1e-3), loss=LossConfig(reward_baseline="none")))
    trainer.train_step([make_sample(0), make_sample(1)], "rl")
    armed("trainer.publish.mid", "enospc", at=1)
    with pytest.raises(OSError, match="No space left"):
        trainer.publish(1)
    assert list((trainer.state_dir / "weights").iterdir()) == [] and trainer.version == 0 and trainer.unpublished
    with pytest.raises(RuntimeError, match="not published yet"):
        trainer.checkpoint()  # it would say the weights are v0
    written = trainer.publish(1)
    armed("trainer.checkpoint.mid", "eio", at=1)
    with pytest.raises(OSError, match="Input/output error"):
        trainer.checkpoint()
    assert list((trainer.state_dir / "checkpoints").iterdir()) == []
    ckpt = trainer.checkpoint()
    assert (trainer.step, trainer.checkpoint_step, trainer.version) == (1, 1, 1)

    # The free-space estimates are what the writes take, within the per-file overhead.
    size = lambda d: sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    published = checkpoints.publish_bytes(trainer.model, trainer.model_dir, trainer.publish_dtype)
    checkpointed = checkpoints.checkpoint_bytes(trainer.model, trainer.optimizer)
    assert 0.95 < published / size(written) < 1.0 and 0.95 < checkpointed / size(ckpt) < 1.0
    trainer.min_free_bytes = 1 << 62
    with pytest.raises(OSError, match="below state.min_free_bytes") as short:
        trainer.publish(2)
    assert short.value.errno == 28 and trainer.version == 1


def test_a_deferred_write_holds_its_versions_weights_and_a_failed_one_is_written_again_from_them(
        tiny_model, tmp_path, armed):
    trainer = Trainer(tiny_model, tmp_path / "state", TrainConfig(optimizer=OptimizerConfig(lr=1e-3),
                                                                  loss=LossConfig(reward_baseline="none")))
    trainer.train_step([make_sample(0), make_sample(1)], "rl")
    v1 = weights(trainer)
    armed("trainer.publish.write", "enospc", at=1)  # the thread's write of v1 fails
    dest = trainer.publish(1, deferred=True)
    assert (trainer.weights_version, trainer.unpublished, trainer.writing.version) == (1, False, 1)  # pushable now
    trainer.writing._thread.join()
    assert not is_published(dest) and list((trainer.state_dir / "weights").iterdir()) == []  # nothing half-written
    trainer.train_step([make_sample(2), make_sample(3)], "rl")  # a later step changes the model, not v1's copy
    with pytest.raises(RuntimeError, match="not published yet"):
        trainer.checkpoint()
    second = trainer.publish(2, deferred=True)  # settles v1 first: written again from its copy
    assert same(tensors(dest), v1) and trainer.writing.version == 2
    trainer.checkpoint()  # waits for v2: a checkpoint says its version's directory is there
    assert trainer.writing is None and same(tensors(second), weights(trainer)) and not same(tensors(second), v1)


def weights(trainer) -> dict:
    """What a version directory of the trainer's current weights holds, copied now."""
    return {k: t.clone() for k, t in checkpoints.cast_state_dict(trainer.model,
                                                                  getattr(torch, trainer.publish_dtype)).items()}


def same(stored: dict, expected: dict) -> bool:
    """Every stored tensor (a tied one is stored once) equals the expected one bit for bit."""
    return len(stored) > 3 and all(torch.equal(t, expected[k]) for k, t in stored.items())


def tensors(directory) -> dict:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# --- the learner and the trainer child -----------------------------------------------------------

@contextlib.asynccontextmanager
async def learning(tiny_model, tmp_path, *, min_free_bytes=0, **train):
    """A running learner over the real trainer (checkpoint every step; `train`: more [train] keys);
    yields (learner, store, fake, trainer)."""
    cfg = Config(model=ModelConfig(path=str(tiny_model)), scoring=ScoringConfig(mode="rl"),
                 state=StateConfig(dir=str(tmp_path / "state"), min_free_bytes=min_free_bytes),
                 # the raw reward: make_sample's rewards are all +1, which the batch mean would centre to no step
                 train=flat_config(**{"lr": 1e-3, "checkpoint_every": 1, "reward_baseline": "none", **train}),
                 versions=VersionsConfig(rollback_depth=0))  # no base checkpoint: the writes counted are the steps
    async with FakeSGLang() as fake:
        engine = EngineClient(fake.url)
        await engine.start()
        journal = Journal(tmp_path / "journal")
        store = SampleStore(journal)
        await store.replay()
        trainer = TrainerSupervisor(trainer_options(cfg), backoff_initial=0.05, ready_timeout=120)
        learner = Learner(LearnerConfig(rollout_batch_size=2, min_batch_size=2, stall_warn_interval=60), store,
                          trainer, Publisher(engine, 10), Policy(), cfg.state_dir)
        tasks = [asyncio.create_task(trainer.run()), asyncio.create_task(learner.run())]
        try:
            yield learner, store, fake, trainer
        finally:
            for t in tasks[::-1]:
                t.cancel()
            await trainer.stop(30)
            await asyncio.gather(*tasks, return_exceptions=True)
            await engine.close()
            await journal.close()


async def put(store, learner, *ids):
    for i in ids:
        await store.put(dataclasses.replace(make_sample(i), policy_version=learner.policy.version))


def ledger(tmp_path) -> list[dict]:
    return read_ledger(tmp_path / "state" / "trainer" / "steps.jsonl")


def newest_checkpoint(tmp_path) -> dict:
    (path,) = sorted((tmp_path / "state" / "checkpoints").glob("ckpt-*"))[-1:]
    return json.loads((path / "state.json").read_text())


def served(fake) -> list[str]:
    return [u["weight_version"] for u in fake.weight_updates]


@pytest.mark.slow
@pytest.mark.parametrize("point", ["trainer.checkpoint.write", "trainer.publish.write"])
async def test_a_write_hitting_enospc_pauses_learning_and_is_retried_alone_on_resume(tiny_model, tmp_path,
                                                                                     fault_env, point):
    fault_env(f"{point}=enospc@1")
    async with learning(tiny_model, tmp_path) as (learner, store, fake, trainer):
        await put(store, learner, 0, 1)
        await until(lambda: learner.paused, timeout=120)
        assert list(learner.pauses.held) == [DISK] and "No space left" in learner.pauses.held[DISK].detail
        op = point.split(".")[1]
        assert learner.stats.failed_writes == learner.stats.disk_pauses == 1 and learner.stats.steps == 1
        assert store.depth == 2  # trained, not acknowledged: no checkpoint holds the step
        owed = [op]  # a checkpoint is owed once the weights it would hold are published
        assert trainer.state["step"] == 1 and trainer.state["owed"] == owed and trainer.state["checkpoint_step"] == 0
        assert served(fake) == (["1"] if op == "checkpoint" else [])  # written weights are served at once
        checkpoints_dir = tmp_path / "state" / "checkpoints"
        assert not checkpoints_dir.exists() or not list(checkpoints_dir.iterdir())

        learner.pauses.lift(DISK)  # the disk budget's poll does this once there is room
        await until(lambda: store.depth == 0, timeout=60)  # acknowledged once the checkpoint is written
        assert trainer.state == {"step": 1, "version": 1, "weights_version": 1, "checkpoint_step": 1, "owed": [],
                                 "writing": None}
        assert newest_checkpoint(tmp_path)["step"] == 1 and served(fake) == ["1"]

        await put(store, learner, 2, 3)
        await until(lambda: learner.policy.version == 2 and store.depth == 0, timeout=60)
        assert trainer.state["step"] == 2 and served(fake) == ["1", "2"] and trainer.restarts == 0
    lines = ledger(tmp_path)
    batch = lines[0]["batch_id"]
    first = [line(1, batch, None, ["s0", "s1"])] if op == "publish" else []  # the failed publish's line
    assert lines[:-1] == first + [line(1, batch, 1, ["s0", "s1"])]  # one optimizer step for the batch
    assert [(x["step"], x["version"], x["samples"]) for x in lineage(lines, 2)] == [(1, 1, ["s0", "s1"]),
                                                                                 (2, 2, ["s2", "s3"])]


@pytest.mark.slow
async def test_too_little_free_space_pauses_before_writing_and_never_retrains(tiny_model, tmp_path, fault_env):
    async with learning(tiny_model, tmp_path, min_free_bytes=1 << 62) as (learner, store, fake, trainer):
        await put(store, learner, 0, 1)
        await until(lambda: learner.paused, timeout=120)
        detail = learner.pauses.held[DISK].detail
        assert detail.startswith("the trainer's publish failed") and "min_free_bytes" in detail
        learner.pauses.lift(DISK)  # still no room: paused again, the step still owed, nothing trained twice
        await until(lambda: learner.paused and learner.stats.disk_pauses == 2, timeout=30)
        assert trainer.state == {"step": 1, "version": 0, "weights_version": 0, "checkpoint_step": 0,
                                 "owed": ["publish"], "writing": None}
        assert learner.stats.steps == 1 and store.depth == 2 and served(fake) == []
        assert not (tmp_path / "state" / "weights").exists() or not list((tmp_path / "state" / "weights").iterdir())
    assert [x["step"] for x in ledger(tmp_path)] == [1]


@pytest.mark.slow
async def test_a_kill_mid_checkpoint_restarts_from_the_previous_one_and_trains_the_batch_once_more(
        tiny_model, tmp_path, fault_env):
    fault_env("trainer.checkpoint.mid=kill@2")  # the first child's second checkpoint
    async with learning(tiny_model, tmp_path) as (learner, store, fake, trainer):
        await fault_env.first_child_only(trainer)
        await put(store, learner, 0, 1)
        await until(lambda: learner.policy.version == 1 and store.depth == 0, timeout=120)
        await put(store, learner, 2, 3)
        # v2 was written before the kill: the retried batch becomes v3, never v2 again.
        await until(lambda: learner.policy.version == 3 and store.depth == 0, timeout=120)
        assert trainer.restarts == 1 and served(fake) == ["1", "3"]
        assert trainer.state == {"step": 2, "version": 3, "weights_version": 3, "checkpoint_step": 2, "owed": [],
                                 "writing": None}
    assert newest_checkpoint(tmp_path)["step"] == 2 and newest_checkpoint(tmp_path)["version"] == 3
    lines = ledger(tmp_path)
    assert [(x["step"], x["version"], x["samples"]) for x in lines] == [
        (1, 1, ["s0", "s1"]), (2, 2, ["s2", "s3"]), (2, 3, ["s2", "s3"])]  # step 2 twice: the first was lost
    kept = lineage(lines, newest_checkpoint(tmp_path)["step"])
    ids = [i for x in kept for i in x["samples"]]
    assert sorted(ids) == ["s0", "s1", "s2", "s3"] and len(ids) == len(set(ids))  # each acked id, once


@pytest.mark.slow
async def test_a_step_that_raises_restarts_the_trainer_and_requeues_its_batch(tiny_model, tmp_path, fault_env):
    fault_env("trainer.step.after_optimizer=eio@1")  # the first child's first step: its model is half updated
    async with learning(tiny_model, tmp_path) as (learner, store, fake, trainer):
        await fault_env.first_child_only(trainer)
        await put(store, learner, 0, 1)
        await until(lambda: learner.policy.version == 1 and store.depth == 0, timeout=120)
        assert trainer.restarts == 1 and learner.stats.failed_steps == 1 and learner.stats.steps == 1
    assert [(x["step"], x["version"], x["samples"]) for x in ledger(tmp_path)] == [(1, 1, ["s0", "s1"])]


@pytest.mark.slow
async def test_a_trainer_that_dies_after_its_checkpoint_before_its_reply_never_trains_the_batch_twice(
        tiny_model, tmp_path, fault_env):
    fault_env("trainer.checkpoint.done=kill@1")  # step 1 is published and checkpointed; the reply is lost
    async with learning(tiny_model, tmp_path) as (learner, store, fake, trainer):
        await fault_env.first_child_only(trainer)
        await put(store, learner, 0, 1)
        # The batch comes again to the new child, which finds it in its checkpoint: acknowledged, not retrained,
        # and the engine still moves onto the checkpoint's weights that the lost reply never named.
        await until(lambda: store.depth == 0 and learner.policy.version == 1, timeout=120)
        assert trainer.restarts == 1 and served(fake) == ["1"]
        assert trainer.state["step"] == 1 and trainer.state["checkpoint_step"] == 1
    assert [(x["step"], x["samples"]) for x in ledger(tmp_path)] == [(1, ["s0", "s1"])]


def test_samples_in_the_checkpoints_lineage_leave_the_journal_line_at_start(tmp_path):
    state = tmp_path / "state"
    ckpt = state / "checkpoints" / "ckpt-00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text(json.dumps({"step": 2, "version": 2}))
    (ckpt / "complete").write_text("")
    book = Ledger(state / "trainer" / "steps.jsonl")
    for entry in (line(1, "a", 1, ["s0", "s1"]), line(2, "b", None, ["s2"]), line(2, "c", 2, ["s3"]),
                  line(3, "d", 3, ["s4"])):  # step 2 retrained after a restart; step 3 after the checkpoint
        book.add(entry)
    book.flush()
    assert checkpointed_samples(state) == {"s0", "s1", "s3"}
    assert checkpointed_samples(tmp_path / "empty") == set()


async def test_the_store_drops_trained_samples_and_acks_them_with_the_next_ack(tmp_path):
    journal = Journal(tmp_path / "journal")
    store = SampleStore(journal)
    await store.replay()
    for i in range(3):
        await store.put(make_sample(i))
    assert store.drop_trained({"s0", "s2", "elsewhere"}) == 2
    batch, _ = store.take_batch(3, current_version=0, max_staleness=5)
    assert [s.sample_id for s in batch] == ["s1"]
    await store.ack(["s1"])  # s0 and s2 go with it
    await journal.close()
    again = Journal(tmp_path / "journal")
    assert again.open() == []
    await again.close()
