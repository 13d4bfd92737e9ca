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
    # LoRA, adapters per principal: each principal's own policy (its lineage's), served to them alone; a
    # principal without one, or whose own has no version yet, is served this one.
    principals: dict[str, Policy] = field(default_factory=dict)

    def of(self, principal: str | None) -> Policy:
        """The policy `principal`'s requests are served: their own adapter's once it has a version, else this."""
        own = self.principals.get(principal) if principal is not None else None
        return own if own is not None and own.adapter is not None else self
