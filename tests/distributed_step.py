"""Run by tests/test_distributed_trainer.py under `torchrun --nproc-per-node 2`: the FSDP2 step on 2
gloo ranks against the single-process step on the same global batch, checkpoints across world
sizes, and the world's sharded start-up against a plain load. Rank 0 also builds the single-process trainers (no process group: today's trainer) and
writes every measured difference to the JSON file named on the command line; the test asserts them.

    torchrun --nproc-per-node 2 tests/distributed_step.py MODEL_DIR WORK_DIR OUT.json
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clawd import startup  # noqa: E402

startup.loading()  # while torch and clawd's trainer import, as in clawd's own ranks (clawd/startup.py)
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from clawd.config.train import LoraConfig, LossConfig, OptimizerConfig, TrainConfig
from clawd.trainer.worker import recompute, sharding  # noqa: E402
from clawd.trainer.worker.step import Trainer  # noqa: E402
from tests.test_trainer import sample  # noqa: E402

startup.loaded()

LR = 1e-2  # a step large enough to see: at 1e-5 any one AdamW step leaves the weights alike
# Adam's first step is lr·g/(|g| + eps): for a gradient entry near eps it is that entry's rounding, amplified
# (the summation order differs between one rank and two). With eps 1e-8 the weights agreed to 5.8e-6;
# at 1e-6 the entries that tiny weigh nothing and the comparison is of the steps themselves.
ADAM_EPS = 1e-6
# One update a batch, each sample's token mean, token-level OPD: the step the comparisons were written for (the
# shipped defaults' mini-batches and top-K rows have their own case, "topk").
UNIT = {"ppo_mini_batches": 1, "loss": LossConfig(aggregation="sample_mean", opd_top_k=0, opd_clip=0.0)}


def skewed_batch(mode: str) -> list:
    """Lengths from 6 to 90 tokens: a token split puts the long one alone on a rank."""
    hint = mode != "rl"
    return [sample(11, 90, 40, reward=1.0, temperature=0.7, hint=hint),
            sample(12, 9, 4, reward=-1.0),
            sample(13, 14, 6, reward=1.0, temperature=1.3, hint=hint),
            sample(14, 6, 3, reward=-1.0, mask=[1, 0, 1]),
            sample(15, 33, 12, reward=0.0, hint=hint),
            sample(16, 21, 10, reward=1.0)]


def full_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: sharding.full(v).detach().cpu().clone() for k, v in trainer.model.state_dict().items()}


def capture_grads(trainer: Trainer, into: dict) -> None:
    """Record every parameter's whole gradient just before the optimizer step (a collective per
    parameter in a world: every rank's step calls it in the same order)."""
    step = trainer.optimizer.step

    def recording(*a, **kw):
        into.clear()
        into.update({n: sharding.full(p.grad).detach().cpu().clone() for n, p in trainer.model.named_parameters()
                     if p.grad is not None})
        return step(*a, **kw)

    trainer.optimizer.step = recording


def recomputed(trainer: Trainer) -> bool:
    """Whether every decoder layer's forward is the recomputing one (after sharding, for the world)."""
    return all(isinstance(layer.__dict__.get("forward"), recompute._Recomputed)
               for layer in recompute.decoder_layers(trainer.model))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a)[:3], sorted(b)[:3])
    return max(rel(a[k], b[k]) for k in a)


def main() -> None:
    model_dir, work, out_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    world = sharding.join(60.0)
    torch.set_num_threads(1)
    out: dict = {"world_size": world.size, "modes": {}}
    # micro_batch_tokens 1: every sample is forwarded alone on both sides, so no padding differs
    # between the packs of 6 samples and of each rank's share; the second config packs them.
    for mode in ("rl", "opd", "combine"):
        for budget in (1, 256):
            cfg = TrainConfig(**UNIT, micro_batch_tokens=budget, optimizer=OptimizerConfig(lr=LR, grad_clip=1e6,
                                                                                           eps=ADAM_EPS))
            batch = skewed_batch(mode)
            grads: dict = {}
            # Packed, the world also recomputes its layers in the backward (applied before fully_shard, as
            # on CUDA) against one process that does not: the same step either way.
            fsdp_cfg = dataclasses.replace(cfg, recompute="on") if budget == 256 else cfg
            fsdp = Trainer(model_dir, work / f"{mode}-{budget}-fsdp", fsdp_cfg, world=world)
            capture_grads(fsdp, grads)
            m = fsdp.train_step(batch, mode)
            fsdp_grads, fsdp_after = dict(grads), full_weights(fsdp)
            if world.writer:
                one = Trainer(model_dir, work / f"{mode}-{budget}-one", cfg)
                capture_grads(one, grads)
                m1 = one.train_step(batch, mode)
                out["modes"][f"{mode}/{budget}"] = {
                    "loss": [m["loss"], m1["loss"]], "grad_norm": [m["grad_norm"], m1["grad_norm"]],
                    "loss_rel": abs(m["loss"] - m1["loss"]) / abs(m1["loss"]),
                    "grad_norm_rel": abs(m["grad_norm"] - m1["grad_norm"]) / m1["grad_norm"],
                    "grad_rel_max": worst(fsdp_grads, grads), "weights_rel_max": worst(fsdp_after, full_weights(one)),
                    "params_with_grad": len(grads), "tokens": [m["tokens"], m1["tokens"]],
                    "recomputed": [recomputed(fsdp), recomputed(one)],
                    "forward_tokens": [m["forward_tokens"], m1["forward_tokens"]]}
                del one
            world.barrier()
            del fsdp

    # The shipped step: two mini-batches, token_sum, top-K rows on the hinted samples (their parts summed over ranks
    # whether a rank's share holds top-k rows or not). The gradients compared are the last update's.
    cfg = TrainConfig(micro_batch_tokens=256, ppo_mini_batches=2,
                      optimizer=OptimizerConfig(lr=LR, grad_clip=1e6, eps=ADAM_EPS), loss=LossConfig(opd_top_k=2))
    batch = [dataclasses.replace(s, top_ids=[[1, 2]] * s.response_length,
                                 teacher_top_logprobs=[[-1.0, -2.5]] * s.response_length) if s.has_hint else s
             for s in skewed_batch("combine")]
    fsdp = Trainer(model_dir, work / "topk-fsdp", cfg, world=world)
    capture_grads(fsdp, grads := {})
    m = fsdp.train_step(batch, "combine")
    fsdp_grads, fsdp_after = dict(grads), full_weights(fsdp)
    if world.writer:
        one = Trainer(model_dir, work / "topk-one", cfg)
        capture_grads(one, grads)
        m1 = one.train_step(batch, "combine")
        out["topk"] = {"loss": [m["loss"], m1["loss"]], "opd_topk": [m["loss_opd_topk"], m1["loss_opd_topk"]],
                       "updates": [m["updates"], m1["updates"]], "grad_rel_max": worst(fsdp_grads, grads),
                       "weights_rel_max": worst(fsdp_after, full_weights(one))}
        del one
    world.barrier()
    del fsdp

    # The negative control: FSDP's own default, gradients averaged over ranks on top of the loss's
    # whole-batch normaliser. The comparison above must see it.
    cfg = TrainConfig(**UNIT, micro_batch_tokens=256, optimizer=OptimizerConfig(lr=LR, grad_clip=1e6))
    control = Trainer(model_dir, work / "control", cfg, world=world)
    for module in control.scorer.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(float(world.size))
    capture_grads(control, grads := {})
    mc = control.train_step(skewed_batch("combine"), "combine")
    control_grads = dict(grads)
    if world.writer:
        ref = out["modes"]["combine/256"]
        one = Trainer(model_dir, work / "control-one", cfg)
        capture_grads(one, grads)
        one.train_step(skewed_batch("combine"), "combine")
        out["control"] = {"grad_rel_max": worst(control_grads, grads), "grad_norm": [mc["grad_norm"], ref["grad_norm"][1]]}
        del one
    world.barrier()
    del control

    # Checkpoints across world sizes: 2 ranks write, 1 resumes; 1 writes, 2 resume; format 1 migrates.
    cfg = TrainConfig(**UNIT, micro_batch_tokens=256, optimizer=OptimizerConfig(lr=LR, grad_clip=1e6))
    b1, b2 = skewed_batch("combine"), skewed_batch("rl")[::-1]
    two = Trainer(model_dir, work / "two", cfg, world=world)
    two.train_step(b1, "combine")
    two.publish(1, deferred=True)  # as with weight-update groups: gathered now, written by rank 0's thread
    pending = [two.writing is not None]
    two.checkpoint({"segment": 1})  # settles it on every rank first
    w_two = full_weights(two)
    if world.writer:
        stored = load_file(str(work / "two" / "weights" / "v000001" / "model.safetensors"))
        out["deferred_world"] = {"pending": pending + [two.writing is not None],
                                 "equal": all(torch.equal(t, w_two[k].to(t.dtype)) for k, t in stored.items())}
    two.train_step(b2, "combine")
    w_two_next = full_weights(two)
    if world.writer:
        one = Trainer(model_dir, work / "two", cfg)  # resumes the 2-rank checkpoint alone
        w_one = full_weights(one)
        out["reshard_2_to_1"] = {"step": one.step, "version": one.weights_version,
                                 "journal_position": one.journal_position,
                                 "weights_equal": all(torch.equal(w_one[k], w_two[k]) for k in w_two),
                                 "optimizer_steps": sorted({int(s["step"]) for s in one.optimizer.state.values()})}
        one.train_step(b2, "combine")  # the same next step: the optimizer state came back too
        out["reshard_2_to_1"]["next_step_rel_max"] = worst(full_weights(one), w_two_next)
        one.publish(2)
        one.checkpoint({"segment": 2})
        out["one_written"] = full_weights(one)["model.norm.weight"].sum().item()
        _format1(one, work / "format1")
        del one
    world.barrier()
    back = Trainer(model_dir, work / "two", cfg, world=world)  # resumes rank 0's 1-process checkpoint
    w_back = full_weights(back)
    migrated = Trainer(model_dir, work / "format1", cfg, world=world)
    w_migrated = full_weights(migrated)
    back.train_step(b1, "combine")
    migrated.train_step(b1, "combine")
    w_back_next, w_migrated_next = full_weights(back), full_weights(migrated)
    if world.writer:
        one = Trainer(model_dir, work / "two", cfg)
        w_ref = full_weights(one)
        one.train_step(b1, "combine")
        w_ref_next = full_weights(one)
        out["reshard_1_to_2"] = {"step": back.step, "weights_equal": all(torch.equal(w_back[k], w_ref[k]) for k in w_ref),
                                 "next_step_rel_max": worst(w_back_next, w_ref_next)}
        out["format1"] = {"step": migrated.step, "weights_equal": all(torch.equal(w_migrated[k], w_ref[k]) for k in w_ref),
                          "next_step_rel_max": worst(w_migrated_next, w_ref_next)}
    world.barrier()
    out["lora"] = _lora(model_dir, work, world)
    out["startup"] = _startup(model_dir, work, world)
    if world.writer:
        out_path.write_text(json.dumps(out, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))
    world.barrier()
    # As clawd's ranks do: gloo's threads still alive at interpreter exit abort a rank now and then (SIGABRT,
    # "terminate called without an active exception"; once in a full suite here, and once more after this
    # destroy was added). The result is written and both ranks passed the barrier: leave without running the
    # interpreter's and C++'s exit-time destructors, where the abort happens.
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _lora(model_dir: Path, work: Path, world) -> dict | None:
    """LoRA in the world (PEFT wraps before fully_shard): the adapters' step against one process's, the
    adapter each publishes, and the 2-rank checkpoint resumed by one process."""
    from safetensors.torch import load_file

    cfg = TrainConfig(**UNIT, micro_batch_tokens=256, seed=5, lora=LoraConfig(rank=4, alpha=8.0, lr=LR),
                      optimizer=OptimizerConfig(grad_clip=1e6, eps=ADAM_EPS))
    grads: dict = {}
    two = Trainer(model_dir, work / "lora-two", cfg, world=world)
    before = full_weights(two)  # the adapters' init came from rank 0, drawn as one process draws it
    capture_grads(two, grads)
    m = two.train_step(skewed_batch("combine"), "combine")
    two_grads, two_after = dict(grads), full_weights(two)
    two.publish(1)
    two.checkpoint({"segment": 1})
    out = None
    if world.writer:
        one = Trainer(model_dir, work / "lora-one", cfg)
        one_before = full_weights(one)
        capture_grads(one, grads)
        m1 = one.train_step(skewed_batch("combine"), "combine")
        one.publish(1)
        files = [load_file(w / "weights" / "v000001" / "adapter_model.safetensors") for w in (work / "lora-two",
                                                                                              work / "lora-one")]
        resumed = Trainer(model_dir, work / "lora-two", cfg)
        w_resumed = full_weights(resumed)
        base = [k for k in before if "lora_" not in k]
        out = {"loss_rel": abs(m["loss"] - m1["loss"]) / abs(m1["loss"]), "grad_rel_max": worst(two_grads, grads),
               "weights_rel_max": worst(two_after, full_weights(one)), "params_with_grad": len(grads),
               "lora_params_with_grad": sum("lora_" in n for n in grads),
               "base_unchanged": all(torch.equal(before[k], two_after[k]) for k in base),
               "published_rel_max": worst(files[0], files[1]), "published_tensors": len(files[0]),
               "resumed_equal": all(torch.equal(w_resumed[k], two_after[k]) for k in two_after),
               "resumed_step": resumed.step,
               "init_equal": before.keys() == one_before.keys() and all(torch.equal(before[k], one_before[k])
                                                                        for k in before)}
        del one, resumed
    world.barrier()
    return out


def _tiny_variants(work: Path) -> list[Path]:
    """Two more tiny architectures beside the tests' Qwen2 (tied): a Llama, tied and with llama3 RoPE scaling
    (SmolLM2's family; a rotary init other than the default one), and a Qwen3, untied, with q/k norms."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    made = [(LlamaForCausalLM, LlamaConfig(**shape, tie_word_embeddings=True, rope_parameters=rope), "tiny-llama"),
            (Qwen3ForCausalLM, Qwen3Config(**shape, head_dim=16, tie_word_embeddings=False), "tiny-qwen3")]
    out = []
    for cls, config, name in made:
        torch.manual_seed(1)
        cls(config).eval().save_pretrained(work / name)
        out.append(work / name)
    return out


def _startup(model_dir: Path, work: Path, world) -> dict | None:
    """The world's start-up (clawd/trainer/worker/sharded_load.py): every rank builds on the meta device and only rank 0
    reads the weights (from_pretrained calls counted per rank). Every gathered parameter and every buffer,
    the non-persistent rotary ones included, against the model `from_pretrained` loads plainly, bit for bit,
    for the tests' model through the Trainer and for a tiny Llama and Qwen3 through the loader itself."""
    import contextlib

    from transformers import AutoModelForCausalLM

    from clawd.trainer.worker import sharded_load

    saved, calls = AutoModelForCausalLM.__dict__["from_pretrained"], []

    def counting(cls, *args, **kwargs):
        calls.append(str(args[0]))
        return saved.__func__(cls, *args, **kwargs)

    def whole(model) -> dict[str, torch.Tensor]:  # a collective per tensor; the buffers are whole on every rank
        state = {k: sharding.full(v).detach().cpu().clone() for k, v in model.state_dict().items()}
        return {**state, **{k: b.detach().cpu().clone() for k, b in model.named_buffers()}}

    def compare(got: dict, path: Path, model) -> dict:
        ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
        want = {**ref.state_dict(), **dict(ref.named_buffers())}
        return {"keys_equal": got.keys() == want.keys(),
                "unequal": sorted(k for k in want if k not in got or got[k].dtype != want[k].dtype
                                  or not torch.equal(got[k], want[k])),
                "buffers": sorted(k for k, _ in ref.named_buffers()), "tensors": len(want),
                "tied": sharded_load.tied(model),  # one parameter under both names, when the config ties them
                "generation_config_equal": model.generation_config.to_dict() == ref.generation_config.to_dict()}

    out: dict = {}
    AutoModelForCausalLM.from_pretrained = classmethod(counting)
    try:
        trainer = Trainer(model_dir, work / "startup", TrainConfig(**UNIT, micro_batch_tokens=256), world=world)
        loads = world.gather(len(calls))
    finally:
        AutoModelForCausalLM.from_pretrained = saved
    got = whole(trainer.model)
    if world.writer:
        out["qwen2"] = {**compare(got, model_dir, trainer.model), "from_pretrained_calls": loads}
    del trainer
    paths = world.broadcast(_tiny_variants(work) if world.writer else None)
    for path in paths:
        scorer = sharded_load.load(path, TrainConfig(), world.device, world, contextlib.nullcontext)
        got = whole(scorer.model)
        if world.writer:
            out[path.name] = compare(got, path, scorer.model)
        del scorer
    world.barrier()
    return out if world.writer else None


def _format1(trainer: Trainer, state_dir: Path) -> None:
    """The single-process checkpoint as clawd wrote it before the trainer world (format 1): the model's
    safetensors, AdamW's state_dict by parameter index, the RNG states, state.json."""
    import random
    import numpy as np
    from safetensors.torch import save_model

    ckpt = state_dir / "checkpoints" / "ckpt-00000001"
    ckpt.mkdir(parents=True)
    save_model(trainer.model, str(ckpt / "model.safetensors"))
    torch.save(trainer.optimizer.state_dict(), ckpt / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state()}, ckpt / "rng.pt")
    py, np_state = random.getstate(), np.random.get_state()
    state = {"format": 1, "step": trainer.step, "version": trainer.weights_version, "newest_version": trainer.version,
             "skipped_steps": 0, "consecutive_skips": 0, "paused": False, "pause_reason": None,
             "journal_position": {"segment": 2}, "created": 0.0, "config": {},
             "python_rng": [py[0], list(py[1]), py[2]], "numpy_rng": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    (ckpt / "state.json").write_text(json.dumps(state))
    (ckpt / "complete").write_text("1\n")


if __name__ == "__main__":
    main()
