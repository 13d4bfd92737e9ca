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
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generator

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


# ---------------------------------------------------------------- memory of text
# Shared accounting for the piece cache, live sessions and the judge backlog: deterministic upper bounds
# of what CPython holds, cheap enough for every request (no scan of a string's characters).

CACHE_BYTES = 64 * 1024 * 1024
# One entry may take at most 1/256 of the cache: a huge one-off piece (a pasted document) is not worth
# flushing the many small pieces that conversations repeat, and the cache still holds 256 of the largest.
MAX_ENTRY_BYTES = CACHE_BYTES // 256
_STR_HEADER = 80     # sys.getsizeof("") is 49, a non-ASCII string's header 74-76
_IDS_HEADER = 80     # sys.getsizeof(array("I")) is 80; ids are kept as 4-byte unsigned ints
_ENTRY_SLOT = 160    # OrderedDict slot and link node per entry, measured with tracemalloc (91-151)
_ID_BYTES = 36       # a token id in a list: an 8-byte pointer and a 28-byte int (ids above 256 are not shared)
_FLOAT_BYTES = 32    # a log-prob in a list: pointer and a 24-byte float


def text_bytes(text: str) -> int:
    """Memory of a string: 1 byte a character if ASCII, else at most 4 (CPython's widest kind)."""
    return _STR_HEADER + (len(text) if text.isascii() else 4 * len(text))


def value_bytes(value: Any) -> int:
    """Memory of JSON-like data (messages, tools); its nesting is bounded by the request parser."""
    if isinstance(value, str):
        return text_bytes(value)
    if isinstance(value, dict):
        return 64 + sum(16 + value_bytes(k) + value_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return 56 + sum(8 + value_bytes(v) for v in value)
    return 32


def turn_bytes(turn: Any) -> int:
    """What a captured turn (clawd.turns.Turn) keeps alive: its messages, tools and reply, its ids and
    log-probs. The one measure for sessions.max_bytes and scoring.max_pending_bytes."""
    return (value_bytes(turn.messages) + value_bytes(turn.tools) + value_bytes(turn.reply)
            + _ID_BYTES * (len(turn.prompt_ids) + len(turn.response_ids))
            + _FLOAT_BYTES * len(turn.response_logprobs))


def cache_entry_bytes(piece: str, n_ids: int) -> int:
    return _ENTRY_SLOT + text_bytes(piece) + _IDS_HEADER + 4 * n_ids


# Normalizers that can only shorten text by a bounded factor: NFC/NFKC compose at most 4 code points into
# one (the longest canonical decomposition is 4, checked over all of Unicode); the others never shorten.
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}
# Pre-tokenizers that keep every character (Whitespace and BERT's drop whitespace: no bound there).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Metaspace", "Split", "Punctuation", "UnicodeScripts"}


def max_chars_per_token(tokenizer: Tokenizer) -> int | None:
    """A proven upper bound of the characters one token can stand for, or None when the pipeline can drop
    text (then no prompt length in characters is ever too long to fit). For a BPE model that is the
    longest vocabulary string (a byte-level entry has a character per byte, at least one per decoded
    character), times what the normalizer can shrink. The default model (SmolLM2-135M-Instruct) measures
    81 (a newline and 80 spaces), no normalizer: 8191 tokens hold at most 663,471 characters."""
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("unk_token") and model.get("fuse_unk")
                                      and not model.get("byte_fallback")):
        return None  # unknown runs fuse into one token

    def walk(node, key):
        if not node:
            return []
        if node.get("type") == "Sequence":
            return [n for child in node.get(key, []) for n in walk(child, key)]
        return [node]

    shrink = 1
    for norm in walk(spec.get("normalizer"), "normalizers"):
        if norm.get("type") not in _NORMALIZER_SHRINK:
            return None
        shrink *= _NORMALIZER_SHRINK[norm["type"]]
    for pre in walk(spec.get("pre_tokenizer"), "pretokenizers"):
        if pre.get("type") not in _KEEPING_PRE_TOKENIZERS or pre.get("behavior") == "Removed":
            return None
    longest = max(len(s) for s in tokenizer.get_vocab(with_added_tokens=True))
    return longest * shrink


FULL, PLAIN = "full", "plain"  # the tokenizers a piece may be encoded by (`ChatTokenizer.encode_as`)


def plain_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer without its added vocabulary: quoted text that spells a control token stays text."""
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec))


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
        # A render's context is built from one flat dict (`new_context(shared=True)`), not from the template's
        # ChainMap of globals merged again each time: ~10 us of a ~40 us render.
        self._globals = dict(self._template.globals)
        self._special = {k: _token_text(cfg.get(k)) for k in
                         ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.special_ids = frozenset(
            int(i) for i, tok in cfg.get("added_tokens_decoder", {}).items() if tok.get("special"))
        self.info = self._model_info(model_dir, cfg)
        self._splitter, self._added = self._added_token_splitter()
        # Pieces → ids, least recently used first, bounded by the bytes it holds (cache_entry_bytes).
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._default_system: str | None = None  # default_system(), rendered once
        self.cache_bytes = 0
        self.cache_max_bytes = CACHE_BYTES
        self.max_chars_per_token = max_chars_per_token(self.tokenizer)

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
            context = self._template.new_context({**self._globals, **self._special, **extra, "messages": messages,
                                                  "tools": tools or None, "add_generation_prompt": True}, shared=True)
            return "".join(self._template.root_render_func(context))  # Jinja's low-level API: what render() does
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from None

    def default_system(self) -> str:
        """The system text the chat template puts in a conversation that has none ("" when it adds none):
        the text that stands, in a render without a system message, where a sentinel system message's
        text stands in one with it. Qwen's and SmolLM2's templates name the model there."""
        if self._default_system is None:
            user, system = [{"role": "user", "content": "x"}], "SYSTEM\u2063SENTINEL"
            try:
                plain = self.render(user, None)
                with_sys = self.render([{"role": "system", "content": system}, *user], None)
            except TemplateError:  # a template that refuses a system message has no default to keep
                plain, with_sys = "", ""
            head, found, tail = with_sys.partition(system)
            fits = found and plain.startswith(head) and plain.endswith(tail) and len(plain) >= len(head) + len(tail)
            self._default_system = plain[len(head):len(plain) - len(tail)] if fits else ""
        return self._default_system

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    **extra: Any) -> list[int]:
        # The template already holds BOS and role markers: no special tokens added.
        return self.encode(self.render(messages, tools, **extra))

    def encode(self, text: str) -> list[int]:
        ids, fresh = self.encode_held(text)
        self.keep(fresh)
        return ids

    def encode_held(self, text: str) -> tuple[list[int], dict[str, array]]:
        """`encode` that leaves the cache as it was: the pieces seen for the first time come back with the
        ids, for `keep` once the caller accepts the text (a refused prompt leaves nothing behind)."""
        return self._here(self.encode_steps(text))

    def encode_steps(self, text: str, inline_chars: int | None = None
                     ) -> Generator[tuple[str, str] | None, list[int] | None, tuple[list[int], dict[str, array]]]:
        """`encode_held` in steps, for a caller that must not hold its event loop for long: each uncached
        piece longer than `inline_chars` is yielded as (FULL, piece) for the caller to encode elsewhere
        (`encode_as`; it sends the ids back),
        and after every `inline_chars` characters encoded here a None is yielded (the caller sends None
        back): a moment to yield the loop. Pieces are what the tokenizer encodes independently (the text
        between added tokens), so the ids equal those of the whole text. None: everything here, no yield."""
        budget = inline_chars if inline_chars is not None else float("inf")
        ids: list[int] = []
        fresh: dict[str, array] = {}
        pieces = [text] if self._splitter is None else self._splitter.split(text)
        done_here = 0
        for piece in pieces:
            if piece in self._added:
                ids.append(self._added[piece])
                continue
            if not piece:
                continue
            cached = self._cache.get(piece)
            if cached is not None:
                self._cache.move_to_end(piece)
                ids += cached
                continue
            if (cached := fresh.get(piece)) is not None:
                ids += cached
                continue
            if len(piece) > budget:
                piece_ids = yield FULL, piece
            else:
                if done_here + len(piece) > budget:
                    yield None
                    done_here = 0
                piece_ids = self._encode(piece)
                done_here += len(piece)
            ids += piece_ids
            if self._splitter is not None and cache_entry_bytes(piece, len(piece_ids)) <= MAX_ENTRY_BYTES:
                fresh[piece] = array("I", piece_ids)
        return ids, fresh

    def _here(self, steps: Generator) -> Any:
        """Runs `encode_steps` or `quoted_steps` whole, every piece encoded in this process."""
        try:
            request = next(steps)
            while True:
                request = steps.send(None if request is None else self.encode_as(*request))
        except StopIteration as done:
            return done.value

    def _encode(self, piece: str) -> list[int]:
        return self.tokenizer.encode(piece, add_special_tokens=False).ids

    def encode_as(self, kind: str, piece: str) -> list[int]:
        """A piece's ids by the tokenizer `kind` names: FULL (the model's) or PLAIN (`plain_tokenizer`)."""
        tokenizer = self.tokenizer if kind == FULL else self._quoting_state()[0]
        return tokenizer.encode(piece, add_special_tokens=False).ids

    def keep(self, fresh: dict[str, array]) -> None:
        """Cache the pieces `encode_held` saw first, evicting the least recently used beyond the budget."""
        for piece, ids in fresh.items():
            if piece in self._cache:  # another text cached it meanwhile
                continue
            self._cache[piece] = ids
            self.cache_bytes += cache_entry_bytes(piece, len(ids))
        while self.cache_bytes > self.cache_max_bytes and self._cache:
            piece, ids = self._cache.popitem(last=False)
            self.cache_bytes -= cache_entry_bytes(piece, len(ids))

    @property
    def cache_entries(self) -> int:
        return len(self._cache)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode_chat_quoted(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                           quotes: dict[str, str]) -> list[int]:
        """See `quoted_steps`: run whole, every piece encoded here."""
        return self._here(self.quoted_steps(messages, tools, quotes))

    def quoted_steps(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     quotes: dict[str, str], inline_chars: int | None = None
                     ) -> Generator[tuple[str, str] | None, list[int] | None, list[int]]:
        """`encode_chat` of the conversation in which each placeholder (a key of `quotes`, somewhere in
        the messages' strings) stands for its quoted text, except that added and special tokens in the
        quoted texts stay plain text: a quoted `<|im_end|>` becomes the ids of its characters, never the
        control token. The template is rendered with the placeholders, then the rendered text is cut
        only at the added tokens outside the quoted texts, where `encode` cuts too, so quoted texts
        without an added token give exactly `encode_chat`'s ids. Added tokens are matched by content
        (lstrip/rstrip honoured, single_word and normalized not). TemplateError when the template
        does not copy each placeholder once and verbatim, or an added id still came out of a quote.
        In steps, as `encode_steps`: a piece over `inline_chars` is yielded as (kind, piece), and None after
        every `inline_chars` characters encoded here."""
        plain, pattern, added_ids = self._quoting_state()
        budget = inline_chars if inline_chars is not None else float("inf")
        done_here = 0

        def fill(value):  # the conversation itself: every placeholder replaced by its text
            if isinstance(value, str):
                for ph, quote in quotes.items():
                    value = value.replace(ph, quote)
                return value
            if isinstance(value, dict):
                return {k: fill(v) for k, v in value.items()}
            return [fill(v) for v in value] if isinstance(value, list) else value

        rendered = self.render(messages, tools)
        found = sorted((rendered.find(ph), ph) for ph in quotes)
        if any(at < 0 or rendered.find(ph, at + 1) >= 0 for at, ph in found):
            raise TemplateError("the chat template does not copy quoted text verbatim (or repeats it)")
        parts, ranges, pos, length = [], [], 0, 0
        for at, ph in found:
            parts += [rendered[pos:at], quotes[ph]]
            length += at - pos
            ranges.append((length, length + len(quotes[ph])))
            length += len(quotes[ph])
            pos = at + len(ph)
        text = "".join(parts) + rendered[pos:]
        if text != self.render(fill(messages), fill(tools)):
            raise TemplateError("the chat template does not copy quoted text verbatim")
        cuts: list[tuple[int, int, int]] = []  # the added tokens outside the quoted texts
        if pattern is not None:
            for start, end in zip([0] + [b for _, b in ranges], [a for a, _ in ranges] + [len(text)]):
                cuts += [(m.start(), m.end(), int(m.lastgroup[1:])) for m in pattern.finditer(text, start, end)]
        ids: list[int] = []
        pos = 0
        for start, end, tid in cuts + [(len(text), len(text), -1)]:
            piece = text[pos:start]
            if piece:
                # only quoted text can hold an added token now: the tokenizer without them reads it
                kind = PLAIN if pattern is not None and pattern.search(piece) else FULL
                if len(piece) > budget:
                    piece_ids = yield kind, piece
                else:
                    if done_here + len(piece) > budget:
                        yield None
                        done_here = 0
                    piece_ids = self.encode_as(kind, piece) if kind == PLAIN else self.encode(piece)
                    done_here += len(piece)
                if kind == PLAIN and added_ids.intersection(piece_ids):
                    raise TemplateError("quoted text encoded to an added token")
                ids += piece_ids
            if tid >= 0:
                ids.append(tid)
            pos = end
        return ids

    def _quoting_state(self):
        state = self.__dict__.get("_quoting")
        if state is None:  # built once: the tokenizer without its added vocabulary, and their pattern
            added = self.tokenizer.get_added_tokens_decoder()
            alts = [("\\s*" if t.lstrip else "") + f"(?P<t{i}>{re.escape(t.content)})" + ("\\s*" if t.rstrip else "")
                    for i, t in sorted(added.items(), key=lambda it: len(it[1].content), reverse=True)]
            first = "".join(sorted({re.escape(t.content[0]) for t in added.values()} | {"\\s"}))
            state = self._quoting = (plain_tokenizer(self.tokenizer),  # a lookahead: scans fast
                                     re.compile(f"(?=[{first}])(?:{'|'.join(alts)})") if alts else None,
                                     frozenset(added))
        return state
