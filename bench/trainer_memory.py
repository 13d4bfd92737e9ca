"""One trainer's memory per rank after a step: what bench/scale.py's trainer section runs, alone (one
process, no process group: clawd's trainer at world size 1) or under torchrun (a world of FSDP2 ranks).

    .venv/bin/python bench/trainer_memory.py MODEL_DIR WORK_DIR OUT.json [LORA_RANK]
    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 --standalone bench/trainer_memory.py MODEL_DIR WORK_DIR OUT.json

Each rank reports, after one optimizer step (AdamW's moments exist then), the bytes of its parameters
and of its optimizer state (local shards in a world) and its peak RSS; rank 0 writes them all to
OUT.json, with the seconds of its three steps. On CPU (gloo, one torch thread per rank), or on CUDA (NCCL,
one GPU per rank) where there is one: bench/gpu.py runs it as a world of 1 there. With LORA_RANK above 0
the trainer trains LoRA adapters (the base frozen: bf16 on CUDA, under FSDP2 beside float32 adapters) and
also publishes one adapter, whose bytes and dtypes are reported.

    .venv/bin/python bench/trainer_memory.py --startup MODEL_DIR

The start-up alone, side by side (CPU, gloo): each rank's peak host RSS (VmHWM) once its Trainer is built,
for one process, then 2 ranks that each load the whole model before sharding it (`sharded_load.whole`, how a
world started before), then 2 ranks built on the meta device with the weights read by rank 0 alone and
broadcast (`sharded_load.sharded`, how a world starts now). The sharded run also checks its gathered weights
and buffers against a plain `from_pretrained`, bit for bit. Prints a table; writes nothing.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clawd.samples import Sample  # noqa: E402
from clawd.config.train import LoraConfig, OptimizerConfig, TrainConfig, WorldConfig
from clawd.trainer.worker import sharded_load, sharding  # noqa: E402
from clawd.trainer.worker.step import Trainer  # noqa: E402


def batch(n: int = 8, length: int = 64, response: int = 16) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    return [Sample(sample_id=f"m{i}", mode="rl", session_id="m", turn_index=i, principal="p",
                   tokens=torch.randint(0, 1000, (length + i,), generator=g).tolist(), response_length=response,
                   loss_mask=[1] * response, rollout_logprobs=[-5.0] * response, temperature=1.0,
                   reward=1.0 if i % 2 else -1.0, teacher_logprobs=None, has_hint=False, policy_version=0,
                   created=0.0, scored=0.0) for i in range(n)]


def main() -> None:
    model_dir, work, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    lora_rank = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    torch.set_num_threads(1)
    world = sharding.join(120.0) if "RANK" in os.environ else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = Trainer(model_dir, work, TrainConfig(optimizer=OptimizerConfig(lr=1e-5), world=WorldConfig(device=device),
                                                   lora=LoraConfig(rank=lora_rank)), world=world)
    seconds = []
    for _ in range(3):  # the first step allocates AdamW's moments; the next ones are timed
        t0 = time.monotonic()
        trainer.train_step(batch(), "rl")
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        seconds.append(time.monotonic() - t0)
    local = lambda t: sharding.local(t)
    params = sum(local(p).numel() * local(p).element_size() for p in trainer.params)
    optim = sum(local(v).numel() * local(v).element_size() for st in trainer.optimizer.state.values()
                for v in st.values() if isinstance(v, torch.Tensor))
    full = sum(p.numel() * p.element_size() for p in trainer.params)  # a DTensor's numel is the whole tensor's
    mine = {"params_bytes": params, "optimizer_bytes": optim, "full_params_bytes": full,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "step_seconds": seconds,
            "device": str(trainer.device), "backend": None if world is None else torch.distributed.get_backend()}
    if trainer.device.type == "cuda":
        mine["peak_cuda_bytes"] = torch.cuda.max_memory_allocated(trainer.device)
    ranks = [mine] if world is None else world.gather(mine)
    report = {"world_size": 1 if world is None else world.size, "lora_rank": lora_rank, "ranks": ranks}
    if lora_rank:
        t0 = time.monotonic()
        published = trainer.publish(1)
        report["publish"] = {"seconds": time.monotonic() - t0,
                             "bytes": sum(f.stat().st_size for f in published.iterdir() if f.is_file()),
                             "files": sorted(f.name for f in published.iterdir())}
        if world is None or world.writer:
            from safetensors import safe_open
            with safe_open(str(published / "adapter_model.safetensors"), "pt") as f:
                report["publish"]["dtypes"] = sorted({str(f.get_slice(k).get_dtype()) for k in f.keys()})
        report["base_dtypes"] = sorted({str(p.dtype) for p in trainer.model.parameters() if not p.requires_grad})
        report["trainable_dtypes"] = sorted({str(p.dtype) for p in trainer.params})
    if world is None or world.writer:
        out.write_text(json.dumps(report))
    if world is not None:
        world.barrier()


def vm(field: str) -> int:
    """A /proc/self/status figure in bytes: VmHWM (peak RSS), VmRSS (now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def startup_rank(how: str, model_dir: Path, out: Path) -> None:
    """One process or rank of a `--startup` run: its RSS before and after building the Trainer (`how`: "whole",
    every rank loads the model; "sharded", the default in a world). Rank 0 writes every rank's to `out`."""
    torch.set_num_threads(1)
    world = sharding.join(600.0) if "RANK" in os.environ else None
    before = vm("VmHWM")  # torch imported, the process group joined
    if how == "whole":  # the start-up as it was: every rank of the world loads the model whole, then shards it
        sharded_load.sharded = lambda d, cfg, w, autocast: sharded_load.whole(d, cfg, w.device, w, autocast)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as state:
        trainer = Trainer(model_dir, state, TrainConfig(world=WorldConfig(device="cpu")), world=world)
        mine = {"hwm_before": before, "hwm_after": vm("VmHWM"), "rss_after": vm("VmRSS"),
                "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "seconds": time.monotonic() - t0}
        exact = None
        if how == "sharded":  # after the figures: the check gathers one tensor at a time onto rank 0
            got = {k: b.detach().cpu() for k, b in trainer.model.named_buffers()}
            for k, v in trainer.model.state_dict().items():
                full = sharding.full(v)  # every rank gathers; rank 0 keeps
                if world.writer:
                    got[k] = full.detach().cpu()
            if world.writer:
                from transformers import AutoModelForCausalLM
                ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
                want = {**ref.state_dict(), **dict(ref.named_buffers())}
                exact = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        ranks = [mine] if world is None else world.gather(mine)
        if world is None or world.writer:
            out.write_text(json.dumps({"ranks": ranks, "bit_exact": exact}))
        if world is not None:
            world.barrier()


def compare_startup(model_dir: Path) -> None:
    """The three start-ups of the model as stored, then of a bf16 copy of it, each in fresh processes (peak RSS
    only grows), and their tables. A float32 file is mapped, not read: its pages count in a rank's RSS only once
    touched (and, shared by the ranks, once in the host's memory). A bf16 file (as checkpoints ship) is upcast
    to float32: a copy of the model in each loading process's own memory."""
    with tempfile.TemporaryDirectory() as tmp:
        from transformers import AutoModelForCausalLM
        bf16 = Path(tmp) / f"{model_dir.name}-bf16"
        AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).save_pretrained(bf16)
        for d in (model_dir, bf16):
            startup_table(d)


def startup_table(model_dir: Path) -> None:
    me = str(Path(__file__).resolve())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone"]
    runs = [("1 process", [sys.executable, me], "whole"), ("2 ranks, whole load each", torchrun + [me], "whole"),
            ("2 ranks, sharded (new)", torchrun + [me], "sharded")]
    mib = lambda b: f"{b / 2**20:8.0f}"
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    print(f"\nstart-up host RSS per rank, MiB: {model_dir.name} ({weights / 2**20:.0f} MiB of weights on disk), CPU")
    print(f"{'':27}{'rank':>5} {'before':>8} {'peak':>8} {'peak-before':>11} {'after':>8} {'seconds':>8}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        for label, cmd, how in runs:
            out = Path(tmp) / "startup.json"
            subprocess.run([*cmd, "--startup-rank", how, str(model_dir), str(out)], env=env, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            report = json.loads(out.read_text())
            for r, m in enumerate(report["ranks"]):
                print(f"{label if r == 0 else '':27}{r:>5} {mib(m['hwm_before'])} {mib(m['hwm_after'])} "
                      f"{mib(m['hwm_after'] - m['hwm_before']):>11} {mib(m['rss_after'])} {m['seconds']:8.1f}")
            print(f"{'':27}{'all':>5} {'':8} {mib(sum(m['hwm_after'] for m in report['ranks']))}")
            if report["bit_exact"] is not None:
                print(f"{'':27}gathered weights and buffers equal from_pretrained's, bit for bit: "
                      f"{report['bit_exact']}")


if __name__ == "__main__":
    if sys.argv[1] == "--startup":
        compare_startup(Path(sys.argv[2]))
    elif sys.argv[1] == "--startup-rank":
        startup_rank(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
    else:
        main()
