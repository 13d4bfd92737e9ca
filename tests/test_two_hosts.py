"""The trainer world across two hosts (docs/ARCHITECTURE.md §13), simulated by two network namespaces joined by a
veth pair (bench/hosts.py, also bench/scale.py's "hosts" section): node 0 through the daemon's trainer child in
namespace A, node 1 by `clawd-trainer@1`'s torchrun line in namespace B. A step there equals the step on the same
two ranks of one host. Needs root for the namespaces (CI runs as root); skipped, saying so, elsewhere.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.harness import load_bench

hosts = load_bench("hosts", "bench_hosts")


def test_gloo_listens_where_node_0_is_reached_and_leaves_a_one_host_world_alone():
    """The interface gloo listens on across hosts: the one the route to node 0 leaves by, never the loopback
    (where a host's own name often resolves, which the other hosts cannot reach); none for a world of one host."""
    from clawd.trainer.worker.sharding import gloo_interface

    assert gloo_interface("") is None
    assert gloo_interface("127.0.0.1") is None and gloo_interface("localhost") is None
    assert gloo_interface("no-such-host.invalid") is None
    names = {name for _, name in socket.if_nameindex()}
    for address in ("192.0.2.1", "10.231.0.1"):  # routed by this host's default route, if it has one
        found = gloo_interface(address)
        assert found is None or (found in names and found != "lo")


# One rank of a bare world: sharding.join as clawd's ranks call it, then a sum over both ranks.
# As clawd.trainer.worker.rank ends: the group destroyed before the interpreter exits (gloo's threads still running
# at exit end the process with "terminate called without an active exception", SIGABRT, now and then).
RANK = """
import json, os, torch
import torch.distributed as dist
from clawd.trainer.worker.sharding import join
world = join(20.0)
total = world.all_sum(torch.tensor([float(world.rank + 1)]))
print(json.dumps({"rank": world.rank, "sum": float(total), "interface": os.environ.get("GLOO_SOCKET_IFNAME")}))
world.barrier()
dist.destroy_process_group()
"""


def test_ranks_on_two_hosts_join_one_world(tmp_path):
    """A rank in namespace A (node 0, the rendezvous) and one in B join the process group and sum across the veth.
    Before gloo listened on the interface that reaches node 0, they never did: this machine's name resolves to
    127.0.0.1 in both namespaces, as it does to 127.0.1.1 on a stock Debian host, so each rank told the other to
    connect to its loopback. The whole step across the two hosts, against one host's: bench/scale.py --sections
    hosts (~25 s, over this suite's budget for a test)."""
    if why := hosts.unavailable():
        pytest.skip(reason=f"two network namespaces cannot be made here: {why}")
    try:
        with hosts.TwoHosts() as net:
            ranks = []
            for rank, side in enumerate("ab"):
                env = {**os.environ, "MASTER_ADDR": hosts.ADDRESS["a"], "MASTER_PORT": str(hosts.PORT),
                       "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}
                env.pop("GLOO_SOCKET_IFNAME", None)
                ranks.append(subprocess.Popen(net.run_in(side, [sys.executable, "-c", RANK]), cwd=hosts.ROOT, env=env,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            done = [r.communicate(timeout=120) for r in ranks]
            veths = dict(net.veth)
            names = set(net.ns.values())
    except hosts.Unavailable as exc:
        pytest.skip(reason=f"two network namespaces cannot be made here: {exc}")
    assert [r.returncode for r in ranks] == [0, 0], [err[-2000:] for _, err in done]
    got = [json.loads(out.splitlines()[-1]) for out, _ in done]
    assert [g["rank"] for g in got] == [0, 1] and [g["sum"] for g in got] == [3.0, 3.0]
    assert [g["interface"] for g in got] == [veths["a"], veths["b"]]
    assert not names & set(hosts.left_over())  # removed on the way out
