"""Degeneration metrics over reply texts: is the policy still answering, or collapsing into a template?

A model trained on form-only checks can satisfy them while its replies collapse: one-word replies
("You", "I", "A"), one template for every question ("The answer is a city."). These pure functions
measure that per policy version, from reply texts alone: the decoded `reply.content` of turn records
(clawd/records.py), the `text` of the simulated users' replies, or evaluation answers. The demo and
the benches print them; the behaviour monitors (clawd.safety.monitors) watch them. Stdlib only, no I/O, no clawd
imports: a floor module any stage may use (docs/ARCHITECTURE.md §1).

Definitions (one place each):
- `words(text)`: the tokenisation every metric uses.
- a reply is *empty* when it has no characters but whitespace; *one-word* when it has 0 or 1 words
  (so empty and punctuation-only replies count as one-word too);
- a reply's *opening* is its first k words (k = 3 by default; all of them when it has fewer), joined
  by one space; a reply with no words has none;
- an opening or a whole reply is *repeated* when replies in two or more groups share it. A group is a
  conversation: a user who asks again after a correction gets the same opening for the same question,
  which is consistency, not a template. Without groups each reply is its own;
- a metric with nothing to measure (no replies, no n-grams) is None, never a made-up 0 or 1.

`flags(summary, baseline)` names the metrics that moved past the thresholds below. They are
heuristics for a person reading a demo or a bench, not a verdict on the model.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

OPENING_WORDS = 3  # words in an opening: enough for "the answer is", few enough to repeat by chance rarely
TOP = 5            # how many of the commonest openings and whole replies a summary lists
RATIO_DIGITS, MEAN_DIGITS = 4, 2  # rounding in summaries; counts are exact

# flags(): each threshold with why.
# Distinct-2 at under half the baseline's: the replies now share phrases wholesale, not just function words.
DISTINCT_2_KEEP = 0.5
# Over a fifth of replies at 0 or 1 word: a few ("Rome.") are fine answers, a fifth is a habit, not a style.
ONE_WORD_SHARE_MAX = 0.20
# Over half the replies share their opening with another: different questions, one template.
REPEATED_OPENING_SHARE_MAX = 0.50
# Over a tenth of replies empty: an empty reply answers nothing, and a healthy policy rarely gives one.
EMPTY_SHARE_MAX = 0.10
# One whole reply is over a fifth of all: the same answer to different questions ("You", "I", "A").
TOP_REPLY_SHARE_MAX = 0.20
# Under this many replies a share moves by 20 points per reply: too noisy to flag.
MIN_REPLIES = 5

# A word: a run of letters/digits (Unicode `\w`), with inner apostrophes kept ("don't", "it's").
_WORD = re.compile(r"\w+(?:['\u2019]\w+)*")


def words(text: str) -> list[str]:
    """The tokenisation every metric uses: case-folded (`str.casefold`, so "Straße" is "strasse")
    Unicode word runs (`\\w+`, underscores and digits included, inner apostrophes kept); punctuation
    and whitespace separate words and are dropped ("3.14" is "3", "14"). Scripts written without
    spaces (Chinese, Japanese) come out as one word per run: the metrics are for space-separated text."""
    return _WORD.findall(text.casefold())


def ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(texts: Iterable[str], n: int) -> float | None:
    """Distinct n-grams / all n-grams, over every reply's words (`words`); n-grams never span two
    replies. None when there is no n-gram at all (no replies, or none with n words): undefined, not 0
    or 1. Not rounded. Falls as a set grows, so compare sets of similar size (the evaluation set: the
    same prompts on both sides)."""
    return _distinct([words(text) for text in texts], n)


def _distinct(tokenised: list[list[str]], n: int) -> float | None:
    """`distinct_n` of texts already split into `words`."""
    if n < 1:
        raise ValueError(f"n must be at least 1, not {n}")
    grams = [g for tokens in tokenised for g in ngrams(tokens, n)]
    return len(set(grams)) / len(grams) if grams else None


def opening(tokens: list[str], k: int = OPENING_WORDS) -> str | None:
    """The first k words joined by one space (all of them if fewer); None for a reply with no words."""
    return " ".join(tokens[:k]) or None


def _ratio(x: float, total: int) -> float | None:
    return round(x / total, RATIO_DIGITS) if total else None


def _mean(x: float, total: int) -> float | None:
    return round(x / total, MEAN_DIGITS) if total else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, RATIO_DIGITS)


def _shared(keys: list[str | None], groups: list[Any]) -> tuple[Counter, set[str]]:
    """(each key's count, the keys that replies of two or more groups share); None keys left out."""
    counts: Counter = Counter()
    first: dict[str, Any] = {}
    shared: set[str] = set()
    for key, group in zip(keys, groups):
        if key is None:
            continue
        counts[key] += 1
        if first.setdefault(key, group) != group:
            shared.add(key)
    return counts, shared


def _repeated(counts: Counter, shared: set[str], top: int) -> list[list[Any]]:
    """The commonest shared keys, [key, count], commonest first (ties: first seen first)."""
    return [[key, count] for key, count in counts.most_common() if key in shared][:top]


def summarise(texts: Iterable[str], *, groups: Iterable[Any] | None = None, k: int = OPENING_WORDS,
              top: int = TOP) -> dict[str, Any]:
    """One JSON-serialisable summary of a set of replies (say, one policy version's).

    replies, words: counts. mean_words (`words`), mean_chars (after stripping surrounding whitespace).
    empty_share, one_word_share (0 or 1 word), repeated_opening_share (replies whose opening, first
    `k` words, is repeated), distinct_1, distinct_2, top_reply_share (the commonest repeated whole
    reply's share, 0 when none is): ratios rounded to 4 digits, means to 2, None when the set is empty
    (or, for distinct-n, has no n-gram). top_openings, top_replies: the `top` commonest repeated
    openings and whole replies (normalised: their words joined by one space), as [text, count]; an
    empty list means none repeats. opening_words: k. groups: each text's conversation (any hashable;
    None: a group of its own), one per text; without them each text is a group of its own.
    """
    texts = list(texts)
    tokenised = [words(t) for t in texts]
    n = len(texts)
    groups = [(i,) if g is None else g for i, g in enumerate(groups)] if groups is not None else list(range(n))
    if len(groups) != n:
        raise ValueError(f"{len(groups)} groups for {n} texts")
    openings, shared_openings = _shared([opening(t, k) for t in tokenised], groups)
    replies, shared_replies = _shared([" ".join(t) or None for t in tokenised], groups)
    top_replies = _repeated(replies, shared_replies, top)
    return {
        "replies": n,
        "words": sum(map(len, tokenised)),
        "mean_words": _mean(sum(map(len, tokenised)), n),
        "mean_chars": _mean(sum(len(t.strip()) for t in texts), n),
        "empty_share": _ratio(sum(1 for t in texts if not t.strip()), n),
        "one_word_share": _ratio(sum(1 for t in tokenised if len(t) <= 1), n),
        "repeated_opening_share": _ratio(sum(openings[o] for o in shared_openings), n),
        "distinct_1": _round(_distinct(tokenised, 1)),  # each text split once (the watch runs this every check)
        "distinct_2": _round(_distinct(tokenised, 2)),
        "top_reply_share": _ratio(top_replies[0][1] if top_replies else 0, n),
        "opening_words": k,
        "top_openings": _repeated(openings, shared_openings, top),
        "top_replies": top_replies,
    }


def reply_of(record: Any) -> tuple[Any, str | None]:
    """(policy version, reply text) of one record, text None when the record is not a text reply.

    Accepts a turn record (`FinishedTurn.to_record()`: `policy_version`, `reply.content`), a simulated
    user's reply (`Reply.to_json()`: `version`, `text`, `kind`) or a (version, text) pair. Not text
    replies: a tool call with no content; a simulated user's "closing" or "tool_call" reply; a turn
    record cut by the length limit after one token (the sim's closing request asks for one token: its
    "You", "I", "A" are first tokens, not answers)."""
    if not isinstance(record, Mapping):
        version, text = record
        return version, text
    if "policy_version" in record:  # a turn record
        reply = record.get("reply") or {}
        capped = record.get("finish_reason") == "length" and len(record.get("response_ids") or ()) <= 1
        return record["policy_version"], None if capped else reply.get("content")
    if record.get("kind", "answer") not in ("answer", "probe"):
        return record.get("version"), None
    return record.get("version"), record.get("text")


def by_version(records: Iterable[Any], *, k: int = OPENING_WORDS, top: int = TOP) -> dict[Any, dict[str, Any]]:
    """{policy version: summarise(its replies)}, versions in order, over records `reply_of` reads, grouped
    by `session_of`. Records with no version are left out; each summary adds `skipped`: that version's records that
    were not text replies (see `reply_of`)."""
    texts: dict[Any, list[str]] = {}
    groups: dict[Any, list[Any]] = {}
    skipped: Counter = Counter()
    for record in records:
        version, text = reply_of(record)
        if version is None:
            continue
        texts.setdefault(version, [])
        groups.setdefault(version, [])
        if text is None:
            skipped[version] += 1
        else:
            texts[version].append(text)
            groups[version].append(session_of(record))
    return {v: {**summarise(texts[v], groups=groups[v], k=k, top=top), "skipped": skipped[v]} for v in sorted(texts)}


def session_of(record: Any) -> Any:
    """The conversation a record's reply belongs to, for `summarise`'s groups: a turn record's
    `session_id`, a simulated user's `session` (its probes, session -1, are each their own); None when
    unknown (a group of its own)."""
    if not isinstance(record, Mapping):
        return None
    if "policy_version" in record:
        return record.get("session_id")
    session = record.get("session")
    return session if record.get("kind", "answer") == "answer" and session is not None and session >= 0 else None


def flags(summary: Mapping[str, Any], baseline: Mapping[str, Any] | None = None) -> list[str]:
    """Lines naming the metrics of `summary` that moved past the module's thresholds relative to
    `baseline` (say, version 0's summary), each starting with the metric's name. A share flags when
    it rose above its threshold from at or below it (or with no baseline, when it is above it);
    distinct_2 when it fell under DISTINCT_2_KEEP of the baseline's. No flags under MIN_REPLIES
    replies; a baseline with fewer counts as none. Mean length is not flagged: learning to be brief shortens replies on purpose.
    Heuristics for a person to read, not a verdict: a persona that asks for one-word answers can
    raise one_word_share legitimately, and a quiet list does not prove the replies are good."""
    if (summary.get("replies") or 0) < MIN_REPLIES:
        return []
    base = baseline if baseline and (baseline.get("replies") or 0) >= MIN_REPLIES else {}
    out = []
    before, now = base.get("distinct_2"), summary.get("distinct_2")
    if before and now is not None and now < DISTINCT_2_KEEP * before:
        out.append(f"distinct_2 {before:.2f} -> {now:.2f}: under {DISTINCT_2_KEEP:.0%} of the baseline's")
    for name, limit in (("one_word_share", ONE_WORD_SHARE_MAX), ("repeated_opening_share", REPEATED_OPENING_SHARE_MAX),
                        ("empty_share", EMPTY_SHARE_MAX), ("top_reply_share", TOP_REPLY_SHARE_MAX)):
        before, now = base.get(name), summary.get(name)
        if now is not None and now > limit and (before is None or before <= limit):
            was = "" if before is None else f"{before:.0%} -> "
            out.append(f"{name} {was}{now:.0%}: above {limit:.0%}")
    return out
