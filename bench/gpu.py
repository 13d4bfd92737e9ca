"""clawd's real Trainer on a GPU: training throughput and MFU on a Qwen2.5-0.5B-shaped model, then one
publish in the base model's dtype (bf16) and one checkpoint. `--shape 4b --recompute on` runs a 4B-shaped
model with layer recompute instead, and every run records the memory plan (clawd.trainer.worker.memory) beside
the peak it measured.

    python3 bench/gpu.py            # CUDA only (refuses to run without it); minutes on an H200, bounded by --time-budget
    python3 bench/gpu.py --smoke    # the same code path on CPU with a tiny shape, in seconds

A randomly initialised Qwen2 with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocabulary 151,936, tied embeddings) is saved as a bf16 base directory without a
tokenizer (the trainer needs none), and `clawd.trainer.worker.step.Trainer` (`[train.world] device = "cuda"`) trains
on synthetic samples: `--samples` of total length spread over [--min-len, --max-len], 20–60 % response,
temperatures 1 / 0.7, half with a teacher hint (mode combine: the OPD term and the T = 1 log-probs run).
One warm-up step (its micro-batch budget halved on out-of-memory), then `--steps` timed ones.

    tokens/s  real input tokens (each sample's tokens minus the last; no padding) of the timed steps / their seconds
    MFU       6·N·T / (seconds · 989e12): N = every parameter once, the tied embedding counted once as the LM head
              (494,032,768 = 357,898,112 decoder + 151,936·896 head), T the tokens above; attention's L² term
              is left out. Also given: the FLOPs the trainer actually needs (the head runs at response
              positions only) and the attention term, for reference.

Also: peak CUDA memory of the timed steps (torch.cuda.max_memory_allocated), micro-batches and padding,
whether SDPA's flash kernel accepts the trainer's forward, the chunked head against full logits, the
top kernels of one profiled step, and the publish's and checkpoint's bytes and seconds. Then the trainer
as a world of one FSDP2 rank under torchrun on the same base (NCCL, bf16 compute over float32 masters:
bench/trainer_memory.py), its step seconds and peak memory (`fsdp_world`), and the same world training LoRA
adapters of rank 16 over the frozen bf16 base, with one adapter published (`lora_world`). Each result
carries `provenance` (bench/provenance.py: the UTC date, the git commit, "unknown" without one, and
whether the tree was dirty). Writes $OUT/gpu.json when $OUT is set, else bench/results/gpu-<date>.json.
Exit status: 0 when measured, 1 when a step failed, 2 without CUDA; the MFU target is reported, not
enforced. Only torch, transformers, safetensors and numpy are needed (and bench/provenance.py, the
standard library only); clawd is imported from this repository.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import random
import resource
import shutil
import subprocess
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(Path(__file__).resolve().parent))  # bench/provenance.py: the standard library only
import provenance  # noqa: E402

PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16, no sparsity
TARGET_MFU, STRETCH_MFU = 0.25, 0.40
SHAPES = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
    # A 4B model's shape (Qwen3-4B's sizes) on Qwen2's architecture: what recompute and the memory plan are for.
    "4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
               max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
    "smoke": dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=4096, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
}
# Per run kind. On an H200 (141 GB) a micro-batch costs ~1.7 MB of saved activations a token (24
# layers, bf16 autocast over float32 weights), so 32k padded tokens take ~55 GB beside ~8 GB of
# weights, gradients and AdamW state: room to spare, and matmuls of 32k rows are already efficient.
DEFAULTS = {
    "cuda": dict(shape="qwen2.5-0.5b", samples=128, min_len=64, max_len=4096, micro_batch_tokens=32768,
                 head_chunk_tokens=0, steps=4),
    "smoke": dict(shape="smoke", samples=16, min_len=16, max_len=256, micro_batch_tokens=1024,
                  head_chunk_tokens=64, steps=2),
}


# --- inputs ----------------------------------------------------------------------------------

def make_samples(n: int, lo: int, hi: int, spread: str, vocab: int, seed: int) -> list:
    from clawd.samples import Sample

    rng = random.Random(seed)
    out = []
    for i in range(n):
        if spread == "uniform":
            total = rng.randint(lo, hi)
        elif spread == "loguniform":
            total = round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        else:  # bench/trainer.py's: P(len > x) = lo / x, capped; mostly short samples
            total = min(hi, int(lo * rng.paretovariate(1.0)))
        r = max(1, min(total - 1, round(total * rng.uniform(0.2, 0.6))))
        hint = i % 2 == 0
        out.append(Sample(
            sample_id=f"s{i}", mode="combine", session_id=f"c{i}", turn_index=0, principal="bench",
            tokens=[rng.randrange(vocab) for _ in range(total)], response_length=r, loss_mask=[1] * r,
            rollout_logprobs=[-rng.uniform(0.0, 3.0) for _ in range(r)], temperature=(1.0, 0.7, 1.0)[i % 3],
            reward=rng.choice((-1.0, 1.0)), has_hint=hint,
            teacher_logprobs=[-rng.uniform(0.0, 3.0) for _ in range(r)] if hint else None,
            policy_version=0, created=0.0, scored=0.0))
    return out


def build_base(dest: Path, shape: str, seed: int, device) -> None:
    """A random Qwen2 of the shape, saved in bf16 (config.json dtype "bfloat16"), no tokenizer files."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it is fast; saving moves it to the host
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape], dtype="bfloat16"))
    model.to(torch.bfloat16).save_pretrained(dest)
    del model


# --- measuring -------------------------------------------------------------------------------

def sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(trainer, samples, mode: str) -> tuple[float, dict]:
    """Seconds of one train_step, the device drained on both sides; a skipped step is a failure."""
    sync(trainer.device)
    t0 = time.perf_counter()
    m = trainer.train_step(samples, mode)
    sync(trainer.device)
    seconds = time.perf_counter() - t0
    if m["skipped"] or not math.isfinite(m["loss"]):
        raise RuntimeError(f"the trainer skipped the step: {m['skip_reason']} (loss {m['loss']})")
    return seconds, m


def flash_check(trainer, samples) -> dict:
    """Does the trainer's forward run with SDPA restricted to the flash kernel? It cannot when an
    attention mask reaches SDPA, or for dtypes or shapes flash does not take."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            trainer.logprobs(samples)
        return {"flash_only_forward": True}
    except Exception as e:  # "No available kernel" (a RuntimeError), or a backend this build lacks
        return {"flash_only_forward": False, "error": str(e).strip().splitlines()[0][:400]}


def chunk_check(trainer, samples) -> dict:
    """The trainer's chunked log-probs and entropy beside losses.token_logprobs/entropy on full logits."""
    import torch
    from clawd.trainer.worker import losses

    mb = trainer._micro_batches(samples)[0]
    with torch.no_grad():
        lp, ent, _, _ = trainer._forward(trainer.scorer, mb, mb.temperature)
        with trainer._autocast():
            hidden = trainer.model.get_decoder()(input_ids=mb.input_ids, use_cache=False).last_hidden_state
            hidden = hidden.gather(1, mb.positions[..., None].expand(-1, -1, hidden.shape[-1]))
            logits = trainer.model.get_output_embeddings()(hidden)
        keep = mb.mask.bool()
        d_lp = (lp - losses.token_logprobs(logits, mb.targets, mb.temperature))[keep].abs().max()
        d_ent = (ent - losses.entropy(logits, mb.temperature))[keep].abs().max()
    return {"tokens": int(keep.sum()), "lp_max_abs_diff": float(d_lp), "entropy_max_abs_diff": float(d_ent)}


def kernel_category(name: str) -> str:
    n = name.lower()
    for category, marks in (("attention", ("flash", "fmha", "attention", "sdpa")),
                            ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "::mm", "addmm", "bmm")),
                            ("softmax", ("softmax",)), ("optimizer", ("adam", "multi_tensor", "foreach")),
                            ("elementwise/reduce", ("elementwise", "reduce", "copy", "fill", "index", "gather",
                                                    "scatter", "embedding", "cat", "norm"))):
        if any(m in n for m in marks):
            return category
    return "other"


def profile_step(trainer, samples, mode: str, top: int) -> dict:
    """One more step under torch.profiler: device (or, on CPU, host) time by kernel and by category."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        seconds, _ = train_step(trainer, samples, mode)

    def own(e) -> float:  # microseconds
        if cuda:
            return float(getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0) or 0)
        return float(e.self_cpu_time_total)

    events = [e for e in prof.key_averages() if own(e) > 0]
    if cuda:  # kernels only: an operator's own device time is its kernels' again
        kernels = [e for e in events if "cuda" in str(getattr(e, "device_type", "")).lower()]
        events = kernels or events
    total = sum(map(own, events))
    by_category: dict[str, float] = {}
    for e in events:
        by_category[kernel_category(e.key)] = by_category.get(kernel_category(e.key), 0.0) + own(e) / 1e6
    kernels = [{"name": e.key[:160], "calls": e.count, "seconds": own(e) / 1e6}
               for e in sorted(events, key=own, reverse=True)[:top]]
    return {"clock": "device" if cuda else "host", "step_seconds_profiled": seconds,
            "busy_seconds": total / 1e6, "by_category_seconds": by_category, "top": kernels}


def directory_bytes(path: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}


def publish_and_checkpoint(trainer, checkpoint: bool) -> dict:
    import torch
    from safetensors import safe_open

    out = {}
    sync(trainer.device)
    t0 = time.perf_counter()
    path = trainer.publish(trainer.version + 1)
    seconds = time.perf_counter() - t0
    files = directory_bytes(path)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = sorted({f.get_slice(k).get_dtype() for k in f.keys()})
        name = "model.embed_tokens.weight"
        exact = torch.equal(f.get_tensor(name), trainer.model.get_input_embeddings().weight.detach().cpu().bfloat16())
    out["publish"] = {"dtype": trainer.publish_dtype, "seconds": seconds, "bytes": sum(files.values()),
                      "weights_bytes": sum(v for k, v in files.items() if k.endswith(".safetensors")),
                      "files": files, "stored_dtypes": stored,
                      "config_dtype": json.loads((path / "config.json").read_text()).get("dtype"),
                      "embedding_equals_master_rounded": exact}
    out["publish_broadcast"] = publish_broadcast(trainer)
    sync(trainer.device)  # the daemon's path with groups: the reply once the weights are on the host, then the write
    t0 = time.perf_counter()
    trainer.publish(trainer.version + 1, deferred=True)
    t1 = time.perf_counter()
    trainer.settle()
    out["publish_deferred"] = {"reply_seconds": t1 - t0, "write_after_seconds": time.perf_counter() - t1}
    if checkpoint:
        sync(trainer.device)
        t0 = time.perf_counter()
        ckpt = trainer.checkpoint()
        files = directory_bytes(ckpt)
        out["checkpoint"] = {"seconds": time.perf_counter() - t0, "bytes": sum(files.values()), "files": files}
    return out


def publish_broadcast(trainer, bucket_mb: int = 512) -> dict:
    """The trainer's side of a publish over a weight-update group (clawd.trainer.worker.weight_sender): every bucket
    gathered, cast to the published dtype and packed on the device, then broadcast, in a group of this process
    alone (NCCL on CUDA, gloo on CPU): the broadcast itself moves nothing, so this is the sender's own cost, set
    beside `publish` (the directory write). The wire to an engine needs a second GPU and SGLang: unmeasured."""
    import socket
    from clawd.trainer.worker.weight_sender import WeightSender

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender = WeightSender(trainer.model, trainer.publish_dtype, trainer.device)
    backend = "nccl" if trainer.device.type == "cuda" else "gloo"
    sender.join("bench", "127.0.0.1", port, 1, backend, 120.0)
    try:
        sent = sender.send("bench", bucket_mb << 20)  # warm-up: NCCL's communicator is made at the first call
        sync(trainer.device)
        t0 = time.perf_counter()
        sent = sender.send("bench", bucket_mb << 20)
        sync(trainer.device)
        seconds = time.perf_counter() - t0
    finally:
        sender.leave("bench")
    return {"backend": backend, "bucket_mb": bucket_mb, "seconds": seconds, "bytes": sent["bytes"],
            "buckets": sent["buckets"], "wire_to_an_engine": "unmeasured (needs a second GPU and SGLang)"}


# --- the run ---------------------------------------------------------------------------------

def run(args, result: dict) -> None:
    import torch
    from clawd.config.train import OptimizerConfig, TrainConfig, WorldConfig
    from clawd.trainer.worker import memory, recompute
    from clawd.trainer.worker.step import Trainer

    device = torch.device("cpu" if args.smoke else "cuda")
    t_start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="clawd-bench-gpu-", dir=args.workdir))
    result["workdir"] = str(work)
    try:
        build_base(work / "base", args.shape, args.seed, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        cfg = TrainConfig(micro_batch_tokens=args.micro_batch_tokens, seed=args.seed, recompute=args.recompute,
                          world=WorldConfig(device=device.type, memory_fraction=args.memory_fraction),
                          optimizer=OptimizerConfig(lr=1e-6))
        trainer = Trainer(work / "base", work / "state", cfg)
        if args.head_chunk_tokens:
            trainer.head_chunk_tokens = args.head_chunk_tokens
        model = trainer.model
        vocab, hidden = model.get_output_embeddings().weight.shape
        n_params = sum(p.numel() for p in model.parameters())  # the tied embedding once: it is the LM head
        layers = model.config.num_hidden_layers
        samples = make_samples(args.samples, args.min_len, args.max_len, args.lengths, vocab, args.seed)
        inputs = [len(s.tokens) - 1 for s in samples]
        responses = sum(s.response_length for s in samples)
        result.update(
            device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            parameters=n_params, decoder_parameters=n_params - vocab * hidden, vocab=vocab, hidden=hidden,
            layers=layers, publish_dtype=trainer.publish_dtype, head_chunk_tokens=trainer.head_chunk_tokens,
            samples=len(samples), tokens_per_step=sum(inputs), response_tokens_per_step=responses,
            length_min=min(inputs) + 1, length_max=max(inputs) + 1, length_median=statistics.median(inputs) + 1)
        short = sorted(samples, key=lambda s: len(s.tokens))[:2]
        result["checks"] = {**flash_check(trainer, short), "chunked_head": chunk_check(trainer, short)}
        print(f"  checks: {json.dumps(result['checks'])}", flush=True)

        result["oom_retries"] = []
        for attempt in range(3):  # the warm-up step; out of memory halves the micro-batch budget
            try:
                seconds, m = train_step(trainer, samples, args.mode)
                break
            except torch.OutOfMemoryError as e:
                message = str(e).splitlines()[0][:300]
            trainer.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            budget = trainer.cfg.micro_batch_tokens // 2
            result["oom_retries"].append({"micro_batch_tokens": trainer.cfg.micro_batch_tokens, "error": message})
            if attempt == 2 or budget < args.max_len:
                raise RuntimeError(f"out of memory at every micro-batch budget tried: {result['oom_retries']}")
            trainer.cfg = dataclasses.replace(trainer.cfg, micro_batch_tokens=budget)
            print(f"  out of memory: micro_batch_tokens now {budget}", flush=True)
        result["micro_batch_tokens"] = trainer.cfg.micro_batch_tokens
        result["warmup_seconds"] = seconds
        print(f"  warm-up step: {seconds:.2f} s, {m['micro_batches']} micro-batches", flush=True)

        # As many timed steps as the time budget leaves room for, keeping ~a minute for the rest.
        room = args.time_budget - (time.monotonic() - t_start) - 60 - 2 * seconds
        steps = max(1, min(args.steps, int(room / seconds))) if seconds > 0 else args.steps
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timed = []
        for i in range(steps):
            seconds, m = train_step(trainer, samples, args.mode)
            timed.append(seconds)
            print(f"  step {i + 1}/{steps}: {seconds:.3f} s, loss {m['loss']:.4f}", flush=True)
        # What the memory plan (bin/clawd --check-config) says this run needs, beside what it took.
        result["memory_plan"] = memory.plan(memory.Shape.from_config(json.loads((work / "base" / "config.json")
                                            .read_text())), trainer.cfg, device.type == "cuda",
                                            recompute.wanted(trainer.cfg.recompute, device)).as_json()
        if device.type == "cuda":
            result["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
            result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        else:  # the process's peak RSS, for the smoke run only
            result["peak_memory_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

        tokens, padded = m["forward_tokens"], m["padded_tokens"]
        total_s = sum(timed)
        flops = 6 * n_params * tokens * steps
        needed = (6 * (n_params - vocab * hidden) * tokens + 6 * vocab * hidden * responses) * steps
        # causal QKᵀ and AV: 2·L²·d forward a layer (d = heads · head dim = hidden), 3× with the backward
        attention = 6 * hidden * layers * sum(n * n for n in inputs) * steps
        result.update(
            steps=steps, step_seconds=timed, seconds=total_s, micro_batches=m["micro_batches"],
            padded_tokens_per_step=padded, padding_share=1 - tokens / padded,
            tokens_per_s=tokens * steps / total_s, peak_flops=PEAK_FLOPS,
            mfu=flops / total_s / PEAK_FLOPS, mfu_target=TARGET_MFU, mfu_stretch=STRETCH_MFU,
            mfu_needed_flops=needed / total_s / PEAK_FLOPS,
            mfu_with_attention=(flops + attention) / total_s / PEAK_FLOPS,
            mfu_formula=f"6*N*T/(s*{PEAK_FLOPS:g}), N={n_params} (decoder {n_params - vocab * hidden} + "
                        f"head {vocab}*{hidden}, tied embedding counted once), T=real input tokens")
        if args.profile:
            try:
                result["profile"] = profile_step(trainer, samples, args.mode, args.profile_top)
            except Exception as e:  # diagnostics only: never the reason a measured run fails
                result["profile"] = {"error": f"{type(e).__name__}: {e}"[:400]}
        result.update(publish_and_checkpoint(trainer, args.checkpoint))
        del trainer, model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.worlds:
            result["fsdp_world"] = fsdp_world(work)
            print(f"  FSDP2 world of 1: {json.dumps(result['fsdp_world'])[:400]}", flush=True)
            result["lora_world"] = fsdp_world(work, lora_rank=16)
            print(f"  FSDP2 world of 1, LoRA rank 16: {json.dumps(result['lora_world'])[:600]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fsdp_world(work: Path, lora_rank: int = 0) -> dict:
    """The trainer as a world of one FSDP2 rank under torchrun on the same base (NCCL on CUDA, bf16
    compute over float32 master weights): bench/trainer_memory.py's three steps, bytes and peak memory.
    With lora_rank: LoRA adapters over the frozen bf16 base (FSDP2 groups mixing a bf16 frozen base and
    float32 adapters), and one adapter published."""
    out = work / f"world-{lora_rank}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone",
           str(ROOT / "bench" / "trainer_memory.py"), str(work / "base"), str(work / f"world-state-{lora_rank}"),
           str(out), str(lora_rank)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if run.returncode != 0:
        return {"ok": False, "error": run.stderr[-2000:]}
    return {"ok": True, **json.loads(out.read_text())}


def summary(r: dict) -> str:
    gib = 2 ** 30
    lines = [f"bench/gpu.py: {r.get('device_name', '?')}, torch {r['torch']}, transformers {r['transformers']}, "
             f"commit {r['commit'][:12]}, {r['date']}"]
    if "parameters" in r:
        lines.append(f"model: {r['shape']}, N = {r['parameters']:,} ({r['decoder_parameters']:,} decoder + "
                     f"{r['vocab']:,}·{r['hidden']} head); publishes {r['publish_dtype']}")
        lines.append(f"samples: {r['samples']}, {r['tokens_per_step']:,} tokens a step "
                     f"({r['response_tokens_per_step']:,} response), lengths {r['length_min']}–{r['length_max']} "
                     f"(median {r['length_median']:g})")
    if "tokens_per_s" in r:
        lines += [
            f"layout: {r['micro_batches']} micro-batches under {r['micro_batch_tokens']:,} tokens, padding "
            f"{r['padding_share']:.1%}, output layer in chunks of {r['head_chunk_tokens']:,} positions",
            f"steps: {r['steps']} timed after a warm-up ({r['warmup_seconds']:.2f} s): "
            f"{statistics.median(r['step_seconds']):.3f} s median",
            f"throughput: {r['tokens_per_s']:,.0f} tokens/s; MFU {r['mfu']:.1%} (6·N·T; target {TARGET_MFU:.0%}, "
            f"stretch {STRETCH_MFU:.0%}: {'met' if r['mfu'] >= TARGET_MFU else 'not met'}), "
            f"{r['mfu_needed_flops']:.1%} counting the head at response positions only, "
            f"{r['mfu_with_attention']:.1%} with attention's L² term",
            f"peak memory: {r['peak_memory_bytes'] / gib:.1f} GiB"
            + (f" ({r['peak_reserved_bytes'] / gib:.1f} GiB reserved)" if "peak_reserved_bytes" in r else "")
            + (f"; the memory plan said {r['memory_plan']['total'] / gib:.1f} GiB (recompute "
               f"{'on' if r['memory_plan']['recompute'] else 'off'})" if "memory_plan" in r else "")]
    if "publish" in r:
        p = r["publish"]
        lines.append(f"publish: {p['dtype']}, {p['bytes'] / 1e6:,.1f} MB in {p['seconds']:.2f} s "
                     f"(stored {'/'.join(p['stored_dtypes'])}, config {p['config_dtype']}, "
                     f"exact: {p['embedding_equals_master_rounded']})")
    if "publish_broadcast" in r:
        b = r["publish_broadcast"]
        lines.append(f"publish over a group, the trainer's side ({b['backend']}, group of one): "
                     f"{b['bytes'] / 1e6:,.1f} MB in {b['buckets']} bucket(s), {b['seconds']:.2f} s; "
                     f"the engine's side {b['wire_to_an_engine']}")
    if "publish_deferred" in r:
        d = r["publish_deferred"]
        lines.append(f"publish deferred: the trainer replies after {d['reply_seconds']:.2f} s (the host copy), the "
                     f"directory follows {d['write_after_seconds']:.2f} s later off the critical path")
    if "checkpoint" in r:
        c = r["checkpoint"]
        lines.append(f"checkpoint: {c['bytes'] / 1e6:,.1f} MB in {c['seconds']:.2f} s")
    if "profile" in r and "top" in r["profile"]:
        prof = r["profile"]
        by_time = sorted(prof["by_category_seconds"].items(), key=lambda kv: -kv[1])
        cats = ", ".join(f"{k} {v:.2f} s" for k, v in by_time)
        lines.append(f"profiled step: {prof['step_seconds_profiled']:.2f} s wall, {prof['busy_seconds']:.2f} s "
                     f"{prof['clock']} busy: {cats}")
        lines += [f"  {k['seconds'] * 1e3:9.1f} ms {k['calls']:6d}× {k['name'][:110]}" for k in prof["top"][:10]]
    if "error" in r:
        lines.append(f"FAILED: {r['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shape: proves the script end to end")
    p.add_argument("--samples", type=int, default=None, help="samples per step")
    p.add_argument("--min-len", type=int, default=None, help="shortest sample (prompt + response tokens)")
    p.add_argument("--max-len", type=int, default=None, help="longest sample")
    p.add_argument("--lengths", choices=("uniform", "loguniform", "pareto"), default="uniform",
                   help="how total lengths spread over [min-len, max-len] (pareto: bench/trainer.py's)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="the trainer's packing budget")
    p.add_argument("--head-chunk-tokens", type=int, default=None,
                   help="positions per output-layer chunk (0: the trainer's default for the vocabulary)")
    p.add_argument("--steps", type=int, default=None, help="timed steps after the warm-up one")
    p.add_argument("--mode", choices=("rl", "opd", "combine"), default="combine")
    p.add_argument("--memory-fraction", type=float, default=0.0, help="[train.world] memory_fraction")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="the model's shape (default qwen2.5-0.5b; smoke with --smoke); 4b with --recompute on "
                        "is the 4B-shaped run the memory plan is checked against")
    p.add_argument("--recompute", choices=("auto", "on", "off"), default="auto", help="TrainConfig.recompute")
    p.add_argument("--time-budget", type=float, default=420.0,
                   help="seconds the whole run should take at most: fewer timed steps when slow")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled step")
    p.add_argument("--profile-top", type=int, default=25, help="kernels listed from the profiled step")
    p.add_argument("--no-checkpoint", dest="checkpoint", action="store_false", help="skip the checkpoint")
    p.add_argument("--no-worlds", dest="worlds", action="store_false",
                   help="skip the FSDP2 and LoRA worlds under torchrun (a run that fits a short lease)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="where the base model and state go (default: $TMPDIR)")
    p.add_argument("--out", type=Path, default=None, help="the JSON result (default: $OUT/gpu.json or bench/results/)")
    args = p.parse_args(argv)
    for k, v in DEFAULTS["smoke" if args.smoke else "cuda"].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)

    import torch
    import transformers

    prov = provenance.stamp()
    now = datetime.datetime.fromisoformat(prov["date"])
    # date, commit and worktree_dirty stay at the top level too, as earlier gpu.json files have them
    result: dict = {"provenance": prov, "date": prov["date"], "commit": prov["commit"],
                    "worktree_dirty": prov["dirty"],
                    "smoke": args.smoke, "shape": args.shape, "torch": torch.__version__,
                    "transformers": transformers.__version__, "python": sys.version.split()[0],
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    # A smoke run measures nothing: it never lands among the results.
    default = (Path(tempfile.gettempdir()) / "gpu-smoke.json" if args.smoke
               else ROOT / "bench" / "results" / f"gpu-{now:%Y%m%dT%H%M%SZ}.json")
    out = args.out or (Path(os.environ["OUT"]) / "gpu.json" if os.environ.get("OUT") else default)
    status = 0
    if not args.smoke and not torch.cuda.is_available():
        result["error"] = "CUDA is not available: this benchmark measures a GPU (--smoke runs it on CPU)"
        status = 2
    else:
        t0 = time.monotonic()
        try:
            run(args, result)
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {e}"[:2000]
            result["traceback"] = traceback.format_exc()[-6000:]
            status = 1
        result["wall_s"] = round(time.monotonic() - t0, 1)
        if status == 0 and args.worlds and not result.get("fsdp_world", {}).get("ok"):
            status = 1  # the trainer world did not run: a failure, with its stderr in the JSON
    result["measured"] = status == 0
    print(summary(result))
    if "traceback" in result:
        print(result["traceback"], file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
