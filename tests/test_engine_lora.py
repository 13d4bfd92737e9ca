"""LoRA in clawd's CPU engine: what only a real model can show (the API shapes are in
test_sglang_conformance.py, run on the fake as well).

The engine runs in this process on 127.0.0.1:0, wired as `python -m clawd.engine.local` wires it.
Adapters are built with PEFT on the tiny model with non-zero B, so each one changes the outputs;
the reference for a row with adapter X is PEFT's own `PeftModel.from_pretrained(base, X)` forward.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from clawd.engine.local.adapters import ALL_TARGETS, Adapters, unmatched_weights
from clawd.engine.local.scheduler import Engine
from clawd.engine.local.server import parse_args
from tests.local_engine import running

TOL = 1e-5
PROMPTS = ([5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19])


@contextlib.contextmanager
def peft_quiet():
    """PEFT 0.21 reads a property transformers 5 deprecated: a FutureWarning about nothing here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def build_adapter(model_dir: Path, dest: Path, seed: int, targets: list[str], r: int = 4,
                  task_type: str | None = None) -> Path:
    """A PEFT adapter directory on the tiny model; init_lora_weights=False gives B != 0."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]), peft_quiet():
        torch.manual_seed(seed)
        peft = get_peft_model(base, LoraConfig(r=r, lora_alpha=8, target_modules=targets,
                                               init_lora_weights=False, task_type=task_type))
    peft.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def lora_dirs(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {"a": build_adapter(tiny_model, root / "a", 1, ["q_proj", "v_proj"]),
            # saved as a causal-LM adapter (PeftModelForCausalLM), as a trainer may save it
            "b": build_adapter(tiny_model, root / "b", 2, ["q_proj", "k_proj", "o_proj", "down_proj"],
                               task_type="CAUSAL_LM")}


@pytest.fixture(scope="module")
def refs(tiny_model, lora_dirs):
    """Reference models: the base, and base + each adapter as PEFT builds it."""
    load = lambda: AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    out = {None: load()}
    for name, path in lora_dirs.items():
        with peft_quiet():
            out[name] = PeftModel.from_pretrained(load(), path).eval()
    return out


@contextlib.asynccontextmanager
async def serve(tiny_model, *flags: str):
    args = parse_args(["--model", str(tiny_model), "--threads", "1", "--context-length", "512",
                       "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", *flags])
    engine = Engine(args)
    async with running(engine) as url, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        yield engine, Client(http, url)


class Client:
    def __init__(self, http, url: str):
        self.http, self.url = http, url

    async def post(self, path: str, body: dict) -> tuple[int, dict]:
        async with self.http.post(self.url + path, json=body) as resp:
            return resp.status, json.loads(await resp.read() or b"null")

    async def load(self, name: str, path: Path) -> dict:
        status, out = await self.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert status == 200 and out["success"], out
        return out


def body(prompts, lora, tokens: int = 6, **extra) -> dict:
    return {"input_ids": prompts, "lora_path": lora, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}, **extra}


def reference(model, prompt: list[int], output: list[int]) -> tuple[list[float], list[float]]:
    """(input log-probs after the first, output log-probs) of prompt + output under `model` at T = 1."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    lps = torch.log_softmax(logits, -1)
    seq = prompt + output
    got = [float(lps[i - 1, seq[i]]) for i in range(1, len(seq))]
    return got[:len(prompt) - 1], got[len(prompt) - 1:]


def check_row(out: dict, model, prompt: list[int]) -> None:
    meta = out["meta_info"]
    inputs = [e[0] for e in meta["input_token_logprobs"]]
    outputs = [e[0] for e in meta["output_token_logprobs"]]
    want_in, want_out = reference(model, prompt, out["output_ids"])
    assert inputs[0] is None
    assert max(abs(a - b) for a, b in zip(inputs[1:] + outputs, want_in + want_out)) <= TOL
    assert len(inputs) - 1 == len(want_in) and len(outputs) == len(want_out)


# --------------------------------------------------------------------------
# Pure parts

def test_flags_follow_sglang(tiny_model):
    base = ["--model", str(tiny_model)]
    with pytest.raises(SystemExit):
        parse_args([*base, "--enable-lora", "--max-lora-rank", "8"])  # targets missing
    with pytest.raises(SystemExit):
        parse_args([*base, "--enable-lora", "--lora-target-modules", "q_proj"])  # rank missing
    with pytest.raises(SystemExit):
        parse_args([*base, "--max-loras-per-batch", "0"])
    args = parse_args([*base, "--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "all"])
    assert (args.enable_lora, args.max_lora_rank, args.max_loras_per_batch) == (True, 16, 8)
    assert args.lora_target_modules == list(ALL_TARGETS)
    assert parse_args(base).enable_lora is False


def test_take_keeps_adapter_kinds_per_batch_and_order():
    """At most --max-loras-per-batch kinds of rows (the base is one); the first misfit stops the intake."""
    req = lambda lora: SimpleNamespace(item=SimpleNamespace(lora=lora))
    adapters = Adapters(SimpleNamespace(enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj"],
                                        max_loras_per_batch=2))
    waiting = collections.deque(req(x) for x in (None, "a", "a", "b", None))
    taken = adapters.take(waiting, 8, [])
    assert [r.item.lora for r in taken] == [None, "a", "a"] and [r.item.lora for r in waiting] == ["b", None]
    assert [r.item.lora for r in adapters.take(waiting, 8, [req("b")])] == ["b", None] and not waiting
    waiting = collections.deque(req(x) for x in ("a", None))
    assert adapters.take(waiting, 8, [req("b"), req(None)]) == [] and len(waiting) == 2  # None waits behind "a"
    waiting = collections.deque(req(x) for x in ("a", "a", "a"))
    assert len(adapters.take(waiting, 2, [req(None)])) == 2 and len(waiting) == 1


# --------------------------------------------------------------------------
# The engine

async def test_mixed_batch_rows_get_their_own_adapter(tiny_model, lora_dirs, refs):
    """One batch holding a base row and rows of two adapters: each row's prompt and output log-probs
    are those of PEFT's model with that adapter (the base row: the base model's), within 1e-5."""
    async with serve(tiny_model) as (engine, client):
        await client.load("b", lora_dirs["b"])  # first: the wrapper is PEFT's causal-LM class
        await client.load("a", lora_dirs["a"])
        status, outs = await client.post("/generate", body(list(PROMPTS), [None, "a", "b"]))
        assert status == 200
        single = await client.post("/generate", body(PROMPTS[1], "a"))
    for out, prompt, lora in zip(outs, PROMPTS, [None, "a", "b"]):
        check_row(out, refs[lora], prompt)
    assert single[1]["output_ids"] == outs[1]["output_ids"]
    base_out = reference(refs[None], PROMPTS[1], outs[1]["output_ids"])[1]
    assert max(abs(a - b) for a, b in zip(base_out, [e[0] for e in outs[1]["meta_info"]["output_token_logprobs"]])) \
        > 1e-3  # the adapter does change the distribution


async def test_unload_waits_for_the_request_in_flight(tiny_model, lora_dirs, refs):
    """An unload stops new requests naming the adapter at once, but frees it only after the
    request already running on it has completed; the model is then the plain base again."""
    async with serve(tiny_model) as (engine, client):
        await client.load("a", lora_dirs["a"])
        stream_body = {**body(PROMPTS[0], "a", tokens=300), "stream": True, "rid": "on-a"}
        async with client.http.post(client.url + "/generate", json=stream_body) as resp:
            first = json.loads((await resp.content.readuntil(b"\n\n"))[len(b"data: "):])
            assert first["meta_info"]["finish_reason"] is None
            unload = asyncio.create_task(client.post("/unload_lora_adapter", {"lora_name": "a"}))
            while "a" in engine.adapters.registered:  # the unload has begun: no new request may name it
                await asyncio.sleep(0.001)
            refused = await client.post("/generate", body(PROMPTS[1], "a"))
            assert not unload.done() and "on-a" in engine.live
            events = (await resp.read()).decode().split("\n\n")
        last = json.loads(events[-3][len("data: "):])
        status, answer = await unload
        after = await client.post("/generate", body(PROMPTS[1], None))
    assert refused[0] == 400 and refused[1]["error"]["message"].startswith(
        "The following requested LoRA adapters are not loaded: a\n")
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 300}
    check_row(last, refs["a"], PROMPTS[0])
    assert (status, answer["success"], answer["loaded_adapters"]) == (200, True, {})
    assert engine.adapters.peft is None and not engine.adapters.present
    assert not any(".lora_" in k for k in engine.model.state_dict())
    check_row(after[1], refs[None], PROMPTS[1])


async def test_an_adapter_request_joins_a_running_base_batch(tiny_model, lora_dirs, refs):
    """Continuous batching: a request on an adapter joins a batch of base rows already decoding,
    and both keep their own model's log-probs."""
    async with serve(tiny_model) as (engine, client):
        await client.load("a", lora_dirs["a"])
        base_body = {**body(PROMPTS[0], None, tokens=250), "stream": True, "rid": "base-row"}
        async with client.http.post(client.url + "/generate", json=base_body) as resp:
            await resp.content.readuntil(b"\n\n")  # the base row is decoding
            status, joined = await client.post("/generate", body(PROMPTS[2], "a"))
            assert "base-row" in engine.live  # it ran alongside, not after
            events = (await resp.read()).decode().split("\n\n")
    assert status == 200
    check_row(joined, refs["a"], PROMPTS[2])
    last = json.loads(events[-3][len("data: "):])
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 250}
    check_row(last, refs[None], PROMPTS[0])


def test_weights_outside_the_targets_are_found_by_name_as_sglang_matches_them():
    names = ["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
             "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight",
             "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    assert unmatched_weights(names, frozenset({"q_proj", "down_proj"})) == [names[1]]
    assert unmatched_weights(names, frozenset({"proj"})) == []  # a substring match, as SGLang's
    assert unmatched_weights([], frozenset()) == []


async def test_strict_loading_refuses_an_adapter_with_weights_outside_the_targets(tiny_model, tmp_path):
    """clawd launches engines with --lora-strict-loading: an adapter whose file holds weights of modules the
    engine does not serve adapters on (its config naming only served ones) is refused, not served without
    them. Without the flag it loads, the extra weights skipped with a warning (SGLang's default)."""
    extra = build_adapter(tiny_model, tmp_path / "extra", 4, ["q_proj", "v_proj", "o_proj"])
    config = json.loads((extra / "adapter_config.json").read_text())
    (extra / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "v_proj"]}))
    request = {"lora_name": "x", "lora_path": str(extra)}
    async with serve(tiny_model, "--lora-target-modules", "q_proj", "v_proj", "--lora-strict-loading") as (
            engine, client):
        status, out = await client.post("/load_lora_adapter", request)
        assert (status, out["success"], out["loaded_adapters"]) == (400, False, {}), out
        assert "did not match any target module" in out["error_message"] and "o_proj" in out["error_message"]
        assert engine.adapters.peft is None
    async with serve(tiny_model, "--lora-target-modules", "q_proj", "v_proj") as (engine, client):
        status, out = await client.post("/load_lora_adapter", request)
        assert status == 200 and out["success"], out


async def test_failed_loads_leave_the_model_as_it_was(tiny_model, lora_dirs, refs, tmp_path):
    """An adapter PEFT fails on half way (weights of another rank than its config says) is a 400 and
    leaves no LoRA layers behind; loading after the last unload works; a weight update keeps the
    loaded adapters on the new base weights."""
    broken = build_adapter(tiny_model, tmp_path / "broken", 3, ["q_proj", "v_proj"], r=2)
    (broken / "adapter_config.json").write_text((lora_dirs["a"] / "adapter_config.json").read_text())
    async with serve(tiny_model) as (engine, client):
        status, out = await client.post("/load_lora_adapter", {"lora_name": "x", "lora_path": str(broken)})
        assert (status, out["success"], out["loaded_adapters"]) == (400, False, {})
        assert out["error_message"].startswith(f"Failed to load LoRA adapter x from {broken}: ")
        assert engine.adapters.peft is None and not any(".lora_" in k for k in engine.model.state_dict())
        await client.load("b", lora_dirs["b"])
        assert (await client.post("/unload_lora_adapter", {"lora_name": "b"}))[0] == 200
        await client.load("a", lora_dirs["a"])
        update = await client.post("/update_weights_from_disk", {"model_path": str(tiny_model),
                                                                 "weight_version": "2"})
        assert update[0] == 200 and update[1]["success"], update
        status, outs = await client.post("/generate", body([PROMPTS[0], PROMPTS[1]], [None, "a"]))
    assert status == 200
    check_row(outs[0], refs[None], PROMPTS[0])
    check_row(outs[1], refs["a"], PROMPTS[1])
