"""The trainer's memory plan (clawd.trainer.worker.memory): its parameter counts are the models', its activation
bytes are what torch saves for the backward (measured here on Qwen2 shapes, float32 and bf16 autocast, with
and without recompute), and `--check-config` / `--plan` print it and refuse a layout that cannot fit."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from clawd.config.train import LoraConfig, TrainConfig, WorldConfig, overlay
from clawd.trainer.worker import recompute
from clawd.trainer.worker.memory import GIB, Shape, activation_bytes_per_token_layer, plan, problem

QWEN = dict(vocab_size=512, hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2)


def test_parameter_counts_are_the_models(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    shape = Shape.from_config(json.loads((tiny_model / "config.json").read_text()))
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    llama = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)  # SmolLM2-135M
    with torch.device("meta"):
        real = sum(p.numel() for p in AutoModelForCausalLM.from_config(llama).parameters())
    assert Shape.from_config(llama.to_dict()).parameters == real == 134_515_008


def measured_bytes_per_token(layers: int, autocast: torch.dtype | None, recomputed: bool, **shape) -> float:
    """The saved-for-backward bytes a token of the decoder costs (the slope between 256 and 512 tokens)."""
    cfg = Qwen2Config(**{**QWEN, **shape}, num_hidden_layers=layers)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    if recomputed:
        recompute.apply(model)
    decoder = model.get_decoder()
    saved = []
    for tokens in (256, 512):
        ids = torch.randint(0, 500, (1, tokens))

        def run():
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                return decoder(input_ids=ids, use_cache=False).last_hidden_state.float().sum()
        saved.append(recompute.saved_bytes(run, model.parameters()))
    return (saved[1] - saved[0]) / 256


@pytest.mark.parametrize("cuda", [False, True])
def test_activation_bytes_are_what_torch_saves_for_the_backward(cuda):
    """Within 3 % on three shapes (hidden, intermediate and key-value sizes varied); with recompute, the
    layers' float32 inputs only (one layer's activations come back in the backward, one at a time)."""
    autocast = torch.bfloat16 if cuda else None
    for shape in ({}, {"intermediate_size": 2432}, {"hidden_size": 1792, "num_attention_heads": 28,
                                                    "num_key_value_heads": 4}):
        s = Shape.from_config(Qwen2Config(**{**QWEN, **shape}, num_hidden_layers=2).to_dict())
        want = 2 * activation_bytes_per_token_layer(s, cuda) + 8 * s.hidden
        got = measured_bytes_per_token(2, autocast, False, **shape)
        assert abs(got - want) / got < 0.03, (shape, got, want)
    redone = measured_bytes_per_token(2, autocast, True)
    assert redone == 2 * 4 * 896 + 8 * 896 + 12  # + a few bytes of positions


def test_the_plan_adds_up_and_refuses_what_cannot_fit():
    shape = Shape(vocab=151936, hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8, tied=True,
                  qkv_bias=False)  # a 4B shape
    full = plan(shape, TrainConfig(micro_batch_tokens=8192), cuda=True, recompute=False)
    assert full.parameters == full.gradients == 4 * shape.parameters and full.optimizer == 8 * shape.parameters
    assert full.activations == 8192 * (36 * activation_bytes_per_token_layer(shape, True) + 8 * 2560)
    redone = plan(shape, TrainConfig(micro_batch_tokens=8192), cuda=True, recompute=True)
    assert redone.activations == full.activations_other < full.activations / 10
    two = plan(shape, TrainConfig(micro_batch_tokens=8192, world=WorldConfig(nproc_per_node=2)), cuda=True,
               recompute=True)
    assert two.optimizer == redone.optimizer // 2 and two.gathered > 0
    lora = plan(shape, TrainConfig(micro_batch_tokens=8192, lora=LoraConfig(rank=16)), cuda=True, recompute=True)
    assert lora.parameters < redone.parameters / 1.9 and lora.optimizer < redone.optimizer / 50
    print(f"\n4B shape, 8192 tokens: full {full.total / GIB:.0f} GiB, recompute {redone.total / GIB:.0f}, "
          f"2 ranks {two.total / GIB:.0f}, LoRA {lora.total / GIB:.0f}")
    assert problem(full, 80, 0.0) and "turn recompute on" in problem(full, 80, 0.0)
    assert problem(lora, 80, 0.0) is None and problem(lora, 0, 0.0) is None  # 0: unchecked
    assert problem(lora, 80, 0.1) is not None  # a 10 % share of 80 GiB is too little


def test_check_config_and_plan_print_the_plan_and_refuse_a_layout_that_cannot_fit(tmp_path):
    """A 4B-shaped base (its config.json only: the plan reads no weights) on a GPU of 80 GiB: full fine-tune
    at 32k tokens without recompute is refused with the figures, before anything starts; the same with
    recompute and LoRA fits; --plan --json carries the plan."""
    from clawd.cli import EXIT_CONFIG, main
    from clawd.tools.tomlfile import to_toml

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(Qwen2Config(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, tie_word_embeddings=True).to_dict()))
    raw = {"model": {"path": str(model)}, "state": {"dir": str(tmp_path / "state")},
           "train": {"micro_batch_tokens": 32768, "recompute": "off", "world": {"device": "cuda",
                                                                                "gpu_memory_gib": 80.0}}}
    path = tmp_path / "clawd.toml"

    def run(*args: str, **train) -> int:
        path.write_text(to_toml({**raw, "train": overlay(raw["train"], train)}))
        return main(["--config", str(path), *args])

    assert run("--check-config") == EXIT_CONFIG
    assert run("--plan") == EXIT_CONFIG
    assert run("--check-config", recompute="on", lora_rank=16) == 0
    assert run("--check-config", gpu_memory_gib=0.0) == 0  # unchecked: printed only
