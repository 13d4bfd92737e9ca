"""The [model] section: the Hugging Face directory served and trained, and how it is read."""
from __future__ import annotations

import typing
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    # Hugging Face directory of the policy: its tokenizer, chat template and weights
    path: str = "state/models/SmolLM2-135M-Instruct"
    context_length: int = 0              # context length in tokens; 0 = max_position_embeddings from the model's config
    max_tokens_cap: int = 1024           # max_tokens when a request leaves it unset: min(this, context - prompt)
    tool_parser: str = "hermes"          # "hermes" (<tool_call>{json}</tool_call>, also "qwen25") or "none"
    reasoning_parser: str = "think"      # "think" (<think>...</think> to reasoning_content) or "none"
    # What the engines serve and the trainer publishes; "auto" = the model's config.json (float32 when it names none)
    dtype: typing.Literal["auto", "bfloat16", "float16", "float32"] = "auto"

    def check(self) -> dict[str, str]:
        errors = {}
        if not self.path:
            errors["path"] = "must name a Hugging Face model directory"
        if self.context_length < 0:
            errors["context_length"] = "must be 0 (from the model) or positive"
        if self.max_tokens_cap < 1:
            errors["max_tokens_cap"] = "must be at least 1"
        return errors
