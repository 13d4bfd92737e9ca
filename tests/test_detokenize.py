"""IncrementalDetokenizer against a small byte-level BPE trained here (Qwen2-style split rules)."""
import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from clawd.serving.detokenize import IncrementalDetokenizer, special_ids

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [
    "Hello world, héllo wörld! Café naïve résumé, déjà vu, Ångström.",
    "你好世界，今天天气很好。日本語のテキストです。한국어 문장.",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 ❤️ and more 😀😀 🎉🎉",
    'def f(x):\n    return {"a": [1, 2], "b": None}\n',
    "The quick brown fox jumps over the lazy dog. 0123456789",
]
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
SAMPLES = [
    "Hello world 😀!",
    "你好世界，今天天气很好。",
    "Café naïve résumé 👍🏽🇫🇷❤️",
    "rare: 🦀 ∮ ẞ ꙮ 𝄞 ok",                      # not in the corpus: split into byte tokens
    "<think>hm 🤔</think>\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
    "  leading spaces\n\n\ttabs ",
]


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|im_end|>"], show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


TOK = build_tokenizer()
IM_END = TOK.token_to_id("<|im_end|>")
SPECIALS = frozenset({IM_END})


def stream(ids_chunks, tok=TOK, skip=SPECIALS):
    detok = IncrementalDetokenizer(tok, skip)
    pieces = [detok.push(chunk) for chunk in ids_chunks]
    return pieces, detok.flush()


def reference(ids):
    return TOK.decode([i for i in ids if i not in SPECIALS], skip_special_tokens=False)


def test_tokenizer_splits_characters_across_tokens():
    # The fixture must exercise the hold-back: some character spans several tokens.
    ids = TOK.encode("🦀").ids
    assert len(ids) > 1 and all("\ufffd" in TOK.decode([i]) for i in ids)


def test_special_ids_default():
    assert special_ids(TOK) == SPECIALS
    pieces, rest = stream([[IM_END]], skip=None)
    assert pieces == [""] and rest == ""


@pytest.mark.parametrize("text", SAMPLES)
def test_single_token_pushes_emit_whole_characters(text):
    ids = TOK.encode(text).ids
    pieces, rest = stream([[i] for i in ids])
    assert "".join(pieces) + rest == text
    assert rest == ""
    assert not any("\ufffd" in p for p in pieces)


def test_multibyte_char_held_until_complete():
    ids = TOK.encode("a🦀b").ids
    detok = IncrementalDetokenizer(TOK, SPECIALS)
    out = [detok.push([i]) for i in ids]
    assert out[0] == "a"
    assert out[1:-2] == [""] * (len(ids) - 3)
    assert out[-2:] == ["🦀", "b"]
    assert detok.flush() == ""


def test_added_tokens_appear_specials_do_not():
    ids = TOK.encode("<think>x</think><tool_call>y</tool_call>").ids + [IM_END]
    pieces, rest = stream([[i] for i in ids])
    assert pieces[0] == "<think>"
    assert "".join(pieces) + rest == "<think>x</think><tool_call>y</tool_call>"


def test_incomplete_tail_comes_out_at_flush():
    crab = TOK.encode("🦀").ids
    pieces, rest = stream([TOK.encode("ok").ids, crab[:2]])
    assert pieces == ["ok", ""]
    assert rest == reference(crab[:2]) and rest.endswith("\ufffd")


def test_window_stays_short():
    # Per-push cost is O(window): no decode call ever sees the whole history.
    class Counting:
        def __init__(self):
            self.longest = 0

        def decode(self, ids, skip_special_tokens):
            self.longest = max(self.longest, len(ids))
            return TOK.decode(ids, skip_special_tokens=skip_special_tokens)

    counting = Counting()
    ids = TOK.encode(" ".join(SAMPLES) * 20).ids
    detok = IncrementalDetokenizer(counting, SPECIALS)
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert text == TOK.decode(ids)
    assert len(ids) > 500 and counting.longest <= 8


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, TOK.get_vocab_size() - 1), max_size=6), max_size=25))
def test_random_ids_concatenate_to_full_decode(chunks):
    pieces, rest = stream(chunks)
    assert "".join(pieces) + rest == reference([i for c in chunks for i in c])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(SAMPLES + ["é", "😀", "🦀", "\n", " ", "<tool_call>"]), max_size=8),
       st.data())
def test_real_text_in_random_chunks(parts, data):
    text = "".join(parts)
    ids = TOK.encode(text).ids
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=6)))
    chunks = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]
    pieces, rest = stream(chunks)
    assert "".join(pieces) + rest == text
    assert not any("\ufffd" in p for p in pieces)


def test_context_dependent_decoder():
    # SentencePiece-style decoders strip the first token's leading space: decoding a
    # token alone loses it, decoding it inside the window keeps it.
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "<0xF0>": 4, "<0x9F>": 5, "<0xA6>": 6,
             "<0x80>": 7, "▁": 8}
    sp = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    ids = [1, 2, 8, 4, 5, 6, 7, 3, 8, 2]
    pieces, rest = stream([[i] for i in ids], tok=sp, skip=())
    assert pieces == ["Hello", " world", " ", "", "", "", "🦀", "!", " ", " world"]
    assert "".join(pieces) + rest == sp.decode(ids) == "Hello world 🦀!  world"
