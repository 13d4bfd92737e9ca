"""Layer recompute: each decoder layer keeps only its inputs for the backward and runs its forward again
there (docs/ARCHITECTURE.md §13).

Without it the backward holds every layer's intermediate activations at once: ~1.7 MB a token at the
0.5B shape, ~6 MB at 4B, so `micro_batch_tokens` 8192 at 8B wants 75-95 GB a rank. With it a layer's
activations exist only while that layer runs, forward or backward, for about a third more compute.

The layer's `forward` is wrapped in place (torch's non-reentrant `checkpoint`) rather than the layer
wrapped in another module: parameter and state-dict names stay the model's, so checkpoints, published
directories and adapters are the same with recompute on or off. Applied before `fully_shard`: FSDP's
hooks run around the wrapped forward, and its pre-backward hook gathers the layer's parameters before
the backward recomputes it (as torchtitan applies its checkpoint wrapper per block, then shards).
Non-reentrant: kwargs pass through, autocast and RNG state are restored for the recompute, and no input
needs `requires_grad` (a frozen LoRA base's embeddings give none).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import torch
from torch.utils.checkpoint import checkpoint

from clawd.config.train import recompute_on

def wanted(mode: str, device: torch.device) -> bool:
    """`[train] recompute` on this device (`clawd.config.train.recompute_on`)."""
    return recompute_on(mode, device.type)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (PEFT-wrapped or not)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise NotImplementedError(f"{type(model).__name__}: no decoder layers")
    return layers


def apply(model: torch.nn.Module) -> int:
    """Recompute every decoder layer of `model` in the backward; returns how many layers. Idempotent."""
    layers = decoder_layers(model)
    for layer in layers:
        if not isinstance(layer.__dict__.get("forward"), _Recomputed):
            layer.forward = _Recomputed(layer.forward)
    return len(layers)


class _Recomputed:
    """A layer's bound forward, run under `checkpoint` while gradients are being recorded."""

    def __init__(self, forward: Callable[..., Any]):
        self.forward = forward
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # inference (log-probs, the reference): nothing to keep or redo
            return self.forward(*args, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def saved_bytes(run: Callable[[], Any], params: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the tensors autograd saves for the backward while `run()` records a graph, less `params`'
    own storage: the activation memory a backward will need (each storage counted once)."""
    seen: set[tuple[int, int]] = {(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in params}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total
