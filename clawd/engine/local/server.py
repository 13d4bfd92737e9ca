"""clawd's CPU engine: a Hugging Face causal LM behind SGLang's native HTTP API.

It speaks the part of SGLang 0.5.23's API that clawd uses, with SGLang's JSON
shapes, so clawd runs unchanged on either engine (docs/ARCHITECTURE.md §10):

    POST /generate                  token-in/token-out, batches, log-probs, SSE
    POST /abort_request             by rid prefix, or abort_all
    POST /update_weights_from_disk  swap in a same-architecture HF directory
    POST /pause_generation, /continue_generation   modes abort | retract | in_place
    POST /load_lora_adapter, /unload_lora_adapter  (with --enable-lora; /generate's lora_path names one)
    GET  /health, /health_generate, /ready, /model_info, /server_info, /v1/models;  GET|POST /flush_cache
    (and SGLang's deprecated aliases /get_model_info, /get_server_info)

This module is the HTTP side and the process. The package's layers, each using
only the ones before it: wire (the request schema), sampling (token math),
model (loading, KV cache), adapters (LoRA with PEFT), sequences (a request's
state), compute (the thread the model's steps run on, and their progress),
scheduler (the queue and the batch loop), auth (API keys, the --config file),
server.

    python -m clawd.engine.local --model DIR [--fd N | --host 127.0.0.1 --port P]
        [--weight-version 0] [--seed 0] [--threads N] [--max-batch-size 8]
        [--context-length N] [--incremental-streaming-output] [--config FILE.yaml]
        [--enable-lora --max-lora-rank R --lora-target-modules M ... | all] [--max-loras-per-batch 8]
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import signal
import socket
import sys
import time

import torch
from aiohttp import web

from clawd import startup
from clawd.config.loading import ConfigError
from clawd.engine.local import adapters, auth, priority
from clawd.engine.local import weight_sync
from clawd.engine.local.responses import render
from clawd.engine.local.scheduler import Engine
from clawd.engine.local.sequences import Cursor, Group
from clawd.engine.local.wire import BadBody, ContractError, RequestError, max_req_input_len, parse_generate

log = logging.getLogger("clawd.engine.cpu")  # the engine's log namespace, as operators (and bench/swap.py) know it

ENGINE = web.AppKey("engine", Engine)
SGLANG_VERSION = "0.5.23"  # the SGLang release whose API this engine speaks (/server_info "version")


# --------------------------------------------------------------------------
# HTTP

def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _json(obj, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status, dumps=_dumps)


def _sse(obj) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


def _sse_response() -> web.StreamResponse:
    return web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})


def _bad_request(message: str) -> web.Response:
    # FastAPI's 422, as SGLang rewrites it to 400
    return _json({"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}, 400)


async def _body(request: web.Request) -> dict:
    try:
        body = json.loads(await request.read() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadBody(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadBody("body must be a JSON object")
    return body


def _abort_error(finish: dict | None) -> web.Response | None:
    """The HTTP error SGLang 0.5.23 makes of a non-streamed request aborted with a status
    (tokenizer_manager.py, _handle_abort_finish_reason); None for a plain abort or a finish.

    400 (e.g. the input limit) is its ValueError shape; 500 and 503 (e.g. the waiting
    timeout) its HTTPException shape; a streamed request gets the abort as its last chunk.
    """
    if not finish or finish.get("type") != "abort":
        return None
    code = finish.get("status_code")
    if code == 400:
        return _json({"error": {"message": finish["message"]}}, 400)
    if code in (500, 503):
        return _json({"object": "error", "message": finish["message"], "type": str(code), "param": None,
                      "code": code}, code)
    return None


def with_body(handler):
    """A POST handler `handler(request, engine, body)` that gets the engine and the JSON object body.

    A body that is not a JSON object, or a BadBody the handler raises while
    checking its fields, is answered 400 in FastAPI's shape.
    """
    @functools.wraps(handler)
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request, request.app[ENGINE], await _body(request))
        except BadBody as exc:
            return _bad_request(str(exc))
    return handle


@with_body
async def handle_generate(request: web.Request, engine: Engine, body: dict) -> web.StreamResponse:
    await engine.loaded.wait()
    stream = body.get("stream") is True
    try:
        items, is_batch, stream = parse_generate(
            body, lambda t: engine.tokenizer(t, add_special_tokens=True)["input_ids"])
        group = engine.submit(items, stream)
    except ContractError as exc:
        return _json({"error": str(exc)}, 400)
    except RequestError as exc:
        if not stream:
            return _json({"error": {"message": str(exc)}}, 400)
        # SGLang reports these inside an already started stream
        resp = _sse_response()
        await resp.prepare(request)
        await resp.write(_sse({"error": {"message": str(exc), "type": "invalid_request_error",
                                         "code": 400, "retryable": False}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp
    if stream:
        return await _stream(request, engine, group, is_batch)
    try:
        remaining = len(group.reqs)
        while remaining:
            i, _, final = await group.events.get()
            remaining -= final
            if final and (error := _abort_error(group.reqs[i].finish)) is not None:
                return error  # the whole call fails, as SGLang's gather does; the rest is aborted
    finally:
        engine.abort_group(group)  # cancelled on client disconnect: stop computing for nobody
    outs = [render(engine.tokenizer, engine.weight_version, r, len(r.output_ids), True) for r in group.reqs]
    return _json(outs if is_batch else outs[0])


async def _stream(request: web.Request, engine: Engine, group: Group, is_batch: bool) -> web.StreamResponse:
    resp = _sse_response()
    cursors = [Cursor() if engine.incremental else None for _ in group.reqs]
    try:
        await resp.prepare(request)
        remaining = len(group.reqs)
        while remaining:
            i, n, final = await group.events.get()
            remaining -= final
            chunk = render(engine.tokenizer, engine.weight_version, group.reqs[i], n, final, cursors[i])
            if is_batch:
                chunk["index"] = i
            await resp.write(_sse(chunk))
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        log.info("stream client went away")
    finally:
        engine.abort_group(group)
    return resp


@with_body
async def handle_abort(request: web.Request, engine: Engine, body: dict) -> web.Response:
    rid, everything = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(rid, str) or not isinstance(everything, bool):
        raise BadBody("rid must be a string and abort_all a boolean")
    if everything:
        n = engine.abort(None)
    elif rid:  # an empty prefix would match everything: only abort_all does that
        n = engine.abort(rid)
    else:
        n = 0
    # One per client that hung up (clawd counts those): a debug line; aborting everything is worth an info line.
    log.log(logging.INFO if everything else logging.DEBUG, "abort %s: %d request(s)",
            "all" if everything else repr(rid), n)
    return web.Response(status=200)


@with_body
async def handle_update_weights(request: web.Request, engine: Engine, body: dict) -> web.Response:
    path, version = body.get("model_path"), body.get("weight_version")
    if not isinstance(path, str) or not path:
        raise BadBody("model_path is required and must be a string")
    if version is not None and not isinstance(version, str):
        raise BadBody("weight_version must be a string")
    await engine.loaded.wait()
    if body.get("abort_all_requests") is True:
        engine.abort(None)
    status, result = await engine.update_weights(path, version)
    return _json(result, status)


@with_body
async def handle_pause(request: web.Request, engine: Engine, body: dict) -> web.Response:
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        raise BadBody(f"mode must be one of abort, retract, in_place; got {mode!r}")
    await engine.pause(mode)
    log.info("generation paused (%s)", mode)
    return _json({"message": "Generation paused successfully.", "status": "ok"})


@with_body
async def handle_continue(request: web.Request, engine: Engine, body: dict) -> web.Response:
    engine.resume()
    log.info("generation continued")
    return _json({"message": "Generation continued successfully.", "status": "ok"})


def _lora_name(body: dict, *keys: str) -> list[str]:
    values = [body.get(k) for k in keys]
    if not all(isinstance(v, str) and v for v in values):
        raise BadBody(" and ".join(keys) + " are required and must be non-empty strings")
    if body.get("pinned") is not None and not isinstance(body["pinned"], bool):
        raise BadBody("pinned must be a boolean")  # accepted and ignored: nothing here is ever evicted
    return values


@with_body
async def handle_load_lora(request: web.Request, engine: Engine, body: dict) -> web.Response:
    name, path = _lora_name(body, "lora_name", "lora_path")
    await engine.loaded.wait()
    try:
        return _json(await engine.adapters.load(engine.model, name, path))
    except adapters.AdapterError as exc:
        return _json(engine.adapters.answer(str(exc)), 400)


@with_body
async def handle_unload_lora(request: web.Request, engine: Engine, body: dict) -> web.Response:
    (name,) = _lora_name(body, "lora_name")
    await engine.loaded.wait()
    try:
        return _json(await engine.adapters.unload(name))
    except adapters.AdapterError as exc:
        return _json(engine.adapters.answer(str(exc)), 400)


async def handle_health(request: web.Request) -> web.Response:
    """/health and /health_generate, one handler as in SGLang 0.5.23: 200 once the model is making progress
    (Engine.progressing), 503 while loading or when nothing moves."""
    engine = request.app[ENGINE]
    return web.Response(status=200 if engine.loaded.is_set() and await engine.progressing() else 503)


async def handle_ready(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(status=200 if engine.loaded.is_set() and not engine.paused else 503)


def model_info(engine: Engine) -> dict:
    cfg = engine.model.config
    return {
        "model_path": engine.model_path, "served_model_name": engine.model_path,
        "tokenizer_path": engine.args.model, "is_generation": True, "preferred_sampling_params": None,
        "weight_version": engine.weight_version, "load_format": "auto", "reasoning_parser": None,
        "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": False,
        "has_audio_understanding": False, "model_type": cfg.model_type,
        "architectures": list(getattr(cfg, "architectures", None) or [type(engine.model).__name__]),
        "max_context_length": engine.context_len,
    }


def server_info(engine: Engine) -> dict:
    """SGLang's /server_info: server arguments, the scheduler's limits, `version`; never a key.

    `context_length` is the context in force (SGLang reports its --context-length flag,
    null when not given); `max_req_input_len` is what SGLang's scheduler computes from it;
    `max_total_num_tokens` (SGLang: the KV pool) is what a full batch can hold here.
    """
    args, context = engine.args, engine.context_len
    return {
        "model_path": engine.model_path, "tokenizer_path": args.model, "served_model_name": engine.model_path,
        "context_length": context, "max_running_requests": args.max_batch_size, "random_seed": args.seed,
        "incremental_streaming_output": args.incremental_streaming_output,
        "max_total_num_tokens": context * args.max_batch_size, "max_req_input_len": max_req_input_len(context),
        "internal_states": [{}], "version": SGLANG_VERSION, "engine": "clawd-cpu",
        "enable_lora": args.enable_lora, "max_lora_rank": args.max_lora_rank,
        "lora_target_modules": args.lora_target_modules, "max_loras_per_batch": args.max_loras_per_batch,
    }


def models(engine: Engine) -> dict:
    """OpenAI's model list as SGLang fills it: the base, then one card per loaded adapter whose
    parent is the base (its root the adapter's path, no max_model_len of its own)."""
    created = int(time.time())
    card = lambda name, root, parent, length: {"id": name, "object": "model", "created": created,
                                               "owned_by": "sglang", "root": root, "parent": parent,
                                               "max_model_len": length}
    data = [card(engine.model_path, engine.model_path, None, engine.context_len)]
    data += [card(name, path, engine.model_path, None) for name, path in engine.adapters.registered.items()]
    return {"object": "list", "data": data}


def _loaded(describe):
    async def handle(request: web.Request) -> web.Response:
        engine = request.app[ENGINE]
        if not engine.loaded.is_set():
            return _json({"error": {"message": "The model is still loading."}}, 503)
        return _json(describe(engine))
    return handle


async def handle_flush_cache(request: web.Request) -> web.Response:
    return web.Response(text="Cache flushed.\n", content_type="text/plain")  # there is no prefix cache


def build_app(engine: Engine) -> web.Application:
    keys = getattr(engine.args, "api_key", None), getattr(engine.args, "admin_api_key", None)
    middlewares = [auth.middleware(*keys)] if any(keys) else []
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=middlewares)
    app[ENGINE] = engine
    app.router.add_post("/generate", handle_generate)
    app.router.add_put("/generate", handle_generate)
    app.router.add_post("/abort_request", handle_abort)
    app.router.add_post("/update_weights_from_disk", handle_update_weights)
    app.router.add_post("/pause_generation", handle_pause)
    app.router.add_post("/continue_generation", handle_continue)
    app.router.add_post("/load_lora_adapter", handle_load_lora)
    app.router.add_post("/unload_lora_adapter", handle_unload_lora)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/health_generate", handle_health)
    app.router.add_get("/ready", handle_ready)
    for path, describe in (("/model_info", model_info), ("/get_model_info", model_info),
                           ("/server_info", server_info), ("/get_server_info", server_info),
                           ("/v1/models", models)):
        app.router.add_get(path, _loaded(describe))
    for path, handler in weight_sync.ROUTES.items():  # SGLang's weight update over torch.distributed
        app.router.add_post(path, with_body(lambda request, engine, body, handler=handler: handler(engine, body)))
    app.router.add_get("/flush_cache", handle_flush_cache)
    app.router.add_post("/flush_cache", handle_flush_cache)
    return app


# --------------------------------------------------------------------------
# Process

async def _watch_parent(ppid: int, stop: asyncio.Event) -> None:
    # Backs up the parent-death signal the launcher sets (a reparented child sees a new ppid).
    while os.getppid() == ppid:
        await asyncio.sleep(1.0)
    log.warning("parent process %d is gone; exiting", ppid)
    stop.set()


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    engine = Engine(args)
    runner = web.AppRunner(build_app(engine), handler_cancellation=True, access_log=None)
    await runner.setup()
    tasks = []
    try:
        if args.fd is not None:
            site = web.SockSite(runner, socket.socket(fileno=args.fd), shutdown_timeout=5.0)
        else:
            site = web.TCPSite(runner, args.host, args.port, shutdown_timeout=5.0)
        await site.start()
        log.info("listening on %s", site.name)
        ppid = os.getppid()
        if ppid != 1:
            tasks.append(asyncio.create_task(_watch_parent(ppid, stop)))
        await asyncio.sleep(0)
        engine.load()
        startup.loaded()
        run = asyncio.create_task(engine.run())
        tasks.append(run)
        stopped = asyncio.create_task(stop.wait())
        tasks.append(stopped)
        await asyncio.wait([run, stopped], return_when=asyncio.FIRST_COMPLETED)
        if run.done():
            run.result()  # the loop never returns: this re-raises its failure
        log.info("shutting down")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        engine.shutdown()
        await runner.cleanup()
        log.info("stopped")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m clawd.engine.local", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--fd", type=int, default=None, help="serve on this inherited, listening TCP socket")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--weight-version", default="0", help="initial weight-version label")
    ap.add_argument("--seed", type=int, default=0, help="seeds requests that carry no sampling_seed")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--context-length", type=int, default=None, help="default: the model's")
    ap.add_argument("--incremental-streaming-output", action="store_true",
                    help="stream chunks hold only new tokens (SGLang's flag of the same name)")
    ap.add_argument("--config", default=None, metavar="FILE.yaml",
                    help="flag values, as SGLang's --config; the only way to give api-key and admin-api-key")
    adapters.add_flags(ap)
    priority.add_flags(ap)
    keys = dict.fromkeys(auth.KEY_OPTIONS)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    config, _ = pre.parse_known_args(argv)
    if config.config is not None:
        try:
            keys = auth.apply_config(ap, config.config)
        except ConfigError as exc:
            ap.error(str(exc))
    args = ap.parse_args(argv)
    args.api_key, args.admin_api_key = keys["api_key"], keys["admin_api_key"]
    if args.max_batch_size < 1:
        ap.error("--max-batch-size must be at least 1")
    adapters.check_flags(ap, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights are local; never ask a hub
    import transformers
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    asyncio.run(serve(args))
    return 0
