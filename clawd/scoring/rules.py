"""The `rules` judge: a vote and a hint from documented phrase lists, no model (docs/ARCHITECTURE.md §5).

Pure, like `judging`: the scoring task calls `rules_vote` where a model judge would be asked.
"""
from __future__ import annotations

import json
import re
from typing import Any, Sequence

from clawd.scoring.judging import accept_hint
from clawd.turns import Turn

# --- the `rules` judge: no model, documented phrase lists ------------------------------------------
# English, case-insensitive, on word boundaries; curly apostrophes count as straight ones.
# A user message that is negative anywhere is negative ("thanks, but that's wrong").

NEGATIVE_PHRASES = (
    r"try again", r"retry", r"redo", r"re-do", r"do it again", r"start over", r"one more time",
    r"(that|this|it|which|you) (is|was|are|were) wrong", r"(that|it|this)'?s wrong", r"(still|all) wrong",
    r"wrong (answer|result|file|output|one|again)", r"incorrect", r"not (right|correct)",
    r"(that|this|it)'?s not (it|what|how|the|right|correct)", r"(that|this|it) is not (it|what|how|the)",
    r"not what i (asked|meant|wanted|said|need|needed)", r"i meant", r"i said",
    r"(please|pls|can you|could you) (fix|correct|change|redo)", r"fix (it|this|that)",
    r"you misunderstood", r"you forgot", r"you missed", r"mistake",
    r"you didn'?t (do|answer|include|add|finish|read|use|follow|change)",
    r"(does|did|do)(n'?t| not) work", r"(is|it'?s) (still )?(broken|not working)", r"still (failing|broken)",
)
POSITIVE_PHRASES = (
    r"thanks?", r"thank you", r"thx", r"great", r"perfect", r"awesome", r"excellent", r"nice",
    r"well done", r"good job", r"looks good", r"lgtm", r"(that|it|this) works", r"works now",
    r"(that|it|this) worked", r"got it", r"moving on", r"let'?s move on", r"next (question|task|step|one)",
    r"now (let'?s|can you|could you|please)",
)
_NEGATIVE = re.compile(r"\b(" + "|".join(NEGATIVE_PHRASES) + r")\b|^\s*(no|nope)\b\s*[,.!]", re.IGNORECASE)
_POSITIVE = re.compile(r"\b(" + "|".join(POSITIVE_PHRASES) + r")\b|^\s*(ok|okay|alright|cool|exactly|next)\b",
                       re.IGNORECASE)
# A correction's leading clauses that only reject ("No, that's not right: the capital is Rome.") are not
# guidance: a teacher shown them turns from whatever answer it is scored on (measured on SmolLM2: the right
# answer's log-prob fell as far as the wrong one's), so the hint is what follows them.
REJECTION_CLAUSES = (
    r"no", r"nope", r"nah", r"wrong", r"incorrect", r"not quite", r"not really", r"try again",
    r"(that|this|it)('s| is| was) (wrong|incorrect|not right|not correct|not it|not quite right|too short|too long"
    r"|not an answer)",
    r"(that|this|it) (doesn't|does not|didn't|did not) answer (it|the question|my question)",
    r"(that|this|it)('s| is| was) not what i (asked|meant|wanted|said)( for)?",
)
_REJECTION = re.compile(r"(" + "|".join(REJECTION_CLAUSES) + r")", re.IGNORECASE)
_LEADING_CLAUSE = re.compile(r"\s*([^,:;.!?]*)(?:[,:;.!?]+\s*|$)")
REPHRASE_JACCARD = 0.6   # word-set overlap with the previous user request that counts as restating it
REPHRASE_MIN_WORDS = 3   # shorter replies ("continue", "yes") are not restatements
MAX_RULES_HINT_CHARS = 1000

# Tool results: a JSON object is judged by its fields only (its text may quote anything);
# other text by its first line, plus a Python traceback anywhere.
ERROR_WORDS = (r"errors?", r"exception", r"traceback", r"failed", r"failure", r"fatal", r"not found",
               r"denied", r"timed out", r"no such file", r"(?-i:\w+(?:Error|Exception))")
_ERROR_WORD = re.compile(r"\b(" + "|".join(ERROR_WORDS) + r")\b", re.IGNORECASE)
_NEGATED_BEFORE = re.compile(r"\b(no|0|zero|without|never)\s+$", re.IGNORECASE)  # "no errors", "0 failed"
_ZERO_AFTER = re.compile(r"\s*[:=]\s*0\b")                                       # "failed: 0"
_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):", re.MULTILINE)
_STATUS_KEYS = ("status", "status_code", "statusCode", "http_status", "code")
_EXIT_KEYS = ("exit_code", "exitCode", "returncode", "return_code")


def _normal(text: str) -> str:
    return text.replace("\u2019", "'").replace("\u2018", "'")


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", _normal(text).lower()))


def is_rephrase(text: str, previous: str) -> bool:
    a, b = _words(text), _words(previous)
    if len(a) < REPHRASE_MIN_WORDS or not b:
        return False
    return len(a & b) / len(a | b) >= REPHRASE_JACCARD


def _json_error(obj: dict) -> bool:
    if obj.get("error") or obj.get("errors"):
        return True
    if obj.get("ok") is False or obj.get("success") is False:
        return True
    for key in _STATUS_KEYS:
        v = obj.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 400:
            return True
        if isinstance(v, str) and (v.strip().lower() in ("error", "failed", "failure")
                                   or (v.strip().isdigit() and int(v) >= 400)):
            return True
    return any(isinstance(obj.get(k), int) and not isinstance(obj.get(k), bool) and obj.get(k) != 0
               for k in _EXIT_KEYS)


def is_tool_error(content: str | None) -> bool:
    """Does a tool result report an error? (heuristic, documented in the module's rule lists)"""
    text = (content or "").strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            return _json_error(obj)
    if _TRACEBACK.search(text):
        return True
    first = text.split("\n", 1)[0][:300]
    for m in _ERROR_WORD.finditer(first):
        if not _NEGATED_BEFORE.search(first[:m.start()]) and not _ZERO_AFTER.match(first, m.end()):
            return True
    return False


def guidance(text: str) -> str:
    """The correction without its leading clauses that only reject: "No, that's not right: the capital of
    Italy is Rome." -> "the capital of Italy is Rome."; "That's wrong." -> ""."""
    while text:
        m = _LEADING_CLAUSE.match(text)
        if not m.group(0) or not _REJECTION.fullmatch(_normal(m.group(1)).strip()):
            break
        text = text[m.end():]
    return text.strip()


def rules_vote(turn: Turn, next_state: Sequence[dict[str, Any]]) -> tuple[int, str | None]:
    """(vote, hint) from phrase lists, no model.

    -1 if a user message in the next state corrects, retries, or restates the
    previous user request (REPHRASE_JACCARD), or a tool result is an error;
    else +1 if a user message thanks, approves or moves on; else 0. A tool result
    without an error scores 0 here (unlike the model judge's rule): a call that ran
    says nothing about whether it was the right call.
    The hint comes only from a correcting user message: the last such message's
    `guidance` (its leading rejection dropped), cut to MAX_RULES_HINT_CHARS, if
    `accept_hint` keeps it.
    """
    previous = next((m.get("content") or "" for m in reversed(turn.messages) if m.get("role") == "user"), "")
    negative = positive = False
    hint = None
    for msg in next_state:
        role, text = msg.get("role"), msg.get("content") or ""
        if role == "tool" and is_tool_error(text):
            negative = True
        elif role == "user":
            if _NEGATIVE.search(_normal(text)) or is_rephrase(text, previous):
                negative = True
                hint = accept_hint(guidance(text)[:MAX_RULES_HINT_CHARS]) or hint
            elif _POSITIVE.search(_normal(text)):
                positive = True
    if negative:
        return -1, hint
    return (1 if positive else 0), None
