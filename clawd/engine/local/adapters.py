"""LoRA adapters in the local engine: SGLang 0.5.23's run-time adapter API, with PEFT doing the math.

SGLang's behaviour (docs/ARCHITECTURE.md §10; entrypoints/http_server.py, managers/io_struct.py,
lora/lora_registry.py, lora/lora_manager.py, arg_groups/lora_hook.py):
- flags `--enable-lora --max-lora-rank R --lora-target-modules m1 m2 ... | all
  --max-loras-per-batch N` (default 8) `--lora-strict-loading` (off by default: weights outside the
  targets are skipped with a warning; on: the adapter is refused). Without `--lora-paths` (which this engine does not take)
  the rank and the targets are required;
- `/load_lora_adapter {lora_name, lora_path, pinned?}` registers a PEFT adapter directory
  under a name; a name already loaded, a rank above the limit or modules outside the targets
  are refused. `/unload_lora_adapter {lora_name}` first stops new requests from naming it, then
  waits for the requests in flight on it before freeing it;
- a /generate item names its adapter in `lora_path`; at most N kinds of rows share a
  batch, the base counting as one kind.

The served model is wrapped in a `peft.PeftModel` while an adapter is loaded. A batch runs as
one forward with PEFT's per-row `adapter_names` ("__base__" for base rows): every row keeps its
own adapter through prefill and decode, rows join and leave a running batch freely, and the base
rows (judge, teacher) see exactly the base model. Grouping rows per adapter would mean one
forward, and one KV cache, per group. When the last adapter goes, PEFT's `unload()` takes the
LoRA layers out again, so a base-only engine runs the plain model.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import importlib.util
import json
import logging
import warnings
from pathlib import Path

log = logging.getLogger("clawd.engine.cpu")

BASE = "__base__"  # PEFT's per-row name for "no adapter" (never a PEFT adapter name here: those are ours)
# SGLang's `--lora-target-modules all` on a Llama/Qwen-style decoder: every linear layer of a block.
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_PER_BATCH = 8
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class AdapterError(ValueError):
    """A load or unload SGLang refuses: 400 with success false and this text as error_message."""


def add_flags(ap) -> None:
    ap.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters loaded at run time")
    ap.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank accepted")
    ap.add_argument("--lora-target-modules", nargs="+", default=None, metavar="MODULE",
                    help="modules adapters may change (e.g. q_proj v_proj), or `all`")
    ap.add_argument("--max-loras-per-batch", type=int, default=DEFAULT_PER_BATCH,
                    help="kinds of rows (adapters, the base counting as one) in one batch")
    ap.add_argument("--lora-strict-loading", action=argparse.BooleanOptionalAction, default=False,
                    help="refuse an adapter with weights outside the target modules (else: a warning)")


def check_flags(ap, args) -> None:
    """SGLang's start-up checks, as argparse errors; expands `all`."""
    if args.max_loras_per_batch < 1:
        ap.error("--max-loras-per-batch must be at least 1")
    if not args.enable_lora:
        return
    if importlib.util.find_spec("peft") is None:
        ap.error("--enable-lora needs the peft package, which runs the adapters")
    if args.max_lora_rank is None or not args.lora_target_modules:
        ap.error("--enable-lora without --lora-paths needs both --max-lora-rank and --lora-target-modules "
                 "(clawd's CPU engine takes no --lora-paths: adapters are loaded with /load_lora_adapter)")
    if args.max_lora_rank < 1:
        ap.error("--max-lora-rank must be at least 1")
    if "all" in args.lora_target_modules:
        args.lora_target_modules = list(ALL_TARGETS)


def incompatible(name: str, rank) -> str:
    return (f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool "
            f"configuration. Please ensure that the LoRA adapter's rank is within the configured "
            f"`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")


def check_adapter_config(name: str, config: dict, max_rank: int, targets: frozenset[str]) -> None:
    """Refuse what SGLang refuses: not LoRA, DoRA, extra trained modules, rank or modules over the limits."""
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"Failed to load LoRA adapter {name}: peft_type is {config.get('peft_type')!r}, not LORA")
    if config.get("use_dora"):
        raise AdapterError(f"Failed to load LoRA adapter {name}: DoRA adapters are not supported")
    if config.get("modules_to_save") or config.get("trainable_token_indices"):
        raise AdapterError(f"Failed to load LoRA adapter {name}: adapters that train whole modules or add "
                           f"tokens to the vocabulary are not supported")
    rank, modules = config.get("r"), config.get("target_modules")
    ranks = [rank, *(config.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and 0 < r <= max_rank for r in ranks):
        raise AdapterError(incompatible(name, rank))
    # PEFT writes a list of names; a regular-expression string cannot be checked against the targets.
    if not isinstance(modules, list) or not modules or not set(modules) <= targets:
        raise AdapterError(incompatible(name, rank))


def unmatched_weights(names, targets: frozenset[str]) -> list[str]:
    """Adapter weight names that belong to no target module: SGLang 0.5.23 matches each name against the
    targets by substring (lora/utils.py get_target_module_name) and skips, or with `--lora-strict-loading`
    refuses, the rest (lora/mem_pool.py). Pure."""
    return sorted(n for n in names if not any(t in n for t in targets))


def strict_weights(name: str, path: str, targets: frozenset[str], strict: bool) -> None:
    """SGLang's `--lora-strict-loading`, at load time here (SGLang checks as it first batches the adapter):
    weights that match no target module refuse the adapter when strict, else are logged as skipped."""
    file = Path(path) / "adapter_model.safetensors"
    if not file.is_file():
        return  # a .bin adapter: PEFT reads it; its names are not listed without loading it
    from safetensors import safe_open
    with safe_open(str(file), framework="pt") as f:
        skipped = unmatched_weights(f.keys(), targets)
    if not skipped:
        return
    message = (f"LoRA adapter '{name}': {len(skipped)} weight(s) skipped because they did not match any target "
               f"module in {sorted(targets)}. Skipped weights: {skipped[:8]}")
    if strict:
        raise AdapterError(f"Failed to load LoRA adapter {name}: {message}")
    log.warning("%s", message)


def read_adapter_config(name: str, path: str) -> dict:
    try:
        config = json.loads((Path(path) / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"Failed to load LoRA adapter {name} from {path}: no readable adapter_config.json "
                           f"({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"Failed to load LoRA adapter {name} from {path}: adapter_config.json is not an object")
    if not any((Path(path) / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        # checked here: PEFT would take the path for a hub repository id and go looking for it
        raise AdapterError(f"Failed to load LoRA adapter {name} from {path}: no adapter_model.safetensors")
    return config


class Adapters:
    """The adapters an engine serves: names, in-flight use counts, and the PEFT wrapper running them."""

    def __init__(self, args):
        self.enabled = bool(getattr(args, "enable_lora", False))
        self.max_rank = getattr(args, "max_lora_rank", None) or 0
        self.targets = frozenset(getattr(args, "lora_target_modules", None) or ())
        self.strict = bool(getattr(args, "lora_strict_loading", False))
        self.per_batch = getattr(args, "max_loras_per_batch", DEFAULT_PER_BATCH)
        self.registered: dict[str, str] = {}  # name -> path: what requests may name, in load order
        self.present: dict[str, str] = {}  # name -> path: in the model (registered, or unloading)
        self.users: collections.Counter[str] = collections.Counter()  # name -> requests in flight on it
        self._idle: dict[str, asyncio.Event] = {}  # set when an unloading adapter has no users left
        self._lock = asyncio.Lock()  # loads and unloads one at a time, as SGLang's lora_update_lock
        # Held while a model step runs on the engine's compute thread: PEFT changes the model's modules in
        # place when it adds or drops an adapter, so that waits for the step, and the next step for it.
        self.stepping = asyncio.Lock()
        self.peft = None  # peft.PeftModel around the served model while an adapter is present
        # PEFT's own name for each present adapter: module keys cannot hold ".", and PEFT misreads
        # names that are part of "lora_"; clients may name adapters as they like.
        self._peft_names: dict[str, str] = {}
        self._serial = 0

    # ---- requests

    def check(self, name: str | None) -> None:
        """Whether a request may name this adapter: RequestError-compatible ValueError otherwise."""
        if name is None:
            return
        if not self.enabled:
            raise ValueError(NOT_ENABLED)
        if name not in self.registered:
            loaded = collections.OrderedDict(self.registered).keys()
            raise ValueError(f"The following requested LoRA adapters are not loaded: {name}\n"
                             f"Loaded adapters: {loaded}.")

    def acquire(self, name: str | None) -> None:
        if name is not None:
            self.users[name] += 1

    def release(self, name: str | None) -> None:
        if name is None:
            return
        self.users[name] -= 1
        if self.users[name] <= 0:
            del self.users[name]
            if name in self._idle:
                self._idle[name].set()

    def take(self, waiting: collections.deque, room: int, running: list) -> list:
        """Up to `room` requests from the head of `waiting` while their adapters fit: at most
        --max-loras-per-batch kinds of rows (the base is one) next to `running`. The first that
        does not fit stops the intake, as in SGLang, so it runs once the batch has drained
        rather than waiting behind later arrivals."""
        kinds = {r.item.lora for r in running}
        taken = []
        while waiting and len(taken) < room:
            lora = waiting[0].item.lora
            if lora not in kinds and len(kinds) >= self.per_batch:
                break
            kinds.add(lora)
            taken.append(waiting.popleft())
        return taken

    # ---- the model

    def forward(self, model, names: list[str | None], **kwargs):
        """One forward of `model` (the plain HF model) for rows of these adapters (None: base)."""
        if self.peft is None:
            return model(**kwargs)
        return self.peft(**kwargs, adapter_names=[BASE if n is None else self._peft_names[n] for n in names])

    def _attach(self, model, name: str, path: str):
        """Load one adapter into `model`, wrapping it when it is the first; returns the PeftModel."""
        from peft import PeftModel
        if name not in self._peft_names:
            self._serial += 1
            self._peft_names[name] = f"clawd_adapter_{self._serial}"
        name = self._peft_names[name]
        with warnings.catch_warnings():
            # PEFT 0.21 reads a property transformers 5 deprecated; the warning says nothing about this model.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            if self.peft is None or self.peft.get_base_model() is not model:
                peft = PeftModel.from_pretrained(model, path, adapter_name=name, is_trainable=False)
            else:
                peft = self.peft
                peft.load_adapter(path, adapter_name=name, is_trainable=False)
        return peft.eval()

    def rebase(self, model):
        """Put every present adapter on a freshly loaded base `model` (a weight update); raises on failure."""
        if not self.present:
            return model
        saved, self.peft = self.peft, None
        try:
            for name, path in self.present.items():
                self.peft = self._attach(model, name, path)
        except Exception:
            self.peft = saved  # the old model and its adapters keep serving
            raise
        return model

    # ---- control

    def answer(self, error: str | None = None) -> dict:
        return {"rid": None, "http_worker_ipc": None, "success": error is None, "error_message": error,
                "loaded_adapters": dict(self.registered) if self.enabled else None}

    async def load(self, model, name: str, path: str) -> dict:
        """Load the adapter at `path` as `name` (blocks the loop for the read; adapters are small)."""
        if not self.enabled:
            raise AdapterError(NOT_ENABLED)
        async with self._lock:
            if name in self.present:
                raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
            check_adapter_config(name, read_adapter_config(name, path), self.max_rank, self.targets)
            strict_weights(name, path, self.targets, self.strict)
            async with self.stepping:
                try:
                    self.peft = self._attach(model, name, path)
                except Exception as exc:  # a broken directory is the caller's 400; the served model is unchanged
                    log.warning("loading LoRA adapter %s from %s failed: %s", name, path, exc)
                    self._drop(name, model)
                    raise AdapterError(f"Failed to load LoRA adapter {name} from {path}: {exc}") from None
            self.registered[name] = self.present[name] = path
            log.info("LoRA adapter %s loaded from %s", name, path)
            return self.answer()

    async def unload(self, name: str) -> dict:
        """Stop new requests naming `name`, wait for those in flight on it, then free it."""
        if not self.enabled:
            raise AdapterError(NOT_ENABLED)
        async with self._lock:
            if name not in self.registered:
                loaded = collections.OrderedDict(self.registered).keys()
                raise AdapterError(f"LoRA with name {name} does not exist. Loaded LoRAs: {loaded}")
            del self.registered[name]
            # Shielded: a caller that hangs up must not leave the adapter unregistered but never freed.
            await asyncio.shield(asyncio.ensure_future(self._free_when_idle(name)))
            return self.answer()

    async def _free_when_idle(self, name: str) -> None:
        if self.users[name] > 0:
            log.info("LoRA adapter %s: waiting for %d request(s) on it to end", name, self.users[name])
            self._idle[name] = asyncio.Event()
            try:
                await self._idle[name].wait()
            finally:
                del self._idle[name]
        async with self.stepping:
            self._drop(name)
        log.info("LoRA adapter %s unloaded", name)

    def _drop(self, name: str, model=None) -> None:
        """Take adapter `name` out of the model (PEFT's calls); the last one out unwraps it. With
        `model`, a failed first load: strip whatever LoRA layers PEFT injected before failing."""
        self.present.pop(name, None)
        name = self._peft_names.pop(name, None)
        peft = self.peft
        if peft is None:
            if model is not None:
                _strip_lora_layers(model)
            return
        if name is not None and name in peft.peft_config:
            if not self.present:
                self.peft = None
                _forget_peft(peft.unload())  # removes the LoRA layers in place; the base weights are untouched
                return
            if name in peft.active_adapters:  # PEFT needs a live active adapter; requests never rely on it
                peft.set_adapter(self._peft_names[next(iter(self.present))])
            peft.delete_adapter(name)


def _strip_lora_layers(model) -> None:
    """Put every PEFT-wrapped layer's base layer back in its place."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    for path, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.get_base_layer())
    _forget_peft(model)


def _forget_peft(model) -> None:
    """PEFT leaves its config on a model it wrapped, and warns when it wraps that model again."""
    if "peft_config" in vars(model):
        del model.peft_config
