"""Adapters beside one another in one trainer process, a lineage each (docs/ARCHITECTURE.md §15).

With an adapter per principal, the trainer trains the shared adapter and, beside it, one adapter for each
principal who has their own, each from that principal's samples only. The base is loaded once. Each lineage is
a `TrainerHandler` of its own over that one model: its adapter, its optimizer, its counters, its trained-steps
ledger, checkpoints and published versions, under state_dir/lineages/<key>/ (the shared lineage's are the state
directory's own, as in a trainer of one adapter). A request names its lineage (`lineage` beside its fields;
none: the shared one), so each lineage steps, publishes, checkpoints, resumes and rolls back exactly as a lone
trainer would, and a principal's samples never reach another's adapter. A new lineage's adapter starts as a
copy of the shared one as it is then; at start every lineage with a directory resumes its newest checkpoint (one
without: from the shared adapter again, its samples trained again from the journal).

A lineage is keyed by the daemon's pseudonym of its principal (`p-` and 16 hex digits, clawd.safety.versions):
no principal's name reaches the trainer or its files. Forgetting a lineage deletes its adapter and its directory.
"""
from __future__ import annotations

import re

from clawd.trainer.worker.handler import TrainerHandler
from clawd.weights import lineage_dir, lineages_root, remove_lineage

LINEAGE_KEY = re.compile(r"p-[0-9a-f]{16}")


def adapter_of(key: str) -> str:
    """The PEFT adapter name of lineage `key` (a module attribute: no '-')."""
    return "p_" + key[2:]


def check_key(key: str) -> str:
    if not isinstance(key, str) or not LINEAGE_KEY.fullmatch(key):
        raise ValueError(f"lineage {key!r} is not a principal's pseudonym (p- and 16 hex digits)")
    return key


def handler_for(options: dict, world=None):
    """The trainer child's handler (clawd.trainer.child): with `lineages` in the options an adapter per principal
    beside the shared one (one process), else `clawd.trainer.worker.handler.make`'s."""
    if options.get("lineages"):
        if world is not None:
            raise ValueError("adapters per principal: a trainer of one process")
        return LineageHandlers(options)
    return TrainerHandler(options, world)


class LineageHandlers:
    """The shared lineage's handler, and the principals' beside it. Requests without a lineage, and the
    shared lineage's state, are the shared handler's (`__getattr__`): to a daemon that names no lineage this
    is a trainer of one adapter."""

    def __init__(self, options: dict):
        self.options = options
        self.shared = TrainerHandler(options)
        self.handlers: dict[str, TrainerHandler] = {}
        root = lineages_root(options["state_dir"])
        for path in sorted(root.iterdir()) if root.is_dir() else ():
            if path.is_dir() and LINEAGE_KEY.fullmatch(path.name):
                self.lineage(path.name)  # resumes its newest checkpoint

    def __getattr__(self, name: str):
        if name in ("options", "shared", "handlers"):  # not set yet: never the shared handler's
            raise AttributeError(name)
        return getattr(self.shared, name)

    def lineage(self, key: str | None) -> TrainerHandler:
        """The handler of lineage `key` (None: the shared one), made on first use."""
        if key is None:
            return self.shared
        handler = self.handlers.get(check_key(key))
        if handler is None:
            options = {**self.options, "state_dir": str(lineage_dir(self.options["state_dir"], key))}
            handler = self.handlers[key] = TrainerHandler(options, beside=self.shared, adapter=adapter_of(key))
        return handler

    def forget(self, key: str) -> bool:
        """Lineage `key` gone: its adapter from the model, its directory from the disk. Whether there was one."""
        handler = self.handlers.pop(check_key(key), None)
        if handler is not None:
            handler.trainer.settle(abandon=True)
            self.shared.trainer.activate()  # PEFT warns when the adapter it deletes is the active one
            self.shared.trainer.model.delete_adapter(adapter_of(key))
        existed = remove_lineage(self.options["state_dir"], key)
        return handler is not None or existed
