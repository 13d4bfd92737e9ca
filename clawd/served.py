"""The policy version being served: moved by the learner only when the engine confirms a publish."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Policy:
    version: int = 0
    weight_version: str = "0"
    weights_dir: str | None = None  # None: the base model (model.path)
    adapter: str | None = None      # LoRA mode: the adapter chat requests carry (None: the base, or full weights)
    published_at: float = field(default_factory=time.time)
