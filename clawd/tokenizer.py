"""The policy's tokenizer and chat template, without transformers.

transformers imports torch, and the daemon must not (docs/ARCHITECTURE.md §1), so this loads
`tokenizer.json` with the `tokenizers` library and renders the Jinja chat
template from `tokenizer_config.json` the way transformers does: a sandboxed
environment with trim_blocks/lstrip_blocks, `raise_exception`,
`strftime_now`, and a `tojson` that keeps non-ASCII text as is.
"""
from __future__ import annotations

import datetime
import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                       "raise_exception", "strftime_now",
                       "unk_token", "pad_token"})


class TemplateError(ValueError):
    """The chat template refused the conversation (a client error)."""


class _GenerationTag(jinja2.ext.Extension):
    """Some templates mark assistant spans with {% generation %}; render the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...} in older configs
        return value.get("content")
    return value


@dataclass(frozen=True)
class ModelInfo:
    context_length: int
    eos_ids: tuple[int, ...]
    model_type: str


class ChatTokenizer:
    """Encodes chat requests into prompt ids exactly as the engine will see them."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (model_dir / "chat_template.jinja").exists():
            template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
        if not template:
            raise ValueError(f"{model_dir}: the tokenizer has no chat template")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(template)
        self._special = {k: _token_text(cfg.get(k)) for k in
                         ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.special_ids = frozenset(
            int(i) for i, tok in cfg.get("added_tokens_decoder", {}).items() if tok.get("special"))
        self.info = self._model_info(model_dir, cfg)
        self._splitter, self._added = self._added_token_splitter()
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self.cache_size = 4096

    def _added_token_splitter(self) -> tuple[re.Pattern | None, dict[str, int]]:
        """The tokenizer cuts text at added tokens before anything else, so the pieces
        between them encode independently: each piece can be cached, and a long
        conversation re-encodes only its new messages. Tokens whose matching depends on
        their neighbours (lstrip, rstrip, single_word, normalized) disable the cache."""
        added = self.tokenizer.get_added_tokens_decoder()
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values()):
            return None, {}
        contents = sorted((t.content for t in added.values()), key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, contents)) + ")"), {t.content: i for i, t in added.items()}

    def _model_info(self, model_dir: Path, tok_cfg: dict) -> ModelInfo:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.exists() else {}
        eos = gen.get("eos_token_id", config.get("eos_token_id"))
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        eos_text = self._special["eos_token"]
        if eos_text and (tid := self.tokenizer.token_to_id(eos_text)) is not None:
            eos_ids.append(tid)
        # ChatML models end a turn with <|im_end|> even when config names another EOS.
        if (im_end := self.tokenizer.token_to_id("<|im_end|>")) is not None:
            eos_ids.append(im_end)
        context = int(config.get("max_position_embeddings") or tok_cfg.get("model_max_length") or 2048)
        return ModelInfo(context_length=context, eos_ids=tuple(dict.fromkeys(eos_ids)),
                         model_type=str(config.get("model_type", "")))

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **extra: Any) -> str:
        """The prompt text; `extra` is the request's chat_template_kwargs (e.g. enable_thinking)."""
        extra = {k: v for k, v in extra.items() if k not in _RESERVED}
        try:
            return self._template.render(**self._special, **extra, messages=messages, tools=tools or None,
                                         add_generation_prompt=True)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from None

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    **extra: Any) -> list[int]:
        # The template already holds BOS and role markers: no special tokens added.
        return self.encode(self.render(messages, tools, **extra))

    def encode(self, text: str) -> list[int]:
        if self._splitter is None:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        for piece in self._splitter.split(text):
            if piece in self._added:
                ids.append(self._added[piece])
            elif piece:
                ids += self._encode_piece(piece)
        return ids

    def _encode_piece(self, piece: str) -> list[int]:
        cached = self._cache.get(piece)
        if cached is None:
            cached = self.tokenizer.encode(piece, add_special_tokens=False).ids
            self._cache[piece] = cached
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(piece)
        return cached

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
