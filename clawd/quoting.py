"""Quoting text for a judge model: what a user, a tool or the policy wrote is shown between `<<<...>>>`
markers and must never pass for a marker, a vote or a hint (docs/ARCHITECTURE.md §5, prompt safety).

A floor module: the turn judge (clawd.scoring.judging) and the gate's rubric checks
(clawd.safety.evalset) quote the same way. Pure, standard library only.
"""
from __future__ import annotations

import re
import secrets
import unicodedata

# Characters a reader takes for an angle bracket (‹ « ᐸ ⟨ 〈 ❮ ⟪ ≺ ≮ ...): NFKC leaves them as they are.
_LT_LIKE = "<\u2039\u00ab\u1438\u27e8\u3008\u276e\u276c\u27ea\u227a\u02c2\u29fc\u2991\u2989\u22d6\u169c\u2993\u226e"
_GT_LIKE = ">\u203a\u00bb\u1433\u27e9\u3009\u276f\u276d\u27eb\u227b\u02c3\u29fd\u2992\u298a\u22d7\u169b\u2994\u226f"
_ANGLE_RUN = re.compile(f"[{re.escape(_LT_LIKE + _GT_LIKE)}]{{3,}}")
_BOXED = re.compile(r"[\\⧵∖⟍╲]\s*(\w{5})")
# A hint tag as a reader takes it: `[HINT_START]`, spaced (`[ HINT START ]`) or hyphenated too.
_HINT_TAG = re.compile(r"\[\s*([^\W_]{4})[\s_\-]*([^\W_]{3,5})\s*\]")
# Chat-template control strings (`<|im_end|>`, `<|eot_id|>`; DeepSeek's fullwidth bars fold to these): a
# third-party judge's server may parse them out of plain text as control tokens.
_CONTROL = re.compile(r"<\|([^<>|\s]{1,64})\|>")
# Lower-case letters of other scripts that read as the Latin ones of `boxed` and `HINT_START` (NFKC keeps
# them); upper-case look-alikes (Н І Т Ѕ А, Greek Η Ι Ν Τ Α) are lowered first, onto these.
_LATIN_LIKE = str.maketrans({"о": "o", "ο": "o", "х": "x", "χ": "x", "е": "e", "ε": "e", "ԁ": "d", "а": "a",
                             "α": "a", "ѕ": "s", "т": "t", "τ": "t", "н": "h", "η": "h", "һ": "h", "і": "i",
                             "ι": "i", "ν": "n", "к": "k", "κ": "k", "р": "p", "ρ": "p", "с": "c", "ϲ": "c",
                             "у": "y", "υ": "y", "м": "m", "μ": "m", "в": "b", "β": "b"})


def _base(word: str) -> str:
    """The word as a reader may take it: accents off, lower case, look-alike letters Latin."""
    plain = "".join(ch for ch in unicodedata.normalize("NFKD", word) if not unicodedata.combining(ch))
    return plain.lower().translate(_LATIN_LIKE)


def _drop_invisible(text: str) -> str:
    """Without format characters, and without combining marks on an ASCII character (a mark on a
    non-ASCII letter is spelling and stays)."""
    out: list[str] = []
    for ch in text:
        cat = unicodedata.category(ch)
        if cat == "Cf" or (cat in ("Mn", "Me") and out and out[-1].isascii()):
            continue
        out.append(ch)
    return "".join(out)


# Typographic apostrophes folded to ASCII (graders and the gate's rules compare "don't" with "don’t").
APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'"})


def normalise(text: str) -> str:
    """NFKC without invisible characters, until stable: look-alikes become their ASCII forms."""
    if text.isascii():  # the common case: nothing to fold
        return text
    for _ in range(3):  # dropping a character can make a new NFKC composition, and back
        new = _drop_invisible(unicodedata.normalize("NFKC", text))
        if new == text:
            break
        text = new
    return text


def _angles(run: str) -> str:
    return " ".join("<" if ch in _LT_LIKE else ">" for ch in run)


def neutralise(text: str) -> str:
    """Quoted text as the judge sees it: no marker, no `\\boxed`, no hint tag, no chat-template control
    string can survive."""
    text = _ANGLE_RUN.sub(lambda m: _angles(m.group()), normalise(text))
    text = _CONTROL.sub(lambda m: f"<| {m.group(1)} |>", text)
    text = _BOXED.sub(lambda m: f"\\ {m.group(1)}" if _base(m.group(1)) == "boxed" else m.group(), text)
    return _HINT_TAG.sub(lambda m: f"[HINT {m.group(2)}]" if _base(m.group(1)) == "hint"
                         and _base(m.group(2)) in ("start", "end") else m.group(), text)


def new_nonce() -> str:
    """A fresh marker nonce for one prompt: 64 random bits, unguessable by the quoted text."""
    return secrets.token_hex(8)


_NONCE = re.compile(r"[0-9A-Za-z]{4,64}")


def marker(name: str, nonce: str | None) -> str:
    """`NAME` or `NAME nonce`: the start of a marker's body."""
    if nonce is None:
        return name
    if not _NONCE.fullmatch(nonce):
        raise ValueError(f"a marker nonce is 4 to 64 letters or digits; got {nonce!r}")
    return f"{name} {nonce}"
