"""LoRA: the trainer's adapters, built, published and merged with PEFT (docs/ARCHITECTURE.md §15).

With `[train.lora] rank > 0` the base model is frozen and held once (bf16 on GPU, float32 on CPU, where
the CPU engine serves float32) and PEFT adds rank-r adapters to the target modules; only those train,
and AdamW keeps state for them alone. Dropout is 0: the trainer runs in eval mode, so the policy being
trained is the one that sampled. PEFT keeps the adapters' weights in float32 over a bf16 base, so the
trainable parameters of every FSDP group share one dtype, as FSDP2 requires.

A published version is a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`):
what SGLang's `/load_lora_adapter` and the CPU engine load. The reference policy is the base itself:
`disabled` runs the model with the adapters switched off, with no second copy of the weights.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch

from clawd import faults
from clawd.trainer.worker.checkpoints import copy_model_files
from clawd.weights import atomic_dir


DEFAULT = "default"  # PEFT's name for a model's first adapter: the one a single lineage trains


def wrap(model, rank: int, alpha: float, targets: tuple[str, ...]):
    """`model` with LoRA adapters on `targets` (a `peft.PeftModel`; the base's parameters frozen). The
    adapters start as PEFT initialises them: A random (from torch's RNG), B zero, so step 0 is the base."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM")
    missing = set(targets) - {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if missing:
        raise ValueError(f"lora_target_modules: {type(model).__name__} has no modules named {', '.join(sorted(missing))}")
    with peft_quietly():
        return get_peft_model(model, config).eval()


@contextlib.contextmanager
def peft_quietly():
    """PEFT 0.21 asks transformers 5 for `is_gradient_checkpointing`, deprecated there (a FutureWarning on
    every wrap): nothing of ours to change."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


def beside(scorer, name: str, source: str, lora: bool, world):
    """`scorer` (a loaded model and its head) with adapter `name` added beside `source` (`add_copy`): one process
    training several adapters on one base (clawd.trainer.worker.lineages)."""
    if world is not None or not lora:
        raise ValueError("adapters beside one another: LoRA in one trainer process only")
    add_copy(scorer.model, name, source)
    return scorer


def add_copy(model, name: str, source: str) -> None:
    """A new adapter `name` beside `source` on the PeftModel, with `source`'s configuration and a copy of its
    weights as they are now (a principal's adapter starts as the shared one). An existing one is left as is."""
    if name in model.peft_config:
        return
    if not name.isidentifier() or name == DEFAULT:  # module attribute names, and no second default
        raise ValueError(f"adapter name {name!r}: a Python identifier other than {DEFAULT!r}")
    with peft_quietly():
        model.add_adapter(name, model.peft_config[source])
    params = dict(model.named_parameters())
    copied = 0
    for key, param in params.items():
        if f".{source}." in key:
            with torch.no_grad():
                params[key.replace(f".{source}.", f".{name}.")].copy_(param)
            copied += 1
    if not copied:
        raise ValueError(f"adapter {source!r} has no weights to copy")


def disabled(model):
    """The base model's forward inside the block (the frozen reference); a no-op context for a full model."""
    return model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext()


def trainable_state(model, dtype: torch.dtype, world=None) -> dict[str, torch.Tensor] | None:
    """The adapters' tensors, whole, on the writing rank's host in dtype, under the PeftModel's own names;
    None on the other ranks. In a world each is gathered in turn (every rank calls this, in one order)."""
    out: dict[str, torch.Tensor] = {}
    writer = world is None or world.writer
    for name, param in model.named_parameters():
        if param.requires_grad:
            whole = param.full_tensor() if hasattr(param, "full_tensor") else param
            if writer:
                out[name] = whole.detach().to("cpu", dtype)
            del whole
    return out if writer else None


def adapter_bytes(model, dtype: str) -> int:
    """About what `publish` writes: the adapters in dtype (the config file is a few hundred bytes)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad) * getattr(torch, dtype).itemsize


def publish(model, dest: Path, dtype: str = "float32", world=None, adapter: str = DEFAULT) -> Path:
    """The adapter (the one training: `adapter`) as a PEFT adapter directory at dest, in dtype (what the engines
    serve the base in), its tensors under PEFT's names, whatever the adapter is called; written atomically. In a
    world every rank calls it and every rank gets its outcome."""
    state = trainable_state(model, getattr(torch, dtype), world)

    def write() -> Path:
        dest.parent.mkdir(parents=True, exist_ok=True)

        def files(tmp: Path) -> None:
            faults.point("trainer.publish.write")
            model.save_pretrained(tmp, state_dict=state, selected_adapters=[adapter])
            if adapter != DEFAULT:  # PEFT writes an adapter not named "default" into a subdirectory of its name
                for path in (tmp / adapter).iterdir():
                    path.rename(tmp / path.name)
                (tmp / adapter).rmdir()
            faults.point("trainer.publish.mid")
            (tmp / "README.md").unlink(missing_ok=True)  # PEFT's model card: nothing an engine reads

        return atomic_dir(dest, files)

    return write() if world is None else world.agree(write if world.writer else None)


def export_merged(base_dir: Path, adapter_dir: Path, dest: Path, dtype: str) -> Path:
    """A full Hugging Face model at dest: the base with the adapter merged into its weights (for engines
    without LoRA serving), in dtype, with the base's tokenizer files; written atomically."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)  # merge in float32
    with peft_quietly():
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged = merged.to(getattr(torch, dtype))
    merged.config.dtype = dtype

    def files(tmp: Path) -> None:
        merged.save_pretrained(tmp)
        copy_model_files(Path(base_dir), tmp)

    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    return atomic_dir(Path(dest), files)
