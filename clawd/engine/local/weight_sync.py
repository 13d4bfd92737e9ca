"""SGLang 0.5.23's weight update over torch.distributed, in the CPU engine (the protocol and its sources:
clawd.engine.weight_group). Routes:

    POST /init_weights_update_group     join a group (gloo only here; SGLang's default backend is nccl)
    POST /begin_weight_update           open a session (SGLang restores packed weights; nothing to do here)
    POST /update_weights_from_distributed   receive tensors from rank 0 and swap them in between batches
    POST /end_weight_update             close the session
    POST /destroy_weights_update_group  leave the group

Answers are SGLang's: {"success", "message"}, 200 or 400, with its messages where clawd reads them. The
rendezvous and the receive block on the other end, so they run in a thread while the loop goes on serving.
"""
from __future__ import annotations

import asyncio
import logging

import torch
import torch.distributed as dist
from aiohttp import web

from clawd.engine import weight_group
from clawd.engine.local.wire import BadBody

log = logging.getLogger("clawd.engine.cpu")

JOIN_TIMEOUT = 600.0  # SGLang's default process-group timeout would be 30 min; a trainer that never comes


class WeightSync:
    """The engine's weight-update groups and whether a session is open."""

    def __init__(self):
        self.groups: dict = {}
        self.session = False


def _answer(ok: bool, message: str) -> web.Response:
    return web.json_response({"success": ok, "message": message}, status=200 if ok else 400)


def _field(body: dict, name: str, kind: type, default=None):
    value = body.get(name, default)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise BadBody(f"{name} must be {kind.__name__}")
    return value


async def init_group(engine, body: dict) -> web.Response:
    address, port = _field(body, "master_address", str), _field(body, "master_port", int)
    rank_offset, world_size = _field(body, "rank_offset", int), _field(body, "world_size", int)
    name, backend = _field(body, "group_name", str, weight_group.DEFAULT_GROUP), _field(body, "backend", str, "nccl")
    if backend != "gloo":
        return _answer(False, f"Failed to initialize custom process group: the CPU engine joins gloo groups "
                              f"only, not {backend}.")
    try:
        group = await asyncio.to_thread(weight_group.join, address, port, world_size, rank_offset, name, backend,
                                        JOIN_TIMEOUT)
    except Exception as exc:  # the rendezvous failed or timed out: the caller's answer
        return _answer(False, f"Failed to initialize custom process group: {exc}.")
    engine.weight_sync.groups[name] = group
    log.info("joined weight-update group %s as rank %d of %d", name, rank_offset, world_size)
    return _answer(True, "Succeeded to initialize custom process group.")


async def begin(engine, body: dict) -> web.Response:
    if engine.weight_sync.session:
        return _answer(False, "a weight-update session is already open; call end_weight_update() first")
    engine.weight_sync.session = True
    return _answer(True, "Weight-update session opened.")


async def end(engine, body: dict) -> web.Response:
    if not engine.weight_sync.session:
        return _answer(False, "no weight-update session is open; call begin_weight_update() first")
    engine.weight_sync.session = False
    return _answer(True, "Weight-update session closed.")


async def update(engine, body: dict) -> web.Response:
    names, dtypes, shapes = _field(body, "names", list), _field(body, "dtypes", list), _field(body, "shapes", list)
    name = _field(body, "group_name", str, weight_group.DEFAULT_GROUP)
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise BadBody("weight_version must be a string")
    if not engine.weight_sync.session:
        return _answer(False, "update_weights_from_distributed must run between begin_weight_update() and "
                              "end_weight_update()")
    group = engine.weight_sync.groups.get(name)
    if group is None:
        return _answer(False, f"Failed to receive weights: no group {name!r}. Please call "
                              f"`init_weights_update_group` first.")
    try:
        bucket = weight_group.Bucket(tuple(names), tuple(dtypes), tuple(tuple(s) for s in shapes))
        tensors = await asyncio.to_thread(_receive, bucket, body.get("load_format"), group)
    except Exception as exc:
        return _answer(False, f"Failed to receive weights: {exc}")
    await engine.loaded.wait()
    if body.get("abort_all_requests") is True:
        engine.abort(None)
    status, result = await engine.update_weights(tensors, version)
    return _answer(status == 200, result["message"])


def _receive(bucket: weight_group.Bucket, load_format, group) -> dict:
    if load_format == "flattened_bucket":
        flat = torch.empty(bucket.nbytes, dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=group)
        return weight_group.unpack(bucket, flat)
    out = {}
    for n, d, s in zip(bucket.names, bucket.dtypes, bucket.shapes):  # one broadcast a tensor, in order
        out[n] = torch.empty(s, dtype=getattr(torch, d))
        dist.broadcast(out[n], src=0, group=group)
    return out


async def destroy(engine, body: dict) -> web.Response:
    group = engine.weight_sync.groups.pop(_field(body, "group_name", str, weight_group.DEFAULT_GROUP), None)
    if group is None:
        return _answer(False, "The group to be destroyed does not exist.")
    weight_group.leave(group)
    return _answer(True, "Succeeded to destroy custom process group.")


ROUTES = {"/init_weights_update_group": init_group, "/begin_weight_update": begin,
          "/update_weights_from_distributed": update, "/end_weight_update": end,
          "/destroy_weights_update_group": destroy}
