"""The fake SGLang server answers with SGLang's shapes (sglang-http-api.md §2, §4, §5)."""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from tests.fake_sglang import (ABORTED, SAMPLING_KEYS, FakeSGLang, default_script, ids_logprobs, input_logprob,
                               lora_offset, output_logprob, row_logprob, shifted, token_text, top_logprobs)

META_KEYS = ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
             "reasoning_tokens", "completion_tokens", "cached_tokens", "weight_versions",
             "e2e_latency", "response_sent_to_client_ts"]
LOGPROB_KEYS = ["input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"]


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


async def post(http, fake, path, body):
    async with http.post(fake.url + path, json=body) as r:
        text = await r.text()
        return r.status, (json.loads(text) if r.content_type == "application/json" else text)


async def post_get(http, fake, path):
    async with http.get(fake.url + path) as r:
        text = await r.text()
        return r.status, (json.loads(text) if r.content_type == "application/json" else text)


async def sse(http, fake, body) -> list:
    """The events of a streamed /generate, "[DONE]" kept as a string."""
    async with http.post(fake.url + "/generate", json=body) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        raw = await r.text()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


async def until(cond, timeout=5.0):
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


# ---- /generate shapes -------------------------------------------------------------------------

async def test_single_response_shape(http):
    async with FakeSGLang(tokens=5) as fake:
        status, out = await post(http, fake, "/generate",
                                 {"input_ids": [5, 6, 7], "rid": "r1", "return_logprob": True})
    script = default_script([5, 6, 7], 5, 2)
    assert status == 200 and script[-1] == 2 and 2 not in script[:-1]
    assert list(out) == ["text", "output_ids", "meta_info"]
    assert out["output_ids"] == script
    assert out["text"] == "".join(map(token_text, script[:-1]))  # EOS trimmed from text only
    meta = out["meta_info"]
    assert sorted(meta) == sorted(META_KEYS + LOGPROB_KEYS)
    assert meta["id"] == "r1"
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (3, 5, 0)
    assert meta["weight_version"] == "0"
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": 5}]
    assert meta["input_token_logprobs"] == []
    assert meta["output_token_logprobs"] == [[output_logprob(t), t, None] for t in script]
    assert meta["output_token_logprobs_length"] == 5
    assert fake.requests == [{"input_ids": [5, 6, 7], "rid": "r1", "return_logprob": True}]
    assert fake.in_flight == 0


async def test_no_logprob_keys_without_return_logprob_and_default_rid(http):
    async with FakeSGLang(tokens=3) as fake:
        _, out = await post(http, fake, "/generate", {"input_ids": [1]})
    assert sorted(out["meta_info"]) == sorted(META_KEYS)
    assert len(out["meta_info"]["id"]) == 32  # uuid4 hex


async def test_stop_conditions(http):
    script = [10, 11, 12, 13, 14]
    async with FakeSGLang(lambda ids, sp: script) as fake:
        _, length = await post(http, fake, "/generate",
                               {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}})
        _, stop = await post(http, fake, "/generate",
                             {"input_ids": [1], "sampling_params": {"stop_token_ids": [12]}})
        _, kept = await post(http, fake, "/generate", {"input_ids": [1], "sampling_params": {
            "stop_token_ids": [12], "no_stop_trim": True}})
        _, past = await post(http, fake, "/generate", {"input_ids": [1]})  # script ends: EOS
        _, ignore = await post(http, fake, "/generate", {"input_ids": [1], "sampling_params": {
            "ignore_eos": True, "stop_token_ids": [12], "max_new_tokens": 7}})
        _, min_new = await post(http, fake, "/generate", {"input_ids": [1], "sampling_params": {
            "stop_token_ids": [11, 13], "min_new_tokens": 3}})
    assert length["output_ids"] == [10, 11]
    assert length["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert stop["output_ids"] == [10, 11, 12] and stop["text"] == "<10><11>"
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": 12}
    assert kept["text"] == "<10><11><12>"
    assert past["output_ids"] == script + [2]
    assert past["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert ignore["output_ids"] == script + [2, 2]
    assert ignore["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    assert min_new["output_ids"] == [10, 11, 12, 13]


async def test_responder_sees_ids_and_params_and_may_be_async(http):
    seen = []

    async def responder(ids, sp):
        seen.append((ids, sp))
        return [ids[0] + 100, 2]

    async with FakeSGLang(responder) as fake:
        _, out = await post(http, fake, "/generate",
                            {"input_ids": [7, 8], "sampling_params": {"temperature": 0.5}})
    assert out["output_ids"] == [107, 2]
    assert seen == [([7, 8], {"temperature": 0.5})]


async def test_batch_and_n(http):
    async with FakeSGLang(lambda ids, sp: [ids[0], 2]) as fake:
        _, batch = await post(http, fake, "/generate", {
            "input_ids": [[10], [20]], "rid": "b",
            "sampling_params": [{"max_new_tokens": 1}, {}]})
        _, rids = await post(http, fake, "/generate",
                             {"input_ids": [[10], [20]], "rid": ["x", "y"]})
        _, n = await post(http, fake, "/generate", {"input_ids": [10], "rid": "keep",
                                                    "sampling_params": {"n": 3}})
        status, bad = await post(http, fake, "/generate", {"input_ids": [[1], [2]], "rid": ["x"]})
    assert [o["output_ids"] for o in batch] == [[10], [20, 2]]
    assert [o["meta_info"]["id"] for o in batch] == ["b_0", "b_1"]
    assert [o["meta_info"]["finish_reason"]["type"] for o in batch] == ["length", "stop"]
    assert [o["meta_info"]["id"] for o in rids] == ["x", "y"]
    assert isinstance(n, list) and len(n) == 3
    assert len({o["meta_info"]["id"] for o in n} | {"keep"}) == 4  # fresh uuids for n > 1
    assert status == 400 and "message" in bad["error"]


async def test_prefill_scoring(http):
    ids = [11, 12, 13, 14, 15, 16]
    async with FakeSGLang() as fake:
        _, out = await post(http, fake, "/generate", {
            "input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 3})
        _, top = await post(http, fake, "/generate", {
            "input_ids": ids, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 4, "top_logprobs_num": 2})
        _, whole = await post(http, fake, "/generate", {
            "input_ids": ids, "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 6})
    assert out["output_ids"] == [] and out["text"] == ""
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["completion_tokens"] == 0 and meta["prompt_tokens"] == 6
    assert meta["output_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 0
    assert meta["input_token_logprobs"] == [
        [None, 14, None], [input_logprob(4, 15), 15, None], [input_logprob(5, 16), 16, None]]
    assert input_logprob(4, 15) != output_logprob(15)
    tmeta = top["meta_info"]
    assert tmeta["input_top_logprobs"] == [None, top_logprobs(input_logprob(5, 16), 16, 2, 4096)]
    # SGLang's one output row for a prefill-only request: the next-token distribution after the prompt
    first = default_script(ids, 32, 2)[0]
    assert tmeta["output_top_logprobs"] == [top_logprobs(input_logprob(6, first), first, 2, 4096)]
    assert tmeta["output_token_logprobs"] == [] and "output_token_ids_logprobs" not in tmeta
    assert whole["meta_info"]["input_token_logprobs"] == []


async def test_output_top_logprobs(http):
    async with FakeSGLang(lambda ids, sp: [30, 2]) as fake:
        _, out = await post(http, fake, "/generate", {
            "input_ids": [1], "return_logprob": True, "top_logprobs_num": 3})
    assert out["meta_info"]["output_top_logprobs"] == [
        [[output_logprob(30), 30, None], [output_logprob(30) - 0.5, 31, None],
         [output_logprob(30) - 1.0, 32, None]],
        top_logprobs(output_logprob(2), 2, 3, 4096)]


def test_row_functions_are_one_distribution():
    assert row_logprob(-1.0, 10, 10, 16) == -1.0 and row_logprob(-1.0, 10, 12, 16) == -2.0
    assert row_logprob(-1.0, 10, 9, 16) == -8.5  # wraps: 15 ids after 10
    assert top_logprobs(-1.0, 15, 3, 16) == [[-1.0, 15, None], [-1.5, 0, None], [-2.0, 1, None]]
    assert ids_logprobs(-1.0, 15, [1, 15, 1], 16) == [[-2.0, 1, None], [-1.0, 15, None], [-2.0, 1, None]]


async def test_token_ids_logprob_rows_and_text(http):
    ids, want = [40, 41, 42, 43], [7, 300, 7]
    async with FakeSGLang(lambda i, sp: [50, 51, 2]) as fake:
        _, out = await post(http, fake, "/generate", {
            "input_ids": ids, "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 2,
            "token_ids_logprob": want, "return_text_in_logprobs": True})
        _, off = await post(http, fake, "/generate", {
            "input_ids": ids, "token_ids_logprob": want, "top_logprobs_num": 2})
        _, zero = await post(http, fake, "/generate", {
            "input_ids": ids, "return_logprob": True, "top_logprobs_num": -1, "token_ids_logprob": []})
    text = lambda row: [[lp, tok, token_text(tok)] for lp, tok, _ in row]
    meta = out["meta_info"]
    assert meta["input_token_ids_logprobs"] == [None, text(ids_logprobs(input_logprob(3, 43), 43, want, 4096))]
    assert meta["input_top_logprobs"] == [None, text(top_logprobs(input_logprob(3, 43), 43, 2, 4096))]
    assert meta["output_token_ids_logprobs"] == [text(ids_logprobs(output_logprob(t), t, want, 4096))
                                                 for t in (50, 51, 2)]
    assert meta["input_token_logprobs"][0] == [None, 42, token_text(42)]
    assert meta["output_token_logprobs"][0] == [output_logprob(50), 50, token_text(50)]
    logprob_keys = {k for k in off["meta_info"] | zero["meta_info"] if "logprob" in k}
    assert logprob_keys == set(LOGPROB_KEYS)  # ignored without return_logprob; K <= 0 and [] are off


async def test_input_rows_carry_the_adapter_shift(http, tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": ["q_proj"]}))
    async with FakeSGLang(enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj"]) as fake:
        assert (await post(http, fake, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}))[0] == 200
        _, out = await post(http, fake, "/generate", {
            "input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1,
            "token_ids_logprob": [6], "lora_path": "x", "sampling_params": {"max_new_tokens": 0}})
    meta, lp = out["meta_info"], shifted(input_logprob(1, 6), "x")
    assert lora_offset("x") != 0 and meta["input_token_logprobs"][1][0] == lp
    assert meta["input_top_logprobs"] == [None, [[lp, 6, None]]]
    assert meta["input_token_ids_logprobs"] == [None, [[lp, 6, None]]]


async def test_stream_cumulative(http):
    async with FakeSGLang(lambda ids, sp: [10, 11, 2]) as fake:
        events = await sse(http, fake, {"input_ids": [1], "stream": True, "rid": "s",
                                        "return_logprob": True})
    assert events[-1] == "[DONE]" and len(events) == 4
    chunks = events[:-1]
    assert [c["output_ids"] for c in chunks] == [[10], [10, 11], [10, 11, 2]]
    assert [c["text"] for c in chunks] == ["<10>", "<10><11>", "<10><11>"]
    assert [c["meta_info"]["finish_reason"] for c in chunks] == [
        None, None, {"type": "stop", "matched": 2}]
    assert [len(c["meta_info"]["output_token_logprobs"]) for c in chunks] == [1, 2, 3]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    assert all(c["meta_info"]["id"] == "s" and "index" not in c for c in chunks)


async def test_stream_incremental_and_batch_index(http):
    responder = lambda ids, sp: [ids[0], 11, 2]  # noqa: E731
    async with FakeSGLang(responder, incremental_streaming_output=True) as fake:
        events = await sse(http, fake, {"input_ids": [1], "stream": True, "return_logprob": True})
        batch = await sse(http, fake, {"input_ids": [[5], [6]], "stream": True,
                                       "sampling_params": [{"max_new_tokens": 1}, {}]})
    chunks = events[:-1]
    assert [c["output_ids"] for c in chunks] == [[1], [11], [2]]
    assert "".join(c["text"] for c in chunks) == "<1><11>"
    assert [c["meta_info"]["output_token_logprobs"] for c in chunks] == [
        [[output_logprob(t), t, None]] for t in (1, 11, 2)]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    assert batch[-1] == "[DONE]"
    by_index = {0: [], 1: []}
    for c in batch[:-1]:
        by_index[c["index"]] += c["output_ids"]
    assert by_index == {0: [5], 1: [6, 11, 2]}


# ---- validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("sp, error", [
    ({"max_tokens": 5}, "unknown field `max_tokens`, expected one of "
     + ", ".join(f"`{k}`" for k in SAMPLING_KEYS)),
    ({"temperature": "hot"}, "invalid type: 'hot', expected a number for `temperature`"),
])
async def test_contract_errors(http, sp, error):
    async with FakeSGLang() as fake:
        status, out = await post(http, fake, "/generate", {"input_ids": [1], "sampling_params": sp})
    assert (status, out) == (400, {"error": error})


@pytest.mark.parametrize("body, message", [
    ({"sampling_params": {"top_k": 0}}, "top_k must be -1 (disable) or a positive integer, got 0."),
    ({"sampling_params": {"temperature": -0.5}}, "temperature must be non-negative, got -0.5."),
    ({"sampling_params": {"top_p": 0}}, "top_p must be in (0, 1], got 0."),
    ({"logprob_start_len": 5}, "logprob_start_len (5) is larger than the input length (1)."),
])
async def test_value_errors(http, body, message):
    async with FakeSGLang() as fake:
        status, out = await post(http, fake, "/generate", {"input_ids": [1], **body})
        events = await sse(http, fake, {"input_ids": [1], "stream": True, **body})
    assert (status, out) == (400, {"error": {"message": message}})
    assert events == [{"error": {"message": message, "type": "invalid_request_error",
                                 "code": 400, "retryable": False}}, "[DONE]"]


async def test_duplicate_rid_in_flight(http):
    async with FakeSGLang() as fake:
        fake.hang_next()
        hung = asyncio.create_task(post(http, fake, "/generate", {"input_ids": [1], "rid": "dup"}))
        await until(lambda: fake.in_flight == 1)
        status, out = await post(http, fake, "/generate", {"input_ids": [1], "rid": "dup"})
        await post(http, fake, "/abort_request", {"rid": "dup"})
        await hung
        again, _ = await post(http, fake, "/generate", {"input_ids": [1], "rid": "dup"})
    assert (status, out) == (400, {"error": {"message": "Duplicate request ID detected"}})
    assert again == 200


async def test_control_routes_need_a_json_body(http):
    async with FakeSGLang() as fake:
        async with http.post(fake.url + "/pause_generation") as r:
            status, out = r.status, await r.json()
    assert status == 400 and out["type"] == "Bad Request" and out["code"] == 400
    assert not fake.paused


# ---- abort ------------------------------------------------------------------------------------

async def test_abort_hanging_request_by_rid_prefix(http):
    async with FakeSGLang() as fake:
        fake.hang_next()
        hung = asyncio.create_task(post(http, fake, "/generate", {
            "input_ids": [1, 2], "rid": "abc123", "return_logprob": True}))
        await until(lambda: fake.in_flight == 1)
        status, body = await post(http, fake, "/abort_request", {"rid": "abc"})
        assert await fake.wait_for_abort("abc123", timeout=5) == {"rid": "abc"}
        hstatus, out = await hung
    assert (status, body) == (200, "")
    assert hstatus == 200 and out["output_ids"] == [] and out["meta_info"]["id"] == "abc123"
    assert out["meta_info"]["finish_reason"] == ABORTED
    assert out["meta_info"]["prompt_tokens"] == 2
    assert fake.aborted == [("abc123", "abort_request")] and fake.in_flight == 0


async def test_abort_slow_stream_keeps_partial_output(http):
    async with FakeSGLang(lambda ids, sp: list(range(10, 1000)), token_delay=0.002) as fake:
        async with http.post(fake.url + "/generate", json={
                "input_ids": [1], "rid": "slow", "stream": True}) as r:
            first = json.loads((await r.content.readuntil(b"\n\n"))[6:])
            await post(http, fake, "/abort_request", {"rid": "slow"})
            rest = [e for e in (await r.text()).split("\n\n") if e]
    assert first["meta_info"]["finish_reason"] is None
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][6:])
    assert last["meta_info"]["finish_reason"] == ABORTED
    n = len(last["output_ids"])
    assert 1 <= n < 990 and last["output_ids"] == list(range(10, 10 + n))


async def test_abort_all_and_unknown_rid(http):
    async with FakeSGLang() as fake:
        status, _ = await post(http, fake, "/abort_request", {"rid": "nobody"})
        fake.hang_next(2)
        tasks = [asyncio.create_task(post(http, fake, "/generate", {"input_ids": [i]}))
                 for i in (1, 2)]
        await until(lambda: fake.in_flight == 2)
        await post(http, fake, "/abort_request", {"abort_all": True})
        outs = await asyncio.gather(*tasks)
    assert status == 200
    assert [o["meta_info"]["finish_reason"] for _, o in outs] == [ABORTED, ABORTED]
    assert fake.abort_requests == [{"rid": "nobody"}, {"abort_all": True}]


async def test_wait_for_abort_times_out():
    async with FakeSGLang() as fake:
        with pytest.raises(TimeoutError):
            await fake.wait_for_abort("never", timeout=0.01)


async def test_client_disconnect_aborts(http):
    async with FakeSGLang(lambda ids, sp: list(range(10, 1000)), token_delay=0.002) as fake:
        async with http.post(fake.url + "/generate", json={
                "input_ids": [1], "rid": "gone", "stream": True}) as r:
            await r.content.readuntil(b"\n\n")
            r.close()
        fake.hang_next()
        task = asyncio.create_task(post(http, fake, "/generate",
                                        {"input_ids": [1], "rid": "gone2"}))
        await until(lambda: fake.in_flight == 1 and fake.aborted)
        task.cancel()
        await until(lambda: fake.in_flight == 0 and len(fake.aborted) == 2)
    assert fake.aborted == [("gone", "disconnect"), ("gone2", "disconnect")]
    assert fake.abort_requests == []


# ---- failure injection ------------------------------------------------------------------------

async def test_fail_next(http):
    async with FakeSGLang() as fake:
        fake.fail_next(503, {"object": "error", "message": "busy", "type": "503", "param": None,
                             "code": 503}, count=2)
        fake.fail_next(500, "boom")
        results = [await post(http, fake, "/generate", {"input_ids": [1]}) for _ in range(4)]
        fake.fail_next(400, {"success": False, "message": "no"}, path="/update_weights_from_disk")
        update = await post(http, fake, "/update_weights_from_disk", {"model_path": "/m"})
    assert [s for s, _ in results] == [503, 503, 500, 200]
    assert results[0][1]["message"] == "busy" and results[2][1] == "boom"
    assert update == (400, {"success": False, "message": "no"})
    assert fake.weight_version == "0" and len(fake.requests) == 4


@pytest.mark.parametrize("stream", [False, True])
async def test_drop_next(http, stream):
    async with FakeSGLang() as fake:
        fake.drop_next()
        with pytest.raises(aiohttp.ClientPayloadError):
            async with http.post(fake.url + "/generate",
                                 json={"input_ids": [1], "stream": stream}) as r:
                await r.read()
        status, _ = await post(http, fake, "/generate", {"input_ids": [1]})
    assert status == 200


# ---- weights, pause, cache, info --------------------------------------------------------------

async def test_weight_swap_with_retract_pause(http):
    async with FakeSGLang(lambda ids, sp: list(range(10, 1000)), token_delay=0.002) as fake:
        async with http.post(fake.url + "/generate", json={
                "input_ids": [1], "rid": "long", "sampling_params": {"max_new_tokens": 900},
                "stream": True}) as r:
            await r.content.readuntil(b"\n\n")
            paused = await post(http, fake, "/pause_generation", {"mode": "retract"})
            held = asyncio.create_task(post(http, fake, "/generate", {"input_ids": [3]}))
            ready, _ = await post_get(http, fake, "/ready")
            update = await post(http, fake, "/update_weights_from_disk",
                                {"model_path": "/ckpt/v7", "weight_version": "v7"})
            assert not held.done()
            resumed = await post(http, fake, "/continue_generation", {})
            while "v7" not in (await r.content.readuntil(b"\n\n")).decode():
                pass  # chunks generated before the pause may still be in flight
            await post(http, fake, "/abort_request", {"rid": "long"})
            events = [e for e in (await r.text()).split("\n\n") if e]
        _, later = await held
        _, info = await post_get(http, fake, "/model_info")
    assert paused == (200, {"message": "Generation paused successfully.", "status": "ok"})
    assert resumed == (200, {"message": "Generation continued successfully.", "status": "ok"})
    assert ready == 503
    assert update == (200, {"success": True, "num_paused_requests": 0, "message":
                            "Succeeded to update model weights. Weight version updated to v7."})
    last = json.loads(events[-2][6:])["meta_info"]
    spans = last["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "v7"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"]
    assert spans[1]["end"] == last["completion_tokens"] and last["num_retractions"] == 1
    assert later["meta_info"]["weight_version"] == "v7"
    assert info["weight_version"] == "v7" and info["model_path"] == "/ckpt/v7"
    assert fake.weight_updates == [{"model_path": "/ckpt/v7", "weight_version": "v7"}]
    assert [p for p, _ in fake.calls] == ["/pause_generation", "/update_weights_from_disk",
                                         "/continue_generation", "/abort_request"]


async def test_pause_abort_mode_aborts_and_holds(http):
    async with FakeSGLang() as fake:
        fake.hang_next()
        hung = asyncio.create_task(post(http, fake, "/generate", {"input_ids": [1], "rid": "h"}))
        await until(lambda: fake.in_flight == 1)
        await post(http, fake, "/pause_generation", {})
        _, out = await hung
        waiting = asyncio.create_task(post(http, fake, "/generate", {"input_ids": [1], "rid": "w"}))
        await until(lambda: fake.in_flight == 1)
        await post(http, fake, "/abort_request", {"rid": "w"})
        _, aborted_waiting = await waiting
    assert out["meta_info"]["finish_reason"] == ABORTED
    meta = aborted_waiting["meta_info"]
    assert meta["finish_reason"]["message"] == "Abort in waiting queue"
    assert not {"prompt_tokens", "cached_tokens", "reasoning_tokens"} & set(meta)
    assert fake.aborted == [("h", "pause"), ("w", "abort_request")]


async def test_update_without_pause_waits_for_running_requests(http):
    async with FakeSGLang() as fake:
        fake.hang_next()
        hung = asyncio.create_task(post(http, fake, "/generate", {"input_ids": [1], "rid": "h"}))
        await until(lambda: fake.in_flight == 1)
        update = asyncio.create_task(post(http, fake, "/update_weights_from_disk",
                                          {"model_path": "/m", "weight_version": "2"}))
        await until(lambda: fake.weight_updates)
        assert not update.done() and fake.weight_version == "0"
        await post(http, fake, "/abort_request", {"rid": "h"})
        assert (await update)[0] == 200 and fake.weight_version == "2"
        _, out = await hung
    assert out["meta_info"]["finish_reason"] == ABORTED


async def test_flush_cache_health_and_model_info(http):
    async with FakeSGLang(weight_version="v1", model_path="/models/x") as fake:
        flushed = [await post_get(http, fake, "/flush_cache"),
                   await post(http, fake, "/flush_cache", {})]
        async with http.get(fake.url + "/flush_cache") as r:
            assert r.content_type == "text/plain"
        health = await post_get(http, fake, "/health")
        _, info = await post_get(http, fake, "/model_info")
        fake.hang_next()
        hung = asyncio.create_task(post(http, fake, "/generate", {"input_ids": [1], "rid": "h"}))
        await until(lambda: fake.in_flight == 1)
        await post(http, fake, "/pause_generation", {"mode": "in_place"})
        busy = await post_get(http, fake, "/flush_cache")
        update = await post(http, fake, "/update_weights_from_disk",
                            {"model_path": "/m", "weight_version": "v2"})
        await post(http, fake, "/abort_request", {"abort_all": True})
        await hung
    assert all(s == 200 and t.startswith("Cache flushed.") for s, t in flushed)
    assert health == (200, "")
    assert info == {
        "model_path": "/models/x", "served_model_name": "/models/x", "tokenizer_path": "/models/x",
        "is_generation": True, "preferred_sampling_params": None, "weight_version": "v1",
        "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
        "disaggregation_mode": "null", "has_image_understanding": False,
        "has_audio_understanding": False, "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"]}
    assert busy[0] == 400
    assert update[0] == 400 and update[1]["success"] is False
    assert fake.weight_version == "v2"  # SGLang swaps the weights even when the flush fails


async def test_a_small_kv_pool_lowers_the_input_limit(http):
    """tp_worker.py: max_req_len = min(context - 1, KV pool - 1); the input limit is 5 under it."""
    async with FakeSGLang(context_length=4096, max_total_num_tokens=100) as fake:
        _, info = await post_get(http, fake, "/server_info")
        status, out = await post(http, fake, "/generate", {"input_ids": [1] * 94})
        _, fits = await post(http, fake, "/generate", {"input_ids": [1] * 93, "sampling_params": {
            "max_new_tokens": 50, "ignore_eos": True}})
    assert (info["context_length"], info["max_total_num_tokens"], info["max_req_input_len"]) == (4096, 100, 94)
    assert status == 400 and "maximum allowed length (94 tokens)" in out["error"]["message"]
    assert fits["meta_info"]["finish_reason"] == {"type": "length", "length": 5}  # 99 - 93 - 1


# ---- standalone -------------------------------------------------------------------------------

def test_standalone_prints_port_and_serves():
    script = Path(__file__).with_name("fake_sglang.py")
    with subprocess.Popen([sys.executable, str(script), "--port", "0", "--tokens", "4",
                           "--token-delay", "0.0", "--incremental-streaming-output"],
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            first = proc.stdout.readline()
            assert first.startswith("PORT ")
            port = int(first.split()[1])
            req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", method="POST",
                                         data=json.dumps({"input_ids": [1, 2]}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                out = json.loads(r.read())
            assert out["output_ids"] == default_script([1, 2], 4, 2)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
