"""The sharded start-up's parts that need no world (clawd/trainer/worker/sharded_load.py): a model built on the meta
device and given storage gets its non-persistent buffers back exactly as `from_pretrained` computes them, a
buffer nothing knows how to rebuild raises, and PEFT's adapters on a meta model take the dtypes they take on a
loaded one (float32 over a bf16 base). The world itself: tests/test_distributed_trainer.py."""
from __future__ import annotations

import pytest
import torch

from clawd.config.train import LoraConfig, TrainConfig
from clawd.trainer.worker import adapters, sharded_load


def meta_model(model_dir, dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)), dtype=dtype,
                                                attn_implementation="sdpa").eval()


def test_the_rotary_buffers_are_rebuilt_bit_for_bit(tiny_model):
    plain = sharded_load.plain(tiny_model, TrainConfig(), torch.float32)
    model = meta_model(tiny_model).to_empty(device="cpu")
    assert sharded_load.rebuild_buffers(model) == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    want = dict(plain.named_buffers())
    assert {k: torch.equal(b, want[k]) for k, b in model.named_buffers()} == {k: True for k in want}


def test_tied_says_whether_the_embeddings_are_one_parameter(tiny_model):
    """A plain module's `to_empty` gives each name a new parameter (meta and CPU tensors cannot share one): the
    tie is lost and `tied` says so. FSDP2's sharded parameters keep theirs (the world's test checks it)."""
    model = meta_model(tiny_model)
    assert sharded_load.tied(model)
    model.to_empty(device="cpu")
    assert not sharded_load.tied(model)
    model.tie_weights()
    assert sharded_load.tied(model)
    assert sharded_load.tied(sharded_load.plain(tiny_model, TrainConfig(), torch.float32))


def test_a_non_persistent_buffer_nothing_rebuilds_raises(tiny_model):
    model = meta_model(tiny_model)
    model.model.layers[0].mlp.register_buffer("scale", torch.ones(4, device="meta"), persistent=False)
    model.to_empty(device="cpu")
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.mlp\.scale of Qwen2MLP"):
        sharded_load.rebuild_buffers(model)
    model = meta_model(tiny_model)
    model.model.norm.register_buffer("steps", torch.zeros(1, dtype=torch.long, device="meta"), persistent=False)
    model.to_empty(device="cpu")
    with pytest.raises(NotImplementedError, match=r"model\.norm\.steps"):
        sharded_load.rebuild_buffers(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapters_on_the_meta_device_take_the_loaded_models_dtypes(tiny_model, dtype):
    cfg = TrainConfig(lora=LoraConfig(rank=4, alpha=8.0))
    loaded = sharded_load.plain(tiny_model, cfg, dtype)
    with torch.device("meta"):
        meta = adapters.wrap(meta_model(tiny_model, dtype), cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules)
    want = {n: (p.dtype, p.shape, p.requires_grad) for n, p in loaded.named_parameters()}
    assert {n: (p.dtype, p.shape, p.requires_grad) for n, p in meta.named_parameters()} == want
    assert {p.device.type for p in meta.parameters()} == {"meta"}
