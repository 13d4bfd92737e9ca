"""Weights over torch.distributed as SGLang 0.5.23 receives them (clawd.engine.weight_group), on clawd's CPU
engine in this process: the engine joins a gloo group beside the sender (rank 0, the trainer's end here played
by this test), receives flattened buckets inside a weight-update session, and serves exactly the weights sent;
without a session, or when the sender dies mid-bucket, it answers 400 and keeps serving its old weights."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import socket

import aiohttp
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from clawd.engine import weight_group
from clawd.engine.local.scheduler import Engine
from clawd.engine.local.server import parse_args
from tests.local_engine import running


def test_buckets_are_aligned_bounded_and_round_trip_exactly():
    torch.manual_seed(0)
    tensors = {"a": torch.randn(3), "b": torch.randn(5).to(torch.bfloat16), "c": torch.randn(4, 4),
               "d": torch.randint(0, 7, (3,)), "e": torch.randn(100)}
    found = weight_group.buckets(tensors, 100)
    assert [b.names for b in found] == [("d", "a", "c"), ("e",), ("b",)]  # widest first; e is alone
    assert [b.nbytes for b in found] == [24 + 12 + 64, 400, 10]
    for b in found:
        back = weight_group.unpack(b, weight_group.pack(b, tensors))
        assert all(torch.equal(back[n], tensors[n]) and back[n].dtype == tensors[n].dtype for n in b.names)
    with pytest.raises(ValueError, match="Unaligned"):
        weight_group.unpack(weight_group.Bucket(("x", "y"), ("bfloat16", "float32"), ((1,), (1,))),
                            torch.zeros(6, dtype=torch.uint8))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def send(port: int, buckets, die_at: int | None) -> None:
    """Rank 0 of the group, in a process of its own as the trainer is (a group name is one per process):
    joins, then broadcasts each flat bucket in turn; at `die_at` it leaves instead, half way."""
    group = weight_group.join("127.0.0.1", port, 2, 0, timeout=60)
    for i, flat in enumerate(buckets):
        if i == die_at:
            os._exit(0)  # gone in the middle of a publish: the receiver's broadcast fails
        dist.broadcast(flat, src=0, group=group)
    weight_group.leave(group)


def sender(port: int, buckets, die_at: int | None = None):
    process = multiprocessing.get_context("spawn").Process(target=send, args=(port, buckets, die_at), daemon=True)
    process.start()
    return process


async def post(http, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def test_the_cpu_engine_receives_the_weights_sent_bit_for_bit_inside_a_session(tiny_model):
    engine = Engine(parse_args(["--model", str(tiny_model), "--threads", "1", "--context-length", "512"]))
    torch.manual_seed(1)
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in
           AutoModelForCausalLM.from_pretrained(tiny_model).state_dict().items() if k != "lm_head.weight"}
    found = weight_group.buckets(new, 40_000)
    assert len(found) > 2  # several buckets, one broadcast each
    async with running(engine) as url, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        async def join(port: int) -> tuple[int, dict]:
            return await post(http, url + "/init_weights_update_group",
                              {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                               "world_size": 2, "group_name": weight_group.DEFAULT_GROUP, "backend": "gloo"})

        port = free_port()
        process = sender(port, [weight_group.pack(b, new) for b in found])
        assert await join(port) == (200, {"success": True, "message": "Succeeded to initialize custom process group."})
        status, out = await post(http, url + "/update_weights_from_distributed", found[0].request())
        assert status == 400 and "between begin_weight_update() and end_weight_update()" in out["message"]
        assert (await post(http, url + "/begin_weight_update", {}))[0] == 200
        for bucket in found:
            status, out = await post(http, url + "/update_weights_from_distributed",
                                     {**bucket.request(), "weight_version": "7"})
            assert status == 200 and out["success"], out
        assert out["message"] == "Succeeded to update parameter online. Weight version updated to 7."
        assert (await post(http, url + "/end_weight_update", {}))[0] == 200
        await asyncio.to_thread(process.join, 30)
        assert process.exitcode == 0
        assert (await post(http, url + "/destroy_weights_update_group", {}))[0] == 200
        served = engine.model.state_dict()
        assert all(torch.equal(served[k], v) for k, v in new.items()) and engine.weight_version == "7"
        assert torch.equal(served["lm_head.weight"], new["model.embed_tokens.weight"])  # tied

        # A sender that dies after the first bucket: 400; what arrived whole is in, the rest as it was.
        before = {k: v.clone() for k, v in served.items()}
        changed = {k: v + 1 for k, v in new.items()}
        port = free_port()
        process = sender(port, [weight_group.pack(b, changed) for b in found], die_at=1)
        assert (await join(port))[0] == 200
        assert (await post(http, url + "/begin_weight_update", {}))[0] == 200
        assert (await post(http, url + "/update_weights_from_distributed", found[0].request()))[0] == 200
        status, out = await post(http, url + "/update_weights_from_distributed", found[1].request())
        assert status == 400 and out["message"].startswith("Failed to receive weights"), out
        now = engine.model.state_dict()
        assert all(torch.equal(now[k], changed[k] if k in found[0].names else before[k]) for k in new)
        await asyncio.to_thread(process.join, 30)
