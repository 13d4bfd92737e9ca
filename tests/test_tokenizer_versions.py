"""The daemon's tokenizer path gives the same results on the GPU pin as on the CPU pin.

A GPU host (`make install GPU=1`) runs clawd on sglang 0.5.23's transformers and tokenizers
(constraints/gpu.txt); this machine's venv has the CPU pin (constraints/cpu.txt). `make test`
installs the GPU pin's two packages, without their dependencies, into .venv/gpu-pins. The
same probe runs twice, in subprocesses: once with that directory first on sys.path, once
in the venv as it is. Each run renders and encodes a set of conversations with
clawd.tokenizer.ChatTokenizer and with transformers' own apply_chat_template, reads the EOS
ids, and detokenizes (all at once and incrementally, as a streamed reply is); the two
runs must agree exactly.
"""
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PINNED_DIR = ROOT / ".venv" / "gpu-pins"
HOW_TO_CREATE = ("`make test` and `make venv` create it, running: .venv/bin/python -m pip install "
                 "--no-deps --target .venv/gpu-pins -c constraints/gpu.txt transformers tokenizers")


def pins(name: str) -> dict[str, str]:
    """`package==version` lines of constraints/NAME."""
    text = (ROOT / "constraints" / name).read_text(encoding="utf-8")
    return dict(re.findall(r"(?m)^([A-Za-z0-9_.-]+)==(\S+)", text))


GPU, CPU = pins("gpu.txt"), pins("cpu.txt")
PACKAGES = ("transformers", "tokenizers")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather — température en °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"},
                                                    "days": {"type": "integer", "minimum": 1}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}

CONVERSATIONS = [
    ("user", [{"role": "user", "content": "Hi"}], None, {}),
    ("system-multi-turn",
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
      {"role": "assistant", "content": "4."}, {"role": "user", "content": "  spaces\n\tand tabs  \n\n"}], None, {}),
    ("unicode",
     [{"role": "user", "content": "Héllo wörld 你好 🦦 e\u0301 (combining) ﬁ ligature 👍🏽🇫🇷 👨‍👩‍👧 مرحبا ∮ 𝄞 \u200b"},
      {"role": "assistant", "content": "Ça va? 日本語のテキスト。😀😀"},
      {"role": "user", "content": "1234567890 3.14159 $19.99 2024-05-17 café naïve"}], None, {}),
    ("content-parts",
     [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]}],
     None, {}),
    ("tools-and-calls",
     [{"role": "system", "content": "You call tools."}, {"role": "user", "content": "Weather in Zürich and 東京?"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"id": "call_1", "type": "function",
           "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}},
          {"id": "call_2", "type": "function",
           "function": {"name": "get_weather", "arguments": "{\"city\": \"東京\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21, \"sky\": \"☀️\"}"},
      {"role": "tool", "tool_call_id": "call_2", "content": "rainy"},
      {"role": "assistant", "content": "Zürich: 21 °C ☀️; 東京: rain."},
      {"role": "user", "content": "And search for umbrellas."}],
     [WEATHER, SEARCH], {}),
    ("tools-no-system",
     [{"role": "user", "content": "Find 'quoted' \"text\" <angles> & {braces}"}], [SEARCH], {}),
    ("think",
     [{"role": "user", "content": "Think first: 17 × 23?"},
      {"role": "assistant", "reasoning_content": "17 × 23 = 391",
       "content": "<think>\n17 × 20 = 340, 17 × 3 = 51 🤔\n</think>\n\n391"},
      {"role": "user", "content": "And 17 × 24?"}], None, {"enable_thinking": True}),
    ("think-off", [{"role": "user", "content": "No thinking, please."}], None, {"enable_thinking": False}),
]

# A reply as a model generates it: reasoning, text, a tool call, the end of the turn.
REPLY = ("<think>\nThe user wants the weather in 東京 🤔 — call the tool.\n</think>\n\n"
         "Sure! Checking…\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"東京\"}}\n"
         "</tool_call><|im_end|>")

# Runs in a fresh interpreter. argv: the JSON request; `path` goes first on sys.path before
# anything is imported. Prints one JSON object. torch is hidden, as it is from the daemon:
# transformers then loads tokenizers without it (the same results, checked with and without,
# and a third of the time).
PROBE = r"""
import copy, json, sys
req = json.loads(sys.argv[1])
for entry in reversed(req["path"]):
    sys.path.insert(0, entry)
sys.modules["torch"] = None
import tokenizers, transformers
versions = {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
for name, module in (("transformers", transformers), ("tokenizers", tokenizers)):
    want = req["expect"].get(name)
    assert want is None or versions[name] == want, f"{name} {versions[name]} from {module.__file__}, expected {want}"
    assert not req["path"] or module.__file__.startswith(req["path"][0]), f"{name} came from {module.__file__}"
from transformers import AutoTokenizer
from clawd.serving.detokenize import IncrementalDetokenizer
from clawd.tokenizer import ChatTokenizer

def ids_of(out):
    return list(out["input_ids"] if not isinstance(out, list) else out)

def streamed(tok, ids):
    detok = IncrementalDetokenizer(tok.tokenizer, tok.special_ids)
    pieces = [detok.push([i]) for i in ids]
    return pieces + [detok.flush()]

result = {"versions": versions, "models": {}}
for model in req["models"]:
    ours = ChatTokenizer(model)
    hf = AutoTokenizer.from_pretrained(model, local_files_only=True)
    m = {"eos_ids": list(ours.info.eos_ids), "context_length": ours.info.context_length,
         "special_ids": sorted(ours.special_ids),
         "hf": {"class": type(hf).__name__, "eos_token_id": hf.eos_token_id, "eos_token": hf.eos_token,
                "all_special_ids": sorted(hf.all_special_ids)},
         "conversations": {}}
    for name, messages, tools, extra in req["conversations"]:
        text = ours.render(copy.deepcopy(messages), copy.deepcopy(tools), **extra)
        ids = ours.encode_chat(copy.deepcopy(messages), copy.deepcopy(tools), **extra)
        kw = dict(tools=copy.deepcopy(tools), add_generation_prompt=True, **extra)
        hf_text = hf.apply_chat_template(copy.deepcopy(messages), tokenize=False, **kw)
        hf_ids = ids_of(hf.apply_chat_template(copy.deepcopy(messages), tokenize=True, **kw))
        m["conversations"][name] = {
            "text": text, "ids": ids, "hf_text": hf_text, "hf_ids": hf_ids,
            "hf_encode": hf.encode(text, add_special_tokens=False),
            "decoded": ours.decode(ids), "hf_decoded": hf.decode(ids, skip_special_tokens=True),
            "streamed": streamed(ours, ids)}
    reply = ours.encode(req["reply"])
    m["reply"] = {"ids": reply, "hf_ids": hf.encode(req["reply"], add_special_tokens=False),
                  "decoded": ours.decode(reply), "hf_decoded": hf.decode(reply, skip_special_tokens=True),
                  "streamed": streamed(ours, reply),
                  "per_token": [ours.tokenizer.decode([i], skip_special_tokens=False) for i in reply]}
    result["models"][model] = m
print(json.dumps(result, ensure_ascii=False))
"""


def run_probe(models: list[str], path: list[str], expect: dict[str, str]) -> dict:
    req = {"path": path, "expect": expect, "models": models, "reply": REPLY,
           "conversations": [list(c) for c in CONVERSATIONS]}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(req)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"probe failed ({'pinned' if path else 'venv'}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def differences(a, b, where="") -> list[str]:
    """Paths at which the two probe results differ, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in differences(a.get(k), b.get(k), f"{where}/{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def compare_versions(models: list[str]):
    if not PINNED_DIR.is_dir():
        absent = (f"{PINNED_DIR} is absent (the GPU pin: transformers=={GPU['transformers']}, "
                  f"tokenizers=={GPU['tokenizers']}); {HOW_TO_CREATE}")
        if os.environ.get("CI"):  # CI runs `make test`, which always creates it: never skip there
            pytest.fail(absent)
        pytest.skip(reason=f"the GPU pin's transformers/tokenizers are not installed: {absent}")
    with ThreadPoolExecutor(2) as pool:
        gpu_run = pool.submit(run_probe, models, [str(PINNED_DIR)], {p: GPU[p] for p in PACKAGES})
        cpu_run = pool.submit(run_probe, models, [], {p: CPU[p] for p in PACKAGES})
        gpu, cpu = gpu_run.result(), cpu_run.result()
    assert gpu["versions"] == {p: GPU[p] for p in PACKAGES}
    assert cpu["versions"] == {p: CPU[p] for p in PACKAGES}

    # Within each version: the daemon renders and encodes exactly as transformers does.
    for label, res in (("GPU pin", gpu), ("CPU pin", cpu)):
        for model, m in res["models"].items():
            for name, c in m["conversations"].items():
                assert c["text"] == c["hf_text"], f"{label} {model} {name}: rendered text differs from transformers"
                assert c["ids"] == c["hf_ids"] == c["hf_encode"], f"{label} {model} {name}: ids differ from transformers"
                assert "".join(c["streamed"]) == c["decoded"] == c["hf_decoded"], f"{label} {model} {name}: decoding"
            r = m["reply"]
            assert r["ids"] == r["hf_ids"] and "".join(r["streamed"]) == r["decoded"] == r["hf_decoded"]
            assert set(m["eos_ids"]) >= {m["hf"]["eos_token_id"]}

    # Between the versions: everything the probe saw, exactly (the class name only informs).
    for res in (gpu, cpu):
        res.pop("versions")
        for m in res["models"].values():
            m["hf"].pop("class")
    diff = differences(gpu, cpu)
    assert not diff, f"GPU pin {GPU['transformers']}/{GPU['tokenizers']} vs CPU pin " \
                     f"{CPU['transformers']}/{CPU['tokenizers']}:\n" + "\n".join(diff[:40])


def test_tiny_model_same_on_gpu_and_cpu_pins(tiny_model):
    compare_versions([str(tiny_model)])


@pytest.mark.slow
def test_smollm2_same_on_gpu_and_cpu_pins(default_model):
    dest, _ = default_model
    compare_versions([str(dest)])
