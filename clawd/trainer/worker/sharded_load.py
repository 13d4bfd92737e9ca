"""The trainer's policy at start-up: loaded whole in one process, built sharded in a world (docs/ARCHITECTURE.md §13).

Runs in the trainer's ranks only (torch). `load` is what `clawd.trainer.worker.step.Trainer` holds as its scorer.

- **One process** (no world, or a world of one rank): `from_pretrained` on the host, LoRA adapters after
  `torch.manual_seed(seed)`, layer recompute, then the whole model to the device, or FSDP2 over the one rank.
- **A world of several ranks**: loading the whole float32 model on every rank's host before sharding costs
  a full copy per rank (~32 GB a rank at 8B, ~160 GB on five). Instead every rank builds the same model on
  the **meta device** (no storage: shapes and dtypes only), wraps it in LoRA and recompute as above, shards
  it (`sharding.shard`), then gives each rank storage for its shards alone on its device (`to_empty`). Rank 0
  alone loads the weights, with exactly the one-process code (`plain`), and **broadcasts** them tensor by
  tensor (torch.distributed.checkpoint's `set_model_state_dict`, broadcast_from_rank0): each rank keeps its
  slice. Rank 0's host holds one full copy while it sends; the others only their shards and one tensor in
  flight.
- **Buffers not in the state dict** (the rotary embedding's `inv_freq`, `original_inv_freq`) are not
  broadcast: after `to_empty` they hold garbage, and each rank recomputes them with transformers' own
  initialisation of the module that owns them (what `from_pretrained` runs for them too). One that
  initialisation leaves unwritten raises: a model with such a buffer is not loaded half right.
- **Tied embeddings** (SmolLM2, the tests' Qwen2) are tied before sharding, so FSDP2 shards one parameter;
  `to_empty` gives a sharded parameter new storage in place (a plain module's would become two parameters),
  and `tied` checks after the load that the two names still hold one.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from clawd.config.train import TrainConfig
from clawd.trainer.worker import adapters, head, recompute, sharding
from clawd.trainer.worker.sharding import World

log = logging.getLogger("clawd.trainer")


def base_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """The weights' dtype in the trainer: a LoRA base is frozen, bf16 on CUDA (no float32 master copy to keep),
    float32 on CPU as the CPU engine serves it; a full fine-tune's float32 master weights."""
    return torch.bfloat16 if cfg.lora.enabled and device.type == "cuda" else torch.float32


def plain(model_dir: Path, cfg: TrainConfig, dtype: torch.dtype):
    """The Hugging Face model loaded whole on the host from model_dir, with its adapters when LoRA is on:
    the one process's model, and rank 0's source of the weights in a world."""
    from transformers import AutoModelForCausalLM

    # sdpa named: with no attention mask it runs the causal flash kernel on CUDA; eval: dropout off.
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="sdpa").eval()
    if cfg.lora.enabled:  # the adapters' random init from the seed: every run the same
        torch.manual_seed(cfg.seed)
        m = adapters.wrap(m, cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules)
    return m


def load(model_dir: Path, cfg: TrainConfig, device: torch.device, world: World | None,
         autocast) -> head.ResponseScorer:
    """The trainer's scorer: on `device` alone, or sharded over `world` (each rank's shards on its device)."""
    if world is not None and world.size > 1:
        return sharded(model_dir, cfg, world, autocast)
    return whole(model_dir, cfg, device, world, autocast)


def whole(model_dir: Path, cfg: TrainConfig, device: torch.device, world: World | None,
          autocast) -> head.ResponseScorer:
    """The scorer loaded whole on this host, then moved to `device`, or sharded over a world of one rank (what
    every rank of a larger world did before `sharded`: bench/trainer_memory.py --startup compares them)."""
    m = plain(model_dir, cfg, base_dtype(cfg, device))
    if recompute.wanted(cfg.recompute, device):  # before sharding: FSDP's hooks go around it
        recompute.apply(m)
    scorer = head.ResponseScorer(m, autocast)
    return scorer.to(device) if world is None else sharding.shard(scorer, world)


def sharded(model_dir: Path, cfg: TrainConfig, world: World, autocast) -> head.ResponseScorer:
    """The scorer built on the meta device, sharded, given storage on each rank's device, its buffers
    recomputed and its weights broadcast from rank 0 (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = base_dtype(cfg, world.device)
    # Rank 0 loads exactly what one process would, adapters included: their init is drawn there from the
    # seed on real tensors and broadcast with the base, so every rank holds the one process's values (a
    # draw on the meta device yields nothing, and the draw order of sharded tensors is not one process's).
    source = {}
    if world.writer:
        loaded = plain(model_dir, cfg, dtype)
        log.info("trainer world: rank 0 loaded %s whole; broadcasting it to %d ranks", model_dir, world.size)
        source = {f"model.{k}": v for k, v in loaded.state_dict().items()}  # the scorer's names
        del loaded  # the tensors live on in source until they are sent
    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
        if cfg.lora.enabled:
            m = adapters.wrap(m, cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules)
    _generation_config(m, model_dir)
    m.tie_weights()  # before sharding: FSDP2 must see one parameter under both names
    if recompute.wanted(cfg.recompute, world.device):
        recompute.apply(m)
    scorer = sharding.shard(head.ResponseScorer(m, autocast), world)
    scorer.to_empty(device=world.device)
    rebuild_buffers(scorer)
    # strict: every parameter and persistent buffer must come from rank 0 (the others pass {}: they receive).
    set_model_state_dict(scorer, source, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                  strict=True))
    source.clear()
    if not tied(m):
        raise RuntimeError("the tied input and output embeddings came apart in the sharded start-up")
    return scorer


def _generation_config(model, model_dir: Path) -> None:
    """generation_config.json as `from_pretrained` reads it (`from_config` derives one from config.json): rank 0
    publishes it with every version."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base.can_generate():
        base.adjust_generation_fn(None, from_auto_class=True, from_pipeline=None,
                                  pretrained_model_name_or_path=str(model_dir), cache_dir=None, force_download=False,
                                  proxies=None, local_files_only=True, token=None, revision=None, subfolder="",
                                  trust_remote_code=False)


def tied(model) -> bool:
    """True unless the config ties the output layer to the input embeddings and they are two parameters."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base.config.get_text_config(), "tie_word_embeddings", False):
        return True
    out = base.get_output_embeddings()
    return out is not None and out.weight is base.get_input_embeddings().weight


@torch.no_grad()
def rebuild_buffers(scorer: torch.nn.Module) -> list[str]:
    """Recompute every non-persistent buffer (garbage after `to_empty`; the state dict does not carry them) with
    the Hugging Face model's own `_init_weights` of the module that owns it; returns their names. A buffer that
    leaves unwritten (NaN, filled first) or that is not floating point raises NotImplementedError."""
    from transformers import PreTrainedModel

    hf = next(mod for mod in scorer.modules() if isinstance(mod, PreTrainedModel))  # inside PEFT's wrapper too
    owners: dict[torch.nn.Module, list[tuple[str, str]]] = {}
    for name, mod in scorer.named_modules():
        for key, buf in mod._buffers.items():  # in registration order (the set has none)
            if buf is None or key not in mod._non_persistent_buffers_set:
                continue
            if not buf.is_floating_point():
                raise NotImplementedError(f"non-persistent buffer {name}.{key} ({buf.dtype}): no rebuild known")
            buf.fill_(float("nan"))
            owners.setdefault(mod, []).append((name, key))
    for mod, keys in owners.items():
        hf._init_weights(mod)
        if left := [f"{name}.{key}" for name, key in keys if torch.isnan(mod._buffers[key]).any()]:
            raise NotImplementedError(f"non-persistent buffer(s) {', '.join(left)} of {type(mod).__name__}: "
                                      "transformers' init does not rebuild them; the sharded start-up cannot")
    return [f"{name}.{key}" for keys in owners.values() for name, key in keys]
