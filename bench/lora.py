"""LoRA beside the full fine-tune, per publish: bytes and seconds written, the engine's swap, the trainer's peak memory.

`bench/swap.py --lora` runs this (so does `.venv/bin/python bench/lora.py`). One run, two arms on one model
(default SmolLM2-135M-Instruct, `make model`): **lora**, clawd's trainer with `[train.lora] rank` `--rank` (16)
and the default alpha and target modules (docs/ARCHITECTURE.md §15), and **full**, the same trainer
with rank 0. Side by side:

  trainer  per arm a fresh subprocess (this file, `--worker`): clawd's `Trainer` trains `--publishes`
           steps of bench/trainer_memory.py's batch and publishes after each as the daemon does
           (`Trainer.publish`, in the model's dtype: float32 for the default model). Per publish the
           seconds of that call (the write, its fsyncs and rename, pruning) and the bytes of the
           version directory. Its peak memory is the process's peak RSS (`getrusage` ru_maxrss, its
           high-water mark: the torch import, the base model, gradients, AdamW's state and the
           publishes), read after the last publish; parameter and AdamW bytes are counted too.
  engine   two CPU engines (`python -m clawd.engine.local`, one torch thread each) on the model: one
           plain, one with the flags a LoRA trainer gives it (`TrainConfig.lora_flags`). In `--rounds`
           rounds, their order alternating, the plain one gets `/update_weights_from_disk` of a full
           version and the LoRA one `/load_lora_adapter` of an adapter version beside the one it serves,
           then `/unload_lora_adapter` of that older one: the learner's swap in each mode (the daemon
           also pauses generation around a full update). Seconds from request to reply. The LoRA engine's
           first load (it wraps the model in PEFT) is shown apart. A `/generate` on each engine, naming
           the adapter on the LoRA one, checks both still serve.

Target: the full fine-tune writes ≥ `--target` (20) times the bytes of a LoRA publish. Ratios printed:
bytes, publish seconds, swap seconds, peak RSS. Exit status: 0 when measured and the target is met;
1 when it is missed; 2 when it could not measure (a worker or an engine failed; the JSON then holds the
error). The JSON (bench/results/lora.json) carries `provenance` (bench/provenance.py) and `pass`.

    .venv/bin/python bench/swap.py --lora                  # ~3 min on 2 cores; writes bench/results/lora.json
    .venv/bin/python bench/swap.py --lora --model tiny --publishes 2 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)

RESULTS = ROOT / "bench" / "results"
DEFAULT_MODEL = ROOT / "state/models/SmolLM2-135M-Instruct"
TARGET_BYTES_RATIO = 20.0
ARMS = ("lora", "full")


def dir_bytes(path: Path) -> int:
    """The bytes of every file under path (a published version directory)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(trainer: dict, engine: dict) -> dict:
    """Full over LoRA for bytes and seconds (how many times more the full fine-tune costs); LoRA over full
    for peak RSS (the share of the full fine-tune's memory LoRA needs)."""
    full, lora = trainer["full"], trainer["lora"]
    return {"bytes_full_over_lora": ratio(median(full["publish_bytes"]), median(lora["publish_bytes"])),
            "publish_s_full_over_lora": ratio(median(full["publish_s"]), median(lora["publish_s"])),
            "swap_s_full_over_lora": ratio(median(engine["update_weights_s"]), median(engine["load_lora_s"])),
            "peak_rss_lora_over_full": ratio(lora["peak_rss_bytes"], full["peak_rss_bytes"])}


def missed(r: dict, target: float) -> list[str]:
    got = r["bytes_full_over_lora"]
    return [] if got is not None and got >= target else [f"bytes per publish, full / LoRA {got}, target >= {target:g}"]


# --- the trainer arm (a fresh process each) ---------------------------------------------------

def worker(model: Path, state: Path, arm: str, rank: int, publishes: int, out: Path) -> None:
    import torch

    from clawd.config.train import LoraConfig, TrainConfig
    from clawd.trainer.worker.step import Trainer
    from trainer_memory import batch

    torch.set_num_threads(1)
    cfg = TrainConfig(keep_versions=publishes, checkpoint_every=10**6,
                      lora=LoraConfig(rank=rank if arm == "lora" else 0))
    trainer = Trainer(model, state, cfg)
    steps = []
    for version in range(1, publishes + 1):
        t0 = time.perf_counter()
        metrics = trainer.train_step(batch(), "rl")
        t1 = time.perf_counter()
        dest = trainer.publish(version)
        steps.append({"step_s": t1 - t0, "publish_s": time.perf_counter() - t1, "bytes": dir_bytes(dest),
                      "dir": str(dest), "files": sorted(p.name for p in dest.iterdir()), "skipped": metrics["skipped"]})
    optim = sum(v.numel() * v.element_size() for st in trainer.optimizer.state.values()
                for v in st.values() if isinstance(v, torch.Tensor))
    out.write_text(json.dumps({
        "arm": arm, "lora_rank": cfg.lora.rank, "lora_alpha": cfg.lora.alpha if cfg.lora.enabled else None,
        "learning_rate": cfg.learning_rate, "publish_dtype": trainer.publish_dtype,
        "params": sum(p.numel() for p in trainer.model.parameters()), "trainable_params": sum(p.numel() for p in trainer.params),
        "optimizer_bytes": optim, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "steps": steps}))


def run_arm(args, arm: str, work: Path) -> dict:
    out = work / f"{arm}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, __file__, "--worker", arm, "--model", str(args.model), "--rank",
                           str(args.rank), "--publishes", str(args.publishes), "--work", str(work / arm),
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0 or not out.exists():
        raise Measuring(f"the {arm} trainer exited {done.returncode}: {done.stderr[-3000:]}")
    res = json.loads(out.read_text())
    res["publish_s"] = [s["publish_s"] for s in res["steps"]]
    res["publish_bytes"] = [s["bytes"] for s in res["steps"]]
    res["wall_s"] = round(time.monotonic() - t0, 1)
    return res


class Measuring(RuntimeError):
    """Something the figures need failed: exit 2, the error in the JSON."""


# --- the engines ------------------------------------------------------------------------------

class Engine:
    """One CPU engine child on an inherited listening socket, talked to with urllib."""

    def __init__(self, model: Path, flags: tuple[str, ...], log: Path, timeout: float):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.log = log
        self.timeout = timeout
        with open(log, "w") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "clawd.engine.local", "--model", str(model),
                                          "--fd", str(self.sock.fileno()), "--threads", "1", "--context-length", "512",
                                          *flags], pass_fds=(self.sock.fileno(),), stdout=f, stderr=subprocess.STDOUT,
                                         env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}, cwd=ROOT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Measuring(f"engine exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/model_info", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening or not loaded yet: poll again
            time.sleep(0.5)
        raise Measuring(f"engine not ready in {self.timeout:g} s: {self.log.read_text()[-2000:]}")

    def post(self, path: str, body: dict) -> tuple[float, dict]:
        """Seconds from request to reply, and the reply; a non-200 is a Measuring error."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as reply:
                answer = json.loads(reply.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise Measuring(f"{path} answered {exc.code}: {exc.read()[:500]!r}") from None
        return time.perf_counter() - t0, answer

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.sock.close()


def measure_engines(args, trainer: dict, work: Path) -> dict:
    from clawd.config.train import LoraConfig, TrainConfig

    full_dirs = [s["dir"] for s in trainer["full"]["steps"]]
    lora_dirs = [s["dir"] for s in trainer["lora"]["steps"]]
    plain = Engine(args.model, (), work / "engine-full.log", args.timeout)
    lora = Engine(args.model, TrainConfig(lora=LoraConfig(rank=args.rank)).lora.flags(), work / "engine-lora.log",
                  args.timeout)
    out = {"update_weights_s": [], "load_lora_s": [], "unload_lora_s": [], "first_load_lora_s": None}
    try:
        plain.wait_ready()
        lora.wait_ready()
        out["first_load_lora_s"], _ = lora.post("/load_lora_adapter", {"lora_name": "a0", "lora_path": lora_dirs[0]})
        serving = "a0"
        for r in range(1, args.rounds + 1):
            def full_swap():
                path = full_dirs[r % len(full_dirs)]
                out["update_weights_s"].append(plain.post("/update_weights_from_disk",
                                                          {"model_path": path, "weight_version": str(r)})[0])

            def lora_swap():
                nonlocal serving
                name = f"a{r}"
                out["load_lora_s"].append(lora.post("/load_lora_adapter", {"lora_name": name,
                                                                            "lora_path": lora_dirs[r % len(lora_dirs)]})[0])
                out["unload_lora_s"].append(lora.post("/unload_lora_adapter", {"lora_name": serving})[0])
                serving = name

            for swap in ((full_swap, lora_swap) if r % 2 else (lora_swap, full_swap)):
                swap()
        probe = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        for engine, body in ((plain, probe), (lora, {**probe, "lora_path": serving})):
            _, answer = engine.post("/generate", body)
            if "meta_info" not in answer:
                raise Measuring(f"/generate after the swaps gave {answer!r}")
    finally:
        plain.stop()
        lora.stop()
    return out


# --- the run ---------------------------------------------------------------------------------

def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(res: dict) -> str:
    t, e, r = res["trainer"], res["engine"], res["ratios"]
    mb = lambda b: None if b is None else b / 1e6  # noqa: E731
    rows = [("", "LoRA", "full", "ratio"),
            ("trainable parameters", f"{t['lora']['trainable_params']:,}", f"{t['full']['trainable_params']:,}", ""),
            ("bytes per publish (MB, p50)", fmt(mb(median(t["lora"]["publish_bytes"])), ".2f"),
             fmt(mb(median(t["full"]["publish_bytes"])), ".1f"), fmt(r["bytes_full_over_lora"], ".1f") + "x fewer"),
            ("publish seconds (p50)", fmt(median(t["lora"]["publish_s"]), ".3f"), fmt(median(t["full"]["publish_s"]), ".3f"),
             fmt(r["publish_s_full_over_lora"], ".1f") + "x faster"),
            ("engine swap seconds (p50)", fmt(median(e["load_lora_s"]), ".3f"), fmt(median(e["update_weights_s"]), ".3f"),
             fmt(r["swap_s_full_over_lora"], ".1f") + "x faster"),
            ("  LoRA: first load / unload p50", fmt(e["first_load_lora_s"], ".3f"), fmt(median(e["unload_lora_s"]), ".3f"), ""),
            ("trainer peak RSS (MB)", fmt(mb(t["lora"]["peak_rss_bytes"]), ".0f"), fmt(mb(t["full"]["peak_rss_bytes"]), ".0f"),
             fmt(r["peak_rss_lora_over_full"], ".2f") + " of full"),
            ("AdamW state (MB)", fmt(mb(t["lora"]["optimizer_bytes"]), ".1f"), fmt(mb(t["full"]["optimizer_bytes"]), ".1f"), ""),
            ("training step seconds (p50)", fmt(median([s["step_s"] for s in t["lora"]["steps"]]), ".2f"),
             fmt(median([s["step_s"] for s in t["full"]["steps"]]), ".2f"), "")]
    return "\n".join(f"{a:<32} {b:>12} {c:>12}  {d}".rstrip() for a, b, c, d in rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory, or `tiny` (default SmolLM2-135M)")
    p.add_argument("--rank", "--lora-rank", type=int, default=16, help="the LoRA arm's lora_rank (default 16)")
    p.add_argument("--publishes", type=int, default=3, help="training steps and publishes per arm (default 3)")
    p.add_argument("--rounds", type=int, default=6, help="engine swap rounds (default 6)")
    p.add_argument("--target", type=float, default=TARGET_BYTES_RATIO, help="bytes per publish, full / LoRA, at least")
    p.add_argument("--timeout", type=float, default=600, help="seconds a worker or an engine call may take")
    p.add_argument("--out", "--json", dest="out", type=Path, default=RESULTS / "lora.json")
    p.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.rank, args.publishes, args.rounds) < 1:
        p.error("--rank, --publishes and --rounds must be at least 1")
    args.model = model_dir(p, args.model)
    return args


def model_dir(p: argparse.ArgumentParser, model: str) -> Path:
    """`--model`: a model directory, or `tiny` (the test model, cached under bench/results)."""
    if model == "tiny":
        from clawd.tools.models import cached_tiny_model
        return cached_tiny_model(RESULTS / "tiny-model")
    if not (Path(model) / "config.json").exists():
        p.error(f"no model at {model} (make model)")
    return Path(model)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.model, args.work, args.worker, args.rank, args.publishes, args.out)
        return 0
    prov = provenance.stamp()
    t0 = time.monotonic()
    # Under bench/results (git-ignored), not /tmp: on a tmpfs a publish's fsyncs would cost nothing.
    RESULTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lora-work-", dir=RESULTS))
    res: dict = {"provenance": prov, "model": str(args.model), "rank": args.rank, "cores": os.cpu_count(),
                 "peak_memory": "peak RSS (getrusage ru_maxrss) of a fresh trainer process per arm",
                 "targets": {"bytes_full_over_lora": args.target}}
    code = 0
    try:
        trainer = {arm: run_arm(args, arm, work) for arm in ARMS}
        engine = measure_engines(args, trainer, work)
        res.update(trainer=trainer, engine=engine, ratios=ratios(trainer, engine))
        res["missed"] = missed(res["ratios"], args.target)
        res["pass"] = not res["missed"]
        code = 0 if res["pass"] else 1
    except (Measuring, subprocess.TimeoutExpired) as exc:
        res.update(error=str(exc), missed=[], **{"pass": False})
        code = 2
    finally:
        shutil.rmtree(work)  # gigabytes of full versions; the figures are in the JSON
    res["wall_s"] = round(time.monotonic() - t0, 1)
    res["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    if code == 2:
        print(f"could not measure: {res['error']}", file=sys.stderr)
    else:
        print(f"\n{args.model.name}, LoRA rank {args.rank} vs full fine-tune, {args.publishes} publishes per arm, "
              f"{args.rounds} engine swaps each, load {os.getloadavg()[0]:.1f}\n")
        print(table(res))
        for m in res["missed"]:
            print("MISSED:", m, file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"\noverall: {'PASS' if res['pass'] else 'FAIL'} in {res['wall_s']:.0f} s; wrote {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
