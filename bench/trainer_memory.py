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
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clawd.samples import Sample  # noqa: E402
from clawd.train_config import TrainConfig  # noqa: E402
from clawd.trainer import sharding  # noqa: E402
from clawd.trainer.step import Trainer  # noqa: E402


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
    trainer = Trainer(model_dir, work, TrainConfig(lr=1e-5, device="cuda" if torch.cuda.is_available() else "cpu",
                                                   lora_rank=lora_rank), world=world)
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


if __name__ == "__main__":
    main()
