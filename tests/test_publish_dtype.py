"""Published versions are in the dtype the engines serve (docs/ARCHITECTURE.md §6): the base model's by
default, `[model] dtype` when set. The trainer's own weights and checkpoints stay float32."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader

from clawd.config.train import OptimizerConfig, TrainConfig
from clawd.trainer.worker import checkpoints
from clawd.trainer.worker.handler import TrainerHandler
from clawd.trainer.worker.step import Trainer
from tests.test_trainer import mixed_batch, weights


def stored_dtypes(directory: Path) -> set[str]:
    with safe_open(directory / "model.safetensors", "pt") as f:
        return {f.get_slice(k).get_dtype() for k in f.keys()}


def config_dtype(directory: Path) -> str:
    return json.loads((directory / "config.json").read_text())["dtype"]


def loaded(directory: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(directory, dtype="auto").state_dict()


def test_a_bf16_base_is_published_in_bf16_rounded_from_the_float32_master(tiny_model_bf16, tmp_path):
    trainer = Trainer(tiny_model_bf16, tmp_path / "state", TrainConfig(optimizer=OptimizerConfig(lr=1e-3)))
    assert trainer.publish_dtype == "bfloat16"
    base = loaded(tiny_model_bf16)
    master = weights(trainer)
    assert all(v.dtype == torch.float32 for v in master.values())
    assert all(torch.equal(master[k], base[k].float()) for k in master)  # bf16 upcast: exact
    assert not trainer.train_step(mixed_batch(), "combine")["skipped"]
    master = weights(trainer)
    # the step left weights between bf16 values: publishing must round them
    assert any(not torch.equal(v, v.bfloat16().float()) for v in master.values())

    path = trainer.publish(1)
    assert config_dtype(path) == "bfloat16" and stored_dtypes(path) == {"BF16"}
    assert (path / "tokenizer.json").read_bytes() == (tiny_model_bf16 / "tokenizer.json").read_bytes()
    published = loaded(path)
    assert published.keys() == master.keys()
    assert all(published[k].dtype == torch.bfloat16 and torch.equal(published[k], master[k].bfloat16())
               for k in master)
    assert weights(trainer).keys() == master.keys() and all(torch.equal(weights(trainer)[k], master[k]) for k in master)

    # The same weights in float32 (a configured dtype overrides the base's): exact, and twice the bytes.
    f32 = checkpoints.publish_weights(trainer.model, trainer.model_dir, tmp_path / "f32", "float32")
    assert config_dtype(f32) == "float32" and stored_dtypes(f32) == {"F32"}
    assert all(torch.equal(v, master[k]) for k, v in loaded(f32).items())
    ratio = (path / "model.safetensors").stat().st_size / (f32 / "model.safetensors").stat().st_size
    assert ratio == pytest.approx(0.5, abs=0.01)  # the header (names, shapes) is the rest

    # The checkpoint keeps the float32 master weights, whatever is published.
    ckpt = trainer.checkpoint()
    metadata = FileSystemReader(str(ckpt / "dcp")).read_metadata().state_dict_metadata
    model_dtypes = {m.properties.dtype for k, m in metadata.items() if k.startswith("model.")}
    assert model_dtypes == {torch.float32}


def test_a_float32_base_still_publishes_float32_equal_to_the_master(tiny_model, tmp_path):
    trainer = Trainer(tiny_model, tmp_path / "state", TrainConfig(optimizer=OptimizerConfig(lr=1e-3)))
    assert trainer.publish_dtype == "float32"
    trainer.train_step(mixed_batch(), "combine")
    path = trainer.publish(1)
    assert config_dtype(path) == "float32" and stored_dtypes(path) == {"F32"}
    master = weights(trainer)
    assert all(v.dtype == torch.float32 and torch.equal(v, master[k]) for k, v in loaded(path).items())


def test_the_handler_publishes_in_the_configured_dtype(tiny_model, tiny_model_bf16, tmp_path):
    def handler(model: Path, name: str, **extra) -> TrainerHandler:
        return TrainerHandler({"mode": "rl", "model_dir": str(model), "state_dir": str(tmp_path / name),
                               "train": TrainConfig(), **extra})

    # without a dtype option (an older daemon): the base model's
    assert handler(tiny_model_bf16, "a").trainer.publish_dtype == "bfloat16"
    assert handler(tiny_model, "b").trainer.publish_dtype == "float32"
    assert handler(tiny_model_bf16, "c", dtype="auto").trainer.publish_dtype == "bfloat16"
    h = handler(tiny_model, "d", dtype="bfloat16")
    path = Path(h.publish(1))
    assert config_dtype(path) == "bfloat16" and stored_dtypes(path) == {"BF16"}
    assert all(torch.equal(v, weights(h.trainer)[k].bfloat16()) for k, v in loaded(path).items())
