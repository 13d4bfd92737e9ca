"""One rank of the trainer world, as torchrun starts it: `python -m clawd.trainer.worker.rank`
(docs/ARCHITECTURE.md §13; the coordinator and the torchrun line: `clawd.trainer.worker.world`).

Every rank joins the process group, gets the trainer's options (rank 0 from the coordinator's
socket, the others by broadcast: a host running `clawd-trainer@N` needs no configuration but the
rendezvous), builds the same handler over its shard of the model, and then runs every request
rank 0 receives and broadcasts. Only rank 0 replies. A fatal step ends every rank (the daemon
starts a new world from the last checkpoint); so does rank 0 losing the coordinator.

`CLAWD_FAULTS_RANKS` (e.g. "1") limits the fault points armed through CLAWD_FAULTS to the ranks it
names, so a test can kill or hang one rank of a world.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from multiprocessing.connection import Connection

from clawd import faults, startup
from clawd.trainer import child
from clawd.trainer.wire import recv_message, send_message
from clawd.trainer.worker.world import RELAY_ENV, out_of_memory_marker
from clawd.lifetime import die_with_parent

log = logging.getLogger("clawd.trainer")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m clawd.trainer.worker.rank", description=__doc__.splitlines()[0])
    parser.add_argument("--collective-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    die_with_parent()  # dies with torchrun
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which stops the world in order
    rank = os.environ.get("RANK", "0")
    if (only := os.environ.get("CLAWD_FAULTS_RANKS")) is not None and rank not in only.split(","):
        os.environ.pop(faults.ENV, None)
    logging.basicConfig(level="INFO", stream=sys.stderr, format=f"%(asctime)s %(levelname)s rank {rank} %(name)s: %(message)s")

    startup.loading()  # until the handler has loaded its shard of the model
    from clawd.trainer.worker import sharding  # torch, from here on
    from clawd.trainer.worker.handler import make

    world = sharding.join(args.collective_timeout)
    conn = _coordinator() if world.writer else None
    options = world.broadcast(conn.recv() if conn is not None else None)
    logging.getLogger().setLevel(str(options.get("log_level", "info")).upper())
    try:
        handler = make(options, world)
        ready = child.ready_message(handler)
        startup.loaded()
    except Exception as exc:
        if conn is not None:
            send_message(conn, child.error_reply(None, exc))
        raise SystemExit(1)
    if conn is not None:
        send_message(conn, ready)
    idle = args.collective_timeout / 3
    while True:
        msg = None
        if conn is not None:
            try:
                # The others wait for the next request in a broadcast, which times out like every collective:
                # while the daemon has nothing to ask, they are told so well within the timeout.
                msg = recv_message(conn) if conn.poll(idle) else {"type": "idle"}
            except (EOFError, OSError):
                msg = {"type": "shutdown"}  # the coordinator is gone: end the world with it
        msg = world.broadcast(msg)
        if msg.get("type") == "shutdown":
            break
        if msg.get("type") == "idle":
            continue
        reply = child.handle(handler, msg)
        if conn is not None:
            send_message(conn, _root_cause(reply))
        elif reply.get("kind") == "oom":  # rank 0 waits in a collective: the coordinator must say why
            _mark_out_of_memory(reply["message"])
        if reply.get("fatal"):
            log.error("exiting to be restarted from the last checkpoint: %s", reply["message"])
            raise SystemExit(1)
    import torch.distributed as dist

    dist.destroy_process_group()


def _root_cause(reply: dict) -> dict:
    """Rank 0's fatal reply when another local rank ran out of memory: its collective failed because that rank
    left, so the reply says "oom" (the batch is split), not "step" (the batch would be sent whole again)."""
    relay = os.environ.get(RELAY_ENV)
    if not (reply.get("fatal") and reply.get("kind") != "oom" and relay):
        return reply
    try:
        cause = out_of_memory_marker(relay).read_text()
    except FileNotFoundError:
        return reply
    return {**reply, "kind": "oom", "retryable": False, "message": f"OutOfMemory: {cause} (rank 0: {reply['message']})"}


def _mark_out_of_memory(message: str) -> None:
    """Tell this host's coordinator that the world ends because this rank ran out of memory, so that the
    daemon splits the batch instead of sending it whole to the next world (a rank on another host has no
    such path: its world's end reads as a crash, and the batch is sent again as after one)."""
    relay = os.environ.get(RELAY_ENV)
    if relay:
        try:
            with open(out_of_memory_marker(relay), "w") as f:
                f.write(f"rank {os.environ.get('RANK', '?')}: {message}")
        except OSError as exc:
            log.error("could not tell the coordinator of the out-of-memory: %s", exc)


def _coordinator() -> Connection:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ[RELAY_ENV])
    return Connection(sock.detach())


if __name__ == "__main__":
    main()
