"""clawd's CPU engine as a real subprocess on 127.0.0.1, driven over HTTP.

Checks SGLang's JSON shapes and, against a teacher-forced forward pass of the
same tiny model in this process, the log-probs the engine reports. Two engine
processes per module: cumulative streaming (the default) and
`--incremental-streaming-output`, which also hosts the weight-swap tests.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from clawd.engine.local.sampling import prompt_logprobs, truncate_probs
from clawd.engine.local.server import parse_args
from clawd.engine.local.wire import ContractError, RequestError, parse_sampling_params

REPO = Path(__file__).resolve().parents[1]
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
TEXTS = ("Hello! How are you today?",
         "The quick brown fox jumps over the lazy dog.",
         "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return n")


# --------------------------------------------------------------------------
# Fixtures: engine processes, models, a reference forward pass

class Engine:
    """An engine process on a listening socket bound here and handed over, as clawd does.

    With `orphanable`, its parent is a shell that lives until its stdin closes,
    so a test can kill the parent and watch the engine notice.
    """

    def __init__(self, model: Path, log_path: Path, *flags: str, orphanable: bool = False):
        sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "clawd.engine.local", "--model", str(model), "--fd", str(sock.fileno()),
               "--threads", "1", "--max-batch-size", "8", *flags]
        with open(log_path, "wb") as log:
            if orphanable:
                cmd = ["sh", "-c", '"$@" </dev/null >&2 & echo $!; read _; exit 0', "sh", *cmd]
            self.proc = subprocess.Popen(cmd, pass_fds=(sock.fileno(),), cwd=REPO, stderr=log,
                                         stdin=subprocess.PIPE if orphanable else None,
                                         stdout=subprocess.PIPE if orphanable else log)
        sock.close()
        self.pid = int(self.proc.stdout.readline()) if orphanable else self.proc.pid

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"engine exited:\n{self.log_path.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=30) as resp:
                    if resp.status == 200:
                        return
            except OSError:  # refused, reset or timed out while it loads
                pass
            time.sleep(0.1)
        raise RuntimeError(f"engine not healthy after {timeout} s:\n{self.log_path.read_text()}")

    def alive(self) -> bool:
        if self.pid == self.proc.pid:
            return self.proc.poll() is None
        try:  # not our child: gone, or a zombie nobody has reaped yet
            return "\nState:\tZ" not in Path(f"/proc/{self.pid}/status").read_text()
        except FileNotFoundError:
            return False

    def wait_gone(self, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.alive()


@pytest.fixture(scope="module")
def models(tiny_model, tmp_path_factory):
    """Directories: the tiny model `a`, `b` with other random weights, `bad` with other shapes."""
    root = tmp_path_factory.mktemp("cpu-engine")
    config = Qwen2Config.from_pretrained(tiny_model)
    dirs = {"a": Path(tiny_model), "b": root / "b", "bad": root / "bad"}
    for name, seed, change in (("b", 1, {}), ("bad", 2, {"intermediate_size": 96})):
        shutil.copytree(tiny_model, dirs[name])
        torch.manual_seed(seed)
        Qwen2ForCausalLM(Qwen2Config.from_dict({**config.to_dict(), **change})).save_pretrained(dirs[name])
    return dirs


@pytest.fixture(scope="module")
def engines(models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("cpu-engine-logs")
    started = {"cumulative": Engine(models["a"], logs / "cumulative.log"),
               "incremental": Engine(models["a"], logs / "incremental.log", "--incremental-streaming-output",
                                     orphanable=True)}
    try:
        for e in started.values():
            e.wait_ready()
        yield started
    finally:
        cumulative, incremental = started["cumulative"], started["incremental"]
        cumulative.proc.terminate()
        incremental.proc.stdin.close()  # its shell parent exits: the engine is orphaned
        try:
            assert cumulative.proc.wait(timeout=20) == 0  # SIGTERM is a clean exit
            assert incremental.proc.wait(timeout=20) == 0
            assert incremental.wait_gone(), "an orphaned engine must exit on its own"
            assert "is gone; exiting" in incremental.log_path.read_text()
        finally:
            for e in started.values():
                if e.alive():
                    os.kill(e.pid, signal.SIGKILL)
            incremental.proc.stdout.close()


@pytest.fixture(scope="module")
def engine(engines) -> str:
    return engines["cumulative"].url


@pytest.fixture(scope="module")
def engine_inc(engines) -> str:
    """The incremental engine; tests that swap its weights put `a` (version "0") back."""
    return engines["incremental"].url


@pytest.fixture(scope="module")
def ref(models):
    """Teacher-forced references: model per directory, and the tokenizer."""
    load = lambda d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return {"a": load(models["a"]), "b": load(models["b"]), "tok": AutoTokenizer.from_pretrained(models["a"])}


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


def prompt(ref, i: int) -> list[int]:
    return ref["tok"](TEXTS[i])["input_ids"]


def teacher(model, prompt_ids: list[int], output_ids: list[int], temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of each output token under a plain forward pass of prompt + output."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0].float()
    lps = torch.log_softmax(logits / temperature, -1)
    return [float(lps[len(prompt_ids) - 1 + i, tok]) for i, tok in enumerate(output_ids)]


def lps_of(out: dict) -> list[float]:
    return [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


async def post(http, url: str, path: str, body) -> tuple[int, object]:
    async with http.post(url + path, json=body) as resp:
        raw = await resp.read()
        if resp.content_type == "application/json":
            return resp.status, json.loads(raw)
        return resp.status, raw.decode()


async def stream(http, url: str, body: dict) -> list[dict]:
    """A streamed /generate, checking SSE framing: data events only, ending with [DONE]."""
    async with http.post(url + "/generate", json={**body, "stream": True}) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        raw = (await resp.read()).decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], raw[-200:]
    assert all(e.startswith("data: ") for e in events[:-1])
    return [json.loads(e[len("data: "):]) for e in events[:-2]]


def generate_body(ids, **params) -> dict:
    return {"input_ids": ids, "sampling_params": params, "return_logprob": True}


# --------------------------------------------------------------------------
# Pure parts (no process)

def test_sampling_params_defaults_and_contract():
    p = parse_sampling_params({"temperature": 0, "stop": "x", "top_k": -1, "logit_bias": {"5": 1}})
    assert (p.max_new_tokens, p.greedy, p.stop, p.top_k, p.logit_bias) == (128, True, ("x",), -1, ((5, 1.0),))
    with pytest.raises(ContractError, match=r"^unknown field `max_tokens`, expected one of `max_new_tokens`"):
        parse_sampling_params({"max_tokens": 3})
    with pytest.raises(ContractError, match="invalid type for `temperature`"):
        parse_sampling_params({"temperature": "hot"})
    for bad in ({"top_k": 0}, {"top_p": 0}, {"n": 2}, {"repetition_penalty": 0}, {"regex": "a+"}):
        with pytest.raises(RequestError):
            parse_sampling_params(bad)


def test_truncate_probs_cuts_the_original_distribution():
    probs = torch.tensor([0.1, 0.5, 0.25, 0.15])
    kept, order = truncate_probs(probs, top_k=-1, top_p=0.7, min_p=0.0)
    assert order.tolist() == [1, 2, 3, 0] and kept.tolist() == [0.5, 0.25, 0.0, 0.0]
    kept, _ = truncate_probs(probs, top_k=3, top_p=1.0, min_p=0.4)
    assert kept.tolist() == [0.5, 0.25, 0.0, 0.0]


def test_prompt_logprobs_alignment():
    ids = [3, 1, 2, 0]
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 3))  # positions 1, 2, 3
    assert prompt_logprobs(logits, ids, 1) == pytest.approx([None, torch.log(torch.tensor(0.3)).item(),
                                                                torch.log(torch.tensor(0.1)).item()])
    assert prompt_logprobs(logits[:0], ids, 4) == []


def test_keys_come_only_from_the_config_file(tmp_path, capsys):
    """SGLang's --config (a .yaml/.yml mapping of flag names with dashes, read here as JSON, the
    YAML subset clawd writes): the only way in for api-key and admin-api-key; flags on the
    command line win over the file; anything it cannot use stops the engine, naming no value."""
    secret = "sk-never-shown-0001"
    config = tmp_path / "engine.yaml"
    config.write_text(json.dumps({"api-key": secret, "admin-api-key": secret + "-admin", "max-batch-size": 3,
                                  "incremental-streaming-output": True, "context-length": "512"}))
    args = parse_args(["--model", "m", "--config", str(config), "--max-batch-size", "5"])
    assert (args.api_key, args.admin_api_key) == (secret, secret + "-admin")
    assert (args.max_batch_size, args.incremental_streaming_output, args.context_length) == (5, True, 512)
    config.write_text(json.dumps({"model": "from-file"}))
    assert parse_args(["--config", str(config)]).model == "from-file"
    assert parse_args(["--model", "m"]).api_key is None

    bad = {"engine.json": {"api-key": secret}, "engine.yml": {"api-key": secret, "api_key_file": "x"},
           "other.yml": {"api-key": 5}, "third.yaml": {"max-batch-size": secret},
           "list.yaml": [secret], "text.yaml": "api-key: " + secret, "flag.yaml": {"incremental-streaming-output": 1}}
    for name, content in bad.items():
        path = tmp_path / name
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", "--config", str(path)])
        err = capsys.readouterr().err
        assert "--config" in err and secret not in err, err
    with pytest.raises(SystemExit):  # never on the command line, where any user can read it
        parse_args(["--model", "m", "--api-key", secret])
    assert "unrecognized arguments" in capsys.readouterr().err


# --------------------------------------------------------------------------
# /generate against the engine process

@pytest.mark.slow
async def test_response_shapes(http, engine, ref):
    ids = prompt(ref, 0)
    status, out = await post(http, engine, "/generate", {
        **generate_body(ids, max_new_tokens=3, ignore_eos=True, sampling_seed=1), "rid": "shape-1"})
    assert status == 200 and list(out) == ["text", "output_ids", "meta_info"]
    meta = out["meta_info"]
    assert set(meta) == {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
                         "input_token_logprobs", "output_token_logprobs", "completion_tokens",
                         "cached_tokens", "reasoning_tokens", "weight_versions", "e2e_latency"}
    assert meta["id"] == "shape-1" and meta["finish_reason"] == {"type": "length", "length": 3}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (len(ids), 3, 0)
    assert meta["weight_version"] == "0" and meta["weight_versions"] == [{"version": "0", "start": 0, "end": 3}]
    assert meta["input_token_logprobs"] == []
    assert [e[1:] for e in meta["output_token_logprobs"]] == [[t, None] for t in out["output_ids"]]
    assert all(isinstance(e[0], float) for e in meta["output_token_logprobs"])
    assert out["text"] == ref["tok"].decode(out["output_ids"])
    assert isinstance(meta["e2e_latency"], float)

    status, out = await post(http, engine, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and "output_token_logprobs" not in out["meta_info"]
    assert len(out["meta_info"]["id"]) == 32  # uuid4 hex

    async with http.get(engine + "/model_info") as resp:
        info = await resp.json()
    assert info == {"model_path": info["model_path"], "served_model_name": info["model_path"],
                    "tokenizer_path": info["model_path"], "is_generation": True, "preferred_sampling_params": None,
                    "weight_version": "0", "load_format": "auto", "reasoning_parser": None,
                    "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": False,
                    "has_audio_understanding": False, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
                    "max_context_length": 2048}
    for method, path in (("GET", "/health"), ("GET", "/ready")):
        async with http.request(method, engine + path) as resp:
            assert resp.status == 200 and await resp.read() == b""
    for method in ("GET", "POST"):
        async with http.request(method, engine + "/flush_cache") as resp:
            assert (resp.status, resp.content_type, await resp.text()) == (200, "text/plain", "Cache flushed.\n")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_output_logprobs_equal_teacher_forcing(http, engine, ref, temperature):
    ids = prompt(ref, 1)
    status, out = await post(http, engine, "/generate", generate_body(
        ids, max_new_tokens=8, temperature=temperature, ignore_eos=True, sampling_seed=11))
    assert status == 200 and len(out["output_ids"]) == 8
    assert close(lps_of(out), teacher(ref["a"], ids, out["output_ids"], temperature), 1e-4)


async def test_batch_equals_single_requests_and_teacher(http, engine, ref):
    prompts = [prompt(ref, i) for i in (0, 1, 2)]
    assert len({len(p) for p in prompts}) == 3  # different lengths: left padding at work
    params = [{"max_new_tokens": 6, "temperature": 0.8, "ignore_eos": True, "sampling_seed": 100 + i}
              for i in range(3)]
    status, outs = await post(http, engine, "/generate", {
        "input_ids": prompts, "sampling_params": params, "return_logprob": True, "rid": "batch"})
    assert status == 200 and [o["meta_info"]["id"] for o in outs] == ["batch_0", "batch_1", "batch_2"]
    for p, sp, out in zip(prompts, params, outs):
        _, alone = await post(http, engine, "/generate", {"input_ids": p, "sampling_params": sp,
                                                          "return_logprob": True})
        assert alone["output_ids"] == out["output_ids"]
        assert close(lps_of(out), lps_of(alone), 1e-5)
        assert close(lps_of(out), teacher(ref["a"], p, out["output_ids"], 0.8), 1e-4)


async def test_prefill_scoring_lines_up_with_the_response(http, engine, ref):
    p, r = prompt(ref, 0), prompt(ref, 1)[:5]
    status, out = await post(http, engine, "/generate", {
        "input_ids": p + r, "sampling_params": {"max_new_tokens": 0, "temperature": 0.7},
        "return_logprob": True, "logprob_start_len": len(p) - 1})
    assert status == 200 and (out["text"], out["output_ids"]) == ("", [])
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["completion_tokens"] == 0
    assert meta["output_token_logprobs"] == []
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(r) + 1 and entries[0] == [None, p[-1], None]
    assert [e[1] for e in entries[1:]] == r
    # prefill log-probs are at T = 1 whatever the request's temperature
    assert close([e[0] for e in entries[1:]], teacher(ref["a"], p, r), 1e-4)

    for start, n in ((0, len(p) + len(r)), (len(p) + len(r), 0)):
        _, out = await post(http, engine, "/generate", {
            "input_ids": p + r, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": start})
        assert len(out["meta_info"]["input_token_logprobs"]) == n


async def test_cumulative_stream_ends_equal_to_the_plain_result(http, engine, ref):
    body = generate_body(prompt(ref, 2), max_new_tokens=6, ignore_eos=True, sampling_seed=5, temperature=0.9)
    _, whole = await post(http, engine, "/generate", body)
    chunks = await stream(http, engine, body)
    assert len(chunks) == 6 and all("index" not in c for c in chunks)
    for i, c in enumerate(chunks):  # cumulative: everything so far in every chunk
        assert c["output_ids"] == whole["output_ids"][: i + 1]
        assert c["meta_info"]["completion_tokens"] == i + 1
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 5
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]


async def test_incremental_stream_adds_up_to_the_plain_result(http, engine_inc, ref):
    body = generate_body(prompt(ref, 0), max_new_tokens=5, ignore_eos=True, sampling_seed=6)
    _, whole = await post(http, engine_inc, "/generate", body)
    chunks = await stream(http, engine_inc, body)
    assert [len(c["output_ids"]) for c in chunks] == [1] * 5
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 4
    assert chunks[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert sum((c["output_ids"] for c in chunks), []) == whole["output_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert sum((c["meta_info"]["output_token_logprobs"] for c in chunks), []) == \
        whole["meta_info"]["output_token_logprobs"]


async def test_greedy_is_deterministic_argmax_with_t1_logprobs(http, engine, ref):
    ids = prompt(ref, 1)
    body = generate_body(ids, max_new_tokens=6, temperature=0, ignore_eos=True)
    (_, one), (_, two) = [await post(http, engine, "/generate", body) for _ in range(2)]
    assert one["output_ids"] == two["output_ids"] and lps_of(one) == lps_of(two)
    with torch.inference_mode():
        logits = ref["a"](torch.tensor([ids + one["output_ids"]])).logits[0]
    assert one["output_ids"] == logits[len(ids) - 1:-1].argmax(-1).tolist()
    assert close(lps_of(one), teacher(ref["a"], ids, one["output_ids"]), 1e-4)


async def test_stop_token_ids_and_stop_strings(http, engine, ref):
    ids, tok = prompt(ref, 2), ref["tok"]
    sp = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 21}
    _, base = await post(http, engine, "/generate", generate_body(ids, **sp))
    out_ids = base["output_ids"]
    k = next(i for i in range(2, len(out_ids) - 1) if out_ids[i] not in out_ids[:i])
    status, out = await post(http, engine, "/generate", generate_body(ids, **sp, stop_token_ids=[out_ids[k]]))
    assert out["output_ids"] == out_ids[: k + 1]  # the stop token is kept in output_ids ...
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": out_ids[k]}
    assert out["text"] == tok.decode(out_ids[:k])  # ... and trimmed from the text
    _, kept = await post(http, engine, "/generate", generate_body(ids, **sp, stop_token_ids=[out_ids[k]],
                                                                   no_stop_trim=True))
    assert kept["text"] == tok.decode(out_ids[: k + 1])

    # A stop string: the text of a token whose text has not appeared before.
    k = next(i for i in range(1, len(out_ids) - 1)
             if len(s := tok.decode([out_ids[i]]).strip()) >= 2 and "\ufffd" not in s
             and s not in tok.decode(out_ids[:i]) and s in tok.decode(out_ids[: i + 1]))
    stop = tok.decode([out_ids[k]]).strip()
    _, out = await post(http, engine, "/generate", generate_body(ids, **sp, stop=[stop, "never-seen-zzz"]))
    full = tok.decode(out_ids[: k + 1])
    assert out["output_ids"] == out_ids[: k + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full[: full.index(stop)]


async def test_abort_a_running_stream_by_rid_prefix(http, engine, ref):
    body = {"input_ids": prompt(ref, 0), "rid": "abort-me-1234", "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    async with http.post(engine + "/generate", json=body) as resp:
        first = await resp.content.readuntil(b"\n\n")
        assert json.loads(first[len(b"data: "):])["meta_info"]["finish_reason"] is None
        async with http.post(engine + "/abort_request", json={"rid": "abort-me"}) as ab:
            assert ab.status == 200 and await ab.read() == b""
        events = (await resp.read()).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    last = json.loads(events[-3][len("data: "):])
    assert last["meta_info"]["finish_reason"] == ABORTED
    assert 0 < last["meta_info"]["completion_tokens"] == len(last["output_ids"]) < 1500


async def test_abort_all_answers_non_stream_requests_with_partial_output(http, engine, ref):
    body = {"input_ids": prompt(ref, 1), "rid": "long-1", "sampling_params": {"max_new_tokens": 1500,
                                                                              "ignore_eos": True}}
    task = asyncio.create_task(post(http, engine, "/generate", body))
    # Probe until the rid is taken. The probe itself can never run (its token is outside
    # the vocabulary, checked after the rid), so it cannot take the rid first.
    while True:
        status, err = await post(http, engine, "/generate", {**body, "input_ids": [10**9]})
        assert status == 400
        if "Duplicate" in err["error"]["message"]:
            assert err == {"error": {"message": "Duplicate request ID detected: long-1"}}
            break
        await asyncio.sleep(0.01)
    status, _ = await post(http, engine, "/abort_request", {"abort_all": True})
    assert status == 200
    status, out = await task
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) < 1500


async def test_requests_sglang_refuses(http, engine, ref):
    ids = prompt(ref, 0)
    cases = [
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": 2048}, "maximum context length"),
        ({"n": 2}, "n > 1"),
    ]
    for params, words in cases:
        status, err = await post(http, engine, "/generate", {"input_ids": ids, "sampling_params": params})
        assert status == 400 and words in err["error"]["message"], err
    status, err = await post(http, engine, "/generate", {"input_ids": ids, "sampling_params": {"max_tokens": 2}})
    assert status == 400 and err["error"].startswith("unknown field `max_tokens`, expected one of ")
    status, err = await post(http, engine, "/generate", {"input_ids": ids, "return_logprob": True,
                                                         "logprob_start_len": len(ids) + 1})
    assert status == 400 and "logprob_start_len" in err["error"]["message"]
    status, err = await post(http, engine, "/generate", {"input_ids": [[1, 2], [3]], "rid": ["x", "x"]})
    assert status == 400 and "Duplicate request ID" in err["error"]["message"]
    # A streamed request learns of the refusal inside the stream, as from SGLang.
    chunks = await stream(http, engine, {"input_ids": ids, "sampling_params": {"top_k": 0}})
    assert chunks[0]["error"]["code"] == 400 and "top_k" in chunks[0]["error"]["message"]


# --------------------------------------------------------------------------
# Weights and pausing (incremental engine; each test puts model `a`, version "0", back)

async def update(http, url: str, path, version: str) -> tuple[int, dict]:
    return await post(http, url, "/update_weights_from_disk", {"model_path": str(path), "weight_version": version,
                                                               "flush_cache": True})


async def test_weight_update_changes_outputs_and_failed_updates_keep_serving(http, engine_inc, ref, models):
    ids = prompt(ref, 1)
    body = generate_body(ids, max_new_tokens=5, ignore_eos=True, sampling_seed=4)
    _, before = await post(http, engine_inc, "/generate", body)
    try:
        status, res = await update(http, engine_inc, models["b"], "1")
        assert (status, res) == (200, {"success": True, "num_paused_requests": 0,
                                       "message": "Succeeded to update model weights. Weight version updated to 1."})
        async with http.get(engine_inc + "/model_info") as resp:
            info = await resp.json()
        assert (info["weight_version"], info["model_path"]) == ("1", str(models["b"]))
        _, after = await post(http, engine_inc, "/generate", body)
        assert after["meta_info"]["weight_version"] == "1" and lps_of(after) != lps_of(before)
        assert close(lps_of(after), teacher(ref["b"], ids, after["output_ids"]), 1e-4)

        for bad in (models["a"].parent / "no-such-model", models["bad"]):
            status, res = await update(http, engine_inc, bad, "2")
            assert status == 400 and res["success"] is False and res["message"]
        _, again = await post(http, engine_inc, "/generate", body)
        assert again["meta_info"]["weight_version"] == "1"
        assert again["output_ids"] == after["output_ids"] and lps_of(again) == lps_of(after)
    finally:
        assert (await update(http, engine_inc, models["a"], "0"))[0] == 200


async def test_update_waits_for_the_running_batch_and_later_requests_wait_for_it(http, engine_inc, ref, models):
    ids = prompt(ref, 0)
    # A full batch (8 rows), long enough that the update and the later request arrive while it
    # runs; being full, it has no room for the later request to join.
    body = {"input_ids": [ids] * 8, "stream": True, "return_logprob": True,
            "sampling_params": [{"max_new_tokens": 120, "ignore_eos": True, "sampling_seed": i} for i in range(8)]}
    try:
        async with http.post(engine_inc + "/generate", json=body) as resp:
            chunks = [json.loads((await resp.content.readuntil(b"\n\n"))[len(b"data: "):])]
            swap = asyncio.create_task(update(http, engine_inc, models["b"], "5"))
            later = asyncio.create_task(post(http, engine_inc, "/generate", generate_body(
                ids, max_new_tokens=3, temperature=0, ignore_eos=True)))
            events = (await resp.read()).decode().split("\n\n")
        chunks += [json.loads(e[len("data: "):]) for e in events[:-2]]
        rows = [[c for c in chunks if c["index"] == i] for i in range(8)]
        for row in rows:  # every row ran on the old weights: the update waited for the batch
            assert row[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 120}
            assert row[-1]["meta_info"]["weight_versions"] == [{"version": "0", "start": 0, "end": 120}]
        out_ids = sum((c["output_ids"] for c in rows[3]), [])
        assert close(sum((lps_of(c) for c in rows[3]), []), teacher(ref["a"], ids, out_ids), 1e-4)
        assert (await swap)[0] == 200
        status, out = await later  # waited for the new weights, and did not fail
        assert status == 200 and out["meta_info"]["weight_versions"][0]["version"] == "5"
        assert close(lps_of(out), teacher(ref["b"], ids, out["output_ids"]), 1e-4)
    finally:
        assert (await update(http, engine_inc, models["a"], "0"))[0] == 200


async def test_requests_join_a_running_batch(http, engine_inc, ref):
    long_ids = prompt(ref, 1)
    # Newcomers shorter and longer than the running sequence, so each side gets re-padded.
    short_ids = [long_ids[:3], prompt(ref, 2) * 6]
    body = {**generate_body(long_ids, max_new_tokens=1500, ignore_eos=True, sampling_seed=12),
            "rid": "long-running", "stream": True}
    async with http.post(engine_inc + "/generate", json=body) as resp:
        chunks = [json.loads((await resp.content.readuntil(b"\n\n"))[len(b"data: "):])]
        shorts = await asyncio.gather(*(post(http, engine_inc, "/generate", generate_body(
            ids, max_new_tokens=4, ignore_eos=True, sampling_seed=13)) for ids in short_ids))
        # The short requests finished while the long one still ran: stop the long one now.
        assert (await post(http, engine_inc, "/abort_request", {"rid": "long-running"}))[0] == 200
        events = (await resp.read()).decode().split("\n\n")
    chunks += [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert chunks[-1]["meta_info"]["finish_reason"] == ABORTED
    for ids, (status, short) in zip(short_ids, shorts):
        assert status == 200 and short["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
        assert close(lps_of(short), teacher(ref["a"], ids, short["output_ids"]), 1e-4)
    out_ids = sum((c["output_ids"] for c in chunks), [])
    assert 4 < len(out_ids) < 1500
    assert close(sum((lps_of(c) for c in chunks), []), teacher(ref["a"], long_ids, out_ids), 1e-4)


@pytest.mark.slow
async def test_pause_retract_update_continue_resumes_on_new_weights(http, engine_inc, ref, models):
    ids = prompt(ref, 2)
    body = {**generate_body(ids, max_new_tokens=400, ignore_eos=True, sampling_seed=9), "stream": True}
    try:
        async with http.post(engine_inc + "/generate", json=body) as resp:
            chunks = [json.loads((await resp.content.readuntil(b"\n\n"))[len(b"data: "):])]
            status, res = await post(http, engine_inc, "/pause_generation", {"mode": "retract"})
            assert (status, res) == (200, {"message": "Generation paused successfully.", "status": "ok"})
            async with http.get(engine_inc + "/ready") as ready:
                assert ready.status == 503
            assert (await update(http, engine_inc, models["b"], "3"))[0] == 200
            status, res = await post(http, engine_inc, "/continue_generation", {})
            assert (status, res) == (200, {"message": "Generation continued successfully.", "status": "ok"})
            events = (await resp.read()).decode().split("\n\n")
        chunks += [json.loads(e[len("data: "):]) for e in events[:-2]]
        meta = chunks[-1]["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 400} and meta["num_retractions"] == 1
        old, new = meta["weight_versions"]
        assert (old["version"], old["start"], new["version"], new["start"], new["end"]) == \
            ("0", 0, "3", old["end"], 400)
        out_ids, lps = sum((c["output_ids"] for c in chunks), []), sum((lps_of(c) for c in chunks), [])
        cut = old["end"]
        assert close(lps[:cut], teacher(ref["a"], ids, out_ids)[:cut], 1e-4)
        assert close(lps[cut:], teacher(ref["b"], ids, out_ids)[cut:], 1e-4)
    finally:
        await post(http, engine_inc, "/continue_generation", {})
        assert (await update(http, engine_inc, models["a"], "0"))[0] == 200
