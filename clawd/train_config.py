"""The [train] section: the trainer's settings (docs/ARCHITECTURE.md §9).

Its own module because the trainer process reads it too, and `clawd.config`, the one schema,
stays one readable file. Loaded and checked as every other section is (`clawd.config`).
"""
from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass

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


def recompute_on(mode: str, device_type: str) -> bool:
    """`recompute`: "auto" is on where memory is short (CUDA) and off on CPU, where host memory is ample and
    compute is not."""
    return mode == "on" or (mode == "auto" and device_type == "cuda")

MAX_OPD_TOP_K = 64  # the engine returns k [log-prob, id, text] triples a token: beyond a few dozen, mostly noise


@dataclass(frozen=True)
class LossConfig:
    """What `clawd.trainer.losses.total_loss` reads: the train section's loss settings (`TrainConfig.loss`).
    Its defaults are the loss's neutral ones (no KL, no entropy bonus); the config's are TrainConfig's."""
    eps_clip: float = 0.2            # PPO's clip below 1
    eps_clip_high: float = 0.28      # and above it (clip-higher)
    tis_cap: float = 2.0             # truncated importance sampling's cap on π_old / π_rollout
    aggregation: str = "sample_mean"  # how token losses become the batch's (losses.aggregate)
    kl_coef: float = 0.0             # KL(policy ‖ reference) at T = 1; 0: off
    entropy_coef: float = 0.0        # the entropy bonus; 0: off


@dataclass(frozen=True)
class TrainConfig:
    """The trainer's settings. The daemon hands this object to the trainer process as is
    (clawd.trainer.options.trainer_options); the trainer refuses one whose check() finds problems."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0               # max gradient norm; 0 = off
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    tis_cap: float = 2.0
    aggregation: typing.Literal[AGGREGATIONS] = "token_sum"
    aggregation_tokens: int = 256        # token_sum's constant: a batch's loss is Σ tokens / (samples × this)
    kl_loss_coef: float = 0.0            # > 0: KL(policy ‖ reference) at T = 1 on the sampled tokens
    entropy_coef: float = 0.0
    w_rl: float = 1.0
    w_opd: float = 1.0
    opd_clip: float = 1.0                # 0 = off
    opd_top_k: int = 4                   # OPD over the policy's k most likely ids a position; 0: the sampled id only
    reward_baseline: typing.Literal["batch_mean", "none"] = "batch_mean"  # losses.centre_rewards
    ppo_epochs: int = 1
    ppo_mini_batches: int = 2            # optimizer steps per pass over the batch: from the second on, the ratio moves
    warmup_steps: int = 0                # the learning rate rises linearly over the first N steps; 0 = none
    micro_batch_tokens: int = 8192       # padded tokens (rows x longest input) per forward
    recompute: typing.Literal[RECOMPUTE] = "auto"  # decoder layers redone in the backward; auto: on CUDA only
    keep_versions: int = 3
    checkpoint_every: int = 10           # checkpoint every N publishes (12 bytes/parameter each)
    device: str = "cpu"                  # "cuda" when gpus is set and device is not written
    gpus: str = ""                       # the trainer process's CUDA_VISIBLE_DEVICES
    memory_fraction: float = 0.0         # share of each GPU the trainer may take; 0 = all of it
    gpu_memory_gib: float = 0.0          # one trainer GPU's memory, for the memory plan's check; 0 = unchecked
    seed: int = 0
    nproc_per_node: int = 0              # trainer ranks on this host; 0 = one per GPU of gpus, or 1
    nnodes: int = 1                      # hosts in the trainer world (the others run clawd-trainer@N)
    rdzv_endpoint: str = ""              # host:port of this host's rendezvous, reachable by the others
    collective_timeout: float = 600.0    # seconds a collective may wait for a rank before the world is torn down
    # LoRA (docs/ARCHITECTURE.md §15): adapters of this rank on the target modules; 0 = full fine-tune.
    lora_rank: int = 0
    lora_alpha: float = 32.0             # the adapter's output is scaled by lora_alpha / lora_rank
    lora_target_modules: tuple[str, ...] = LORA_TARGETS
    lora_lr: float = 1e-4                # LoRA's learning rate (lr is the full fine-tune's)

    @property
    def ranks_per_node(self) -> int:
        return self.nproc_per_node or max(len(devices.device_set(self.gpus)), 1)

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def loss(self) -> LossConfig:
        return LossConfig(eps_clip=self.eps_clip, eps_clip_high=self.eps_clip_high, tis_cap=self.tis_cap,
                          aggregation=self.aggregation, kl_coef=self.kl_loss_coef, entropy_coef=self.entropy_coef)

    @property
    def learning_rate(self) -> float:
        return self.lora_lr if self.lora else self.lr

    def lora_flags(self) -> tuple[str, ...]:
        """The engine flags that serve this trainer's adapters (SGLang's names; the CPU engine takes the same);
        () for a full fine-tune."""
        if not self.lora:
            return ()
        # Strict: an adapter whose weights miss the targets is refused, not served with those weights as zeros.
        return ("--enable-lora", "--max-lora-rank", str(self.lora_rank), "--lora-target-modules",
                *self.lora_target_modules, "--max-loras-per-batch", str(LORA_PER_BATCH), "--lora-strict-loading")

    @property
    def world_size(self) -> int:
        """Ranks in the trainer world; 1 is today's single process (no process group, no FSDP)."""
        return self.ranks_per_node * self.nnodes

    def check(self) -> dict[str, str]:
        errors = {}

        def number(name: str, ok=lambda x: True, want: str = "") -> None:  # TOML has inf and nan
            value = getattr(self, name)
            if not (is_number(value) and math.isfinite(value) and ok(value)):
                errors[name] = f"must be a finite number {want}".rstrip()

        number("lr", lambda x: x > 0, "above 0")
        number("eps", lambda x: x > 0, "above 0")
        number("weight_decay", lambda x: x >= 0, ">= 0")
        number("grad_clip", lambda x: x >= 0, ">= 0 (0 = off)")
        number("eps_clip", lambda x: 0 < x < 1, "in (0, 1)")
        number("eps_clip_high", lambda x: x > 0, "above 0")
        # The cap truncates exp(lp_old - lp_rollout); below 1 it would shrink on-policy tokens too.
        number("tis_cap", lambda x: x >= 1, ">= 1")
        number("kl_loss_coef", lambda x: x >= 0, ">= 0 (0 = off)")
        number("entropy_coef", lambda x: x >= 0, ">= 0 (0 = off)")
        number("w_rl")
        number("w_opd")
        number("opd_clip", lambda x: x >= 0, ">= 0 (0 = off)")
        betas = self.betas
        if not (isinstance(betas, tuple) and len(betas) == 2
                and all(is_number(b) and 0 <= b < 1 for b in betas)):
            errors["betas"] = "must be two numbers in [0, 1)"
        if self.aggregation not in AGGREGATIONS:
            errors["aggregation"] = f"must be one of {', '.join(map(repr, AGGREGATIONS))}"
        if self.recompute not in RECOMPUTE:
            errors["recompute"] = f"must be one of {', '.join(map(repr, RECOMPUTE))}"
        for name in ("ppo_epochs", "ppo_mini_batches", "micro_batch_tokens", "keep_versions", "checkpoint_every",
                     "aggregation_tokens"):
            if not (is_int(getattr(self, name)) and getattr(self, name) >= 1):
                errors[name] = "must be an integer, at least 1"
        if not (is_int(self.opd_top_k) and 0 <= self.opd_top_k <= MAX_OPD_TOP_K):
            errors["opd_top_k"] = f"must be an integer in 0..{MAX_OPD_TOP_K} (0 = the sampled token only)"
        if not (is_int(self.warmup_steps) and self.warmup_steps >= 0):
            errors["warmup_steps"] = "must be an integer, 0 (none) or more"
        if not (isinstance(self.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?", self.device)):
            errors["device"] = 'must be "cpu", "cuda" or "cuda:N"'
        elif self.gpus and self.device == "cpu":
            errors["device"] = 'must be "cuda" when gpus is set'
        if problem := devices.set_problem(self.gpus):
            errors["gpus"] = problem
        number("memory_fraction", lambda x: 0 <= x <= 1, "in [0, 1] (0 = the whole device)")
        number("gpu_memory_gib", lambda x: x >= 0, ">= 0 (0 = unchecked)")
        if not (is_int(self.seed) and 0 <= self.seed < 2**32):  # numpy's seed range
            errors["seed"] = "must be an integer in 0..2**32 - 1"
        errors |= self._world_problems()
        errors |= self._lora_problems()
        return errors

    def _lora_problems(self) -> dict[str, str]:
        errors = {}
        if not (is_int(self.lora_rank) and 0 <= self.lora_rank <= 1024):
            errors["lora_rank"] = "must be an integer in 0..1024 (0 = full fine-tune)"
        for name in ("lora_alpha", "lora_lr"):
            value = getattr(self, name)
            if not (is_number(value) and math.isfinite(value) and value > 0):
                errors[name] = "must be a finite number above 0"
        targets = self.lora_target_modules
        if not (isinstance(targets, tuple) and targets
                and all(isinstance(t, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", t) for t in targets)):
            errors["lora_target_modules"] = "must be a non-empty list of module names such as \"q_proj\""
        elif len(set(targets)) != len(targets):
            errors["lora_target_modules"] = "names a module twice"
        elif unknown := [t for t in targets if t not in SGLANG_LORA_TARGETS]:
            errors["lora_target_modules"] = (f"{', '.join(unknown)}: not a module SGLang serves adapters on "
                                             f"(it takes {', '.join(SGLANG_LORA_TARGETS)})")
        return errors

    def _world_problems(self) -> dict[str, str]:
        errors = {}
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
        if not (is_number(self.collective_timeout) and math.isfinite(self.collective_timeout)
                and self.collective_timeout > 0):
            errors["collective_timeout"] = "must be a positive number of seconds"
        return errors
