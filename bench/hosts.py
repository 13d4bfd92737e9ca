"""Two hosts on one machine, for bench/scale.py's "hosts" section: two network namespaces joined by a veth pair
(10.231.0.1/24 and 10.231.0.2/24, loopback up in both), and the trainer world of docs/ARCHITECTURE.md §13 across
them, launched as clawd launches it.

Node 0 runs in namespace A as `python bench/hosts.py node0 ...`: it builds a Config with `[train.world] nnodes`,
`rdzv_endpoint`, and spawns the trainer child through the daemon's own `TrainerLink(trainer_options(cfg))`,
whose coordinator (clawd/trainer/worker/world.py) starts torchrun for node 0. Node 1 runs in namespace B with the
torchrun line `bin/clawd --plan` prints for `clawd-trainer@1` (`world_launches`; this machine's interpreter in
place of the plan's `python3`). The same driver, outside the namespaces with `nnodes = 1, nproc_per_node = 2`,
is the one-host world it is compared with: the same batches, the same seed, the same two ranks.

Needs root (or CAP_NET_ADMIN) and iproute2; `unavailable()` says why not, and the section then reports that it
could not measure. Everything made here is removed on the way out, on failure and on Ctrl-C too.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SUBNET = "10.231.0"
ADDRESS = {"a": f"{SUBNET}.1", "b": f"{SUBNET}.2"}
PORT = 29500  # node 0's rendezvous; its namespace is new, so nothing else holds the port


class Unavailable(RuntimeError):
    """This machine cannot make the namespaces (not root, no iproute2, or the kernel refused)."""


def unavailable() -> str | None:
    """Why two namespaces cannot be made here, or None when they may be."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "not root: `ip netns add` needs CAP_SYS_ADMIN and CAP_NET_ADMIN"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise Unavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


class TwoHosts:
    """Namespaces A and B (names unique by pid), a veth pair between them, addresses and links up. A context
    manager: whatever part of it was made is removed on exit, whatever the exit."""

    def __init__(self) -> None:
        pid = os.getpid()
        self.ns = {"a": f"clawd-hosts-{pid}-a", "b": f"clawd-hosts-{pid}-b"}
        self.veth = {"a": f"cwh{pid}a", "b": f"cwh{pid}b"}  # interface names: 15 characters at most
        self.made: list[str] = []

    def __enter__(self) -> "TwoHosts":
        if why := unavailable():
            raise Unavailable(why)
        try:
            for side in "ab":
                _ip("netns", "add", self.ns[side])
                self.made.append(self.ns[side])
            _ip("link", "add", self.veth["a"], "type", "veth", "peer", "name", self.veth["b"])
            self.made.append("veth")
            for side in "ab":
                _ip("link", "set", self.veth[side], "netns", self.ns[side])
                _ip("-n", self.ns[side], "addr", "add", f"{ADDRESS[side]}/24", "dev", self.veth[side])
                _ip("-n", self.ns[side], "link", "set", "lo", "up")
                _ip("-n", self.ns[side], "link", "set", self.veth[side], "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """A veth moved into a namespace goes with it; one still here (setup failed midway) is deleted."""
        if "veth" in self.made:
            subprocess.run(["ip", "link", "del", self.veth["a"]], capture_output=True, timeout=30)
        for side in "ab":
            if self.ns[side] in self.made:
                subprocess.run(["ip", "netns", "del", self.ns[side]], capture_output=True, timeout=30)
        self.made.clear()

    def run_in(self, side: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side], *argv]


def left_over() -> list[str]:
    """This machine's namespaces named as TwoHosts names them (by any pid): what a killed run left."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in done.stdout.splitlines() if line.startswith("clawd-hosts-")]


# ---------------------------------------------------------------- the world's configuration and batches

def config(model: Path, state: Path, *, nnodes: int, nproc: int, endpoint: str, seed: int = 0):
    """The daemon's Config for one host of the world: the rules judge's rl mode, a visible learning rate,
    no base checkpoint and none during the steps (only the step and its publish are timed)."""
    from clawd.config.model import ModelConfig
    from clawd.config.schema import Config
    from clawd.config.scoring import ScoringConfig
    from clawd.config.state import StateConfig
    from clawd.config.versions import VersionsConfig
    from clawd.config.train import OptimizerConfig, TrainConfig, WorldConfig

    train = TrainConfig(seed=seed, checkpoint_every=1000, optimizer=OptimizerConfig(lr=1e-3),
                        world=WorldConfig(nnodes=nnodes, nproc_per_node=nproc, rdzv_endpoint=endpoint,
                                          collective_timeout=120.0))
    return Config(model=ModelConfig(path=str(model)), scoring=ScoringConfig(mode="rl"),
                  state=StateConfig(dir=str(state), min_free_bytes=0), train=train,
                  versions=VersionsConfig(rollback_depth=0))


def batch(step: int, vocab: int) -> list:
    """Six rl samples of 6 to 48 tokens, drawn from the step's number: every world trains the same ones."""
    from clawd.samples import Sample

    rng = random.Random(1000 + step)
    out = []
    for i, (length, response) in enumerate([(48, 20), (9, 4), (14, 6), (6, 3), (33, 12), (21, 10)]):
        out.append(Sample(sample_id=f"b{step}s{i}", mode="rl", session_id=f"h{i}", turn_index=0, principal="p",
                          tokens=[rng.randrange(vocab) for _ in range(length)], response_length=response,
                          loss_mask=[1] * response, rollout_logprobs=[-6.0 + rng.random() for _ in range(response)],
                          temperature=1.0, reward=(1.0, -1.0)[i % 2], teacher_logprobs=None, has_hint=False,
                          policy_version=step - 1, created=0.0, scored=0.0))
    return out


def weights_checksum(weights_dir: str) -> str:
    """sha256 over every published tensor's name, dtype, shape and bytes, in name order."""
    from safetensors import safe_open

    digest = hashlib.sha256()
    for path in sorted(Path(weights_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="np") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name)
                digest.update(f"{name}:{t.dtype}:{t.shape}".encode())
                digest.update(t.tobytes())
    return digest.hexdigest()


def node1_argv(cfg) -> list[str]:
    """`clawd-trainer@1`'s torchrun line as `bin/clawd --plan` prints it, run by this machine's interpreter."""
    from clawd.trainer.worker.world import world_launches

    launch = world_launches(cfg)[1]
    return [sys.executable, *launch.argv[1:]]


def driver(command: str, model: Path, state: Path, out: Path, **flags) -> list[str]:
    """This file's command line: `node0` (the daemon's trainer child, `flags`: nnodes, nproc, endpoint, steps)
    or `serve` (a daemon in front of the replica at `serve`)."""
    argv = [sys.executable, str(Path(__file__).resolve()), command, "--model", str(model), "--state", str(state),
            "--out", str(out)]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def run_driver(tmp: Path, name: str, model: Path, under: list[str], command: str, **flags) -> dict:
    """This file run as `command` under `under` (`ip netns exec NS`, or nothing), its log in tmp/name.log;
    what it measured. RuntimeError, with the log's end, when it failed."""
    out, log_path = tmp / f"{name}.json", tmp / f"{name}.log"
    with open(log_path, "w") as log:
        done = subprocess.run([*under, *driver(command, model, tmp / name / "state", out, **flags)], cwd=ROOT,
                              stdout=log, stderr=subprocess.STDOUT, timeout=900, env=_env())
    if done.returncode != 0:
        raise RuntimeError(f"{name}: exit {done.returncode}\n{log_path.read_text()[-3000:]}")
    return json.loads(out.read_text())


def _env() -> dict:
    # One torch thread per rank, as the coordinator gives node 0's ranks: the cores are few and shared.
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def one_host(tmp: Path, model: Path, steps: int) -> dict:
    """The steps on 2 ranks of this host (`--standalone`), through the daemon's trainer child."""
    return run_driver(tmp, "one-host", model, [], "node0", nnodes=1, nproc=2, steps=steps)


def two_hosts(net: TwoHosts, tmp: Path, model: Path, steps: int) -> tuple[dict, int, list[str]]:
    """The steps on 1 + 1 ranks: node 1 in B by clawd-trainer@1's line, node 0 in A through the daemon's trainer
    child. (what node 0 measured, node 1's exit status, node 1's command line)."""
    endpoint = f"{ADDRESS['a']}:{PORT}"
    argv = node1_argv(config(model, tmp / "two-hosts" / "state", nnodes=2, nproc=1, endpoint=endpoint))
    with open(tmp / "node1.log", "w") as log:
        node1 = subprocess.Popen(net.run_in("b", argv), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=_env())
    try:
        two = run_driver(tmp, "two-hosts", model, net.run_in("a", []), "node0", nnodes=2, nproc=1,
                         endpoint=endpoint, steps=steps)
        return two, node1.wait(60), argv
    finally:
        if node1.poll() is None:  # node 0 failed: torchrun stops its rank on SIGTERM
            node1.terminate()
            try:
                node1.wait(15)
            except subprocess.TimeoutExpired:
                node1.kill()
                node1.wait()


def compare(one: dict, two: dict) -> dict:
    """Step by step, the one-host world's against the two hosts': the published weights (their checksum), every
    numeric metric but the step's own seconds, and the seconds of each step's round trip (the daemon's view)."""
    steps = []
    for i, (a, b) in enumerate(zip(one["steps"], two["steps"]), 1):
        ma, mb = ({k: v for k, v in x["metrics"].items() if k != "seconds"} for x in (a, b))
        steps.append({"step": i, "weights_equal": a["weights_sha256"] == b["weights_sha256"],
                      "weights_sha256": b["weights_sha256"], "metrics_equal": ma == mb,
                      "unequal_metrics": sorted(k for k in ma.keys() | mb.keys() if ma.get(k) != mb.get(k)),
                      "loss": [ma.get("loss"), mb.get("loss")], "grad_norm": [ma.get("grad_norm"), mb.get("grad_norm")],
                      "seconds": [a["seconds"], b["seconds"]], "ratio": round(b["seconds"] / a["seconds"], 2),
                      "trainer_seconds": [round(a["metrics"].get("seconds", 0.0), 3),
                                          round(b["metrics"].get("seconds", 0.0), 3)]})
    equal = bool(steps) and len(one["steps"]) == len(two["steps"]) and all(
        s["weights_equal"] and s["metrics_equal"] for s in steps)
    later = steps[1:] or steps  # the first step also pays for FSDP's lazy set-up
    median = [statistics.median(s["seconds"][i] for s in later) for i in (0, 1)] if steps else [None, None]
    return {"equal": equal, "steps": steps, "ready_s": [one.get("ready_s"), two.get("ready_s")],
            "median_step_s_after_first": median,
            "median_ratio_after_first": round(median[1] / median[0], 2) if steps else None,
            "world_size": [one.get("world_size"), two.get("world_size")]}


def table(compared: dict, served: dict | None) -> str:
    steps = compared["steps"]
    head = "".join(f"  {'step ' + str(s['step']) + ' s':>9}" for s in steps)
    lines = [f"{'world (2 ranks, gloo, CPU)':<34}  {'ready s':>7}{head}"]
    for i, name in enumerate(("one host, 2 ranks (standalone)", "two hosts (netns A + B), 1 + 1")):
        lines.append(f"{name:<34}  {compared['ready_s'][i]:>7.1f}"
                     + "".join(f"  {s['seconds'][i]:>9.3f}" for s in steps))
    lines.append(f"{'two hosts / one host':<34}  {compared['ready_s'][1] / compared['ready_s'][0]:>7.2f}"
                 + "".join(f"  {s['ratio']:>9.2f}" for s in steps))
    if len(steps) > 1:
        median = compared["median_step_s_after_first"]
        lines.append(f"median step after the first: {median[0]:.3f} s on one host, {median[1]:.3f} s on two "
                     f"(x {compared['median_ratio_after_first']:.2f})")
    lines.append("equal per step (published weights' sha256, every metric): "
                 + ", ".join(f"{s['step']}: {'yes' if s['weights_equal'] and s['metrics_equal'] else 'NO'}"
                             + ("" if s["metrics_equal"] else f" ({', '.join(s['unequal_metrics'])})") for s in steps)
                 + "; loss " + ", ".join(f"{s['loss'][1]:.6g}" for s in steps))
    if served is not None:
        lines.append(f"chat through the daemon in A to the replica in B ({served['engine']}): HTTP {served['status']} "
                     f"in {served['seconds']:.3f} s, {served['completion_tokens']} tokens; the replica saw "
                     f"{served['replica_requests']} request(s)")
    return "\n".join(lines)


# ---------------------------------------------------------------- node 0: the daemon's trainer child

async def _node0(args: argparse.Namespace) -> dict:
    from clawd.trainer.link import TrainerLink
    from clawd.trainer.options import trainer_options

    cfg = config(args.model, args.state, nnodes=args.nnodes, nproc=args.nproc, endpoint=args.endpoint)
    vocab = min(json.loads((args.model / "config.json").read_text())["vocab_size"], 4096)
    t0 = time.monotonic()
    link = TrainerLink(trainer_options(cfg), ready_timeout=args.ready_timeout)
    out: dict = {"steps": []}
    try:
        ready = await link.start()
        out["ready_s"] = round(time.monotonic() - t0, 2)
        out["world_size"] = ready.world_size
        for step in range(1, args.steps + 1):
            started = time.monotonic()
            reply = await link.request({"type": "train", "batch_id": f"b{step}", "version": step,
                                        "samples": batch(step, vocab)}, args.step_timeout)
            seconds = time.monotonic() - started
            if reply["type"] != "trained" or reply.get("weights_dir") is None:
                raise RuntimeError(f"step {step}: {reply}")
            metrics = {k: v for k, v in reply["metrics"].items() if isinstance(v, (int, float))}
            out["steps"].append({"seconds": round(seconds, 3), "metrics": metrics,
                                 "weights_sha256": weights_checksum(reply["weights_dir"])})
    finally:
        out["trainer_exit"] = await link.stop(60)
    return out


def _serve(args: argparse.Namespace) -> dict:
    """One clawd daemon here (namespace A) whose one replica is `args.serve` (in namespace B), and one chat
    request through it, sent from here: the daemon listens on this namespace's loopback."""
    import scale  # noqa: PLC0415  (bench/scale.py; imported here: it imports this module)

    proc, url = scale.start_clawd(args.state.parent / "clawd", args.model, [args.serve])
    try:
        body = json.dumps({"model": "clawd", "max_tokens": 16, "messages": [
            {"role": "user", "content": "Which host answered?"}]}).encode()
        import urllib.request
        request = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json",
                                                                             "X-Session-Id": "two-hosts"})
        started = time.monotonic()
        with urllib.request.urlopen(request, timeout=60) as resp:
            reply = json.loads(resp.read())
        return {"status": resp.status, "seconds": round(time.monotonic() - started, 3),
                "completion_tokens": reply["usage"]["completion_tokens"], "engine": args.serve}
    finally:
        scale.stop(proc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="node 0 of bench/scale.py's hosts section (run inside namespace A)")
    p.add_argument("command", choices=["node0", "serve"])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--state", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--endpoint", default="")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--serve", default="", help="serve: the replica's URL")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--step-timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    out = asyncio.run(_node0(args)) if args.command == "node0" else _serve(args)
    args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: scale.py and provenance.py
    sys.exit(main())
