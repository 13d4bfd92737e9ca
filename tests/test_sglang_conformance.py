"""What clawd relies on SGLang for, checked against the fake and the local engine alike.

Each test is one behaviour of SGLang 0.5.23 that clawd depends on. Its docstring
names where it was read: the released wheel (`sglang==0.5.23`), paths under
`sglang/srt/`, the files of the §10 table of sglang-http-api.md. Every test runs
twice, on `tests/fake_sglang.py` and on clawd's CPU engine (`clawd.engine.local`,
on the tiny model), both in this process on 127.0.0.1:0. The two share no code,
so each checks the other: a behaviour both show is the contract clawd codes to.

The local engine is wired as `python -m clawd.engine.local` wires it (parse_args,
Engine, build_app), its keys coming from a `--config` file as clawd passes them.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from dataclasses import dataclass

import aiohttp
import pytest
import torch
from aiohttp import web

from clawd.engine.local.scheduler import WAITING_TIMEOUT_ENV
from clawd.engine.local.scheduler import Engine as LocalEngine
from clawd.engine.local.server import build_app, parse_args
from tests.fake_sglang import FakeSGLang

CONTEXT = 1024  # both servers' context length
LIMIT = CONTEXT - 6  # max_req_input_len, SGLang's arithmetic (see test_server_info_reports_the_input_limit)
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
TIMED_OUT = {"type": "abort", "status_code": 503, "message": "Request waiting timeout reached."}
PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}
KEY, ADMIN_KEY = "k-ordinary-0123456789", "k-admin-9876543210"


@dataclass
class Server:
    kind: str  # "fake" | "local"
    url: str
    model_path: str


@pytest.fixture(params=["fake", "local"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def serve(kind, tiny_model, tmp_path):
    """serve(**options) -> async context manager of a Server of this test's kind.

    Options: incremental (--incremental-streaming-output), api_key / admin_api_key,
    max_running (max running requests) and waiting_timeout (SGLANG_REQ_WAITING_TIMEOUT).
    """
    @contextlib.asynccontextmanager
    async def start(incremental=False, api_key=None, admin_api_key=None, max_running=None,
                    waiting_timeout=None):
        if kind == "fake":
            # 1 ms a token, so a long request is still running when a control call arrives
            fake = FakeSGLang(tokens=32, token_delay=0.001, context_length=CONTEXT,
                              incremental_streaming_output=incremental, api_key=api_key,
                              admin_api_key=admin_api_key, max_running_requests=max_running,
                              waiting_timeout=waiting_timeout)
            async with fake:
                yield Server("fake", fake.url, fake.model_path)
            return
        argv = ["--model", str(tiny_model), "--context-length", str(CONTEXT), "--threads", "1",
                "--max-batch-size", str(max_running or 8)]
        if incremental:
            argv.append("--incremental-streaming-output")
        if api_key or admin_api_key:
            config = tmp_path / "engine.yaml"
            keys = {"api-key": api_key, "admin-api-key": admin_api_key}
            config.write_text(json.dumps({k: v for k, v in keys.items() if v}))
            argv += ["--config", str(config)]
        args = parse_args(argv)
        saved = os.environ.pop(WAITING_TIMEOUT_ENV, None)
        if waiting_timeout:
            os.environ[WAITING_TIMEOUT_ENV] = str(waiting_timeout)
        try:
            engine = LocalEngine(args)
        finally:
            os.environ.pop(WAITING_TIMEOUT_ENV, None)
            if saved is not None:
                os.environ[WAITING_TIMEOUT_ENV] = saved
        runner = web.AppRunner(build_app(engine), handler_cancellation=True, access_log=None)
        await runner.setup()
        run, threads = None, torch.get_num_threads()
        torch.set_num_threads(1)  # as clawd runs it (--threads): 2 threads on 2 busy cores are slower
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            engine.load()
            run = asyncio.create_task(engine.run())
            yield Server("local", f"http://127.0.0.1:{runner.addresses[0][1]}", str(tiny_model))
        finally:
            if run is not None:
                run.cancel()
                await asyncio.gather(run, return_exceptions=True)
            engine.shutdown()
            await runner.cleanup()
            torch.set_num_threads(threads)
    return start


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


async def call(http, server: Server, path: str, body=None, key: str | None = None, headers=None):
    """(status, JSON body or text) of a POST (with a body) or GET (without)."""
    headers = dict(headers or {})
    if key:
        headers["Authorization"] = f"Bearer {key}"
    method = "GET" if body is None else "POST"
    async with http.request(method, server.url + path, json=body, headers=headers) as resp:
        raw = await resp.read()
        if resp.content_type == "application/json":
            return resp.status, json.loads(raw)
        return resp.status, raw.decode()


async def sse(http, server: Server, body: dict, key: str | None = None) -> list[dict]:
    """A streamed /generate: its chunks, after checking the framing (data events, [DONE] last)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with http.post(server.url + "/generate", json={**body, "stream": True}, headers=headers) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        raw = (await resp.read()).decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], raw[-300:]
    assert all(e.startswith("data: ") for e in events[:-1])
    return [json.loads(e[len("data: "):]) for e in events[:-2]]


class Stream:
    """A streamed /generate read chunk by chunk, to act while it runs."""

    def __init__(self, http, server: Server, body: dict, key: str | None = None):
        self.ctx = http.post(server.url + "/generate", json={**body, "stream": True},
                             headers={"Authorization": f"Bearer {key}"} if key else {})
        self.chunks: list[dict] = []

    async def __aenter__(self) -> Stream:
        self.resp = await self.ctx.__aenter__()
        assert self.resp.status == 200
        return self

    async def __aexit__(self, *exc) -> None:
        await self.ctx.__aexit__(*exc)

    async def next(self) -> dict:
        event = await self.resp.content.readuntil(b"\n\n")
        assert event.startswith(b"data: ") and event != b"data: [DONE]\n\n"
        self.chunks.append(json.loads(event[len(b"data: "):]))
        return self.chunks[-1]

    async def rest(self) -> list[dict]:
        events = (await self.resp.read()).decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        self.chunks += [json.loads(e[len("data: "):]) for e in events[:-2]]
        return self.chunks


def long_body(rid: str | None = None, tokens: int = 1000) -> dict:
    """A request that runs for about a second on either server unless stopped."""
    body = {"input_ids": [11, 12, 13, 14], "return_logprob": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0}}
    return body if rid is None else {**body, "rid": rid}


def short_body(**params) -> dict:
    return {"input_ids": [21, 22, 23], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0, **params}}


async def until_registered(http, server: Server, rid: str) -> None:
    """Wait until `rid` is in flight. The probe reuses the rid with a prompt at the input limit:
    refused as a duplicate once the rid is taken, refused by the input limit before that, so
    it never runs and never takes the rid itself."""
    probe = {"input_ids": [7] * LIMIT, "rid": rid}
    for _ in range(2000):
        status, err = await call(http, server, "/generate", probe)
        assert status == 400
        if "Duplicate request ID" in err["error"]["message"]:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{rid} never showed up")


def ids_and_logprobs(out: dict) -> tuple[list, list]:
    return out["output_ids"], out["meta_info"]["output_token_logprobs"]


# --------------------------------------------------------------------------
# 1. /server_info

async def test_server_info_reports_the_input_limit(serve, http):
    """`/server_info` answers the scheduler's limits and the version; `/get_server_info` is its
    deprecated alias; `/model_info` (and `/get_model_info`) unchanged. SGLang 0.5.23:
    entrypoints/http_server.py (the routes), managers/tp_worker.py (max_req_len = min(context
    - 1, KV pool - 1); max_req_input_len = max_req_len - 5: a reserve of 6 under the context,
    so a prompt at the limit still leaves a few tokens to generate). The servers here report
    the context in force as `context_length` (SGLang echoes its --context-length flag, null when
    not given): clawd derives the prompt limit from `max_req_input_len`, which is always there."""
    async with serve() as server:
        status, info = await call(http, server, "/server_info")
        alias = await call(http, server, "/get_server_info")
        model = await call(http, server, "/model_info")
        model_alias = await call(http, server, "/get_model_info")
    assert status == 200 and alias == (200, info)
    assert info["max_req_input_len"] == LIMIT and type(info["max_req_input_len"]) is int
    assert info["context_length"] == CONTEXT and info["version"] == "0.5.23"
    assert info["max_total_num_tokens"] >= CONTEXT and info["internal_states"]
    assert not {"api_key", "admin_api_key"} & set(info)
    assert model[0] == 200 and model_alias == model
    assert {"model_path", "served_model_name", "tokenizer_path", "is_generation", "weight_version",
            "preferred_sampling_params", "model_type", "architectures"} <= set(model[1])


# --------------------------------------------------------------------------
# 2. The input limit

async def test_input_limit_refuses_long_prompts_and_trims_max_new_tokens(serve, http):
    """A prompt of `max_req_input_len` tokens or more is refused: HTTP 400 {"error": {"message"}}
    when not streamed; streamed, an abort chunk carrying status_code 400, then [DONE] (the
    scheduler aborts it; only a non-streamed abort with status 400 becomes HTTP 400).
    `max_new_tokens`, given or the default 128, is cut to the room left, max_req_len -
    len(prompt) - 1; a given one that with the prompt exceeds the context is refused (400).
    SGLang 0.5.23: managers/tp_worker.py (the limit), managers/scheduler.py
    (validate_input_length, the trim), managers/tokenizer_manager.py (_validate_one_request,
    _handle_abort_finish_reason), entrypoints/http_server.py."""
    message = (f"Input length ({LIMIT} tokens) exceeds the maximum allowed length ({LIMIT} tokens). "
               f"Use a shorter input or enable --allow-auto-truncate.")
    at_limit = {"input_ids": [9] * LIMIT, "sampling_params": {"max_new_tokens": 1}}
    below = [9] * (LIMIT - 1)  # room: CONTEXT - 2 - (LIMIT - 1) = 5 tokens
    async with serve() as server:
        refused = await call(http, server, "/generate", at_limit)
        chunks = await sse(http, server, at_limit)
        default = await call(http, server, "/generate", {"input_ids": below, "sampling_params": {
            "ignore_eos": True, "temperature": 0}})
        fitting = await call(http, server, "/generate", {"input_ids": below, "sampling_params": {
            "max_new_tokens": CONTEXT - len(below), "ignore_eos": True, "temperature": 0}})
        over = await call(http, server, "/generate", {"input_ids": below, "sampling_params": {
            "max_new_tokens": CONTEXT - len(below) + 1}})
        whole = await call(http, server, "/generate", {"input_ids": [9] * CONTEXT})
    assert refused == (400, {"error": {"message": message}})
    assert len(chunks) == 1 and chunks[0]["output_ids"] == []
    assert chunks[0]["meta_info"]["finish_reason"] == {
        "type": "abort", "message": message, "status_code": 400, "err_type": "BadRequestError"}
    for status, out in (default, fitting):
        assert status == 200 and len(out["output_ids"]) == 5
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert over[0] == 400 and over[1]["error"]["message"].startswith(
        f"Requested token count exceeds the model's maximum context length of {CONTEXT} tokens.")
    assert whole == (400, {"error": {"message": f"The input ({CONTEXT} tokens) is longer than the "
                                                 f"model's context length ({CONTEXT} tokens)."}})


# --------------------------------------------------------------------------
# 3. Aborts

async def test_abort_request_ends_requests_with_abort_and_http_200(serve, http):
    """`/abort_request {"rid"}` and `{"abort_all": true}` answer 200 with an empty body; the
    aborted request answers HTTP 200 with its partial output and finish_reason.type "abort"
    (a plain abort carries no status_code); an unknown rid is a no-op. SGLang 0.5.23:
    entrypoints/http_server.py, managers/tokenizer_manager.py (abort_request), managers/io_struct.py
    (AbortReq: over HTTP only rid and abort_all count)."""
    async with serve() as server:
        async with Stream(http, server, long_body("conf-stream-1")) as stream:
            await stream.next()
            assert await call(http, server, "/abort_request", {"rid": "conf-stream-1"}) == (200, "")
            chunks = await stream.rest()
        last = chunks[-1]
        assert last["meta_info"]["finish_reason"] == ABORTED
        assert 0 < last["meta_info"]["completion_tokens"] < 1000

        one = asyncio.create_task(call(http, server, "/generate", long_body("conf-plain-1")))
        await until_registered(http, server, "conf-plain-1")
        assert await call(http, server, "/abort_request", {"rid": "conf-plain-1"}) == (200, "")
        status, out = await one
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
        assert out["meta_info"]["finish_reason"]["status_code"] is None
        assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] < 1000

        tasks = [asyncio.create_task(call(http, server, "/generate", long_body(f"conf-all-{i}")))
                 for i in range(2)]
        for i in range(2):
            await until_registered(http, server, f"conf-all-{i}")
        assert await call(http, server, "/abort_request", {"rid": "no-such-rid"}) == (200, "")
        assert await call(http, server, "/abort_request", {"abort_all": True}) == (200, "")
        for status, out in await asyncio.gather(*tasks):
            assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"


async def test_aborts_carrying_a_status_are_http_errors(serve, http):
    """An abort the scheduler gives a status code (not /abort_request's, which never has one)
    comes back, when not streamed, as that HTTP error: 400 as {"error": {"message"}} (the input
    limit, previous test), 500 and 503 as {"object": "error", "message", "type": "<code>",
    "param": null, "code": <code>}; streamed, as the last chunk's finish_reason, HTTP 200.
    The reference's two sentences agree once read with the source: §10's "come back as HTTP
    400" is the 400 case, §1's 503 body the other. Here the 503 is SGLang's waiting timeout
    (SGLANG_REQ_WAITING_TIMEOUT): a request waiting for room in a full batch that long.
    SGLang 0.5.23: managers/tokenizer_manager.py (_handle_abort_finish_reason),
    managers/scheduler.py (_abort_on_waiting_timeout), entrypoints/http_server.py."""
    async with serve(max_running=1, waiting_timeout=0.2) as server:
        async with Stream(http, server, long_body("conf-busy")) as busy:
            await busy.next()  # running: the only place in the batch is taken
            status, body = await call(http, server, "/generate", short_body())
            chunks = await sse(http, server, short_body())
            await call(http, server, "/abort_request", {"rid": "conf-busy"})
            await busy.rest()
    assert (status, body) == (503, {"object": "error", "message": "Request waiting timeout reached.",
                                    "type": "503", "param": None, "code": 503})
    assert len(chunks) == 1 and chunks[0]["output_ids"] == []
    assert chunks[0]["meta_info"]["finish_reason"] == TIMED_OUT
    assert "prompt_tokens" not in chunks[0]["meta_info"]  # aborted in the waiting queue


# --------------------------------------------------------------------------
# 4. Pausing

@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
async def test_paused_requests_wait_and_updates_go_through(serve, http, mode):
    """After `/pause_generation {"mode"}` a new /generate waits (is not refused) until
    `/continue_generation`; `/ready` answers 503 meanwhile; `/update_weights_from_disk` is
    accepted while paused (in_place with flush_cache false: its KV stays, so a flush would fail).
    abort ends the running request (finish "abort"); retract parks it and it finishes after
    continue, `num_retractions` 1 and its `weight_versions` spanning both versions; in_place
    freezes it and it finishes after continue. SGLang 0.5.23: managers/io_struct.py
    (PauseGenerationReqInput), managers/scheduler.py, managers/tokenizer_manager.py (is_pause_cond,
    the writer lock skipped while paused), entrypoints/http_server.py."""
    async with serve() as server:
        async with Stream(http, server, long_body("conf-run", tokens=60)) as running:
            await running.next()
            assert await call(http, server, "/pause_generation", {"mode": mode}) == (200, PAUSED)
            waiting = asyncio.create_task(call(http, server, "/generate", short_body()))
            assert (await call(http, server, "/ready"))[0] == 503
            status, res = await call(http, server, "/update_weights_from_disk", {
                "model_path": server.model_path, "weight_version": "v2", "flush_cache": mode != "in_place"})
            assert (status, res["success"]) == (200, True)
            await asyncio.sleep(0.1)
            assert not waiting.done()
            assert await call(http, server, "/continue_generation", {}) == (200, CONTINUED)
            chunks = await running.rest()
        status, out = await waiting
    assert status == 200 and out["meta_info"]["weight_version"] == "v2"
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    meta = chunks[-1]["meta_info"]
    if mode == "abort":
        assert meta["finish_reason"] == ABORTED
        return
    assert meta["finish_reason"] == {"type": "length", "length": 60}
    assert meta["num_retractions"] == (1 if mode == "retract" else 0)
    old, new = meta["weight_versions"]
    assert (old["version"], old["start"], new["version"], new["end"]) == ("0", 0, "v2", 60)
    assert old["end"] == new["start"]


async def test_continue_when_not_paused_changes_nothing(serve, http):
    """`/continue_generation` when not paused answers 200 and disturbs nothing: clawd sends it
    whenever an engine becomes ready. SGLang 0.5.23: managers/tokenizer_manager.py
    (continue_generation), entrypoints/http_server.py."""
    async with serve() as server:
        assert await call(http, server, "/continue_generation", {}) == (200, CONTINUED)
        async with Stream(http, server, long_body("conf-steady", tokens=20)) as running:
            await running.next()
            assert await call(http, server, "/continue_generation", {}) == (200, CONTINUED)
            chunks = await running.rest()
        ready = await call(http, server, "/ready")
        status, out = await call(http, server, "/generate", short_body())
    meta = chunks[-1]["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 20} and meta["num_retractions"] == 0
    assert ready[0] == 200 and status == 200 and len(out["output_ids"]) == 4


# --------------------------------------------------------------------------
# 5. Keys

async def test_admin_key_guards_control_endpoints_and_refuses_the_api_key(serve, http, caplog):
    """With `--api-key K` and `--admin-api-key A`: /health*, /ready* stay open; /generate,
    /model_info, /server_info take K (not A); control endpoints take A and refuse K; a missing
    or wrong key is 401 {"error": "Unauthorized"}; `x-api-key` works as well as Bearer. The
    local engine reads both keys from its --config file and logs neither. SGLang 0.5.23:
    utils/auth.py (decide_request_auth; ADMIN_OPTIONAL routes), server_args_config_parser.py."""
    unauthorized = (401, {"error": "Unauthorized"})
    caplog.set_level(logging.DEBUG)
    async with serve(api_key=KEY, admin_api_key=ADMIN_KEY) as server:
        for path in ("/health", "/ready"):
            assert (await call(http, server, path))[0] == 200
        for path, body in (("/generate", short_body()), ("/model_info", None), ("/server_info", None)):
            assert await call(http, server, path, body) == unauthorized
            assert await call(http, server, path, body, key=ADMIN_KEY) == unauthorized
            assert (await call(http, server, path, body, key=KEY))[0] == 200
        assert (await call(http, server, "/model_info", headers={"x-api-key": KEY}))[0] == 200
        assert await call(http, server, "/model_info", key=KEY + "x") == unauthorized
        control = [("/abort_request", {"rid": "nobody"}), ("/pause_generation", {"mode": "abort"}),
                   ("/continue_generation", {}), ("/flush_cache", {}),
                   ("/update_weights_from_disk", {"model_path": server.model_path, "weight_version": "1"})]
        for path, body in control:
            assert await call(http, server, path, body) == unauthorized
            assert await call(http, server, path, body, key=KEY) == unauthorized
        for path, body in control:
            assert (await call(http, server, path, body, key=ADMIN_KEY))[0] == 200, path
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert KEY not in logged and ADMIN_KEY not in logged


async def test_api_key_alone_guards_everything_but_health(serve, http):
    """With only `--api-key K`, every endpoint but /health*, /ready*, /metrics* needs K, the
    control endpoints included. SGLang 0.5.23: utils/auth.py."""
    async with serve(api_key=KEY) as server:
        assert (await call(http, server, "/health"))[0] == 200
        for path, body in (("/generate", short_body()), ("/pause_generation", {}), ("/continue_generation", {})):
            assert await call(http, server, path, body) == (401, {"error": "Unauthorized"})
            assert (await call(http, server, path, body, key=KEY))[0] == 200


# --------------------------------------------------------------------------
# 6. Streams

@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_stream_reassembles_to_the_plain_answer(serve, http, incremental):
    """Streamed chunks are cumulative by default (each holds the whole output so far, log-probs
    likewise) and deltas with `--incremental-streaming-output`; either way the reassembled ids
    and log-probs equal the non-streamed answer's, and only the last chunk has a finish_reason.
    SGLang 0.5.23: managers/tokenizer_manager.py (_slice_streaming_output_meta_info)."""
    body = {**short_body(max_new_tokens=6), "rid": "conf-stream"}
    async with serve(incremental=incremental) as server:
        status, whole = await call(http, server, "/generate", body)
        chunks = await sse(http, server, body)
    assert status == 200 and len(whole["output_ids"]) == 6
    assert [c["meta_info"]["finish_reason"] is None for c in chunks] == [True] * (len(chunks) - 1) + [False]
    for c in chunks:
        assert len(c["output_ids"]) == len(c["meta_info"]["output_token_logprobs"])
    if incremental:
        ids = sum((c["output_ids"] for c in chunks), [])
        lps = sum((c["meta_info"]["output_token_logprobs"] for c in chunks), [])
        assert all(c["output_ids"] for c in chunks)
    else:
        for before, after in zip(chunks, chunks[1:]):
            assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
            assert after["meta_info"]["output_token_logprobs"][:len(before["output_ids"])] == \
                before["meta_info"]["output_token_logprobs"]
        ids, lps = ids_and_logprobs(chunks[-1])
    assert (ids, lps) == ids_and_logprobs(whole)
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


# --------------------------------------------------------------------------
# 7. The sampling_params contract

async def test_sampling_params_contract_and_neutral_values(serve, http):
    """Unknown keys inside `sampling_params` are refused, 400 {"error": "<text>"}; unknown
    top-level keys are ignored; `top_k: 0` is refused, 400 {"error": {"message"}}; the neutral
    values clawd sends on trainable turns are accepted and change nothing. SGLang 0.5.23:
    api/v1/api_types.py (the contract), sampling/sampling_params.py (verify)."""
    neutral = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
               "repetition_penalty": 1.0, "min_new_tokens": 0}
    base = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
    async with serve() as server:
        unknown = await call(http, server, "/generate", short_body(max_tokens=3))
        top_k = await call(http, server, "/generate", short_body(top_k=0))
        extra = await call(http, server, "/generate", {**short_body(), "clawd_turn": {"x": 1}})
        plain = await call(http, server, "/generate", {**short_body(), "sampling_params": base})
        spelled = await call(http, server, "/generate", {**short_body(), "sampling_params": {**base, **neutral}})
    assert unknown[0] == 400 and isinstance(unknown[1]["error"], str)
    assert unknown[1]["error"].startswith("unknown field `max_tokens`, expected one of ")
    assert top_k[0] == 400 and "top_k" in top_k[1]["error"]["message"]
    assert extra[0] == 200 and len(extra[1]["output_ids"]) == 4
    assert plain[0] == spelled[0] == 200
    assert ids_and_logprobs(plain[1]) == ids_and_logprobs(spelled[1])
