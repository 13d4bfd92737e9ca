"""The trainer world's coordinator: the spawned trainer child when the trainer is several ranks
(docs/ARCHITECTURE.md §13). No torch: it only starts torchrun and relays messages.

The daemon spawns one trainer child, as always (`clawd.trainer.child.main`), and talks to it over
its socket pair. With more than one rank (`[train.world]`) that child does not train. It starts torch's own
launcher, `python -m torch.distributed.run` (torchrun's elastic agent; across hosts a static
rendezvous with this host as node 0 and its master, on one host `--standalone`), which starts the
local ranks (`clawd.trainer.worker.rank`); other hosts join the same rendezvous with the same torchrun
line and their node rank (`clawd-trainer@N`, `world_argv(..., node_rank=N)`). Rank 0 is on this host and connects back to a Unix socket the
coordinator listens on; the coordinator sends it the trainer's options first, then relays every
message of `clawd.trainer.wire`, both ways, unchanged but for `ready`, which gets the coordinator's
pid and the world size. Rank 0 broadcasts each request to the others; every rank runs it.

Everything dies together: the coordinator dies with the daemon (PR_SET_PDEATHSIG) and torchrun with
the coordinator (the same, set between fork and exec); each rank with torchrun (the same, set at
its start), and rank 0 also on the relay's EOF. torchrun runs with no restarts: a rank that dies
makes it stop the others and exit; a rank that hangs makes the others' collectives time out
(`[train.world] collective_timeout`), raise, and exit. Either way the coordinator exits 1 and the
daemon's supervisor starts a new world from the last checkpoint, sending the batch again.
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

from clawd.devices import Launch, child_env, device_set
from clawd.trainer.wire import recv_message, relay_message, send_message
from clawd.lifetime import die_with_parent

log = logging.getLogger("clawd.trainer")

RELAY_ENV = "CLAWD_TRAINER_RELAY"   # the Unix socket rank 0 connects to


def out_of_memory_marker(relay: str) -> Path:
    """The file a local rank other than 0 writes when it ran out of memory mid-step (beside the relay)."""
    return Path(relay).with_name("out-of-memory")


def world_argv(train, *, node_rank: int = 0, endpoint: str = "", python: str = sys.executable) -> list[str]:
    """The torchrun line of one host of the trainer world (`train`: a TrainConfig). With an `endpoint`
    (host:port) every host meets there (static rendezvous); without one the world is this host's alone and
    torchrun's own store listens on a port the kernel gives it (`--standalone`), so no port is picked here
    and then lost to another process before the store binds it."""
    if endpoint:
        host, _, port = endpoint.rpartition(":")
        rendezvous = ["--rdzv-backend", "static", "--master-addr", host, "--master-port", port]
    else:
        rendezvous = ["--standalone", "--local-addr", "127.0.0.1"]
    return [python, "-m", "torch.distributed.run", "--nnodes", str(train.world.nnodes),
            "--nproc-per-node", str(train.world.ranks_per_node), "--node-rank", str(node_rank), *rendezvous,
            "--max-restarts", "0", "--monitor-interval", "0.5",
            "-m", "clawd.trainer.worker.rank", "--collective-timeout", str(train.world.collective_timeout)]


def world_launches(cfg) -> list[Launch]:
    """A trainer world's torchrun lines for `bin/clawd --plan`: this host's, started by the trainer child
    (the coordinator), then each other host's, run there by `clawd-trainer@N` (the same line, node rank N)."""
    train = cfg.train
    if train.world.size == 1:
        return []
    env = {**child_env(cfg, train.world.gpus, dict(os.environ), unbuffered=False),
           RELAY_ENV: "<the coordinator's socket>"}
    found = [Launch("trainer-ranks", tuple(world_argv(train, endpoint=train.world.rdzv_endpoint)), env, None,
                    device_set(train.world.gpus), cfg.learner.trainer_ready_timeout)]
    for node in range(1, train.world.nnodes):
        found.append(Launch(f"trainer-ranks on host {node} (clawd-trainer@{node})",
                            tuple(world_argv(train, node_rank=node, endpoint=train.world.rdzv_endpoint,
                                             python="python3")),
                            {}, None, device_set(train.world.gpus), cfg.learner.trainer_ready_timeout))
    return found


def coordinate(conn: Connection, options: dict) -> None:
    """The coordinator's life: torchrun, rank 0's connection, then the relay until shutdown. Exits 1
    (SystemExit) when the world ends on its own or rank 0 goes away."""
    train = options["train"]
    runtime = Path(tempfile.mkdtemp(prefix="clawd-trainer-"))
    path = str(runtime / "relay.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    env = {**os.environ, RELAY_ENV: path}
    for name, value in options.get("env", {}).items():  # its GPUs, scrubbed secrets
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default for several ranks, without its warning
    argv = world_argv(train, endpoint=train.world.rdzv_endpoint)
    log.info("trainer world: %d rank(s) on %d host(s): %s", train.world.size, train.world.nnodes, " ".join(argv))
    # die_with_parent between fork and exec: torchrun dies with the coordinator.
    proc = subprocess.Popen(argv, env=env, preexec_fn=die_with_parent)
    try:
        rank0 = _accept(listener, proc, float(options.get("ready_timeout", 600.0)))
        rank0.send(options)
        ready = recv_message(rank0)  # ready or error, as a child's
        if ready.get("type") == "ready":
            ready = {**ready, "pid": os.getpid(), "world_size": train.world.size}
        send_message(conn, ready)
        if ready.get("type") != "ready":
            raise SystemExit(1)
        _relay(conn, rank0, proc, out_of_memory_marker(path))
    finally:
        listener.close()
        _end(proc)
        for p in runtime.iterdir():
            p.unlink()
        runtime.rmdir()


def _accept(listener: socket.socket, proc: subprocess.Popen, timeout: float) -> Connection:
    listener.settimeout(0.5)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.error("trainer world: torchrun exited with %s before rank 0 connected", proc.returncode)
            raise SystemExit(1)
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            continue
        sock.setblocking(True)
        return Connection(sock.detach())
    log.error("trainer world: rank 0 did not connect within %.0fs", timeout)
    raise SystemExit(1)


def _relay(conn: Connection, rank0: Connection, proc: subprocess.Popen, marker: Path) -> None:
    pidfd = os.pidfd_open(proc.pid)
    try:
        while True:
            ready = wait([conn, rank0, pidfd])
            if conn not in ready:  # idle, and rank 0 wrote or closed, or torchrun ended: the world is gone
                log.error("trainer world: it ended while idle (torchrun: %s)", proc.poll())
                raise SystemExit(1)
            try:
                msg = relay_message(conn, rank0)
            except EOFError:
                return  # the daemon is gone
            except OSError:
                log.error("trainer world: rank 0 went away (torchrun: %s)", proc.poll())
                raise SystemExit(1)
            if msg.get("type") == "shutdown":
                proc.wait()
                return
            try:
                reply = relay_message(rank0, conn)
            except (EOFError, OSError):
                log.error("trainer world: rank 0 went away during %r (torchrun: %s)", msg.get("type"), proc.poll())
                _report_out_of_memory(conn, msg, marker)
                raise SystemExit(1)
            if reply.get("fatal"):
                raise SystemExit(1)  # every rank exits after a fatal step; the daemon starts a new world
    finally:
        os.close(pidfd)


def _report_out_of_memory(conn: Connection, msg: dict, marker: Path) -> None:
    """The world ended mid-request because a rank other than 0 ran out of memory (its marker says so): the
    daemon gets the error reply rank 0 could not send, kind "oom", so it splits the batch."""
    try:
        text = marker.read_text()
    except FileNotFoundError:
        return
    send_message(conn, {"type": "error", "batch_id": msg.get("batch_id"), "message": f"OutOfMemory: {text}",
                        "retryable": False, "kind": "oom", "fatal": True})


def _end(proc: subprocess.Popen) -> None:
    """torchrun is asked to stop its ranks (SIGTERM), then killed."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
