"""The policy-gradient trainer: one step per batch (docs/ARCHITECTURE.md §3, §6).

Runs in the trainer process only; `clawd.trainer.worker.handler` calls it with decoded `Sample`s, plain Python in and
out. Packing is `clawd.trainer.worker.batches`, writes `clawd.trainer.worker.checkpoints`, settings `TrainConfig`.

One step (ppo_epochs = 1): per micro-batch, forward → log-probs at each sample's temperature →
advantages → `losses.total_loss_terms` with the whole batch's normaliser → backward; then the
non-finite checks (the loss, then the grad norm), clipping and one AdamW step. lp_old is lp_new
detached from the same forward; the OPD term reads T = 1 log-probs computed without grad in the same
pass; the KL term (against the reference's T = 1 log-probs) and top-K OPD read T = 1 log-probs at chosen
ids with grad (`head.head_logprobs_at`). With several updates a no-grad pass first fixes the old values.
Nothing in the micro-batch loop reads a value back from the device; the loss is read once per update.

Precision: float32 master weights and optimizer state (a bf16 base is upcast exactly); on CUDA bf16
autocast with SDPA attention (no mask: its flash kernel applies) and fused AdamW. Versions are published in
the served dtype (`clawd.weights.model_dtype`). Dropout is off: the policy trained is the one that sampled.

Failures. An exception inside a step (after its arguments were checked) is `StepFailed`, `fatal`: the
weights, gradients or optimizer state may be half updated, so the trainer process exits and is
restarted from its last checkpoint; running out of memory is `OutOfMemory` (not fatal when alone and
before any update of the batch). A write (publish, checkpoint) is separate from the step: it
checks free space first (`min_free_bytes`, OSError ENOSPC when short), and a failed one changes
nothing and may be tried again alone. A checkpoint is refused while the weights of the last step are
unpublished: it records the version its weights were published as. Fault points:
`trainer.step.after_optimizer` right after each optimizer step, `trainer.step.forward` before each forward.

Scale-out (docs/ARCHITECTURE.md §13): under torchrun + FSDP2 the same step runs on every rank (the grad
norm and the loss parts are summed over them), and publish/checkpoint gather the full state and write
from rank 0 only; the version is a directory name.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from clawd import faults
from clawd.config.train import TrainConfig
from clawd.samples import MODES, Sample
from clawd.trainer.worker import adapters, checkpoints, head, losses, publishing, sharded_load, sharding
from clawd.trainer.worker.batches import MicroBatch, mini_batches
from clawd.trainer.worker.failures import OutOfMemory, StepFailed, TrainingPaused, out_of_memory
from clawd.trainer.worker.sharding import World
from clawd.weights import check_free, model_dtype, remove_temporaries, version_dir

log = logging.getLogger("clawd.trainer")

PAUSE_AFTER_SKIPS = 3  # non-finite steps in a row before learning pauses


class Trainer:
    """The policy, its optimizer and its state on disk.

    state_dir/weights/v{version:06d}   published Hugging Face directories, the last keep_versions
    state_dir/checkpoints/ckpt-{n:08d}  checkpoints, the last keep_checkpoints; the newest complete one resumes
    """

    def __init__(self, model_dir: str | Path, state_dir: str | Path, cfg: TrainConfig = TrainConfig(), *,
                 dtype: str = "auto", min_free_bytes: int = 0, world: World | None = None,
                 keep_checkpoints: int = checkpoints.CHECKPOINTS_KEPT, beside: Trainer | None = None,
                 adapter: str | None = None):
        """dtype: `[model] dtype`, the dtype versions are published in ("auto": the base model's);
        min_free_bytes: `[state] min_free_bytes`, what a write must leave free on the state directory;
        world: this rank's place in a trainer world of several ranks (`sharding.World`), None alone;
        keep_checkpoints: complete checkpoints kept (the rollback targets among them).
        beside, adapter (LoRA, one process): the adapter `adapter` on `beside`'s model, with its own optimizer,
        counters and state_dir (clawd.trainer.worker.lineages); a new one starts as `beside`'s adapter is now."""
        from transformers.utils import logging as hf_logging

        if problems := cfg.check():
            raise ValueError("invalid trainer config: " + "; ".join(f"{k} {v}" for k, v in problems.items()))
        hf_logging.disable_progress_bar()  # stderr is the daemon's log
        self.cfg = cfg
        self.min_free_bytes = min_free_bytes
        self.keep_checkpoints = max(keep_checkpoints, checkpoints.CHECKPOINTS_KEPT)
        self.model_dir = Path(model_dir)
        self.state_dir = Path(state_dir)
        self.weights_dir = self.state_dir / "weights"
        self.checkpoints_dir = self.state_dir / "checkpoints"
        self.world = world
        self.device = torch.device(cfg.world.device) if world is None else world.device
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {cfg.world.device!r} asked for, but CUDA is not available")
        self.publish_dtype = model_dtype(self.model_dir, dtype)
        cuda = self.device.type == "cuda"
        if cuda and cfg.world.memory_fraction > 0:  # before anything is allocated: an engine may share the GPU
            torch.cuda.set_per_process_memory_fraction(cfg.world.memory_fraction, self.device)

        self.scorer = (sharded_load.load(self.model_dir, cfg, self.device, world, self._autocast) if beside is None
                       else adapters.beside(beside.scorer, adapter, beside.adapter, cfg.lora.enabled, world))
        self.adapter = adapter or adapters.DEFAULT  # its adapter (LoRA); made active before every use of the model
        self.model = self.scorer.model
        self.activate()
        for attr in ("final_logit_softcapping", "logit_scale"):  # the head would not be the plain lm_head
            if getattr(self.model.config, attr, None) not in (None, 1, 1.0):
                raise NotImplementedError(f"models with {attr} are not supported by the trainer's logit path")
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        adam = cfg.optimizer
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, betas=adam.betas, eps=adam.eps,
                                           weight_decay=adam.weight_decay, fused=True if cuda else None)
        # The logits' dtype (what autocast gives on CUDA) and positions per output-layer chunk.
        self.compute_dtype = torch.bfloat16 if cuda else None
        self.head_chunk_tokens = head.head_chunk_tokens(self.model.get_output_embeddings().weight.shape[0])
        self.step = 0                  # batches trained (train_step calls), skipped ones included
        self.version = 0               # the newest version published: new ones must be above it
        self.weights_version = 0       # the version the current weights were published as; 0: model_dir
        self.unpublished = False       # a step changed the weights since: weights_version no longer says them
        self.checkpoint_step = 0       # the step of the newest checkpoint (0: none)
        self.skipped_steps = 0
        self.updates = 0               # optimizer steps taken by this process (an OOM before any is harmless)
        self.consecutive_skips = 0
        self.paused = False
        self.pause_reason: str | None = None
        self.journal_position: Any = None
        self._publishes_since_checkpoint = 0
        self.writing: publishing.DeferredWrite | None = None  # a version's directory still being written (`publish`)
        self.resume()

    def activate(self) -> None:
        """This trainer's adapter is the one the model runs and trains, when the model holds several."""
        if len(getattr(self.model, "peft_config", ())) > 1 and self.model.active_adapter != self.adapter:
            self.model.set_adapter(self.adapter)

    # --- forward ------------------------------------------------------------------------------

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _forward(self, scorer: head.ResponseScorer, mb: MicroBatch, temperature: float | torch.Tensor,
                 with_t1: bool = False, at_ids: torch.Tensor | None = None):
        """(log-probs at temperature, entropy, log-probs at T = 1 or None), each [b, R], and the T = 1 log-probs
        at `at_ids` [b, R, K] with gradients, or None (`head.ResponseScorer`)."""
        return scorer(mb.input_ids, mb.positions, mb.targets, temperature, with_t1, self.head_chunk_tokens,
                      self.compute_dtype, at_ids)

    def _at_ids(self, mb: MicroBatch, mode: str) -> torch.Tensor | None:
        """The ids an update needs T = 1 log-probs at, with gradients: the sampled ids first (the KL term's: the
        reference's log-probs are at T = 1), then the policy's top-k at rollout (top-K OPD's)."""
        cols = [mb.targets[..., None]] if self.cfg.loss.kl_coef > 0 else []
        if self._top_k(mode) and mb.top_ids is not None:
            cols.append(mb.top_ids)
        return torch.cat(cols, -1) if cols else None

    def _micro_batches(self, samples: list[Sample], share: bool = False) -> list[MicroBatch]:
        """The batch packed into micro-batches; with `share`, in a world, this rank's share (`sharding.packed`)."""
        return sharding.packed(samples, self.cfg.micro_batch_tokens, self.device, self.world if share else None)

    @torch.no_grad()
    def _reference_forward(self, mb: MicroBatch, temperature) -> torch.Tensor:
        """Log-probs under the frozen reference, in LoRA mode: the base with the adapters off. A full fine-tune
        keeps no copy of the initial weights: its samples carry the reference engine's (`Sample.reference_logprobs`)."""
        if not self.cfg.lora.enabled:
            raise RuntimeError("a full fine-tune holds no reference model: the reference's log-probs come with "
                               "the samples (reference_logprobs)")
        with adapters.disabled(self.model):
            return self._forward(self.scorer, mb, temperature)[0]

    def _reference(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The KL term's reference log-probs at T = 1 and the rows that have them: the base's (LoRA), or the ones
        journaled with the samples, which a sample scored without them lacks."""
        if self.cfg.lora.enabled:
            return self._reference_forward(mb, 1.0), torch.ones_like(mb.has_ref)
        return mb.ref_lp, mb.has_ref

    @torch.no_grad()
    def logprobs(self, samples: list[Sample], temperature: float | None = None,
                 reference: bool = False) -> list[list[float]]:
        """Each sample's response-token log-probs under the current weights (or the reference's), through
        the packed path, at the sample's own temperature (or `temperature`)."""
        self.activate()
        out: list[list[float]] = [[] for _ in samples]
        for mb in self._micro_batches(samples):
            t = mb.temperature if temperature is None else temperature
            lp = (self._reference_forward(mb, t) if reference else self._forward(self.scorer, mb, t)[0]).float().cpu()
            for r, i in enumerate(mb.rows):
                out[i] = lp[r, :samples[i].response_length].tolist()
        return out

    @torch.no_grad()
    def _fix_old(self, mb: MicroBatch, mode: str) -> None:
        """Several updates per step (ppo_epochs or ppo_mini_batches > 1): lp_old at T, at 1 and at the `at` ids
        from a no-grad pass before any update."""
        lp, _, lp_t1, at = self._forward(self.scorer, mb, mb.temperature, with_t1=mb.needs_t1,
                                         at_ids=self._at_ids(mb, mode))
        mb.old = (lp, lp if lp_t1 is None else lp_t1, at)  # at T = 1 the first two are the same numbers

    # --- one step -----------------------------------------------------------------------------

    def train_step(self, samples: list[Sample], mode: str) -> dict[str, Any]:
        """Train on one batch: ppo_epochs optimizer steps (one by default). Returns metrics."""
        self.activate()
        if mode not in MODES:
            raise ValueError(f"mode {mode!r} is not one of {MODES}")
        if not samples:
            raise ValueError("train_step needs at least one sample")
        if self.paused:
            raise TrainingPaused(f"learning is paused: {self.pause_reason}")
        updates_before = self.updates
        try:
            metrics = self._train_step(samples, mode)
        except Exception as exc:
            if out_of_memory(exc):
                self.optimizer.zero_grad(set_to_none=True)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                tokens = sum(len(s.tokens) for s in samples)
                raise OutOfMemory(f"step {self.step + 1} ran out of memory on {len(samples)} sample(s) of {tokens} "
                                  f"tokens: {type(exc).__name__}: {exc}",
                                  fatal=self.world is not None or self.updates != updates_before) from exc
            raise StepFailed(f"step {self.step + 1} failed: {type(exc).__name__}: {exc}") from exc
        if not metrics["skipped"]:
            self.unpublished = True
        return metrics

    def _train_step(self, samples: list[Sample], mode: str) -> dict[str, Any]:
        t0 = time.monotonic()
        cfg = self.cfg
        centred = cfg.loss.reward_baseline == "batch_mean"
        baseline = losses.reward_baseline(s.reward for s in samples if s.advantage is None) if centred else 0.0
        # The batch's mini-batches, one optimizer step each (the reward baseline is the whole batch's). One
        # whose every advantage is 0 takes no step: AdamW's momentum would still move every weight by ~lr.
        updates = []
        for rows in mini_batches(len(samples), cfg.ppo_mini_batches):
            group = [samples[i] for i in rows]
            if losses.carries_signal(mode, [losses.centred(s.reward, baseline, s.advantage) for s in group],
                                     [s.has_hint for s in group], w_rl=cfg.loss.w_rl, w_opd=cfg.loss.w_opd,
                                     kl_coef=cfg.loss.kl_coef, entropy_coef=cfg.loss.entropy_coef):
                norm = losses.batch_normaliser(len(group), sum(sum(s.loss_mask) for s in group), cfg.loss.aggregation,
                                               cfg.loss.aggregation_tokens)  # fixed before splitting
                updates.append((self._micro_batches(group, share=True), norm))
        lr = losses.warmup_lr(cfg.learning_rate, self.step + 1, cfg.optimizer.warmup_steps)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        if len(updates) * cfg.ppo_epochs > 1:  # later updates see moved weights: lp_old is fixed before the first
            for mbs, _ in updates:
                for mb in mbs:
                    self._fix_old(mb, mode)
        done: list[dict[str, Any]] = []
        for epoch in range(cfg.ppo_epochs):
            for mbs, norm in updates:
                done.append(self._update(mbs, mode, norm, baseline))
                if done[-1]["skip_reason"]:
                    break
            if done and done[-1]["skip_reason"]:
                break
        self.step += 1
        metrics = self._step_metrics(done, mode)
        metrics.update(step=self.step, epochs=epoch + 1 if done else 0, samples=len(samples),
                       reward_baseline=baseline, mini_batches=min(cfg.ppo_mini_batches, len(samples)),
                       response_tokens_mean=sum(s.response_length for s in samples) / len(samples),
                       **self._token_counts([mb for mbs, _ in updates for mb in mbs]),
                       micro_batches=sum(len(mbs) for mbs, _ in updates), lr=lr, skipped_total=self.skipped_steps,
                       paused=self.paused, pause_reason=self.pause_reason, seconds=time.monotonic() - t0)
        return metrics

    def _step_metrics(self, done: list[dict[str, Any]], mode: str) -> dict[str, Any]:
        """The step's metrics from its updates: the diagnostics over every update's loss tokens, the loss
        parts and the gradient norm averaged over the updates. No update: a step without signal."""
        applied = [d for d in done if not d["skip_reason"]]
        bad = next((d["skip_reason"] for d in done if d["skip_reason"]), None)
        if bad is not None:  # the weights stay as the last applied update left them
            self.skipped_steps += 1
            self.consecutive_skips += 1
            if self.consecutive_skips >= PAUSE_AFTER_SKIPS:
                self.paused = True
                self.pause_reason = f"{self.consecutive_skips} non-finite steps in a row (last: {bad})"
        elif applied:
            self.consecutive_skips = 0
        if not done:
            return {"skipped": True, "no_signal": True, "updates": 0,
                    "skip_reason": f"no signal: every advantage in the batch is 0 ({mode})",
                    "grad_norm": math.nan}
        metrics = losses.update_diagnostics(done, self.cfg.loss)
        norms = [d["grad_norm"] for d in done]
        metrics.update(grad_norm=math.fsum(norms) / len(norms), updates=len(applied), no_signal=False,
                       skipped=not applied, skip_reason=bad)
        return metrics

    def _token_counts(self, mbs: list[MicroBatch]) -> dict[str, int]:
        counts = (sum(mb.tokens for mb in mbs), sum(mb.input_ids.numel() for mb in mbs))
        if self.world is not None:  # every rank's forwards, the empty ones counted as padding
            counts = tuple(map(sum, zip(*self.world.gather(counts))))
        return {"forward_tokens": counts[0], "padded_tokens": counts[1]}

    def _update(self, mbs: list[MicroBatch], mode: str, norm: float, baseline: float = 0.0) -> dict[str, Any]:
        """Forward and backward every micro-batch of one mini-batch, then one optimizer step, or none when
        the loss or the gradient is not finite ("skip_reason" says which). Its loss parts, gradient norm
        and per-token values for the step's metrics."""
        cfg = self.cfg
        opd_clip = cfg.loss.opd_clip or None  # 0 = off
        # The same parts in every update and on every rank, whatever rows a micro-batch holds: the ranks sum them
        # as one tensor, and the step averages them over its updates.
        parts = {k: torch.zeros((), dtype=torch.float64, device=self.device) for k in self._part_names(mode)}
        seen: dict[str, list[torch.Tensor]] = {k: [] for k in ("new", "old", "rollout", "adv", "entropy")}
        for mb in mbs:
            faults.point("trainer.step.forward")  # mid-step: a rank dying here leaves the others in a collective
            # The OPD term compares at T = 1; only needed when some hinted row was sampled at T != 1.
            with_t1 = mb.old is None and mode != "rl" and mb.needs_t1
            at_ids = self._at_ids(mb, mode)
            lp_new, ent, lp_t1, lp_at = self._forward(self.scorer, mb, mb.temperature, with_t1=with_t1, at_ids=at_ids)
            if mb.old is not None:
                lp_old, lp_old_t1, lp_old_at = mb.old
            else:
                lp_old = lp_new.detach()
                lp_old_t1 = lp_old if lp_t1 is None else lp_t1
                lp_old_at = None if lp_at is None else lp_at.detach()
            reward = losses.centre_rewards(mb.reward, baseline, mb.preset) if baseline else mb.reward
            kl_lp = lp_ref = kl_rows = topk = None
            if cfg.loss.kl_coef > 0:  # the sampled ids' column of the `at` log-probs
                kl_lp, (lp_ref, kl_rows) = lp_at[..., 0], self._reference(mb)
            if self._top_k(mode) and mb.top_ids is not None:  # the top-k columns; their rows leave the token-level term
                first = 1 if cfg.loss.kl_coef > 0 else 0
                topk = losses.TopK(lp_at[..., first:], lp_old_at[..., first:], mb.teacher_top, mb.has_top,
                                   weight=cfg.loss.w_opd, clip=opd_clip)
            token_hint = mb.has_hint if topk is None else mb.has_hint & ~mb.has_top
            adv = losses.advantages(mode, reward, lp_old_t1, mb.teacher_lp, token_hint,
                                    w_rl=cfg.loss.w_rl, w_opd=cfg.loss.w_opd, opd_clip=opd_clip)
            if not cfg.loss.entropy_coef:
                ent = ent.detach()  # a metric only: no gradient through it
            loss, mb_parts = losses.total_loss_terms(lp_new, lp_old, mb.lp_rollout, adv, mb.mask, cfg.loss,
                                                     normaliser=norm, lp_ref=lp_ref, kl_lp=kl_lp, kl_rows=kl_rows,
                                                     entropy=ent, topk=topk)
            for k, v in [*mb_parts.items(), ("loss", loss.detach())]:  # summed in float64, as floats were
                parts[k] = parts[k] + v.double()
            for k, x in zip(seen, (lp_new, lp_old, mb.lp_rollout, adv, ent)):
                seen[k].append(x.detach().flatten().index_select(0, mb.keep).float())
            # Backward even when this loss is not finite: checking first would wait for the device on
            # every micro-batch; a non-finite loss skips the step below, its gradients unused.
            loss.backward()

        summed = torch.stack(list(parts.values()))
        if self.world is not None:  # every rank's share of the whole batch's loss: their sum is the loss
            self.world.all_sum(summed)
        totals = dict(zip(parts, summed.tolist()))  # the update's one read-back
        bad = None if math.isfinite(totals["loss"]) else f"non-finite loss ({totals['loss']})"
        gn = math.nan
        if bad is None:
            gn = losses.grad_norm(self.params) if self.world is None else sharding.grad_norm(self.params, self.world)
            if not math.isfinite(gn):
                bad = f"non-finite gradient norm ({gn})"
        if bad is None:
            if cfg.optimizer.grad_clip and gn > cfg.optimizer.grad_clip:
                grads = [sharding.local(p.grad) for p in self.params if p.grad is not None]
                torch._foreach_mul_(grads, cfg.optimizer.grad_clip / (gn + 1e-6))  # one launch, not one per tensor
            self.optimizer.step()
            self.updates += 1
            faults.point("trainer.step.after_optimizer")
        self.optimizer.zero_grad(set_to_none=True)  # a skipped update leaves weights and optimizer state as they were

        cat = {k: torch.cat(v) for k, v in seen.items()}
        if self.world is not None:  # the diagnostics are over the whole batch's loss tokens
            cat = {k: torch.cat(per_rank) for k, per_rank in zip(cat, zip(*self.world.gather(
                [cat[k].cpu() for k in cat])))}
        return {"totals": totals, "seen": cat, "grad_norm": gn, "skip_reason": bad}

    def _top_k(self, mode: str) -> bool:
        """Top-K distillation is on: samples with top-k rows take it (opd_top_k = 0: every hint is token-level)."""
        return mode != "rl" and self.cfg.loss.opd_top_k > 0

    def _part_names(self, mode: str) -> list[str]:
        loss = self.cfg.loss
        on = {"opd_topk": self._top_k(mode), "kl": loss.kl_coef > 0, "entropy": loss.entropy_coef > 0}
        return ["policy_loss", *(k for k, v in on.items() if v), "loss"]

    def unpause(self) -> None:
        """Lift a pause caused by non-finite steps (the operator's `resume`)."""
        self.paused, self.pause_reason, self.consecutive_skips = False, None, 0

    # --- publishing and checkpoints ---------------------------------------------------------

    def publish(self, version: int, *, deferred: bool = False) -> Path:
        """Write the current weights as weights/v{version:06d} in publish_dtype (`clawd.trainer.worker.publishing`) and
        keep the newest keep_versions. Versions must increase. `deferred` (full weights): the weights are copied
        to the host now and written on a thread; they are `version` at once (a group may push them), and
        `settle` waits for the directory."""
        self.activate()
        if not isinstance(version, int) or version <= self.version:
            raise ValueError(f"version {version!r} must be an integer above the last one, {self.version}")
        self.settle()  # one write at a time, and pruning in order
        dest, lora, spare = version_dir(self.state_dir, version), self.cfg.lora.enabled, self._checkpointed_version
        self._on_writer(lambda: publishing.check_room(self.model, self.model_dir, dest, self.publish_dtype, lora,
                                                      self.min_free_bytes))
        def prune() -> None:
            checkpoints.prune_versions(self.weights_dir, self.cfg.keep_versions, spare)

        dest, self.writing = publishing.write_version(self.model, self.model_dir, version, dest, self.publish_dtype,
                                                      lora=lora, world=self.world, deferred=deferred, then=prune,
                                                      adapter=self.adapter)
        if self.writing is None:  # written now: pruned now (a deferred write prunes on its thread, after it)
            self._on_writer(prune)
        self.version = self.weights_version = version
        self.unpublished = False
        self._publishes_since_checkpoint += 1
        return dest

    def settle(self, abandon: bool = False) -> None:
        """A deferred write finished: waited for, written again once when it had failed (OSError when that
        fails too: it stays pending, its host copy kept; `abandon`: dropped instead). Every rank gets rank 0's
        outcome."""
        if self.writing is not None:
            try:
                self._on_writer(self.writing.result)
            except OSError as exc:
                if not abandon:
                    raise
                log.warning("v%d's directory is abandoned: %s", self.writing.version, exc)
            self.writing = None

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
        self.activate()
        if self.unpublished:
            raise RuntimeError(f"the weights of step {self.step} are not published yet: a checkpoint would "
                               f"say they are v{self.weights_version}")
        self.settle()  # a checkpoint says its version's directory is there
        lora = self.cfg.lora.enabled

        def room() -> None:
            self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
            check_free(self.checkpoints_dir, checkpoints.checkpoint_bytes(self.model, self.optimizer, lora),
                       self.min_free_bytes, f"checkpoint of step {self.step}")

        self._on_writer(room)
        state = {"step": self.step, "version": self.weights_version, "newest_version": self.version,
                 "skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips,
                 "paused": self.paused, "pause_reason": self.pause_reason,
                 "journal_position": journal_position, "created": time.time(), "config": asdict(self.cfg),
                 "lora": self.cfg.lora.shape()}
        dest = checkpoints.save_checkpoint(self.checkpoints_dir, self.model, self.optimizer, state, self.world,
                                           keep=self.keep_checkpoints)
        self.journal_position = journal_position
        self._publishes_since_checkpoint = 0
        self._checkpointed_version = self.weights_version
        self.checkpoint_step = self.step
        return dest

    def restore(self, version: int) -> None:
        """A rollback: the model, the optimizer and the counters of the checkpoint whose weights are
        `version`, in memory. The abandoned checkpoints (steps above its) go when the next checkpoint
        is written (`checkpoints.save_checkpoint`): until then a crash resumes where this was asked."""
        path = self._on_writer(lambda: checkpoints.checkpoint_of(self.checkpoints_dir, version))
        if path is None:
            raise ValueError(f"no checkpoint holds v{version}: it cannot be restored")
        self.settle(abandon=True)  # before resume clears the temporary directory it may write in; newer: abandoned
        self.resume(path)

    def resume(self, path: Path | None = None) -> Any:
        """Restore the newest complete checkpoint (or `path`'s: a rollback) (model, optimizer, counters,
        RNG states) and return its journal position; without one, keep model_dir's weights (as loaded by
        the constructor, which calls this), seed from the config and return None. The version never
        goes below a directory already in weights/."""
        self.activate()
        def find() -> Path | None:
            remove_temporaries(self.weights_dir)  # what crashed writes left behind
            remove_temporaries(self.checkpoints_dir)
            return checkpoints.latest_checkpoint(self.checkpoints_dir)

        if path is None:
            path = self._on_writer(find)
        if path is None:
            checkpoints.seed_all(self.cfg.seed)
            self.step = self.skipped_steps = self.consecutive_skips = self.weights_version = newest = 0
            self.paused, self.pause_reason, self.journal_position = False, None, None
        else:
            state = checkpoints.load_checkpoint(path, self.model, self.optimizer, self.device, self.world,
                                                seed=self.cfg.seed, lora=self.cfg.lora.shape())
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
