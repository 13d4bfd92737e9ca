"""Incremental detokenisation: generated token ids in, final text out.

Byte-level BPE tokens are byte strings: one character may span several tokens,
and a token decoded alone may differ from the same token decoded in context
(decoders that strip or join). So each push decodes a short window of ids
twice, once up to the last emitted token (`read`) and once to the end, both
starting at the same earlier token (the window start), and emits the
difference. Text whose last character is U+FFFD may be an incomplete UTF-8
sequence that the next token completes: it is held back until it is not.

The window only ever starts where emitted text ended on a whole character, so
the pieces concatenate to exactly what decoding all ids at once gives.
"""
from __future__ import annotations

from typing import Iterable

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


def special_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """The ids of the tokenizer's special added tokens (BOS, EOS, <|im_end|>, ...)."""
    return frozenset(i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special)


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text, one push at a time.

    `skip_ids` are dropped before decoding (default: the tokenizer's special
    tokens); added tokens that are not special, such as `<tool_call>` or
    `<think>`, come out as their text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_ids: Iterable[int] | None = None):
        self._tokenizer = tokenizer
        self._skip = special_ids(tokenizer) if skip_ids is None else frozenset(skip_ids)
        self._ids: list[int] = []   # the window: ids from the window start on
        self._read = 0              # ids[:read] are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False) if ids else ""

    def push(self, ids: Iterable[int]) -> str:
        """Adds generated ids; returns the text that became final with them."""
        new = [i for i in ids if i not in self._skip]
        if not new:
            return ""
        self._ids.extend(new)
        prefix = self._decode(self._ids[:self._read])
        text = self._decode(self._ids)
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT):
            return ""
        # The emitted tokens become the context of the next window; older ones are dropped.
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """Returns whatever is still held (an incomplete character decodes to U+FFFD)."""
        if self._read == len(self._ids):  # nothing held (a whole reply's one push emitted it all): no decode
            return ""
        prefix = self._decode(self._ids[:self._read])
        text = self._decode(self._ids)
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        return text[len(prefix):]
