"""The [train] section: the trainer's settings, grouped as the trainer reads them (docs/ARCHITECTURE.md §9).

[train] holds the step's shape and the writes; [train.optimizer], [train.loss], [train.world] (where and on
how many ranks it runs) and [train.lora] hold the rest. The daemon hands the object to the trainer process
as is (clawd.trainer.options.trainer_options), and the trainer refuses one whose check() finds problems.
Files written before the groups existed put every key directly under [train]: `regroup` still reads them.
"""
from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass, field

from clawd import devices
from clawd.checks import is_int, is_number

AGGREGATIONS = ("sample_mean", "token_mean", "token_sum")  # how the loss averages a batch (losses.aggregate)
# Every attention and MLP projection of Llama/Qwen-style models: adapters on the MLP matter most.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# What SGLang 0.5.23 takes for --lora-target-modules (srt/utils/common.py SUPPORTED_LORA_TARGET_MODULES; argparse
# refuses any other name and the engine never starts). Its "all" is left out: the trainer needs the names.
SGLANG_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj",
                       "kv_b_proj", "wq_b", "wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                       "gate_up_proj", "embed_tokens", "lm_head", "qkvr", "wo_ud")
# SGLang's adapters per batch: the base (judge, teacher), the new adapter, and one or two older ones that
# requests started before a publish still use.
LORA_PER_BATCH = 4
RECOMPUTE = ("auto", "on", "off")
ADAPTERS = ("shared", "per_principal")
MAX_OPD_TOP_K = 64  # the engine returns k [log-prob, id, text] triples a token: beyond a few dozen, mostly noise


def recompute_on(mode: str, device_type: str) -> bool:
    """`recompute`: "auto" is on where memory is short (CUDA) and off on CPU, where host memory is ample and
    compute is not."""
    return mode == "on" or (mode == "auto" and device_type == "cuda")


def _finite(section, errors: dict, name: str, ok=lambda x: True, want: str = "") -> None:
    value = getattr(section, name)  # TOML has inf and nan
    if not (is_number(value) and math.isfinite(value) and ok(value)):
        errors[name] = f"must be a finite number {want}".rstrip()


def _counts(section, errors: dict, *names: str) -> None:
    for name in names:
        if not (is_int(getattr(section, name)) and getattr(section, name) >= 1):
            errors[name] = "must be an integer, at least 1"


@dataclass(frozen=True)
class OptimizerConfig:
    """[train.optimizer]: AdamW and its schedule (LoRA's learning rate is [train.lora] lr)."""
    lr: float = 1e-5                     # the full fine-tune's learning rate
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's moment decays, each in [0, 1)
    eps: float = 1e-8                    # AdamW's epsilon
    weight_decay: float = 0.0            # AdamW's decoupled weight decay
    grad_clip: float = 1.0               # max gradient norm; 0 = off
    warmup_steps: int = 0                # the learning rate rises linearly over the first N steps; 0 = none

    def check(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        _finite(self, errors, "lr", lambda x: x > 0, "above 0")
        _finite(self, errors, "eps", lambda x: x > 0, "above 0")
        _finite(self, errors, "weight_decay", lambda x: x >= 0, ">= 0")
        _finite(self, errors, "grad_clip", lambda x: x >= 0, ">= 0 (0 = off)")
        betas = self.betas
        if not (isinstance(betas, tuple) and len(betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in betas)):
            errors["betas"] = "must be two numbers in [0, 1)"
        if not (is_int(self.warmup_steps) and self.warmup_steps >= 0):
            errors["warmup_steps"] = "must be an integer, 0 (none) or more"
        return errors


@dataclass(frozen=True)
class LossConfig:
    """[train.loss]: what `clawd.trainer.worker.losses.total_loss` and the advantages read."""
    eps_clip: float = 0.2                # PPO's clip below 1: the ratio's range is [1 - eps_clip, 1 + eps_clip_high]
    eps_clip_high: float = 0.28          # and above it (clip-higher)
    tis_cap: float = 2.0                 # truncated importance sampling's cap on π_old / π_rollout, at least 1
    aggregation: typing.Literal[AGGREGATIONS] = "token_sum"  # how token losses become the batch's (losses.aggregate)
    aggregation_tokens: int = 256        # token_sum's constant: a batch's loss is Σ tokens / (samples × this)
    kl_coef: float = 0.0                 # > 0: KL(policy ‖ reference) at T = 1 on the sampled tokens; 0: off
    entropy_coef: float = 0.0            # the entropy bonus; 0: off
    w_rl: float = 1.0                    # combine: the reward's weight in the advantage
    w_opd: float = 1.0                   # combine and opd: the teacher term's weight
    opd_clip: float = 1.0                # the teacher term per token bounded to [-opd_clip, opd_clip]; 0 = off
    opd_top_k: int = 4                   # OPD over the policy's k most likely ids a position; 0: the sampled id only
    reward_baseline: typing.Literal["batch_mean", "none"] = "batch_mean"  # losses.centre_rewards

    def check(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        _finite(self, errors, "eps_clip", lambda x: 0 < x < 1, "in (0, 1)")
        _finite(self, errors, "eps_clip_high", lambda x: x > 0, "above 0")
        # The cap truncates exp(lp_old - lp_rollout); below 1 it would shrink on-policy tokens too.
        _finite(self, errors, "tis_cap", lambda x: x >= 1, ">= 1")
        _finite(self, errors, "kl_coef", lambda x: x >= 0, ">= 0 (0 = off)")
        _finite(self, errors, "entropy_coef", lambda x: x >= 0, ">= 0 (0 = off)")
        _finite(self, errors, "w_rl")
        _finite(self, errors, "w_opd")
        _finite(self, errors, "opd_clip", lambda x: x >= 0, ">= 0 (0 = off)")
        if self.aggregation not in AGGREGATIONS:
            errors["aggregation"] = f"must be one of {', '.join(map(repr, AGGREGATIONS))}"
        _counts(self, errors, "aggregation_tokens")
        if not (is_int(self.opd_top_k) and 0 <= self.opd_top_k <= MAX_OPD_TOP_K):
            errors["opd_top_k"] = f"must be an integer in 0..{MAX_OPD_TOP_K} (0 = the sampled token only)"
        return errors


@dataclass(frozen=True)
class WorldConfig:
    """[train.world]: where the trainer runs, on how many ranks and hosts (FSDP2 under torchrun above one)."""
    device: str = "cpu"                  # "cpu", "cuda" or "cuda:N"; "cuda" when gpus is set and device is not
    gpus: str = ""                       # the trainer process's CUDA_VISIBLE_DEVICES
    memory_fraction: float = 0.0         # share of each GPU the trainer may take; 0 = all of it
    gpu_memory_gib: float = 0.0          # one trainer GPU's memory, for the memory plan's check; 0 = unchecked
    nproc_per_node: int = 0              # trainer ranks on this host; 0 = one per GPU of gpus, or 1
    nnodes: int = 1                      # hosts in the trainer world (the others run clawd-trainer@N)
    rdzv_endpoint: str = ""              # host:port of this host's rendezvous, reachable by the others
    collective_timeout: float = 600.0    # seconds a collective may wait for a rank before the world is torn down

    @property
    def ranks_per_node(self) -> int:
        return self.nproc_per_node or max(len(devices.device_set(self.gpus)), 1)

    @property
    def size(self) -> int:
        """Ranks in the trainer world; 1 is a single process (no process group, no FSDP)."""
        return self.ranks_per_node * self.nnodes

    def check(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        if not (isinstance(self.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", self.device)):
            errors["device"] = 'must be "cpu", "cuda" or "cuda:N"'
        elif self.gpus and self.device == "cpu":
            errors["device"] = 'must be "cuda" when gpus is set'
        if problem := devices.set_problem(self.gpus):
            errors["gpus"] = problem
        _finite(self, errors, "memory_fraction", lambda x: 0 <= x <= 1, "in [0, 1] (0 = the whole device)")
        _finite(self, errors, "gpu_memory_gib", lambda x: x >= 0, ">= 0 (0 = unchecked)")
        gpus = len(devices.device_set(self.gpus))
        if not (is_int(self.nproc_per_node) and self.nproc_per_node >= 0):
            errors["nproc_per_node"] = "must be an integer, 0 (one per GPU of gpus) or more"
        elif gpus and self.nproc_per_node not in (0, gpus):
            errors["nproc_per_node"] = f"must be 0 or {gpus} with gpus set: one rank per GPU"
        if not (is_int(self.nnodes) and self.nnodes >= 1):
            errors["nnodes"] = "must be an integer, at least 1"
        elif self.nnodes > 1 and not re.fullmatch(r"[^\s:]+:\d{1,5}", self.rdzv_endpoint):
            errors["rdzv_endpoint"] = 'must be "host:port" (this host, as the others reach it) when nnodes > 1'
        elif self.rdzv_endpoint and not re.fullmatch(r"[^\s:]+:\d{1,5}", self.rdzv_endpoint):
            errors["rdzv_endpoint"] = 'must be "host:port" or "" (this host alone: torchrun --standalone)'
        _finite(self, errors, "collective_timeout", lambda x: x > 0, "above 0 (seconds)")
        return errors


@dataclass(frozen=True)
class LoraConfig:
    """[train.lora]: adapters of `rank` on the target modules instead of every weight (docs/ARCHITECTURE.md §15)."""
    rank: int = 0                        # 0 = a full fine-tune
    alpha: float = 32.0                  # the adapter's output is scaled by alpha / rank
    target_modules: tuple[str, ...] = LORA_TARGETS  # the modules that get an adapter (SGLang's names)
    lr: float = 1e-4                     # LoRA's learning rate, in place of [train.optimizer] lr

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def flags(self, principals: int = 0) -> tuple[str, ...]:
        """The engine flags that serve these adapters (SGLang's names; the CPU engine takes the same); () for a
        full fine-tune. `principals`: adapters of their own the engine serves besides, one more batch slot each."""
        if not self.enabled:
            return ()
        # Strict: an adapter whose weights miss the targets is refused, not served with those weights as zeros.
        return ("--enable-lora", "--max-lora-rank", str(self.rank), "--lora-target-modules", *self.target_modules,
                "--max-loras-per-batch", str(LORA_PER_BATCH + principals), "--lora-strict-loading")

    def shape(self) -> dict | None:
        """What a checkpoint's adapters must match to be loaded (None: a full fine-tune's)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.target_modules)} if self.enabled else None

    def check(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        if not (is_int(self.rank) and 0 <= self.rank <= 1024):
            errors["rank"] = "must be an integer in 0..1024 (0 = full fine-tune)"
        _finite(self, errors, "alpha", lambda x: x > 0, "above 0")
        _finite(self, errors, "lr", lambda x: x > 0, "above 0")
        targets = self.target_modules
        if not (isinstance(targets, tuple) and targets
                and all(isinstance(t, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", t) for t in targets)):
            errors["target_modules"] = "must be a non-empty list of module names such as \"q_proj\""
        elif len(set(targets)) != len(targets):
            errors["target_modules"] = "names a module twice"
        elif unknown := [t for t in targets if t not in SGLANG_LORA_TARGETS]:
            errors["target_modules"] = (f"{', '.join(unknown)}: not a module SGLang serves adapters on "
                                        f"(it takes {', '.join(SGLANG_LORA_TARGETS)})")
        return errors


@dataclass(frozen=True)
class TrainConfig:
    """[train]: the step's shape and the trainer's writes, and its four groups."""
    ppo_epochs: int = 1                  # optimizer passes over a batch
    ppo_mini_batches: int = 2            # optimizer steps per pass over the batch: from the second on, the ratio moves
    micro_batch_tokens: int = 8192       # padded tokens (rows x longest input) per forward
    recompute: typing.Literal[RECOMPUTE] = "auto"  # decoder layers redone in the backward; auto: on CUDA only
    keep_versions: int = 3               # published weight versions kept under state/weights/
    checkpoint_every: int = 10           # checkpoint every N publishes (12 bytes/parameter each)
    seed: int = 0                        # a fresh start's seed (a resume restores its checkpoint's random state)
    # LoRA: one adapter for everyone ("shared"), or besides it one per principal ("per_principal")
    adapters: typing.Literal[ADAPTERS] = "shared"
    adapter_min_samples: int = 64        # per_principal: a principal's samples before they get their own adapter
    max_adapters: int = 16               # per_principal: most principals with an adapter of their own
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # [train.optimizer]
    loss: LossConfig = field(default_factory=LossConfig)                 # [train.loss]
    world: WorldConfig = field(default_factory=WorldConfig)              # [train.world]
    lora: LoraConfig = field(default_factory=LoraConfig)                 # [train.lora]

    @property
    def per_principal(self) -> bool:
        return self.adapters == "per_principal" and self.lora.enabled

    def lora_flags(self) -> tuple[str, ...]:
        """The engine's LoRA flags (`LoraConfig.flags`), with a batch slot per principal's own adapter."""
        return self.lora.flags(self.max_adapters if self.per_principal else 0)

    @property
    def learning_rate(self) -> float:
        return self.lora.lr if self.lora.enabled else self.optimizer.lr

    def check(self) -> dict[str, str]:
        errors: dict[str, str] = {}
        _counts(self, errors, "ppo_epochs", "ppo_mini_batches", "micro_batch_tokens", "keep_versions",
                "checkpoint_every")
        if self.recompute not in RECOMPUTE:
            errors["recompute"] = f"must be one of {', '.join(map(repr, RECOMPUTE))}"
        if not (is_int(self.seed) and 0 <= self.seed < 2**32):  # numpy's seed range
            errors["seed"] = "must be an integer in 0..2**32 - 1"
        _counts(self, errors, "adapter_min_samples", "max_adapters")
        if self.adapters not in ADAPTERS:
            errors["adapters"] = f"must be one of {', '.join(map(repr, ADAPTERS))}"
        elif self.adapters == "per_principal" and not self.lora.enabled:
            errors["adapters"] = "\"per_principal\" trains LoRA adapters: set [train.lora] rank above 0"
        elif self.adapters == "per_principal" and self.world.size > 1:
            errors["adapters"] = "\"per_principal\" needs a trainer of one process ([train.world] size 1)"
        for group in ("optimizer", "loss", "world", "lora"):
            errors |= {f"{group}.{key}": problem for key, problem in getattr(self, group).check().items()}
        return errors


# Where each key of a [train] table written before the groups now lives: (group, key).
REGROUPED = {
    **{k: ("optimizer", k) for k in ("lr", "betas", "eps", "weight_decay", "grad_clip", "warmup_steps")},
    **{k: ("loss", k) for k in ("eps_clip", "eps_clip_high", "tis_cap", "aggregation", "aggregation_tokens",
                                "entropy_coef", "w_rl", "w_opd", "opd_clip", "opd_top_k", "reward_baseline")},
    "kl_loss_coef": ("loss", "kl_coef"),
    **{k: ("world", k) for k in ("device", "gpus", "memory_fraction", "gpu_memory_gib", "nproc_per_node", "nnodes",
                                 "rdzv_endpoint", "collective_timeout")},
    "lora_rank": ("lora", "rank"), "lora_alpha": ("lora", "alpha"), "lora_target_modules": ("lora", "target_modules"),
    "lora_lr": ("lora", "lr"),
}


def regroup(table: dict) -> tuple[dict, list[tuple[str, str]], list[str]]:
    """A [train] table with its old flat keys moved into their groups: (table, [(old, new)] moved, [old] given
    both ways). Pure: the loader says what moved and refuses a key given twice."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in table.items() if k not in REGROUPED}
    moved, twice = [], []
    for old, value in table.items():
        if old not in REGROUPED:
            continue
        group, key = REGROUPED[old]
        target = out.setdefault(group, {})
        if not isinstance(target, dict):
            continue  # "[train] optimizer = 3": the loader says it must be a table
        if key in target:
            twice.append(old)
        target[key] = value
        moved.append((old, f"{group}.{key}"))
    return out, moved, twice


def overlay(table: dict, keys: dict) -> dict:
    """The [train] table `table` with `keys` written over it (a tool's `--train KEY=VALUE`s), grouped. Either may
    name a key flat as files before the groups did (lr), dotted (optimizer.lr) or in its group's table."""
    def grouped(raw: dict) -> dict:
        nested: dict = {}
        for key, value in raw.items():
            group, dot, name = key.partition(".")
            if dot:
                nested.setdefault(group, {})[name] = value
            else:
                nested[key] = value
        return regroup(nested)[0]

    out = grouped(table)
    for key, value in grouped(keys).items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
