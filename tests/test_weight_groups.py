"""Publishing full weights over torch.distributed (clawd.learning.weight_groups): the real trainer child joins a
gloo group with clawd's CPU engine as its rank 0 and broadcasts its weights in buckets inside the publisher's
pause; the engine then serves exactly what the published directory holds, bit for bit. A trainer killed in the
middle of a push leaves the engine with a mix of weights: the publisher falls back to the directory, which
the engine then serves exactly, and the replica publishes from disk until its cool-down ends. The trainer writes
the directory off the critical path meanwhile: the engine serves a version before it is on disk, and the
publish returns (the policy moves) only once it is."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clawd.config.engine import EngineConfig
from clawd.config.model import ModelConfig
from clawd.config.schema import Config
from clawd.config.scoring import ScoringConfig
from clawd.config.state import StateConfig
from clawd.config.train import LoraConfig, LossConfig, OptimizerConfig, TrainConfig, WorldConfig
from clawd.engine.local.scheduler import Engine
from clawd.engine.local.server import parse_args
from clawd.engine.replicas import Replicas
from clawd.learning import weight_groups
from clawd.learning.publisher import NotWritten, Publisher
from clawd.served import Policy
from clawd.trainer.link import TrainerSupervisor
from clawd.trainer.options import trainer_options
from clawd.weights import is_published
from tests.local_engine import running, supervised
from tests.trainer_handlers import make_sample


def served_equals_directory(engine: Engine, weights_dir: str) -> list[str]:
    """The names whose served tensor differs from the directory's (cast to the engine's dtype: exact)."""
    stored = {}
    for f in sorted(__import__("pathlib").Path(weights_dir).glob("*.safetensors")):
        stored.update(load_file(f))
    served = engine.model.state_dict()
    assert set(stored) <= set(served) and len(stored) > 3
    return [n for n, t in stored.items() if not torch.equal(served[n], t.to(served[n].dtype))]


def test_groups_apply_only_where_sglang_can_receive_them():
    def cfg(lora_rank=0, device="cpu", **engine):  # replaced, not parsed: the GPU placement checks are not the point
        return dataclasses.replace(Config(), engine=dataclasses.replace(EngineConfig(), **engine),
                                   train=TrainConfig(lora=LoraConfig(rank=lora_rank), world=WorldConfig(device=device)))
    trainer = object()
    assert weight_groups.for_config(cfg(), trainer) is None   # "auto": the CPU engine loads a directory faster
    local = weight_groups.for_config(cfg(weight_sync="distributed"), trainer)
    assert (local.backend, local.engine_ranks, local.bucket_bytes) == ("gloo", 1, 512 << 20)
    tp2 = weight_groups.for_config(cfg(launch="sglang", device="cuda", sglang_args=("--tp-size", "2")), trainer)
    assert (tp2.backend, tp2.engine_ranks) == ("nccl", 2)
    assert weight_groups.for_config(cfg(weight_sync="distributed"), None) is None         # no learner
    assert weight_groups.for_config(cfg(launch="none"), trainer) is None                  # "auto": launched ones only
    assert weight_groups.for_config(cfg(launch="none", weight_sync="distributed"), trainer).backend == "gloo"
    assert weight_groups.for_config(cfg(weight_sync="disk"), trainer) is None
    assert weight_groups.for_config(cfg(lora_rank=8, weight_sync="distributed"), trainer) is None  # adapters: disk
    assert weight_groups.for_config(cfg(launch="sglang", device="cuda", sglang_args=("--dp-size", "2")),
                                    trainer) is None                                      # SGLang asserts dp == 1
    assert weight_groups.for_config(cfg(launch="sglang"), trainer) is None                # NCCL needs a GPU trainer


@contextlib.asynccontextmanager
async def trainer_and_engine(model, tmp_path):
    """The real trainer child on `model` (a checkpoint every step) and clawd's CPU engine in this process under its
    supervisor: yields (trainer, engine, policy, supervisor)."""
    cfg = Config(model=ModelConfig(path=str(model)), scoring=ScoringConfig(mode="rl"),
                 state=StateConfig(dir=str(tmp_path / "state")),
                 train=TrainConfig(checkpoint_every=1, optimizer=OptimizerConfig(lr=1e-3),
                                   loss=LossConfig(reward_baseline="none")))
    trainer = TrainerSupervisor(trainer_options(cfg), backoff_initial=0.05, ready_timeout=120)
    engine = Engine(parse_args(["--model", str(model), "--threads", "1", "--context-length", "512"]))
    task = asyncio.create_task(trainer.run())
    policy = Policy()
    async with running(engine) as url, supervised(url, policy) as sup:
        try:
            yield trainer, engine, policy, sup
        finally:
            await trainer.stop(30)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_a_publish_goes_over_the_group_bit_for_bit_and_a_push_cut_short_falls_back_to_disk(
        tiny_model_bf16, tmp_path, fault_env):
    fault_env("trainer.sync.bucket=kill@4")  # the first push sends 2 buckets; the second dies at its 2nd
    async with trainer_and_engine(tiny_model_bf16, tmp_path) as (trainer, engine, policy, sup):
        # An engine that cannot join (the CPU engine takes gloo groups only): the trainer gives up its
        # rendezvous after group_timeout, and the publish goes by disk with the engine never paused meanwhile.
        cannot = weight_groups.WeightGroups(trainer, address="127.0.0.1", backend="nccl", engine_ranks=1,
                                            bucket_bytes=150_000, timeout=30, group_timeout=3)
        trained = await trainer.train("b1", 1, [make_sample(0), make_sample(1)])
        held = await Publisher(Replicas([sup], policy), 30, groups=cannot).publish(trained.weights_dir, 1)
        assert (cannot.stats.pushes, cannot.stats.fallbacks) == (0, 1) and held < 3
        assert "custom process group" in cannot.stats.last_error and engine.weight_version == "1"

        groups = weight_groups.WeightGroups(trainer, address="127.0.0.1", backend="gloo", engine_ranks=1,
                                            bucket_bytes=150_000, timeout=30)
        publisher = Publisher(Replicas([sup], policy), 30, groups=groups)
        trained = await trainer.train("b2", 2, [make_sample(2), make_sample(3)])
        held = await publisher.publish(trained.weights_dir, 2)
        assert (groups.stats.pushes, groups.stats.fallbacks) == (1, 0) and engine.weight_version == "2"
        assert served_equals_directory(engine, trained.weights_dir) == []
        assert held >= groups.stats.last_seconds > 0 and groups.stats.last_bytes > 0
        assert len(groups.groups[sup.name].buckets) == 2  # what the fault's pass count assumes
        first_pid = trainer.pid

        trained = await trainer.train("b3", 3, [make_sample(4), make_sample(5)])
        assert served_equals_directory(engine, trained.weights_dir) != []  # v3 differs from what is served
        await publisher.publish(trained.weights_dir, 3)  # the trainer dies at the push's second bucket
        assert trainer.ready is None  # the disk fallback did not wait for the next trainer child to start
        assert (groups.stats.pushes, groups.stats.fallbacks) == (1, 1), groups.stats
        assert engine.weight_version == "3" and served_equals_directory(engine, trained.weights_dir) == []
        assert sup.name not in groups.groups and not groups.applies(sup.name, 3)  # disk during the cool-down
        await trainer.ready_info()
        assert trainer.pid != first_pid  # restarted from its checkpoint; no group of the old child is kept


async def test_the_engine_serves_a_version_pushed_before_its_directory_is_written_and_the_policy_waits_for_it(
        tiny_model_bf16, tmp_path, fault_env):
    fault_env("trainer.publish.write=slow")  # every directory write takes SLOW_SECONDS longer
    async with trainer_and_engine(tiny_model_bf16, tmp_path) as (trainer, engine, policy, sup):
        groups = weight_groups.WeightGroups(trainer, address="127.0.0.1", backend="gloo", engine_ranks=1,
                                            bucket_bytes=150_000, timeout=30)
        publisher = Publisher(Replicas([sup], policy), 30, groups=groups)
        trained = await trainer.train("b1", 1, [make_sample(0), make_sample(1)], deferred=True)
        directory = Path(trained.weights_dir)
        # The reply came before the write: the step's checkpoint (due at every step) is left owed behind it.
        assert trainer.state["writing"] == 1 and trainer.state["owed"] == ["checkpoint"]
        assert not is_published(directory) and not trained.checkpointed
        seen = []  # the directory's presence at the moment the engine first served v1

        async def watch():
            while engine.weight_version != "1":
                await asyncio.sleep(0.005)
            seen.append(is_published(directory))
        watcher = asyncio.create_task(watch())
        await publisher.publish(trained.weights_dir, 1)
        await watcher
        assert seen == [False] and is_published(directory)  # served first, written before publish returned
        assert (groups.stats.pushes, groups.stats.fallbacks) == (1, 0) and trainer.state["writing"] is None
        assert served_equals_directory(engine, trained.weights_dir) == []
        await trainer.checkpoint(30)

        # The child dies while it writes v2: the engine keeps v1 (no push: the group died with the child;
        # no directory to load), and the publish fails without the policy moving.
        trained = await trainer.train("b2", 2, [make_sample(2), make_sample(3)], deferred=True)
        trainer.link.kill()
        with pytest.raises(NotWritten, match="never written"):
            await publisher.publish(trained.weights_dir, 2)
        assert engine.weight_version == "1" and not is_published(Path(trained.weights_dir))
        assert served_equals_directory(engine, str(directory)) == []


@pytest.mark.parametrize("tied", [True, False])
def test_the_sender_sends_a_tied_embedding_once_as_save_pretrained_stores_it(tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from clawd.trainer.worker.weight_sender import WeightSender

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied))
    sender = WeightSender(model, "bfloat16", torch.device("cpu"))
    heads = [n for n in sender.named() if n in ("model.embed_tokens.weight", "lm_head.weight")]
    assert heads == (["model.embed_tokens.weight"] if tied else ["model.embed_tokens.weight", "lm_head.weight"])
    layout = sender.layout(1 << 20)
    assert sum(b.nbytes for b in layout) == sum(t.numel() * 2 for t in sender.named().values())  # all bf16
    assert [d for b in layout for d in b.dtypes] == ["bfloat16"] * len(sender.named())
