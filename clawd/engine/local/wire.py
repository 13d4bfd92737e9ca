"""The request side of the local engine's API contract: /generate bodies and sampling params.

SGLang 0.5.23's schema and value checks (docs/ARCHITECTURE.md §10), in SGLang's
words where they are known, and its two shapes of 400: a body that breaks the
schema (ContractError) and a well-formed request it refuses (RequestError).
Pure Python, no torch: nothing here needs the model but a tokenizer callable.
"""
from __future__ import annotations

import dataclasses
import math
import uuid
from dataclasses import dataclass

GREEDY_TEMPERATURE = 1e-6  # below this, SGLang samples greedily and reports T=1 log-probs
MAX_STOP_STRINGS = 32


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
    max_new_tokens_set: bool = False  # given in the request (SGLang checks only that one against the context)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_bool(v) -> bool:
    return isinstance(v, bool)


def _is_str(v) -> bool:
    return isinstance(v, str)


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
    "ignore_eos": ("a boolean", _is_bool),
    "skip_special_tokens": ("a boolean", _is_bool),
    "spaces_between_special_tokens": ("a boolean", _is_bool),
    "no_stop_trim": ("a boolean", _is_bool),
    "n": ("an integer", _is_int),
    "logit_bias": ("a map of token id to number",
                   lambda v: isinstance(v, dict) and all(map(_is_num, v.values()))),
    "sampling_seed": ("an integer", _is_int),
    "stream_interval": ("an integer", _is_int),
    "custom_params": ("an object", lambda v: isinstance(v, dict)),  # for logit processors; ignored here
    # In SGLang's contract but not implemented here: refused when set.
    "stop_regex": ("a string or a list of strings", _is_stop),
    "json_schema": ("a string", _is_str),
    "regex": ("a string", _is_str),
    "ebnf": ("a string", _is_str),
    "structural_tag": ("a string", _is_str),
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
    p = SamplingParams(**{**given, **floats}, stop=stop, stop_token_ids=stop_ids, logit_bias=tuple(bias),
                       max_new_tokens_set="max_new_tokens" in given)
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
    lora: str | None = None  # `lora_path`: the name of a loaded LoRA adapter; None = the base model
    top_logprobs_num: int = 0  # > 0 only with return_logprob: SGLang ignores it otherwise, and <= 0 is off
    # As requested (None for [] or absent): SGLang checks the ids against the vocabulary even without
    # return_logprob, so they are kept here; `logprob_ids` is what the response reports on.
    token_ids_logprob: tuple[int, ...] | None = None
    priority: int | None = None  # the request's (one for all its items); used with --enable-priority-scheduling

    @property
    def logprob_ids(self) -> tuple[int, ...] | None:
        return self.token_ids_logprob if self.return_logprob else None

    @property
    def wants_rows(self) -> bool:
        """Whether each position also reports a top-k row or an id row."""
        return self.top_logprobs_num > 0 or bool(self.logprob_ids)


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


FLAT_IDS = "token_ids_logprob must be a flat list of integers."


def parse_token_ids_logprob(value, n: int, is_batch: bool) -> list[tuple[int, ...] | None]:
    """`token_ids_logprob` -> one id tuple (or None) per item, by SGLang's rules.

    [] or a list starting with a number is one flat list, shared by every item;
    any other list is one list per item; anything else breaks the contract. A
    single request may not send a list of lists. An empty list means None.
    Duplicate ids are kept.
    """
    if value is None or value == []:
        return [None] * n
    kind = "invalid type for `token_ids_logprob`: expected a list of integers or a list of such lists"
    if not isinstance(value, list):
        raise ContractError(kind)
    flat = _is_num(value[0])
    lists = [value] if flat else value
    if not all(isinstance(ids, list) and all(map(_is_int, ids)) for ids in lists):
        raise ContractError(kind)
    if flat:
        return [tuple(value)] * n
    if not is_batch:
        raise RequestError(FLAT_IDS)
    if len(value) != n:  # SGLang does not check this and fails on an index later
        raise RequestError(f"token_ids_logprob has {len(value)} lists for a batch of {n}")
    return [tuple(ids) or None for ids in value]


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

    return_logprob = _per_item(body, "return_logprob", n, False, _is_bool, "a boolean")
    start = _per_item(body, "logprob_start_len", n, -1, _is_int, "an integer")
    top = _per_item(body, "top_logprobs_num", n, 0, _is_int, "an integer")
    token_ids = parse_token_ids_logprob(body.get("token_ids_logprob"), n, is_batch)
    stream = body.get("stream", False)
    with_text = body.get("return_text_in_logprobs", False)
    if not isinstance(stream, bool) or not isinstance(with_text, bool):
        raise ContractError("invalid type for `stream` / `return_text_in_logprobs`: expected a boolean")
    # An adapter's name (SGLang's field keeps its old name), one for all items or one per item.
    loras = _per_item(body, "lora_path", n, None, lambda v: v is None or isinstance(v, str), "a string")
    priority = body.get("priority")  # SGLang's GenerateReqInput: Optional[int], one for the request
    if priority is not None and not _is_int(priority):
        raise ContractError("invalid type for `priority`: expected an integer")
    items = [GenerateItem(tuple(prompts[i]), params[i], rids[i], return_logprob[i], start[i], with_text, loras[i],
                          max(top[i], 0) if return_logprob[i] else 0, token_ids[i], priority)
             for i in range(n)]
    return items, is_batch, stream


# --------------------------------------------------------------------------
# The context window (SGLang 0.5.23: managers/tokenizer_manager.py _validate_one_request,
# managers/tp_worker.py, managers/scheduler.py)

# SGLang's scheduler keeps max_req_len = context - 1 (while its KV pool holds a whole context) and
# max_req_input_len = max_req_len - 5: a prompt must leave room for at least a few new tokens.
INPUT_RESERVE = 6


def max_req_input_len(context_len: int) -> int:
    """The longest prompt plus one: prompts of this many tokens or more are refused."""
    return context_len - INPUT_RESERVE


def input_too_long(n: int, context_len: int) -> dict:
    """The scheduler's refusal: an abort carrying status 400 (HTTP 400 when not streamed)."""
    limit = max_req_input_len(context_len)
    return {"type": "abort", "message": f"Input length ({n} tokens) exceeds the maximum allowed length ({limit} "
            f"tokens). Use a shorter input or enable --allow-auto-truncate.",
            "status_code": 400, "err_type": "BadRequestError"}


def fit_to_context(item: GenerateItem, context_len: int) -> tuple[GenerateItem, dict | None]:
    """SGLang's length rules for one sequence, in its order.

    The tokenizer refuses (RequestError) a prompt of the whole context or more, and an
    explicit max_new_tokens that with the prompt exceeds the context. The scheduler then
    refuses a prompt of max_req_input_len tokens or more (returned as an abort reason) and
    trims max_new_tokens, given or default, to the room left: max_req_len - len(prompt) - 1.
    """
    n, p = len(item.prompt), item.params
    if n >= context_len:
        raise RequestError(f"The input ({n} tokens) is longer than the model's context length "
                           f"({context_len} tokens).")
    if p.max_new_tokens_set and n + p.max_new_tokens > context_len:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
            f"You requested a total of {n + p.max_new_tokens} tokens: {n} tokens from the input messages and "
            f"{p.max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
            f"messages or the completion to fit within the limit.")
    if n >= max_req_input_len(context_len):
        return item, input_too_long(n, context_len)
    room = context_len - 2 - n
    if p.max_new_tokens > room:
        item = dataclasses.replace(item, params=dataclasses.replace(p, max_new_tokens=room))
    return item, None
