"""The policy-gradient trainer: one step per batch (docs/ARCHITECTURE.md §3, §6).

Runs in the trainer process only (it imports torch and transformers); `clawd.trainer.handler`
calls it with decoded `Sample`s. Plain Python in, plain Python out. Publishing and checkpoints
are `clawd.trainer.checkpoints`; the settings are `clawd.train_config.TrainConfig`.

Packing. Samples are sorted by length and grouped greedily into micro-batches whose padded size
(rows × longest input) stays within `micro_batch_tokens` and is at most a quarter padding; rows are right-padded and no attention
mask is passed. With right padding the causal mask alone keeps every real token from seeing a
pad (pads come after it), so a row's logits are those of the sample forwarded alone, up to
float rounding (matmul shapes differ: ~3e-7 on the tiny model's logits with sdpa on CPU). This
works with sdpa, eager and flash kernels alike, needs no 4-D mask (an [L, L] block-diagonal mask
costs memory quadratic in the whole pack) and, sorted by length, wastes little padding.
Logits are computed only at the response positions: the decoder's last hidden states are
gathered there and only those go through the output layer, so memory scales with response
tokens, not with prompt tokens × vocabulary. Even those never exist whole: `losses.head_logprobs`
runs the output layer and the log-softmax a chunk of positions at a time and recomputes a chunk's
logits in the backward (a [b, R, V] float32 tensor is 0.6 MB a position at Qwen's vocabulary).

One step (ppo_epochs = 1): per micro-batch, forward → log-probs at each sample's temperature →
advantages → `losses.total_loss_terms` with the whole batch's normaliser → backward; then the
non-finite checks (the loss, then the grad norm), clipping and one AdamW step. lp_old is lp_new
detached from the same forward; the OPD term reads log-probs at T = 1, computed without grad in the
same pass over the logits. With ppo_epochs > 1 a no-grad pass first fixes lp_old (and lp_old at
T = 1) for every epoch. Nothing in the micro-batch loop reads a value back from the device, so on
CUDA the host queues the next micro-batch while this one runs; the loss is read once per step.

Precision: float32 master weights and optimizer state everywhere (a bf16 base model is upcast
exactly); on CUDA the forward runs under bf16 autocast with SDPA attention (no mask, so its flash
kernel applies) and AdamW is fused, on CPU in float32. Published versions are cast to the served
dtype (`clawd.weights.model_dtype`). Dropout is off (eval mode): the policy being trained is the
one that sampled, and with ppo_epochs = 1 the ratio is exactly 1.

Failures. An exception inside a step (after its arguments were checked) is `StepFailed`, `fatal`: the
weights, gradients or optimizer state may be half updated, so the trainer process exits and is
restarted from its last checkpoint. A write (publish, checkpoint) is separate from the step: it
checks free space first (`min_free_bytes`, OSError ENOSPC when short), and a failed one changes
nothing and may be tried again alone. A checkpoint is refused while the weights of the last step are
unpublished: it records the version its weights were published as. The fault point
`trainer.step.after_optimizer` fires right after each optimizer step, before any write; `trainer.step.forward` before each micro-batch's forward.

Scale-out (docs/ARCHITECTURE.md §13): nothing here assumes more than this process's model. Under
torchrun + FSDP2 the same step runs on every rank (grad_norm would all-reduce), and publish/checkpoint
gather the full state and write from rank 0 only; the version is a directory name.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from clawd import faults
from clawd.train_config import TrainConfig
from clawd.samples import MODES, Sample
from clawd.trainer import checkpoints, losses, sharding
from clawd.trainer.sharding import World
from clawd.weights import check_free, model_dtype, remove_temporaries, version_dir

PAUSE_AFTER_SKIPS = 3  # non-finite steps in a row before learning pauses


class TrainingPaused(RuntimeError):
    """train_step while learning is paused after non-finite steps; `unpause()` lifts it."""


class StepFailed(RuntimeError):
    """The step raised after it began changing state: the model is in an unknown state, and the trainer
    process must be restarted from its last checkpoint."""
    fatal = True


# --- packing (pure) --------------------------------------------------------------------------

def pack(lengths: list[int], budget: int, max_padding: float = 0.25) -> list[list[int]]:
    """Group sample indices into micro-batches of similar length: sorted by length (ties by
    index), each group grown while rows × longest length stays within `budget` and padding stays
    within `max_padding` of that size (a long sample joining short ones pads every one of them:
    a skewed batch at a large budget was 57% padding without this bound). A sample longer than
    the budget goes alone. Deterministic: the same lengths always give the same groups."""
    groups: list[list[int]] = []
    real = 0  # tokens of the open group
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        n = lengths[i]
        padded = (len(groups[-1]) + 1) * n if groups else 0  # ascending: i is the longest
        if groups and padded <= budget and real + n >= (1 - max_padding) * padded:
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            real = n
    return groups


@dataclass
class _MicroBatch:
    """Right-padded tensors for a group of samples; per-token tensors are [b, R] over responses."""
    rows: list[int]               # indices into the step's sample list
    input_ids: torch.Tensor       # [b, L]: tokens[:-1], right-padded with 0
    positions: torch.Tensor       # [b, R]: where in the input the logits score each response token
    targets: torch.Tensor         # [b, R]: the response ids (0 on padding)
    mask: torch.Tensor            # [b, R]: loss_mask (0 on padding)
    temperature: torch.Tensor     # [b]
    reward: torch.Tensor          # [b]
    has_hint: torch.Tensor        # [b] bool
    lp_rollout: torch.Tensor      # [b, R]
    teacher_lp: torch.Tensor      # [b, R], 0 where there is no hint
    tokens: int                   # real input tokens (no padding)
    keep: torch.Tensor            # flat indices into [b, R] of the loss tokens (mask 1), built on the host
    needs_t1: bool                # a hinted row sampled at T != 1: the OPD term needs log-probs at T = 1
    old: tuple[torch.Tensor, torch.Tensor] | None = field(default=None)  # (lp_old, lp_old_t1) when ppo_epochs > 1


def _micro_batch(samples: list[Sample], rows: list[int], device: torch.device) -> _MicroBatch:
    group = [samples[i] for i in rows]
    L = max(len(s.tokens) - 1 for s in group)
    R = max(s.response_length for s in group)
    b = len(group)
    input_ids = torch.zeros(b, L, dtype=torch.long)
    positions = torch.zeros(b, R, dtype=torch.long)
    targets = torch.zeros(b, R, dtype=torch.long)
    mask = torch.zeros(b, R)
    lp_rollout = torch.zeros(b, R)
    teacher_lp = torch.zeros(b, R)
    for r, s in enumerate(group):
        n, p = s.response_length, len(s.tokens) - s.response_length
        input_ids[r, :len(s.tokens) - 1] = torch.tensor(s.tokens[:-1])
        positions[r, :n] = torch.arange(p - 1, p - 1 + n)  # logits at i score token i + 1
        positions[r, n:] = p - 1                           # padding: any valid position
        targets[r, :n] = torch.tensor(s.response_ids)
        mask[r, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        lp_rollout[r, :n] = torch.tensor(s.rollout_logprobs)
        if s.has_hint:
            teacher_lp[r, :n] = torch.tensor(s.teacher_logprobs)
    to = lambda x: x.to(device)
    return _MicroBatch(
        rows=rows, input_ids=to(input_ids), positions=to(positions), targets=to(targets), mask=to(mask),
        temperature=to(torch.tensor([s.temperature for s in group])),
        reward=to(torch.tensor([s.reward for s in group])),
        has_hint=to(torch.tensor([s.has_hint for s in group])),
        lp_rollout=to(lp_rollout), teacher_lp=to(teacher_lp),
        tokens=sum(len(s.tokens) - 1 for s in group),
        keep=to(mask.flatten().nonzero()[:, 0]),  # indexing by it later needs no device sync
        needs_t1=any(s.has_hint and s.temperature != 1 for s in group))


# --- the trainer -----------------------------------------------------------------------------

class _Scorer(torch.nn.Module):
    """The model's log-probs at the response positions, as one module call: the decoder's last hidden
    states there, then `losses.head_logprobs` over the output layer. One call, so that FSDP's root
    (this module, holding the embeddings, the final norm and the output layer) gathers its
    parameters before them and reduces their gradients after."""

    def __init__(self, model, autocast):
        super().__init__()
        self.model = model
        self.autocast = autocast

    def forward(self, input_ids, positions, targets, temperature, with_t1, chunk_tokens, compute_dtype):
        with self.autocast():
            hidden = self.model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
        hidden = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
        head = self.model.get_output_embeddings()
        return losses.head_logprobs(hidden, head.weight, targets, temperature, bias=head.bias, with_t1=with_t1,
                                    chunk_tokens=chunk_tokens, compute_dtype=compute_dtype)


class Trainer:
    """The policy, its optimizer and its state on disk.

    state_dir/weights/v{version:06d}   published Hugging Face directories, the last keep_versions
    state_dir/checkpoints/ckpt-{n:08d}  checkpoints, the last CHECKPOINTS_KEPT; the newest complete one resumes
    """

    def __init__(self, model_dir: str | Path, state_dir: str | Path, cfg: TrainConfig = TrainConfig(), *,
                 dtype: str = "auto", min_free_bytes: int = 0, world: World | None = None):
        """dtype: `[model] dtype`, the dtype versions are published in ("auto": the base model's);
        min_free_bytes: `[state] min_free_bytes`, what a write must leave free on the state directory;
        world: this rank's place in a trainer world of several ranks (`sharding.World`), None alone."""
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        if problems := cfg.check():
            raise ValueError("invalid trainer config: " + "; ".join(f"{k} {v}" for k, v in problems.items()))
        hf_logging.disable_progress_bar()  # stderr is the daemon's log
        self.cfg = cfg
        self.min_free_bytes = min_free_bytes
        self.model_dir = Path(model_dir)
        self.state_dir = Path(state_dir)
        self.weights_dir = self.state_dir / "weights"
        self.checkpoints_dir = self.state_dir / "checkpoints"
        self.world = world
        self.device = torch.device(cfg.device) if world is None else world.device
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {cfg.device!r} asked for, but CUDA is not available")
        self.publish_dtype = model_dtype(self.model_dir, dtype)
        cuda = self.device.type == "cuda"
        if cuda and cfg.memory_fraction > 0:  # before anything is allocated: an engine may share the GPU
            torch.cuda.set_per_process_memory_fraction(cfg.memory_fraction, self.device)

        def load() -> _Scorer:
            # sdpa named: with no attention mask it runs the causal flash kernel on CUDA.
            m = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()  # dropout off
            scorer = _Scorer(m, self._autocast)
            if world is None:
                return scorer.to(self.device)
            return sharding.shard(scorer, world)  # moves each rank's shards to its device

        self.scorer = load()
        self.model = self.scorer.model
        for attr in ("final_logit_softcapping", "logit_scale"):  # the head would not be the plain lm_head
            if getattr(self.model.config, attr, None) not in (None, 1, 1.0):
                raise NotImplementedError(f"models with {attr} are not supported by the trainer's logit path")
        self.ref_scorer = None
        if cfg.kl_loss_coef > 0:  # the frozen initial policy, only for the KL term
            self.ref_scorer = load().requires_grad_(False)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                           weight_decay=cfg.weight_decay, fused=True if cuda else None)
        # The logits' dtype (what autocast gives on CUDA) and positions per output-layer chunk.
        self.compute_dtype = torch.bfloat16 if cuda else None
        self.head_chunk_tokens = losses.head_chunk_tokens(self.model.get_output_embeddings().weight.shape[0])
        self.step = 0                  # batches trained (train_step calls), skipped ones included
        self.version = 0               # the newest version published: new ones must be above it
        self.weights_version = 0       # the version the current weights were published as; 0: model_dir
        self.unpublished = False       # a step changed the weights since: weights_version no longer says them
        self.checkpoint_step = 0       # the step of the newest checkpoint (0: none)
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.paused = False
        self.pause_reason: str | None = None
        self.journal_position: Any = None
        self._publishes_since_checkpoint = 0
        self.resume()

    # --- forward ------------------------------------------------------------------------------

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward(self, scorer: _Scorer, mb: _MicroBatch, temperature: float | torch.Tensor, with_t1: bool = False):
        """(log-probs at temperature, entropy, log-probs at T = 1 or None), each [b, R] (`_Scorer`)."""
        return scorer(mb.input_ids, mb.positions, mb.targets, temperature, with_t1, self.head_chunk_tokens,
                      self.compute_dtype)

    def _micro_batches(self, samples: list[Sample], share: bool = False) -> list[_MicroBatch]:
        """The batch packed into micro-batches; with `share`, in a world, this rank's share of it
        (`sharding.split_by_tokens`), with empty ones added so that every rank runs as many."""
        lengths = [len(s.tokens) - 1 for s in samples]
        if not share or self.world is None:
            return [_micro_batch(samples, rows, self.device) for rows in pack(lengths, self.cfg.micro_batch_tokens)]
        packs = [[[rows[i] for i in g] for g in pack([lengths[j] for j in rows], self.cfg.micro_batch_tokens)]
                 for rows in sharding.split_by_tokens(lengths, self.world.size)]
        mine = [_micro_batch(samples, rows, self.device) for rows in packs[self.world.rank]]
        pad = [sharding.empty_row()]
        return mine + [_micro_batch(pad, [0], self.device) for _ in range(max(map(len, packs)) - len(mine))]

    @torch.no_grad()
    def logprobs(self, samples: list[Sample], temperature: float | None = None) -> list[list[float]]:
        """Each sample's response-token log-probs under the current weights, through the packed
        path, at the sample's own temperature (or `temperature`)."""
        out: list[list[float]] = [[] for _ in samples]
        for mb in self._micro_batches(samples):
            t = mb.temperature if temperature is None else temperature
            lp = self._forward(self.scorer, mb, t)[0].float().cpu()
            for r, i in enumerate(mb.rows):
                out[i] = lp[r, :samples[i].response_length].tolist()
        return out

    @torch.no_grad()
    def _fix_old(self, mb: _MicroBatch) -> None:
        """ppo_epochs > 1: lp_old at T and at 1 from a no-grad pass before any update."""
        lp, _, lp_t1 = self._forward(self.scorer, mb, mb.temperature, with_t1=mb.needs_t1)
        mb.old = (lp, lp if lp_t1 is None else lp_t1)  # at T = 1 they are the same numbers

    # --- one step -----------------------------------------------------------------------------

    def train_step(self, samples: list[Sample], mode: str) -> dict[str, Any]:
        """Train on one batch: ppo_epochs optimizer steps (one by default). Returns metrics."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        if not samples:
            raise ValueError("train_step needs at least one sample")
        if self.paused:
            raise TrainingPaused(f"learning is paused: {self.pause_reason}")
        try:
            metrics = self._train_step(samples, mode)
        except Exception as exc:
            raise StepFailed(f"step {self.step + 1} failed: {type(exc).__name__}: {exc}") from exc
        if not metrics["skipped"]:
            self.unpublished = True
        return metrics

    def _train_step(self, samples: list[Sample], mode: str) -> dict[str, Any]:
        t0 = time.monotonic()
        cfg = self.cfg
        mbs = self._micro_batches(samples, share=True)
        loss_tokens = sum(sum(s.loss_mask) for s in samples)
        # The whole batch's denominator, fixed before splitting (losses.whole_batch_normaliser).
        norm = float(max(len(samples) if cfg.aggregation == "sample_mean" else loss_tokens, 1))
        baseline = losses.reward_baseline(s.reward for s in samples) if cfg.reward_baseline == "batch_mean" else 0.0
        if cfg.ppo_epochs > 1:
            for mb in mbs:
                self._fix_old(mb)
        for epoch in range(cfg.ppo_epochs):
            metrics = self._epoch(mbs, mode, norm, baseline)
            if metrics["skipped"]:
                break
        self.step += 1
        metrics.update(step=self.step, epochs=epoch + 1, samples=len(samples), reward_baseline=baseline,
                       **self._token_counts(mbs),
                       micro_batches=len(mbs), lr=cfg.lr, skipped_total=self.skipped_steps,
                       paused=self.paused, pause_reason=self.pause_reason,
                       seconds=time.monotonic() - t0)
        return metrics

    def _token_counts(self, mbs: list[_MicroBatch]) -> dict[str, int]:
        counts = (sum(mb.tokens for mb in mbs), sum(mb.input_ids.numel() for mb in mbs))
        if self.world is not None:  # every rank's forwards, the empty ones counted as padding
            counts = tuple(map(sum, zip(*self.world.gather(counts))))
        return {"forward_tokens": counts[0], "padded_tokens": counts[1]}

    def _epoch(self, mbs: list[_MicroBatch], mode: str, norm: float, baseline: float = 0.0) -> dict[str, Any]:
        """Forward and backward every micro-batch, then one optimizer step (or a skip)."""
        cfg = self.cfg
        kw = dict(eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, tis_cap=cfg.tis_cap)
        opd_clip = cfg.opd_clip or None  # 0 = off
        parts: dict[str, torch.Tensor] = {}
        seen: dict[str, list[torch.Tensor]] = {k: [] for k in ("new", "old", "rollout", "adv", "entropy")}
        for mb in mbs:
            faults.point("trainer.step.forward")  # mid-step: a rank dying here leaves the others in a collective
            # The OPD term compares at T = 1; only needed when some hinted row was sampled at T != 1.
            with_t1 = mb.old is None and mode != "rl" and mb.needs_t1
            lp_new, ent, lp_t1 = self._forward(self.scorer, mb, mb.temperature, with_t1=with_t1)
            if mb.old is not None:
                lp_old, lp_old_t1 = mb.old
            else:
                lp_old = lp_new.detach()
                lp_old_t1 = lp_old if lp_t1 is None else lp_t1
            reward = losses.centre_rewards(mb.reward, baseline) if baseline else mb.reward
            adv = losses.advantages(mode, reward, lp_old_t1, mb.teacher_lp, mb.has_hint,
                                    w_rl=cfg.w_rl, w_opd=cfg.w_opd, opd_clip=opd_clip)
            if not cfg.entropy_coef:
                ent = ent.detach()  # a metric only: no gradient through it
            lp_ref = None
            if self.ref_scorer is not None:
                with torch.no_grad():
                    lp_ref = self._forward(self.ref_scorer, mb, mb.temperature)[0]
            loss, mb_parts = losses.total_loss_terms(
                lp_new, lp_old, mb.lp_rollout, adv, mb.mask, aggregation=cfg.aggregation, normaliser=norm,
                lp_ref=lp_ref, kl_coef=cfg.kl_loss_coef, entropy=ent, entropy_coef=cfg.entropy_coef, **kw)
            for k, v in [*mb_parts.items(), ("loss", loss.detach())]:  # summed in float64, as floats were
                parts[k] = parts[k] + v.double() if k in parts else v.double()
            for k, x in zip(seen, (lp_new, lp_old, mb.lp_rollout, adv, ent)):
                seen[k].append(x.detach().flatten().index_select(0, mb.keep).float())
            # Backward even when this loss is not finite: checking first would wait for the device on
            # every micro-batch; a non-finite loss skips the step below, its gradients unused.
            loss.backward()

        summed = torch.stack(list(parts.values()))
        if self.world is not None:  # every rank's share of the whole batch's loss: their sum is the loss
            self.world.all_sum(summed)
        totals = dict(zip(parts, summed.tolist()))  # the step's one read-back
        bad = None if math.isfinite(totals["loss"]) else f"non-finite loss ({totals['loss']})"
        gn = math.nan
        if bad is None:
            gn = losses.grad_norm(self.params) if self.world is None else sharding.grad_norm(self.params, self.world)
            if not math.isfinite(gn):
                bad = f"non-finite gradient norm ({gn})"
        if bad is None:
            if cfg.grad_clip and gn > cfg.grad_clip:
                grads = [sharding.local(p.grad) for p in self.params if p.grad is not None]
                torch._foreach_mul_(grads, cfg.grad_clip / (gn + 1e-6))  # one launch, not one per tensor
            self.optimizer.step()
            faults.point("trainer.step.after_optimizer")
            self.consecutive_skips = 0
        else:  # the weights and the optimizer state stay exactly as they were
            self.skipped_steps += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= PAUSE_AFTER_SKIPS:
                self.paused = True
                self.pause_reason = f"{self.consecutive_skips} non-finite steps in a row (last: {bad})"
        self.optimizer.zero_grad(set_to_none=True)

        cat = {k: torch.cat(v) for k, v in seen.items()}
        if self.world is not None:  # the diagnostics are over the whole batch's loss tokens
            cat = {k: torch.cat(per_rank) for k, per_rank in zip(cat, zip(*self.world.gather(
                [cat[k].cpu() for k in cat])))}
        metrics = losses.loss_metrics(cat["new"], cat["old"], cat["rollout"], cat["adv"],
                                      torch.ones_like(cat["adv"]), entropy=cat["entropy"], **kw)
        names = {"loss": "loss", "policy_loss": "loss_policy", "kl": "loss_kl", "entropy": "loss_entropy"}
        metrics.update({names[k]: v for k, v in totals.items()})
        metrics.update(grad_norm=gn, skipped=bad is not None, skip_reason=bad)
        return metrics

    def unpause(self) -> None:
        """Lift a pause caused by non-finite steps (the operator's `resume`)."""
        self.paused, self.pause_reason, self.consecutive_skips = False, None, 0

    # --- publishing and checkpoints ---------------------------------------------------------

    def publish(self, version: int) -> Path:
        """Write the current weights as weights/v{version:06d}, a complete Hugging Face directory in
        publish_dtype, and keep the newest keep_versions. Versions must increase."""
        if not isinstance(version, int) or version <= self.version:
            raise ValueError(f"version {version!r} must be an integer above the last one, {self.version}")
        def room() -> None:
            self.weights_dir.mkdir(parents=True, exist_ok=True)
            check_free(self.weights_dir, checkpoints.publish_bytes(self.model, self.model_dir, self.publish_dtype),
                       self.min_free_bytes, f"v{version:06d}")

        self._on_writer(room)
        dest = checkpoints.publish_weights(self.model, self.model_dir, version_dir(self.state_dir, version),
                                           self.publish_dtype, world=self.world)
        self.version = self.weights_version = version
        self.unpublished = False
        self._publishes_since_checkpoint += 1
        spare = self._checkpointed_version
        self._on_writer(lambda: checkpoints.prune_versions(self.weights_dir, self.cfg.keep_versions, spare=spare))
        return dest

    def _on_writer(self, work):
        """`work` on the rank that writes (rank 0; the only one alone); its result or exception on every rank."""
        return work() if self.world is None else self.world.agree(work if self.world.writer else None)

    @property
    def checkpoint_due(self) -> bool:
        """True once checkpoint_every publishes have happened since the last checkpoint."""
        return self._publishes_since_checkpoint >= self.cfg.checkpoint_every

    def checkpoint(self, journal_position: Any = None) -> Path:
        """Save everything a resume needs into a new checkpoints/ckpt-N.

        journal_position is the caller's, opaque and JSON-serialisable: where the journal stood
        after the last step these weights contain."""
        if self.unpublished:
            raise RuntimeError(f"the weights of step {self.step} are not published yet: a checkpoint would "
                               f"say they are v{self.weights_version}")
        def room() -> None:
            self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
            check_free(self.checkpoints_dir, checkpoints.checkpoint_bytes(self.model, self.optimizer),
                       self.min_free_bytes, f"checkpoint of step {self.step}")

        self._on_writer(room)
        state = {"step": self.step, "version": self.weights_version, "newest_version": self.version,
                 "skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips,
                 "paused": self.paused, "pause_reason": self.pause_reason,
                 "journal_position": journal_position, "created": time.time(), "config": asdict(self.cfg)}
        dest = checkpoints.save_checkpoint(self.checkpoints_dir, self.model, self.optimizer, state, self.world)
        self.journal_position = journal_position
        self._publishes_since_checkpoint = 0
        self._checkpointed_version = self.weights_version
        self.checkpoint_step = self.step
        return dest

    def resume(self) -> Any:
        """Restore the newest complete checkpoint (model, optimizer, counters, RNG states) and
        return its journal position; without one, keep model_dir's weights (as loaded by the
        constructor, which calls this), seed from the config and return None. The version never
        goes below a directory already in weights/."""
        def find() -> Path | None:
            remove_temporaries(self.weights_dir)  # what crashed writes left behind
            remove_temporaries(self.checkpoints_dir)
            return checkpoints.latest_checkpoint(self.checkpoints_dir)

        path = self._on_writer(find)
        if path is None:
            checkpoints.seed_all(self.cfg.seed)
            self.step = self.skipped_steps = self.consecutive_skips = self.weights_version = newest = 0
            self.paused, self.pause_reason, self.journal_position = False, None, None
        else:
            state = checkpoints.load_checkpoint(path, self.model, self.optimizer, self.device, self.world,
                                                seed=self.cfg.seed)
            self.step = state["step"]
            self.skipped_steps = state["skipped_steps"]
            self.consecutive_skips = state["consecutive_skips"]
            self.paused, self.pause_reason = state["paused"], state["pause_reason"]
            self.journal_position = state["journal_position"]
            self.weights_version = state["version"]
            newest = state["newest_version"]
        # Versions published after that checkpoint may be live on an engine: never reuse them.
        published = self._on_writer(lambda: checkpoints.newest_published(self.weights_dir))
        self.version = max(self.weights_version, newest, published)
        self._checkpointed_version = self.weights_version
        self._publishes_since_checkpoint = 0
        self.checkpoint_step, self.unpublished = self.step, False
        return self.journal_position
