"""The local engine's model side: loading a Hugging Face checkpoint, and a batch's KV cache.

The two places that reach into transformers' internals (its loading report, the
layers of a DynamicCache), kept apart from the scheduler that drives them
(docs/ARCHITECTURE.md §10).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch


class WeightLoadError(Exception):
    """A checkpoint that is not a loadable model, or not the same kind as the served one."""


def _model_kind(model) -> tuple:
    """Class and tensor shapes of the base model. LoRA adapters (adapters.py) live inside the served
    model's layers while loaded: their tensors are left out and the wrapped weights keep their names."""
    shapes = {k.replace(".base_layer.", "."): tuple(v.shape) for k, v in model.state_dict().items()
              if ".lora_" not in k}
    return type(model), shapes


def load_model(path: str, like=None):
    """Load an HF causal LM in float32; with `like`, insist on the same class and tensor shapes."""
    from transformers import AutoModelForCausalLM
    if not Path(path).is_dir():
        raise WeightLoadError(f"{path} is not a directory")
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    problems = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise WeightLoadError(f"checkpoint does not match its config: {problems or info['error_msgs']}")
    model.eval()
    if like is not None:
        (cls, shapes), (old_cls, old_shapes) = _model_kind(model), _model_kind(like)
        if cls is not old_cls:
            raise WeightLoadError(f"architecture {cls.__name__} differs from the served {old_cls.__name__}")
        diff = sorted(k for k in shapes.keys() | old_shapes.keys() if shapes.get(k) != old_shapes.get(k))
        if diff:
            raise WeightLoadError(f"{len(diff)} tensors differ in name or shape from the served model, "
                                  f"e.g. {diff[0]}: {shapes.get(diff[0])} vs {old_shapes.get(diff[0])}")
    return model


def copy_in(model, tensors: dict):
    """Named tensors received over a weight-update group copied into `model`'s own (converted to its dtype, as
    SGLang's load_weights does); every name must be one of the model's, with its shape. Returns the model."""
    own = model.state_dict()  # tied weights appear under both names, one storage
    wrong = sorted(n for n, t in tensors.items() if n not in own or tuple(own[n].shape) != tuple(t.shape))
    if wrong:
        raise WeightLoadError(f"{len(wrong)} received tensors match no tensor of the served model by name and "
                              f"shape, e.g. {wrong[0]}")
    with torch.no_grad():
        for name, t in tensors.items():
            own[name].copy_(t)
    return model


@dataclass
class Batch:
    """Sequences decoding together: left-padded rows sharing one KV cache."""
    rows: list  # the scheduler's Req objects, one per row
    cache: object  # transformers DynamicCache
    mask: torch.Tensor  # [rows, cache length]; 0 marks padding
    next_pos: torch.Tensor  # [rows, 1]: position id of each row's next token

    def select(self, keep: list[int]) -> None:
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, dtype=torch.long)
            self.cache.batch_select_indices(index)
            self.mask, self.next_pos = self.mask[index], self.next_pos[index]
            self.rows = [self.rows[b] for b in keep]

    def row(self, b: int) -> Batch:
        """Row b as a batch of its own with its KV copied out, this batch unchanged: a row that yields keeps its
        cache (clawd.engine.local.priority)."""
        cache = copy.copy(self.cache)
        cache.layers = [copy.copy(layer) for layer in self.cache.layers]  # selecting on a copy reassigns its tensors
        index = torch.tensor([b], dtype=torch.long)
        cache.batch_select_indices(index)
        return Batch([self.rows[b]], cache, self.mask[index], self.next_pos[index])

    def can_extend(self) -> bool:
        # Only plain full-attention layers hold every position, so only they can be re-padded.
        from transformers.cache_utils import DynamicLayer
        return all(type(layer) is DynamicLayer for layer in getattr(self.cache, "layers", [None]))

    def extend(self, other: Batch) -> None:
        """Append `other`'s rows, left-padding the shorter side with masked zeros."""
        if not other.rows:
            return
        width = max(self.mask.shape[1], other.mask.shape[1])
        pad = torch.nn.functional.pad
        left = lambda t: pad(t, (0, 0, width - t.shape[-2], 0))  # [batch, heads, time, dim]
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([left(mine.keys), left(theirs.keys)])
            mine.values = torch.cat([left(mine.values), left(theirs.values)])
        self.mask = torch.cat([pad(m, (width - m.shape[1], 0)) for m in (self.mask, other.mask)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.rows = self.rows + other.rows
