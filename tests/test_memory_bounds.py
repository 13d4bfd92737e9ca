"""Memory bounded by bytes: the accounting's exact values, and text that cannot fit the context refused
before it is encoded, leaving the tokenizer's cache as it was."""
import json
import sys
from array import array
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from clawd.config.loading import config_from_dict
from clawd.engine.replicas import Replicas
from clawd.served import Policy
from clawd.serving.completion import ChatService
from clawd.serving.errors import ApiError
from clawd.serving.request import Limits, parse_chat_request
from clawd.serving.sessions import SessionTable
from clawd.tokenizer import (ChatTokenizer, cache_entry_bytes, max_chars_per_token, text_bytes, turn_bytes,
                             value_bytes)
from clawd.turns import Turn


# ---- the accounting -------------------------------------------------------------------------

def test_text_and_value_bytes_exact():
    assert text_bytes("") == 80
    assert text_bytes("hello") == 85
    assert text_bytes("héllo") == 100  # not ASCII: 4 bytes a character
    # 64 + (16 + "role" 84 + "user" 84) + (16 + "content" 87 + "hi" 82)
    assert value_bytes({"role": "user", "content": "hi"}) == 433
    assert value_bytes([1, None]) == 56 + 2 * (8 + 32)
    assert cache_entry_bytes("user\nhello", 3) == 160 + 90 + 80 + 12


def test_turn_bytes_exact():
    turn = Turn(session_id="s", turn_index=0, principal="p", request_id="r", rid="rid", prompt_ids=[1, 2, 3],
                response_ids=[4, 5], response_logprobs=[-0.5, -0.25], temperature=1.0,
                messages=[{"role": "user", "content": "hi"}], tools=None,
                reply={"role": "assistant", "content": "yo"}, finish_reason="stop", policy_version=0,
                weight_version="0", created=0.0)
    # messages 56 + 8 + 433, tools 32, reply 64 + (16 + 84 + 89) + (16 + 87 + 82), ids 5 * 36, log-probs 2 * 32
    assert turn_bytes(turn) == 497 + 32 + 438 + 180 + 64


@pytest.mark.parametrize("text", ["", "a" * 1000, "é" * 1000, "€" * 1000, "🦦" * 1000, "mixed é € 🦦 text"])
def test_accounting_bounds_what_cpython_holds(text):
    assert text_bytes(text) >= sys.getsizeof(text)
    ids = array("I", range(len(text)))
    assert cache_entry_bytes(text, len(ids)) >= sys.getsizeof(text) + sys.getsizeof(ids)


def test_max_chars_per_token(tiny_model):
    # The tiny model: longest vocabulary entry 21 (byte-level) characters, NFC may compose 4 into 1.
    assert ChatTokenizer(tiny_model).max_chars_per_token == 21 * 4
    vocab = {"a": 0, "b": 1, "ab": 2, "[UNK]": 3}
    plain = Tokenizer(models.BPE(vocab, [("a", "b")]))
    plain.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert max_chars_per_token(plain) == 5
    plain.normalizer = normalizers.Strip()  # may drop any amount of whitespace
    assert max_chars_per_token(plain) is None
    dropping = Tokenizer(models.BPE(vocab, [("a", "b")]))
    dropping.pre_tokenizer = pre_tokenizers.Whitespace()
    assert max_chars_per_token(dropping) is None
    fused = Tokenizer(models.BPE(vocab, [("a", "b")], unk_token="[UNK]", fuse_unk=True))
    assert max_chars_per_token(fused) is None
    assert max_chars_per_token(Tokenizer(models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))) is None


# ---- refused before it is encoded --------------------------------------------------------------

class CountingEncoder:
    """The tokenizers object, counting encode calls."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = 0

    def encode(self, *args, **kwargs):
        self.calls += 1
        return self.inner.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def service(tiny_model):
    tok = ChatTokenizer(tiny_model)
    tok.tokenizer = CountingEncoder(tok.tokenizer)
    cfg = config_from_dict({"model": {"path": str(tiny_model)}})
    supervisor = SimpleNamespace(input_limit=None, is_ready=False)  # accepted requests end in a 503
    sessions = SessionTable(idle_timeout=100.0, max_turns=8, max_sessions=8, new_id=lambda: "s")
    return ChatService(cfg, tok, Replicas([supervisor]), sessions, lambda ft: None, Policy(), spawn=None)


async def _status(svc: ChatService, content: str) -> tuple[int, str | None]:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()
    req = parse_chat_request(body, {}, Limits(max_messages=16, max_message_chars=1_000_000))
    with pytest.raises(ApiError) as err:
        await svc.complete(req, "alice", None)
    return err.value.status, err.value.code


async def test_text_beyond_the_context_is_refused_unencoded_and_uncached(service):
    tok = service.tok
    assert service.max_prompt_chars == 2047 * 84  # the tiny model's context, 84 characters a token at most
    assert await _status(service, "hello there") == (503, "engine_unavailable")  # fits: its pieces are kept
    before, calls = (dict(tok._cache), tok.cache_bytes), tok.tokenizer.calls
    assert before[1] > 0

    assert await _status(service, "a" * 1_000_000) == (400, "context_length_exceeded")
    assert tok.tokenizer.calls == calls and (dict(tok._cache), tok.cache_bytes) == before

    # Within the character bound yet over the context in tokens: encoded, refused, nothing cached.
    assert await _status(service, "one two three " * 1000) == (400, "context_length_exceeded")
    assert tok.tokenizer.calls > calls and (dict(tok._cache), tok.cache_bytes) == before

    assert await _status(service, "something new") == (503, "engine_unavailable")
    assert "user\nsomething new" in tok._cache and tok.cache_bytes > before[1]
