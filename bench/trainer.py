"""Training step throughput: clawd's `Trainer.train_step` beside a bare forward+backward, packed beside padded.

One process, one model, the same samples (docs/ARCHITECTURE.md §12: ratios measured side by side in one run):
  trainer        `Trainer.train_step(samples, mode)`: micro-batches built from the Samples (its
                 length-sorted packing under `micro_batch_tokens`), log-probs at T, advantages,
                 the PPO/TIS loss, entropy and loss metrics, grad norm, non-finite checks,
                 clipping, one AdamW step
  bare/packed    the same micro-batches, pre-built as tensors on the device, through the same
                 model: decoder → hidden states at the response positions → lm_head →
                 log_softmax → gather → minus the mean over loss tokens → backward → the same
                 AdamW step. What it leaves out is what clawd adds; the optimizer and the
                 response-only head are in both, so the ratio is clawd's overhead, not theirs.
  bare/padded    the bare step on a naive layout: samples in arrival order, `--padded-rows` per
                 micro-batch (default: as many rows of the longest sample as fit the same
                 `micro_batch_tokens` budget), every row padded to the longest sample in the batch.
Ratios, each the median of per-round ratios (rounds interleave the paths, rotating their order):
  overhead = time(trainer) / time(bare/packed)       target <= 1.15
  packing  = time(bare/padded) / time(bare/packed)   target >= 1.5
Tokens are real input tokens (each sample's tokens minus the last), never padding. Before timing,
the three paths must agree on the mean response log-prob (a layout bug stops the bench); peak
memory is taken in the last warm-up round, so that its resets stay out of the timed ones.

Model FLOPs (MFU on CUDA, against the GPU's dense bf16 peak; H100/H200 SXM: 989 TFLOP/s):
  6 · N_body · T  +  6 · V · d · R
N_body: parameters without the input embedding and the output head; T: real input tokens; V·d: the
output head, which runs at the R response positions only. Attention's L² term is left out, so
MFU is slightly understated for long samples.

    .venv/bin/python bench/trainer.py                 # about 1.5 min on 1 of 2 cores; writes bench/results/trainer.json
    .venv/bin/python bench/trainer.py --device cuda   # a random Qwen2.5-0.5B-shaped model, bf16 autocast

Exit status: 0 when both ratios met their targets (overhead <= 1.15, packing >= 1.5); 1 when one
was missed, or (a traceback, no JSON written) when it could not measure: the paths disagree on the
log-prob, the trainer skipped a step, or anything else failed. The JSON carries `provenance`
(bench/provenance.py) and `pass`.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from clawd.config.train import TrainConfig, WorldConfig
from clawd.samples import Sample  # noqa: E402
from clawd.trainer.worker.batches import pack  # noqa: E402
from clawd.trainer.worker.step import Trainer  # noqa: E402
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)

RESULTS = ROOT / "bench" / "results"
TARGET_OVERHEAD = 1.15
TARGET_PACKING = 1.5
# Dense bf16 peaks (TFLOP/s, no sparsity) by a substring of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "L4": 121.0}

# Model shapes: "small" measures on 2 CPU cores in seconds; "qwen2.5-0.5b" is Qwen2.5-0.5B's shape.
SHAPES = {
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6),
}
# Per device: model shape, batch, sample lengths, micro-batch budget (the trainer's default), threads.
# One CPU thread: on a shared machine OpenMP threads stall on each other's time slices and the
# rounds scatter by 3x; one thread per process keeps them within a few per cent.
DEFAULTS = {
    "cpu": dict(shape="small", batch=32, min_len=24, max_len=512,
                micro_batch_tokens=TrainConfig.micro_batch_tokens, threads=1),
    "cuda": dict(shape="qwen2.5-0.5b", batch=128, min_len=64, max_len=4096,
                 micro_batch_tokens=TrainConfig.micro_batch_tokens),
}
PATHS = ("trainer", "bare/packed", "bare/padded")


# --- inputs (pure) ---------------------------------------------------------------------------

def skewed_lengths(n: int, min_len: int, max_len: int, alpha: float, rng: random.Random) -> list[int]:
    """n sample lengths (prompt + response) from a Pareto tail: P(len > x) = (min_len / x)^alpha,
    capped at max_len. alpha 1: half the samples within 2·min_len, a few at the cap."""
    return [min(max_len, int(min_len * rng.paretovariate(alpha))) for _ in range(n)]


def make_samples(lengths: list[int], vocab: int, rng: random.Random) -> list[Sample]:
    """Random samples of the given lengths: 20–60 % response, all loss tokens, half with a hint."""
    out = []
    for i, n in enumerate(lengths):
        r = max(1, min(n - 1, round(n * rng.uniform(0.2, 0.6))))
        hint = i % 2 == 0
        out.append(Sample(
            sample_id=f"s{i}", mode="rl", session_id=f"c{i}", turn_index=0, principal="bench",
            tokens=[rng.randrange(vocab) for _ in range(n)], response_length=r, loss_mask=[1] * r,
            rollout_logprobs=[-rng.uniform(0.0, 3.0) for _ in range(r)], temperature=1.0,
            reward=rng.choice((-1.0, 1.0)), has_hint=hint,
            teacher_logprobs=[-rng.uniform(0.0, 3.0) for _ in range(r)] if hint else None,
            policy_version=0, created=0.0, scored=0.0))
    return out


def padded_groups(n: int, rows: int) -> list[list[int]]:
    """A naive trainer's micro-batches: samples in arrival order, `rows` at a time."""
    return [list(range(i, min(i + rows, n))) for i in range(0, n, rows)]


# --- the bare step ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor   # [b, L] right-padded with 0
    positions: torch.Tensor   # [b, R] input positions whose logits score the response tokens
    targets: torch.Tensor     # [b, R] response ids (0 on padding)
    mask: torch.Tensor        # [b, R] 1 on response tokens


def build_batch(samples: list[Sample], rows: list[int], device: torch.device,
                pad_to: tuple[int, int] | None = None) -> Batch:
    """Right-padded tensors for samples[rows]: to the group's longest input and response, or to pad_to (L, R)."""
    group = [samples[i] for i in rows]
    L, R = pad_to or (max(len(s.tokens) - 1 for s in group), max(s.response_length for s in group))
    input_ids = torch.zeros(len(group), L, dtype=torch.long)
    positions = torch.zeros(len(group), R, dtype=torch.long)
    targets = torch.zeros(len(group), R, dtype=torch.long)
    mask = torch.zeros(len(group), R)
    for r, s in enumerate(group):
        n, p = s.response_length, len(s.tokens) - s.response_length
        input_ids[r, :len(s.tokens) - 1] = torch.tensor(s.tokens[:-1])
        positions[r, :n] = torch.arange(p - 1, p - 1 + n)
        targets[r, :n] = torch.tensor(s.response_ids)
        mask[r, :n] = 1.0
    return Batch(*(x.to(device) for x in (input_ids, positions, targets, mask)))


def bare_loss(model, b: Batch, loss_tokens: int, autocast) -> torch.Tensor:
    """Minus this micro-batch's share of the mean response log-prob over the whole batch."""
    with autocast():
        hidden = model.get_decoder()(input_ids=b.input_ids, use_cache=False).last_hidden_state
        hidden = hidden.gather(1, b.positions[..., None].expand(-1, -1, hidden.shape[-1]))
        logits = model.get_output_embeddings()(hidden)
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, b.targets[..., None]).squeeze(-1)
    return -(lp * b.mask).sum() / loss_tokens


def bare_step(model, optimizer, batches: list[Batch], loss_tokens: int, autocast) -> None:
    """Forward, the plain mean of the response log-probs, backward, one optimizer step."""
    for b in batches:
        bare_loss(model, b, loss_tokens, autocast).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# --- measuring -------------------------------------------------------------------------------

class Peak:
    """Peak memory of one call: CUDA allocator peak, or on CPU the process's peak RSS (VmHWM,
    reset through /proc/self/clear_refs after malloc_trim; it includes the model and optimizer)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so the peak is this call's
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def read_mib(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        return kib / 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Seconds of fn(), the device queue drained on both sides."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def measure_peak(fn, device: torch.device, peak: Peak) -> float:
    """Peak MiB while fn() runs."""
    _sync(device)
    peak.reset()
    fn()
    _sync(device)
    return peak.read_mib()


def model_flops(model, tokens: int, response_tokens: int) -> float:
    """6 · N_body · T + 6 · V · d · R (see the module docstring)."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    seen = {id(p) for p in (emb, head)}
    body = sum(p.numel() for p in model.parameters() if id(p) not in seen)
    return 6.0 * body * tokens + 6.0 * head.numel() * response_tokens


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


# --- the run ---------------------------------------------------------------------------------

def random_model(dest: Path, shape: str, seed: int) -> int:
    """A randomly initialised Qwen2 of the named shape, saved (float32) into dest; returns its parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.save_pretrained(dest)
    return sum(p.numel() for p in model.parameters())


def run(args) -> dict:
    device = torch.device(args.device)
    load0 = os.getloadavg()[0]  # others' work on a shared machine skews rounds unevenly
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="clawd-bench-trainer-", dir=args.workdir) as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = Path(tmp) / "model"
            random_model(model_dir, args.shape, args.seed)
        cfg = TrainConfig(micro_batch_tokens=args.micro_batch_tokens, seed=args.seed,
                          world=WorldConfig(device=args.device))
        trainer = Trainer(model_dir, Path(tmp) / "state", cfg)
    model = trainer.model
    vocab = model.get_input_embeddings().weight.shape[0]
    n_params = sum(p.numel() for p in model.parameters())

    samples = make_samples(skewed_lengths(args.batch, args.min_len, args.max_len, args.alpha, rng), vocab, rng)
    inputs = [len(s.tokens) - 1 for s in samples]
    tokens, responses = sum(inputs), sum(s.response_length for s in samples)
    longest = (max(inputs), max(s.response_length for s in samples))
    rows = args.padded_rows or max(1, args.micro_batch_tokens // longest[0])
    packed = [build_batch(samples, g, device) for g in pack(inputs, args.micro_batch_tokens)]
    padded = [build_batch(samples, g, device, pad_to=longest) for g in padded_groups(len(samples), rows)]
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda"
                else contextlib.nullcontext)

    def trainer_step():
        m = trainer.train_step(samples, args.mode)
        if m["skipped"]:
            raise RuntimeError(f"the trainer skipped a step: {m['skip_reason']}")

    steps = {"trainer": trainer_step,
             "bare/packed": lambda: bare_step(model, trainer.optimizer, packed, responses, autocast),
             "bare/padded": lambda: bare_step(model, trainer.optimizer, padded, responses, autocast)}
    layout = {"trainer": packed, "bare/packed": packed, "bare/padded": padded}
    # All three paths must score the same tokens: the mean response log-prob, before any step.
    with torch.no_grad():
        mean_lp = {"trainer": sum(map(sum, trainer.logprobs(samples))) / responses}
        for name, bs in (("bare/packed", packed), ("bare/padded", padded)):
            mean_lp[name] = -float(sum(bare_loss(model, b, responses, autocast) for b in bs))
    lp_spread = max(mean_lp.values()) - min(mean_lp.values())
    if lp_spread > (1e-5 if device.type == "cpu" else 1e-2) * abs(mean_lp["trainer"]):
        raise RuntimeError(f"the paths disagree on the mean response log-prob: {mean_lp}")
    peak = Peak(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"bench/trainer.py: {name}, {torch.get_num_threads()} thread(s), "
          f"{n_params / 1e6:.1f} M parameters, {args.batch} samples, {tokens} tokens ({responses} response), "
          f"lengths {min(inputs) + 1}–{longest[0] + 1} (median {statistics.median(inputs) + 1:g}); "
          f"packed: {len(packed)} micro-batches under {args.micro_batch_tokens} tokens, "
          f"padded: {len(padded)} × {rows} rows of {longest[0]}; load average {os.getloadavg()[0]:.2f}",
          flush=True)

    seconds: dict[str, list[float]] = {p: [] for p in PATHS}
    peaks: dict[str, float] = {}
    for r in range(-args.warmup, args.rounds):  # negative rounds are warm-up, not recorded
        order = PATHS[r % 3:] + PATHS[:r % 3]
        for path in order:
            if r < 0:  # memory in the warm-up: on CPU its reset (malloc_trim) costs page faults later
                peaks[path] = measure_peak(steps[path], device, peak)
            else:
                seconds[path].append(timed(steps[path], device))
        if r >= 0:
            times = ", ".join(f"{p} {seconds[p][-1]:.2f} s" for p in PATHS)
            print(f"  round {r + 1}/{args.rounds}: {times}", flush=True)

    tflops = peak_tflops(device, args.peak_tflops)
    flops = model_flops(model, tokens, responses)
    paths = {}
    for p in PATHS:
        t = statistics.median(seconds[p])
        padded_tokens = sum(b.input_ids.numel() for b in layout[p])
        paths[p] = {"seconds": seconds[p], "median_s": t, "tokens_per_s": tokens / t,
                    "tokens_per_s_range": [tokens / max(seconds[p]), tokens / min(seconds[p])],
                    "padded_tokens": padded_tokens, "padding_fraction": 1 - tokens / padded_tokens,
                    "micro_batches": len(layout[p]), "peak_mib": peaks.get(p), "model_tflops": flops / t / 1e12,
                    "mfu": flops / t / 1e12 / tflops if tflops else None}

    def ratio(a: str, b: str) -> dict:
        per_round = [x / y for x, y in zip(seconds[a], seconds[b])]
        return {"median": statistics.median(per_round), "min": min(per_round), "max": max(per_round)}

    ratios = {"overhead": ratio("trainer", "bare/packed"), "packing": ratio("bare/padded", "bare/packed"),
              "trainer_vs_padded": ratio("bare/padded", "trainer")}
    ok = ratios["overhead"]["median"] <= TARGET_OVERHEAD and ratios["packing"]["median"] >= TARGET_PACKING
    return {"device": args.device, "device_name": name, "threads": torch.get_num_threads(),
            "load_average_1m": [load0, os.getloadavg()[0]], "parameters": n_params, "samples": args.batch,
            "tokens": tokens, "response_tokens": responses, "lengths": [len(s.tokens) for s in samples],
            "padded_rows": rows, "mean_logprob": mean_lp, "mean_logprob_spread": lp_spread,
            "model_flops_per_step": flops, "peak_tflops": tflops, "paths": paths, "ratios": ratios,
            "targets": {"overhead": TARGET_OVERHEAD, "packing": TARGET_PACKING}, "pass": ok}


def table(res: dict) -> str:
    mfu = res["peak_tflops"] is not None
    head = f"{'path':<12} {'tokens/s':>9} {'range':>15} {'padding':>8} {'mbs':>4} {'peak MiB':>9} {'TFLOP/s':>8}"
    lines = [head + (f" {'MFU':>6}" if mfu else "")]
    for p, r in res["paths"].items():
        lo, hi = r["tokens_per_s_range"]
        line = (f"{p:<12} {r['tokens_per_s']:>9.0f} {f'{lo:.0f}–{hi:.0f}':>15} {r['padding_fraction']:>7.1%} "
                f"{r['micro_batches']:>4} {r['peak_mib'] or math.nan:>9.0f} {r['model_tflops']:>8.3f}")
        lines.append(line + (f" {r['mfu']:>6.1%}" if mfu else ""))
    o, k, e = (res["ratios"][x] for x in ("overhead", "packing", "trainer_vs_padded"))
    lines += ["",
              f"overhead  trainer / bare packed time   {o['median']:.3f}  (rounds {o['min']:.3f}–{o['max']:.3f}; "
              f"target <= {TARGET_OVERHEAD}) {'ok' if o['median'] <= TARGET_OVERHEAD else 'MISSED'}",
              f"packing   padded / packed time         {k['median']:.2f}x (rounds {k['min']:.2f}–{k['max']:.2f}; "
              f"target >= {TARGET_PACKING}) {'ok' if k['median'] >= TARGET_PACKING else 'MISSED'}",
              f"end to end  bare padded / trainer time {e['median']:.2f}x (clawd's step vs a naive padded loop)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--model", type=Path, default=None, help="a Hugging Face model directory instead of a random Qwen2")
    p.add_argument("--shape", choices=SHAPES, default=None, help="the random model's shape (default: per device)")
    p.add_argument("--batch", type=int, default=None, help="samples per step")
    p.add_argument("--min-len", type=int, default=None, help="shortest sample (prompt + response tokens)")
    p.add_argument("--max-len", type=int, default=None, help="longest sample: the Pareto tail's cap")
    p.add_argument("--alpha", type=float, default=1.0, help="Pareto tail shape: lower = more long samples")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="the trainer's packing budget")
    p.add_argument("--padded-rows", type=int, default=None,
                   help="rows per padded micro-batch (default: budget // longest input)")
    p.add_argument("--mode", choices=("rl", "opd", "combine"), default="rl")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed rounds first (the last one measures peak memory)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, for MFU")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: 1 on CPU, torch's choice on CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="where the random model is saved (default: the temp dir)")
    p.add_argument("--out", type=Path, default=RESULTS / "trainer.json")
    args = p.parse_args(argv)
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    for k, v in DEFAULTS[kind].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.threads:
        torch.set_num_threads(args.threads)
    prov = provenance.stamp()
    t0 = time.monotonic()
    res = {"provenance": prov, **run(args)}
    res["wall_s"] = round(time.monotonic() - t0, 1)
    res["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print()
    print(table(res))
    print(f"load average (1 min) {res['load_average_1m'][0]:.2f} at the start, {res['load_average_1m'][1]:.2f} "
          f"at the end, on {os.cpu_count()} cores")
    print(f"\noverall: {'PASS' if res['pass'] else 'FAIL'} in {res['wall_s']:.0f} s")
    return provenance.write(res, args.out)


if __name__ == "__main__":
    sys.exit(main())
