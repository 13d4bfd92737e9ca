"""The offline models: the tiny Qwen2 test model and the SmolLM2 conversion (docs/ARCHITECTURE.md §10)."""
import json
import subprocess
import sys
import unicodedata
from pathlib import Path

import jinja2
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from clawd.tools import models
from clawd.tools.models import MARKER, build_tiny_model, main, prepare_default_model

TOKEN_IDS = {
    "<|endoftext|>": 4087, "<|im_start|>": 4088, "<|im_end|>": 4089,
    "<tool_call>": 4090, "</tool_call>": 4091, "<think>": 4092, "</think>": 4093,
    "<tool_response>": 4094, "</tool_response>": 4095,
}

STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve Straße Ångström señor",
    "καλημέρα κόσμε, привет мир, 你好，世界。こんにちは 안녕하세요",
    "emoji 🙂🚀 👍🏽 🇫🇷 ❤️ and a rare one: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "1234567890 3.14159 -17 1e-6 0x1F $19.99 2024-05-17",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    'const o = {"a": [1, 2, {"b": null}], "c": true};',
    "   leading spaces\t\ttabs    runs     \n\n\n   trailing   ",
    "\r\n windows\r\nlines \n",
    "it's, they've, we'll, I'd, you're, IT'S",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think>plan</think>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "<tool_response>\n42\n</tool_response><|endoftext|>",
    "x<tool_call>y</tool_call>z<think></think>",
    "e\u0301 (decomposed é), Å (angstrom sign)",
    "",
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Zürich?"},
    {"role": "assistant", "content": None, "reasoning_content": "Two calls.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
    ]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "c2", "content": "12 C"},
    {"role": "assistant", "content": "Paris 18 C, Zürich 12 C.", "reasoning_content": "easy"},
    {"role": "user", "content": [{"type": "text", "text": "Thanks!"}]},
]

TOOLS_SECTION = (
    "# Tools\n\nYou can call functions to help with the request. Their signatures are listed as JSON "
    "inside <tools></tools>:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n'
    "</tools>\n\nTo call a function, answer with one block per call, each holding a JSON object with "
    "the function name and its arguments:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call><|im_end|>\n'
)

RENDERED = (
    "<|im_start|>system\nYou are terse.\n\n" + TOOLS_SECTION
    + "<|im_start|>user\nWeather in Paris and Zürich?<|im_end|>\n"
    "<|im_start|>assistant\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n"
    "<tool_response>\n12 C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nParis 18 C, Zürich 12 C.<|im_end|>\n"
    "<|im_start|>user\nThanks!<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def raw_tokenizer(tiny_model):
    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def test_tiny_config_and_files(tiny_model):
    config = json.loads((tiny_model / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "intermediate_size", "vocab_size",
                                   "max_position_embeddings", "tie_word_embeddings", "dtype")} == {
        "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 4096,
        "max_position_embeddings": 2048, "tie_word_embeddings": True, "dtype": "float32"}
    assert config["eos_token_id"] == 4089
    generation = json.loads((tiny_model / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [4089, 4087]
    assert generation["pad_token_id"] == 4087
    tok_config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "Qwen2Tokenizer"
    assert (tok_config["eos_token"], tok_config["pad_token"], tok_config["bos_token"]) == (
        "<|im_end|>", "<|endoftext|>", None)
    with safe_open(tiny_model / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype.is_floating_point and f.get_tensor(n).itemsize == 4 for n in names)
    assert "lm_head.weight" not in names  # tied to the embeddings
    assert "model.embed_tokens.weight" in names


def test_tokenizer_rules_are_qwen2s(raw_tokenizer):
    from transformers.models.qwen2 import tokenization_qwen2
    spec = json.loads(raw_tokenizer.to_str())
    assert spec["normalizer"] == {"type": "NFC"}
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"] == {"Regex": tokenization_qwen2.PRETOKENIZE_REGEX}
    assert (split["behavior"], split["invert"]) == ("Isolated", False)
    assert (byte_level["type"], byte_level["add_prefix_space"], byte_level["use_regex"]) == ("ByteLevel", False, False)
    assert spec["decoder"]["type"] == "ByteLevel"
    assert len(spec["model"]["merges"]) > 3500


def test_special_and_added_token_ids(hf_tokenizer, raw_tokenizer):
    assert len(hf_tokenizer) == raw_tokenizer.get_vocab_size() == 4096
    for token, token_id in TOKEN_IDS.items():
        assert raw_tokenizer.token_to_id(token) == token_id
        assert hf_tokenizer.convert_tokens_to_ids(token) == token_id
        assert raw_tokenizer.encode(token, add_special_tokens=False).ids == [token_id]
        assert hf_tokenizer.encode(token, add_special_tokens=False) == [token_id]
        ids = raw_tokenizer.encode(f"a{token}b", add_special_tokens=False).ids
        assert token_id in ids and len(ids) == 3
    assert hf_tokenizer.eos_token_id == 4089 and hf_tokenizer.pad_token_id == 4087
    # The chat markup stays in decoded text; only ChatML's own tokens are special.
    assert hf_tokenizer.decode([4090, 4092, 4089], skip_special_tokens=True) == "<tool_call><think>"


@pytest.mark.parametrize("text", STRINGS)
def test_transformers_reload_encodes_like_tokenizer_json(text, hf_tokenizer, raw_tokenizer):
    ids = raw_tokenizer.encode(text, add_special_tokens=False).ids
    assert hf_tokenizer.encode(text, add_special_tokens=False) == ids
    expected = unicodedata.normalize("NFC", text)
    assert raw_tokenizer.decode(ids, skip_special_tokens=False) == expected
    assert hf_tokenizer.decode(ids) == expected


def test_chat_template_renders_tools_calls_and_results(hf_tokenizer):
    rendered = hf_tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False,
                                                add_generation_prompt=True)
    assert rendered == RENDERED
    ids = hf_tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=True)["input_ids"]
    assert ids == hf_tokenizer.encode(RENDERED, add_special_tokens=False)
    assert ids.count(TOKEN_IDS["<tool_call>"]) == 3 and ids.count(TOKEN_IDS["<tool_response>"]) == 2


def test_chat_template_plain_conversations(hf_tokenizer):
    render = lambda msgs, **kw: hf_tokenizer.apply_chat_template(msgs, tokenize=False, **kw)  # noqa: E731
    user = {"role": "user", "content": "hi"}
    assert render([user]) == "<|im_start|>user\nhi<|im_end|>\n"
    assert render([{"role": "system", "content": "S"}, user], add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert render([user], tools=TOOLS) == "<|im_start|>system\n" + TOOLS_SECTION + "<|im_start|>user\nhi<|im_end|>\n"
    # A flat call ({"name", "arguments"}) with content before it; one tool result alone.
    msgs = [user, {"role": "assistant", "content": "Let me look.",
                   "tool_calls": [{"name": "f", "arguments": {"k": [1, "ü"]}}]},
            {"role": "tool", "content": "ok"}]
    assert render(msgs) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nLet me look.\n"
        '<tool_call>\n{"name": "f", "arguments": {"k": [1, "ü"]}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n")


def test_chat_template_renders_the_same_in_plain_jinja2(tiny_model):
    # The daemon renders with jinja2 directly. The template uses `-` whitespace control
    # throughout, so only `tojson` must match transformers' (json.dumps, non-ASCII kept,
    # no HTML escaping, keys in order); jinja2's built-in tojson does neither.
    source = json.loads((tiny_model / "tokenizer_config.json").read_text())["chat_template"]
    env = jinja2.Environment()
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    rendered = env.from_string(source).render(messages=CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    assert rendered == RENDERED


def test_tiny_model_loads_and_runs(tiny_model, hf_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = hf_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 4096)
    assert torch.isfinite(logits).all()


def test_same_seed_gives_byte_identical_files(tiny_model, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    names = sorted(p.name for p in tiny_model.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert set(names) >= {"config.json", "generation_config.json", "model.safetensors",
                                  "tokenizer.json", "tokenizer_config.json", MARKER}
    for name in names:
        assert (tiny_model / name).read_bytes() == (again / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_build_replaces_its_own_output_and_refuses_anything_else(tmp_path):
    dest = build_tiny_model(tmp_path / "m", seed=3)
    (dest / "stray").write_text("x")
    build_tiny_model(dest, seed=3)  # ours (marker): replaced whole
    assert not (dest / "stray").exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a clawd model directory"):
        build_tiny_model(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "m"]  # no temporaries left


def test_cli_reports_failure(tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("not a directory")
    assert main(["tiny", str(target)]) == 1
    assert "clawd.tools.models: error: FileExistsError" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["huge", str(tmp_path)])
    assert exc.value.code == 2


def test_module_imports_without_torch():
    code = ("import sys, clawd.tools.models; "
            "assert not {'torch', 'transformers'} & set(sys.modules), 'heavy import at module level'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


@pytest.mark.slow
def test_default_model_smollm2(default_model):
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest, lines = default_model
    assert [line[:5] for line in lines[:4]] == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert (dest / MARKER).read_text().startswith("SmolLM2-135M-Instruct.Q4_1.gguf sha256=")
    config = json.loads((dest / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert json.loads((dest / "generation_config.json").read_text())["eos_token_id"] == [2, 0]

    tok = AutoTokenizer.from_pretrained(dest)
    model = AutoModelForCausalLM.from_pretrained(dest).eval()
    assert model.dtype == torch.float32
    chat = [{"role": "user", "content": "What is the capital of France? Digits: 12345."}]
    prompt = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    raw = Tokenizer.from_file(str(dest / "tokenizer.json"))
    assert raw.encode(prompt, add_special_tokens=False).ids == ids
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|>, <|im_end|> as single tokens
    assert [tok.decode([i]) for i in raw.encode("12345", add_special_tokens=False).ids] == list("12345")

    # Plain conversations render exactly as with SmolLM2's own template from the GGUF.
    field = gguf.GGUFReader(models.smollm2_gguf()).fields["tokenizer.chat_template"]
    original = field.contents()
    for msgs in (chat, [{"role": "system", "content": "Be brief."}] + chat):
        for gen in (False, True):
            assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == \
                tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, chat_template=original)

    # Greedy on a question the model knows: garbled dequantisation would not say Paris.
    question = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(question, add_generation_prompt=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids):], skip_special_tokens=True)

    before = {p.name: p.stat().st_mtime_ns for p in dest.iterdir()}
    lines.clear()
    assert prepare_default_model(dest, progress=lines.append) == dest
    assert len(lines) == 1 and "nothing to do" in lines[0]
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == before
