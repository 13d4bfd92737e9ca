"""clawd's CPU engine (DESIGN §10): a Hugging Face causal LM behind SGLang's native HTTP API.

It speaks the part of SGLang 0.5.23's API that clawd uses, with SGLang's JSON
shapes (reference/sglang-http-api.md §1, §2, §4, §5), so clawd runs unchanged on
either engine:

    POST /generate                  token-in/token-out, batches, log-probs, SSE
    POST /abort_request             by rid prefix, or abort_all
    POST /update_weights_from_disk  swap in a same-architecture HF directory
    POST /pause_generation, /continue_generation   modes abort | retract | in_place
    GET  /health, /health_generate, /ready, /model_info;  GET|POST /flush_cache

One process, one event loop, no Python threads. The model runs on the loop one
step at a time and yields between decode steps, so aborts, health checks and
new arrivals are served while a batch runs. Requests queued when the engine is
ready to start work run as one left-padded batch sharing a KV cache, each
sequence stopping on its own; requests arriving while it runs are prefilled
and join it at a step boundary while there is room (continuous batching).
Weight updates are applied between batches: a pending update lets the running
batch drain, and requests arriving meanwhile wait for the new weights.

    python -m clawd.engine.local.server --model DIR [--fd N | --host 127.0.0.1 --port P]
        [--weight-version 0] [--seed 0] [--threads N] [--max-batch-size 8]
        [--context-length N] [--incremental-streaming-output]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import inspect
import json
import logging
import math
import os
import random
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from aiohttp import web

log = logging.getLogger("clawd.engine.cpu")

GREEDY_TEMPERATURE = 1e-6  # below this, SGLang samples greedily and reports T=1 log-probs
MAX_STOP_STRINGS = 32
GATHER_YIELDS = 4  # loop turns given to requests that arrived together before a batch starts


class ContractError(ValueError):
    """A body that breaks /generate's schema: 400 {"error": "<text>"} (SGLang's contract check)."""


class RequestError(ValueError):
    """A well-formed request that SGLang refuses: 400 {"error": {"message": ...}}."""


class BadBody(ValueError):
    """A control endpoint's body failed validation: 400 in FastAPI's rewritten 422 shape."""


# --------------------------------------------------------------------------
# Sampling parameters

@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    sampling_seed: int | None = None
    stream_interval: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_stop(v) -> bool:
    return isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v))


# key -> (type name for the error, check). Order = the order the error message lists them.
_SAMPLING_KEYS = {
    "max_new_tokens": ("an integer", _is_int),
    "min_new_tokens": ("an integer", _is_int),
    "stop": ("a string or a list of strings", _is_stop),
    "stop_token_ids": ("a list of integers", lambda v: isinstance(v, list) and all(map(_is_int, v))),
    "temperature": ("a number", _is_num),
    "top_p": ("a number", _is_num),
    "top_k": ("an integer", _is_int),
    "min_p": ("a number", _is_num),
    "frequency_penalty": ("a number", _is_num),
    "presence_penalty": ("a number", _is_num),
    "repetition_penalty": ("a number", _is_num),
    "ignore_eos": ("a boolean", lambda v: isinstance(v, bool)),
    "skip_special_tokens": ("a boolean", lambda v: isinstance(v, bool)),
    "spaces_between_special_tokens": ("a boolean", lambda v: isinstance(v, bool)),
    "no_stop_trim": ("a boolean", lambda v: isinstance(v, bool)),
    "n": ("an integer", _is_int),
    "logit_bias": ("a map of token id to number",
                   lambda v: isinstance(v, dict) and all(map(_is_num, v.values()))),
    "sampling_seed": ("an integer", _is_int),
    "stream_interval": ("an integer", _is_int),
    "custom_params": ("an object", lambda v: isinstance(v, dict)),  # for logit processors; ignored here
    # In SGLang's contract but not implemented here: refused when set.
    "stop_regex": ("a string or a list of strings", _is_stop),
    "json_schema": ("a string", lambda v: isinstance(v, str)),
    "regex": ("a string", lambda v: isinstance(v, str)),
    "ebnf": ("a string", lambda v: isinstance(v, str)),
    "structural_tag": ("a string", lambda v: isinstance(v, str)),
}
_UNSUPPORTED_SAMPLING = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag")


def parse_sampling_params(raw) -> SamplingParams:
    """One `sampling_params` object -> SamplingParams; SGLang's defaults and checks."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ContractError("invalid type: sampling_params must be an object")
    for key, value in raw.items():
        if key not in _SAMPLING_KEYS:
            expected = ", ".join(f"`{k}`" for k in _SAMPLING_KEYS)
            raise ContractError(f"unknown field `{key}`, expected one of {expected}")
        kind, ok = _SAMPLING_KEYS[key]
        if value is not None and not ok(value):
            raise ContractError(f"invalid type for `{key}`: expected {kind}")
    given = {k: v for k, v in raw.items() if v is not None}
    for key in _UNSUPPORTED_SAMPLING:
        if given.get(key):
            raise RequestError(f"sampling_params.{key} is not supported by clawd's CPU engine")
    if given.pop("n", 1) != 1:
        raise RequestError("n > 1 is not supported by clawd's CPU engine; send one request per sample")
    stop = given.pop("stop", ())
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    bias = []
    for k, v in given.pop("logit_bias", {}).items():
        try:
            bias.append((int(k), float(v)))
        except ValueError:
            raise RequestError(f"logit_bias keys must be token ids, got {k!r}") from None
    for key in ("custom_params", *_UNSUPPORTED_SAMPLING):
        given.pop(key, None)
    stop_ids = tuple(given.pop("stop_token_ids", ()))
    floats = {k: float(given[k]) for k in ("temperature", "top_p", "min_p", "frequency_penalty",
                                             "presence_penalty", "repetition_penalty") if k in given}
    p = SamplingParams(**{**given, **floats}, stop=stop, stop_token_ids=stop_ids, logit_bias=tuple(bias))
    check_sampling_params(p)
    return p


def check_sampling_params(p: SamplingParams) -> None:
    """SGLang's value checks (400 {"error": {"message"}}), in its words where they are known."""
    if not (p.temperature >= 0.0 and math.isfinite(p.temperature)):
        raise RequestError(f"temperature must be non-negative and finite, got {p.temperature}.")
    if not 0.0 < p.top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {p.top_p}.")
    if not 0.0 <= p.min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {p.min_p}.")
    if p.top_k < 1 and p.top_k != -1:
        raise RequestError(f"top_k must be -1 (disable), or at least 1, got {p.top_k}.")
    if not -2.0 <= p.frequency_penalty <= 2.0:
        raise RequestError(f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}.")
    if not -2.0 <= p.presence_penalty <= 2.0:
        raise RequestError(f"presence_penalty must be in [-2, 2], got {p.presence_penalty}.")
    if not 0.0 < p.repetition_penalty <= 2.0:
        raise RequestError(f"repetition_penalty must be in (0, 2], got {p.repetition_penalty}.")
    if p.max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
    if not 0 <= p.min_new_tokens <= p.max_new_tokens:
        raise RequestError(f"min_new_tokens must be in [0, max_new_tokens={p.max_new_tokens}], "
                           f"got {p.min_new_tokens}.")
    if len(p.stop) > MAX_STOP_STRINGS or not all(p.stop):
        raise RequestError(f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings.")
    if p.stream_interval < 1:
        raise RequestError(f"stream_interval must be at least 1, got {p.stream_interval}.")


# --------------------------------------------------------------------------
# /generate's top-level fields

@dataclass(frozen=True)
class GenerateItem:
    """One sequence of a /generate request, validated against the schema."""
    prompt: tuple[int, ...]
    params: SamplingParams
    rid: str
    return_logprob: bool
    logprob_start_len: int
    return_text_in_logprobs: bool


def _per_item(body: dict, key: str, n: int, default, ok, kind: str) -> list:
    """A field that is one value for all items or a list with one per item."""
    value = body.get(key)
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if not all(ok(v) for v in value):
            raise ContractError(f"invalid type for `{key}`: expected {kind} or a list of them")
        if len(value) != n:
            raise RequestError(f"{key} has {len(value)} entries for a batch of {n}")
        return list(value)
    if not ok(value):
        raise ContractError(f"invalid type for `{key}`: expected {kind} or a list of them")
    return [value] * n


def parse_generate(body: dict, tokenize) -> tuple[list[GenerateItem], bool, bool]:
    """A /generate body -> (items, is_batch, stream). Unknown top-level keys are ignored."""
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise RequestError("Either text or input_ids should be provided, but not both.")
    if text is not None:
        if isinstance(text, str):
            prompts, is_batch = [tokenize(text)], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, is_batch = [tokenize(t) for t in text], True
        else:
            raise ContractError("invalid type for `text`: expected a string or a non-empty list of strings")
    elif isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        prompts, is_batch = ids, True
    elif isinstance(ids, list):
        prompts, is_batch = [ids], False
    else:
        raise ContractError("invalid type for `input_ids`: expected a list of integers or of lists")
    for prompt in prompts:
        if not all(map(_is_int, prompt)):
            raise ContractError("invalid type for `input_ids`: expected integers")
        if not prompt:
            raise RequestError("input_ids is empty.")
    n = len(prompts)

    raw_params = body.get("sampling_params")
    if isinstance(raw_params, list):
        if len(raw_params) != n:
            raise RequestError(f"sampling_params has {len(raw_params)} entries for a batch of {n}")
        params = [parse_sampling_params(p) for p in raw_params]
    else:
        params = [parse_sampling_params(raw_params)] * n

    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(n)] if is_batch else [rid]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != n:
            raise RequestError("The specified rids length mismatch with the batch_size for batch processing.")
        rids = list(rid)
    else:
        raise ContractError("invalid type for `rid`: expected a string or a list of strings")

    return_logprob = _per_item(body, "return_logprob", n, False, lambda v: isinstance(v, bool), "a boolean")
    start = _per_item(body, "logprob_start_len", n, -1, _is_int, "an integer")
    top = _per_item(body, "top_logprobs_num", n, 0, _is_int, "an integer")
    if any(top) or body.get("token_ids_logprob") is not None:
        raise RequestError("top_logprobs_num and token_ids_logprob are not supported by clawd's CPU engine")
    stream = body.get("stream", False)
    with_text = body.get("return_text_in_logprobs", False)
    if not isinstance(stream, bool) or not isinstance(with_text, bool):
        raise ContractError("invalid type for `stream` / `return_text_in_logprobs`: expected a boolean")
    items = [GenerateItem(tuple(prompts[i]), params[i], rids[i], return_logprob[i], start[i], with_text)
             for i in range(n)]
    return items, is_batch, stream


# --------------------------------------------------------------------------
# Token selection (pure tensor functions)

def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
                    banned: list[int]) -> torch.Tensor:
    """Penalties, logit bias and the min_new_tokens ban applied to one row of logits.

    As in SGLang: repetition covers prompt and output tokens, frequency and
    presence the output only; `banned` (stop ids before min_new_tokens) -> -inf.
    """
    z = logits
    vocab = z.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(prompt + output, dtype=torch.long)] = True
        scaled = torch.where(z > 0, z / p.repetition_penalty, z * p.repetition_penalty)
        z = torch.where(seen, scaled, z)
    if output and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).to(z.dtype)
        z = z - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(z.dtype)
    if p.logit_bias:
        z = z.clone()
        for tok, bias in p.logit_bias:
            if 0 <= tok < vocab:
                z[tok] += bias
    if banned:
        z = z.clone()
        z[torch.tensor(banned, dtype=torch.long)] = -math.inf
    return z


def truncate_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float):
    """Probabilities sorted high to low with the top-k / top-p / min-p tail zeroed, and their ids.

    All three cut the original distribution (not one another's renormalised
    result), and the most likely token always survives.
    """
    sorted_p, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    if top_p < 1.0:
        keep &= (sorted_p.cumsum(0) - sorted_p) < top_p  # mass strictly before this token
    if min_p > 0.0:
        keep &= sorted_p >= min_p * sorted_p[0]
    keep[0] = True
    return sorted_p * keep, order


def pick_token(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
               banned: list[int], generator: torch.Generator) -> tuple[int, float]:
    """Choose the next token from one row of float32 logits; return (id, log-prob).

    The log-prob is SGLang's: log_softmax(z / T) over the whole vocabulary, not
    renormalised after truncation; greedy requests report T = 1.
    """
    z = apply_penalties(logits, p, prompt, output, banned)
    if p.greedy:
        tok = int(torch.argmax(z))
        return tok, float(torch.log_softmax(z, -1)[tok])
    logprobs = torch.log_softmax(z / p.temperature, -1)
    probs = logprobs.exp()
    if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
        kept, order = truncate_probs(probs, p.top_k, p.top_p, p.min_p)
        tok = int(order[torch.multinomial(kept, 1, generator=generator)])
    else:
        tok = int(torch.multinomial(probs, 1, generator=generator))
    return tok, float(logprobs[tok])


def prompt_logprobs(logits: torch.Tensor, ids: list[int], start: int) -> list[float | None]:
    """SGLang's input log-probs of `ids` from position `start` on: len(ids) - start values.

    `logits` are the model's outputs at positions start .. len(ids)-1 (one row
    each). Entry i is log P(ids[start+i] | ids[:start+i]) at T = 1; entry 0 is
    always None, as SGLang's shifted window leaves it.
    """
    n = len(ids)
    if start >= n:
        return []
    rows = torch.log_softmax(logits[: n - start - 1], -1)
    targets = torch.tensor(ids[start + 1:], dtype=torch.long)
    return [None] + rows.gather(1, targets[:, None])[:, 0].tolist()


# --------------------------------------------------------------------------
# Requests in flight

ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue", "status_code": None, "err_type": None}


class Group:
    """The sequences of one HTTP request and the queue its handler reads events from."""

    def __init__(self, stream: bool):
        self.stream = stream
        self.reqs: list[Req] = []
        # (index, tokens so far, final): one per streamed token, and one final per sequence
        self.events: asyncio.Queue[tuple[int, int, bool]] = asyncio.Queue()


class Req:
    """One sequence: its validated request, its progress, and where to report it."""

    def __init__(self, item: GenerateItem, group: Group, index: int, seed: int):
        self.item = item
        self.params = item.params
        self.rid = item.rid
        self.prompt = list(item.prompt)
        self.group, self.index = group, index
        self.generator = torch.Generator().manual_seed(seed % 2**64)  # any int seed is valid
        self.t0 = time.perf_counter()
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.input_logprobs: list[float | None] | None = None
        self.versions: list[dict] = []  # SGLang's weight_versions spans over output indices
        self.finish: dict | None = None
        self.started = False  # has been in a batch (an abort is then "Aborted", not "in waiting queue")
        self.abort_requested = False
        self.num_retractions = 0

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.item.return_logprob and self.item.logprob_start_len >= 0 and self.input_logprobs is None

    def append(self, tok: int, lp: float, version: str) -> None:
        n = len(self.output_ids)
        self.output_ids.append(tok)
        self.output_logprobs.append(lp)
        if self.versions and self.versions[-1]["version"] == version:
            self.versions[-1]["end"] = n + 1
        else:
            self.versions.append({"version": version, "start": n, "end": n + 1})

    def notify(self, final: bool) -> None:
        n = len(self.output_ids)
        if final or (self.group.stream and n % self.params.stream_interval == 0):
            self.group.events.put_nowait((self.index, n, final))


@dataclass
class Cursor:
    """What an incremental stream has already sent for one sequence."""
    n: int = 0
    text: str = ""
    sent_input: bool = False


# --------------------------------------------------------------------------
# The engine: model, queue and the batch loop

@dataclass
class Batch:
    """Sequences decoding together: left-padded rows sharing one KV cache."""
    rows: list[Req]
    cache: object  # transformers DynamicCache
    mask: torch.Tensor  # [rows, cache length]; 0 marks padding
    next_pos: torch.Tensor  # [rows, 1]: position id of each row's next token

    def select(self, keep: list[int]) -> None:
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, dtype=torch.long)
            self.cache.batch_select_indices(index)
            self.mask, self.next_pos = self.mask[index], self.next_pos[index]
            self.rows = [self.rows[b] for b in keep]

    def can_extend(self) -> bool:
        # Only plain full-attention layers hold every position, so only they can be re-padded.
        from transformers.cache_utils import DynamicLayer
        return all(type(layer) is DynamicLayer for layer in getattr(self.cache, "layers", [None]))

    def extend(self, other: Batch) -> None:
        """Append `other`'s rows, left-padding the shorter side with masked zeros."""
        if not other.rows:
            return
        width = max(self.mask.shape[1], other.mask.shape[1])
        pad = torch.nn.functional.pad
        left = lambda t: pad(t, (0, 0, width - t.shape[-2], 0))  # [batch, heads, time, dim]
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([left(mine.keys), left(theirs.keys)])
            mine.values = torch.cat([left(mine.values), left(theirs.values)])
        self.mask = torch.cat([pad(m, (width - m.shape[1], 0)) for m in (self.mask, other.mask)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.rows = self.rows + other.rows


class WeightLoadError(Exception):
    pass


def _model_kind(model) -> tuple:
    return type(model), {k: tuple(v.shape) for k, v in model.state_dict().items()}


def load_model(path: str, like=None):
    """Load an HF causal LM in float32; with `like`, insist on the same class and tensor shapes."""
    from transformers import AutoModelForCausalLM
    if not Path(path).is_dir():
        raise WeightLoadError(f"{path} is not a directory")
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    problems = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise WeightLoadError(f"checkpoint does not match its config: {problems or info['error_msgs']}")
    model.eval()
    if like is not None:
        (cls, shapes), (old_cls, old_shapes) = _model_kind(model), _model_kind(like)
        if cls is not old_cls:
            raise WeightLoadError(f"architecture {cls.__name__} differs from the served {old_cls.__name__}")
        diff = sorted(k for k in shapes.keys() | old_shapes.keys() if shapes.get(k) != old_shapes.get(k))
        if diff:
            raise WeightLoadError(f"{len(diff)} tensors differ in name or shape from the served model, "
                                  f"e.g. {diff[0]}: {shapes.get(diff[0])} vs {old_shapes.get(diff[0])}")
    return model


class Engine:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.incremental = args.incremental_streaming_output
        self.model_path = args.model
        self.weight_version = args.weight_version
        self.model = None
        self.tokenizer = None
        self.loaded = asyncio.Event()
        self.waiting: collections.deque[Req] = collections.deque()
        self.live: dict[str, Req] = {}  # rid -> request, waiting or running
        self.updates: collections.deque[tuple[str, str | None, asyncio.Future]] = collections.deque()
        self.paused: str | None = None  # None or the pause mode
        self._kick = asyncio.Event()  # something changed: new work, abort, pause, update
        self.parked = asyncio.Event()  # the loop is waiting at a step boundary, not computing
        self._seeds = random.Random(args.seed)

    # ---- loading

    def load(self) -> None:
        """Load tokenizer and model (blocks the loop; nothing can run before this anyway)."""
        from transformers import AutoTokenizer
        t0 = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(self.args.model)
        self.model = load_model(self.args.model)
        cfg, gen = self.model.config, self.model.generation_config
        eos = set()
        for ids in (getattr(cfg, "eos_token_id", None), getattr(gen, "eos_token_id", None),
                    self.tokenizer.eos_token_id):
            eos.update([ids] if isinstance(ids, int) else (ids or []))
        self.eos_ids = frozenset(eos)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.context_len = self.args.context_length or getattr(cfg, "max_position_embeddings", None) or 4096
        # transformers 5.x renamed the cache argument; accept either spelling.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.loaded.set()
        log.info("loaded %s (%s, vocab %d, context %d, eos %s) in %.1f s", self.args.model,
                 cfg.model_type, self.vocab_size, self.context_len, sorted(self.eos_ids),
                 time.perf_counter() - t0)

    # ---- requests

    def submit(self, items: list[GenerateItem], stream: bool) -> Group:
        """Validate against the model and queue the items as one group (they batch together)."""
        rids = set()
        for it in items:
            if it.rid in self.live or it.rid in rids:
                raise RequestError(f"Duplicate request ID detected: {it.rid}")
            rids.add(it.rid)
            n, m = len(it.prompt), it.params.max_new_tokens
            if n >= self.context_len:
                raise RequestError(f"The input ({n} tokens) is longer than the model's context length "
                                   f"({self.context_len} tokens).")
            if n + m > self.context_len:
                raise RequestError(
                    f"Requested token count exceeds the model's maximum context length of {self.context_len} "
                    f"tokens. You requested a total of {n + m} tokens: {n} tokens from the input messages and "
                    f"{m} tokens for the completion. Please reduce the number of tokens in the input messages "
                    f"or the completion to fit within the limit.")
            if it.return_logprob and not -1 <= it.logprob_start_len <= n:
                raise RequestError(f"logprob_start_len ({it.logprob_start_len}) must be -1 or between 0 and "
                                   f"the number of input tokens ({n}).")
            bad = [t for t in it.prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"input_ids hold {bad[0]}, outside the vocabulary [0, {self.vocab_size}).")
        group = Group(stream)
        for i, it in enumerate(items):
            seed = it.params.sampling_seed
            req = Req(it, group, i, self._seeds.getrandbits(63) if seed is None else seed)
            group.reqs.append(req)
            self.live[req.rid] = req
            self.waiting.append(req)
        self._kick.set()
        return group

    def finish(self, req: Req, reason: dict) -> None:
        req.finish = reason
        self.live.pop(req.rid, None)
        req.notify(final=True)

    def abort(self, rid: str | None) -> int:
        """Abort requests whose rid starts with `rid` (all when None), as SGLang matches; return how many."""
        hits = [r for r in self.live.values() if rid is None or r.rid.startswith(rid)]
        for req in hits:
            self._abort_one(req)
        return len(hits)

    def abort_group(self, group: Group) -> None:
        """The client is gone (or its handler ended early): abort what it still waits for."""
        for req in group.reqs:
            if not req.done:
                log.info("client disconnected; aborting %s", req.rid)
                self._abort_one(req)

    def _abort_one(self, req: Req) -> None:
        if req in self.waiting:  # not computing: answer now
            self.waiting.remove(req)
            self.finish(req, ABORTED if req.started else ABORTED_WAITING)
        else:  # running: the batch loop ends it at the next step boundary
            req.abort_requested = True
        self._kick.set()

    # ---- control

    async def pause(self, mode: str) -> None:
        self.paused = mode
        if mode == "abort":
            self.abort(None)
        self._kick.set()
        await self.parked.wait()

    def resume(self) -> None:
        self.paused = None
        self._kick.set()

    async def update_weights(self, path: str, version: str | None) -> tuple[int, dict]:
        """Queue a swap for the loop to apply between batches (or now, if paused); await its result."""
        fut = asyncio.get_running_loop().create_future()
        self.updates.append((path, version, fut))
        self._kick.set()
        return await fut

    def _apply_update(self, path: str, version: str | None, fut: asyncio.Future) -> None:
        t0 = time.perf_counter()
        try:
            model = load_model(path, like=self.model)
        except Exception as exc:  # any failure is the caller's answer; the old weights keep serving
            log.warning("weight update from %s failed: %s", path, exc, exc_info=not isinstance(exc, WeightLoadError))
            result = (400, {"success": False, "num_paused_requests": 0,
                            "message": f"Failed to update weights: {exc}. Rolled back to the previous weights."})
        else:
            self.model, self.model_path = model, path
            message = "Succeeded to update model weights."
            if version is not None:
                self.weight_version = version
                message += f" Weight version updated to {version}."
            log.info("weights now %s (version %s), loaded in %.2f s", path, self.weight_version,
                     time.perf_counter() - t0)
            result = (200, {"success": True, "message": message, "num_paused_requests": 0})
        if not fut.done():
            fut.set_result(result)

    # ---- the loop

    async def _park(self, between_batches: bool) -> None:
        """Wait at a step boundary while paused or idle, applying weight updates when allowed.

        Between batches an update always applies; inside a batch only while paused
        (in_place), as SGLang skips its lock when paused.
        """
        while True:
            if self.updates and (between_batches or self.paused):
                self._apply_update(*self.updates.popleft())
                continue
            idle = between_batches and not self.waiting
            if not (self.paused or idle):
                return
            self.parked.set()
            self._kick.clear()
            await self._kick.wait()
            self.parked.clear()

    async def run(self) -> None:
        await self.loaded.wait()
        while True:
            await self._park(between_batches=True)
            for _ in range(GATHER_YIELDS):  # let requests that arrived together start together
                await asyncio.sleep(0)
            if self.paused or self.updates or not self.waiting:
                continue
            members = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.args.max_batch_size))]
            try:
                await self._run_batch(members)
            except Exception as exc:  # fail these requests, keep serving the next ones
                log.exception("batch of %d failed", len(members))
                for req in members:
                    if not req.done:
                        self.finish(req, {"type": "abort", "message": f"Internal error: {exc}",
                                          "status_code": 500, "err_type": "InternalServerError"})

    def _forward(self, ids, mask, pos, cache, keep: int) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                             logits_to_keep=keep, **{self._cache_kw: cache})
        return out.logits.float()

    async def _run_batch(self, members: list[Req]) -> None:
        """Decode `members` to the end, one step per loop turn; newcomers join while there is room.

        Requests that join are appended to `members`, so the caller can fail them all.
        """
        batch = self._prefill(members)
        while batch.rows:
            await asyncio.sleep(0)  # serve aborts, health checks and arrivals between steps
            if self.paused == "in_place":
                await self._park(between_batches=False)
            for req in batch.rows:
                if req.abort_requested and not req.done:
                    self.finish(req, ABORTED)
            batch.select([b for b, r in enumerate(batch.rows) if not r.done])
            if self.paused == "retract":  # back to the queue; KV recomputed on resume
                for req in reversed(batch.rows):
                    req.num_retractions += 1
                    self.waiting.appendleft(req)
                log.info("retracted %d requests", len(batch.rows))
                return
            room = self.args.max_batch_size - len(batch.rows)
            # Continuous batching, but never past a pending update: the batch drains first.
            if batch.rows and room > 0 and self.waiting and not self.paused and not self.updates \
                    and batch.can_extend():
                newcomers = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
                members.extend(newcomers)
                batch.extend(self._prefill(newcomers))
            if not batch.rows:
                return
            tokens = torch.tensor([[r.output_ids[-1]] for r in batch.rows], dtype=torch.long)
            batch.mask = torch.cat([batch.mask, torch.ones(len(batch.rows), 1, dtype=torch.long)], dim=1)
            last = self._forward(tokens, batch.mask, batch.next_pos, batch.cache, 1)[:, -1]
            batch.next_pos = batch.next_pos + 1
            self._sample(batch.rows, last)

    def _prefill(self, rows: list[Req]) -> Batch:
        """Run the prompts (plus any output so far, after a retraction) and sample each first token.

        Rows are left-padded and right-aligned. The logits kept are the ones input
        log-probs need (the last len - logprob_start_len positions) plus the last.
        """
        from transformers import DynamicCache
        for req in rows:
            req.started = True
        seqs = [r.prompt + r.output_ids for r in rows]
        width = max(map(len, seqs))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for b, seq in enumerate(seqs):
            ids[b, width - len(seq):] = torch.tensor(seq)
            mask[b, width - len(seq):] = 1
        keep = max(max(1, len(seq) - r.item.logprob_start_len) if r.wants_input_logprobs else 1
                   for r, seq in zip(rows, seqs))
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache, keep)
        for b, (req, seq) in enumerate(zip(rows, seqs)):
            if req.wants_input_logprobs:
                start = req.item.logprob_start_len
                req.input_logprobs = prompt_logprobs(logits[b, keep - (len(seq) - start):], seq, start)
            if req.params.max_new_tokens == 0:  # prefill only: the scoring path
                self.finish(req, {"type": "length", "length": 0})
        self._sample(rows, logits[:, -1])
        batch = Batch(list(rows), cache, mask, mask.sum(-1, keepdim=True))
        batch.select([b for b, r in enumerate(rows) if not r.done])
        return batch

    def _sample(self, rows: list[Req], last: torch.Tensor) -> None:
        """One token for every unfinished row from its row of `last` logits; report it."""
        for b, req in enumerate(rows):
            if req.done:
                continue
            tok, lp = pick_token(last[b], req.params, req.prompt, req.output_ids, self._banned(req),
                                 req.generator)
            req.append(tok, lp, self.weight_version)
            reason = self._stop_reason(req)
            if reason is not None:
                self.finish(req, reason)
            else:
                req.notify(final=False)

    def _banned(self, req: Req) -> list[int]:
        p = req.params
        if len(req.output_ids) >= p.min_new_tokens or p.ignore_eos:
            return []
        return sorted(self.eos_ids | set(p.stop_token_ids))

    def _stop_reason(self, req: Req) -> dict | None:
        """SGLang's order: length first, then stop tokens, then stop strings."""
        p, out = req.params, req.output_ids
        if len(out) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(out) < p.min_new_tokens:
            return None
        if not p.ignore_eos and (out[-1] in self.eos_ids or out[-1] in p.stop_token_ids):
            return {"type": "stop", "matched": out[-1]}
        if p.stop:
            # A multi-byte character may take several tokens: look back far enough.
            window = 4 * max(map(len, p.stop)) + 4
            tail = self.decode(out[-window:], p)
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None

    # ---- output

    def decode(self, ids: list[int], p: SamplingParams) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens,
                                     spaces_between_special_tokens=p.spaces_between_special_tokens)

    def text(self, req: Req, n: int, final: bool) -> str:
        """The output text after n tokens: trimmed at the stop on the final chunk, and with an
        incomplete UTF-8 character held back on the others."""
        p, ids = req.params, req.output_ids[:n]
        reason = req.finish if final else None
        trim = reason is not None and reason.get("type") == "stop" and not p.no_stop_trim
        if trim and isinstance(reason["matched"], int):
            ids = ids[:-1]
        text = self.decode(ids, p)
        if trim and isinstance(reason["matched"], str):
            at = text.find(reason["matched"])
            text = text if at < 0 else text[:at]
        if not final:
            text = text.rstrip("\ufffd")
        return text

    def render(self, req: Req, n: int, final: bool, cursor: Cursor | None = None) -> dict:
        """A /generate response object (or stream chunk) for `req` after n tokens.

        With a cursor (incremental streaming) ids, text and log-probs hold only
        what is new since the cursor; input log-probs go in its first chunk only.
        """
        it = req.item
        since = cursor.n if cursor is not None else 0
        text = self.text(req, n, final)
        waiting_abort = final and req.finish is ABORTED_WAITING  # SGLang omits the token counts then
        meta = {"id": req.rid, "finish_reason": req.finish if final else None}
        if not waiting_abort:
            meta["prompt_tokens"] = len(req.prompt)
        meta["weight_version"] = self.weight_version
        if not waiting_abort:
            meta["num_retractions"] = req.num_retractions
        if it.return_logprob:
            inputs = req.input_logprobs or []
            if cursor is not None and cursor.sent_input:
                inputs = []
            scored = req.prompt[it.logprob_start_len:] if it.logprob_start_len >= 0 else []
            meta["input_token_logprobs"] = [self._entry(lp, tok) for lp, tok in zip(inputs, scored)]
            meta["output_token_logprobs"] = [self._entry(lp, tok, it.return_text_in_logprobs) for lp, tok in
                                             zip(req.output_logprobs[since:n], req.output_ids[since:n])]
        meta["completion_tokens"] = n
        if not waiting_abort:
            meta["cached_tokens"] = 0
            meta["reasoning_tokens"] = 0
        meta["weight_versions"] = [{**s, "end": min(s["end"], n)} for s in req.versions if s["start"] < n]
        meta["e2e_latency"] = time.perf_counter() - req.t0
        out_text = text
        if cursor is not None:
            out_text = text[len(cursor.text):] if text.startswith(cursor.text) else ""
            cursor.n, cursor.text, cursor.sent_input = n, text, True
        return {"text": out_text, "output_ids": req.output_ids[since:n], "meta_info": meta}

    def _entry(self, lp: float | None, tok: int, with_text: bool = False) -> list:
        return [lp, tok, self.tokenizer.decode([tok]) if with_text else None]

    def model_info(self) -> dict:
        cfg = self.model.config
        return {
            "model_path": self.model_path, "served_model_name": self.model_path,
            "tokenizer_path": self.args.model, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": self.weight_version, "load_format": "auto", "reasoning_parser": None,
            "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": cfg.model_type,
            "architectures": list(getattr(cfg, "architectures", None) or [type(self.model).__name__]),
            "max_context_length": self.context_len,
        }

    def shutdown(self) -> None:
        """Answer everything still waiting so handlers finish and the server can close."""
        for req in list(self.live.values()):
            self.finish(req, ABORTED if req.started else ABORTED_WAITING)
        self.waiting.clear()


# --------------------------------------------------------------------------
# HTTP

ENGINE = web.AppKey("engine", Engine)


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _json(obj, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status, dumps=_dumps)


def _sse(obj) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


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


async def handle_generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = await _body(request)
    except BadBody as exc:
        return _bad_request(str(exc))
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
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
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
            _, _, final = await group.events.get()
            remaining -= final
    finally:
        engine.abort_group(group)  # cancelled on client disconnect: stop computing for nobody
    outs = [engine.render(r, len(r.output_ids), True) for r in group.reqs]
    failed = [r.finish for r in group.reqs if (r.finish.get("status_code") or 0) >= 400]
    if failed:
        code = failed[0]["status_code"]
        return _json({"object": "error", "message": failed[0]["message"], "type": str(code),
                      "param": None, "code": code}, code)
    return _json(outs if is_batch else outs[0])


async def _stream(request: web.Request, engine: Engine, group: Group, is_batch: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    cursors = [Cursor() if engine.incremental else None for _ in group.reqs]
    try:
        await resp.prepare(request)
        remaining = len(group.reqs)
        while remaining:
            i, n, final = await group.events.get()
            remaining -= final
            chunk = engine.render(group.reqs[i], n, final, cursors[i])
            if is_batch:
                chunk["index"] = i
            await resp.write(_sse(chunk))
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        log.info("stream client went away")
    finally:
        engine.abort_group(group)
    return resp


async def handle_abort(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        body = await _body(request)
    except BadBody as exc:
        return _bad_request(str(exc))
    rid, everything = body.get("rid", ""), body.get("abort_all", False)
    if not isinstance(rid, str) or not isinstance(everything, bool):
        return _bad_request("rid must be a string and abort_all a boolean")
    if everything:
        n = engine.abort(None)
    elif rid:  # an empty prefix would match everything: only abort_all does that
        n = engine.abort(rid)
    else:
        n = 0
    log.info("abort %s: %d request(s)", "all" if everything else repr(rid), n)
    return web.Response(status=200)


async def handle_update_weights(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        body = await _body(request)
    except BadBody as exc:
        return _bad_request(str(exc))
    path, version = body.get("model_path"), body.get("weight_version")
    if not isinstance(path, str) or not path:
        return _bad_request("model_path is required and must be a string")
    if version is not None and not isinstance(version, str):
        return _bad_request("weight_version must be a string")
    await engine.loaded.wait()
    if body.get("abort_all_requests") is True:
        engine.abort(None)
    status, result = await engine.update_weights(path, version)
    return _json(result, status)


async def handle_pause(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        body = await _body(request)
    except BadBody as exc:
        return _bad_request(str(exc))
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        return _bad_request(f"mode must be one of abort, retract, in_place; got {mode!r}")
    await engine.pause(mode)
    log.info("generation paused (%s)", mode)
    return _json({"message": "Generation paused successfully.", "status": "ok"})


async def handle_continue(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        await _body(request)
    except BadBody as exc:
        return _bad_request(str(exc))
    engine.resume()
    log.info("generation continued")
    return _json({"message": "Generation continued successfully.", "status": "ok"})


async def handle_health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[ENGINE].loaded.is_set() else 503)


async def handle_ready(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(status=200 if engine.loaded.is_set() and not engine.paused else 503)


async def handle_model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if not engine.loaded.is_set():
        return _json({"error": {"message": "The model is still loading."}}, 503)
    return _json(engine.model_info())


async def handle_flush_cache(request: web.Request) -> web.Response:
    return web.Response(text="Cache flushed.\n", content_type="text/plain")  # there is no prefix cache


def build_app(engine: Engine) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[ENGINE] = engine
    app.router.add_post("/generate", handle_generate)
    app.router.add_put("/generate", handle_generate)
    app.router.add_post("/abort_request", handle_abort)
    app.router.add_post("/update_weights_from_disk", handle_update_weights)
    app.router.add_post("/pause_generation", handle_pause)
    app.router.add_post("/continue_generation", handle_continue)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/health_generate", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/model_info", handle_model_info)
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
    ap = argparse.ArgumentParser(prog="python -m clawd.engine.local.server", description=__doc__.split("\n\n")[0])
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
    args = ap.parse_args(argv)
    if args.max_batch_size < 1:
        ap.error("--max-batch-size must be at least 1")
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


if __name__ == "__main__":
    sys.exit(main())
