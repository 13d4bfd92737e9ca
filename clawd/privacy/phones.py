"""Phone numbers in chat text, for clawd.privacy.pii: the costliest category, so it has its own module and
its own bound. libphonenumber's `PhoneNumberMatcher` reads a window around each place a phone may stand,
per configured region until every such place is read; what it reads is checked by `_is_phone` (the rules are
in clawd.privacy.pii's docstring). A turn's `Budget` bounds that work: digit-dense text costs the same per
character as prose a few times over, never seconds, and past the budget a possible phone is reported unread.
"""
from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass
from typing import Iterator

import phonenumbers
from stdnum import isbn as stdnum_isbn

# Each scanner yields its findings' spans, and None before each candidate it reads: `_detect` yields the loop
# between candidates, so that no text holds it for long, however many candidates it packs.
Scan = Iterator["tuple[int, int] | None"]


def glued(before: re.Pattern[str], text: str, start: int) -> bool:
    """Whether the one or two characters just before `start` are what `before` matches."""
    return any(before.fullmatch(text, i, start) for i in (start - 1, start - 2) if i >= 0)


_SEARCH_PIECE = 4096  # characters one search reads between two yields: ~2-8 ms on digit-dense text
_LOOKAHEAD = 8  # characters past a match the patterns here look at, at most


def in_pieces(pattern: re.Pattern[str], text: str, longest: int) -> Iterator[re.Match | None]:
    """`pattern.finditer(text)`, a piece of the text at a time with None between pieces: one search over
    digit-dense text can take ~0.6 µs a character without a match to yield at. Each piece is searched `longest`
    characters past its end, at least the longest match the pattern makes, so that a match is found whole in
    the piece that starts it; one that runs within a few characters of that end (where a lookahead could have
    been cut) is read again on the whole text from its start. So every match is the one a search of the
    whole text finds."""
    pos = 0
    for lo in range(0, len(text), _SEARCH_PIECE):
        hi = lo + _SEARCH_PIECE
        end = min(len(text), hi + longest)
        at = max(pos, lo)
        while (m := pattern.search(text, at, end)) is not None and m.start() < hi:
            if end < len(text) and m.end() > end - _LOOKAHEAD:
                whole = pattern.match(text, m.start())
                if whole is None:  # a match only because the text seemed to end there: go on from the next place
                    at = m.start() + 1
                    continue
                m = whole
            pos = at = max(m.end(), m.start() + 1)
            yield m
        yield None


# Where any phone might be: a digit run with phone punctuation (the matcher's own scan is costly per region).
# 7 digits at least: the few shorter numbers (some Italian, German and Austrian lines) are left out.
_DIGIT_RUN = re.compile(r"[0-9](?:[\s\-.()/]{0,3}\d){6,}")
_SENTENCE_END = re.compile(r"[.!?]\s+(?=[^\W\d])|\n")  # a new sentence starts with a letter
_LETTER = re.compile(r"[^\W\d]")
# Right before a number, a word that names another kind of number (the phone words below may be nearer).
OTHER_NUMBER = (
    r"(?i)\b(?:order|invoice|inv|tracking|track|shipment|parcel|ref|reference|receipt|transaction|txn|account|acct"
    r"|iban|isbn|issn|ean|upc|sku|serial|s/n|part|model|policy|ticket|case|booking|confirmation|reservation"
    r"|customer|member|id|no|nr|num|zip|postal|postcode|code|pin|otp|cvv|version|build|patent|batch|lot|item"
    r"|claim|registration|license|licence|passport{})\b"
    r"[\s.:#-]*(?:number|no\.?|nr\.?|id|#)?(?:\s+(?:is|was|of))?[\s.:#=-]*\Z|#\s*\Z")
_NOT_PHONE_WORDS = re.compile(OTHER_NUMBER.format("|card|visa|mastercard|amex"))
# A bare run followed by a unit is a quantity: "449592966 bytes".
_UNIT_AFTER = re.compile(r"\s?(?:%|€|\$|(?:[kKMGT]i?)?B|bytes?|rows?|lines?|items?|users?|people|times|km|kg|ms|"
                         r"sec(?:ond)?s?|tokens?|words?|records?|EUR|USD|GBP|JPY)\b", re.IGNORECASE)
_PHONE_WORDS = re.compile(r"(?i)\b(?:phone|tel|telephone|call|calling|mobile|cell|fax|whatsapp|sms|text|dial|ring"
                          r"|contact|reach|number|hotline|landline|telefon|téléphone|portable|cellulare|móvil)\b")
# OIDs, versions, decimals; not "206.269.0743"
_DOTTED = re.compile(r"\d{1,3}(?:\.\d{1,3}){3,}|\d+(?:\.\d+)*\.\d(?:\.\d+)*|\d+\.\d+")
_GLUED_BEFORE = re.compile(r"(?:\w|\d[ .\-/]?)\Z")
_GLUED_AFTER = re.compile(r"\w|[ .\-/]\d|[-/][^\W\d_]")  # 1-800-FLOWERS
_DATE = re.compile(r"\(?\d{1,4}[-./]\d{1,2}[-./]\d{1,4}\)?(?:\s+\d{1,2}[:.]\d{2})?")


def _phone_context_ok(text: str, start: int) -> bool:
    """False right after a word that names another kind of number ("order number", "ISBN", "#")."""
    return not _NOT_PHONE_WORDS.search(text, max(0, start - 40), start)


def _phone_word_before(text: str, start: int) -> bool:
    """A phone word earlier in the same sentence, at most 40 characters back, with no other number between."""
    before = text[max(0, start - 40):start]
    cut = max((m.end() for m in _SENTENCE_END.finditer(before)), default=0)  # not after "Tel. "
    words = list(_PHONE_WORDS.finditer(before, cut))
    return bool(words) and not any(c.isdigit() for c in before[words[-1].end():])  # no other number between


class Spans:
    """Spans that a later finding may not overlap, asked in O(log n): a log full of IPs and ids holds
    thousands of them, and a linear scan per digit run was quadratic (seconds on 100 KB)."""

    def __init__(self, spans: list[tuple[int, int]]):
        spans = sorted(spans)
        self.starts = [s for s, _ in spans]
        self.reach = list(itertools.accumulate((e for _, e in spans), max))  # furthest end among the first i+1

    def overlaps(self, start: int, end: int) -> bool:
        i = bisect.bisect_left(self.starts, end)  # the spans that start before `end`
        return i > 0 and self.reach[i - 1] > start


_GROUP = re.compile(r"\d+")
_GLUE = frozenset(" .-/")  # one of these between two digits glues them: no phone starts or ends there
_WINDOW_CHARS = 256  # the longest text one matcher call reads: its cost grows with the candidates in it
_RUN_PIECE = 4096  # of a digit run, read between two yields
# libphonenumber work one turn may spend (`Budget`), in units of ~40 µs (measured on digit-dense text): a
# parse of a number in one region is one; the matcher reading a window in one region, four per digit group in
# it. ~40 ms in all; a message with a few phones spends a few units per phone.
PHONE_BUDGET_UNITS = 1024
_UNITS_PER_GROUP = 4


@dataclass
class Budget:
    """How much of the phone matcher (the costly step: ~0.1-0.3 ms per candidate and region) one turn may
    use. Past it, every stretch that could be a phone is reported as one, unread: more is redacted, nothing
    is missed, and detection stays linear in the text whatever its digits (a list of 100,000 numbers)."""
    units: int = PHONE_BUDGET_UNITS
    unread: int = 0  # stretches reported as phones unread

    def spend(self, units: int) -> bool:
        """False once the budget is spent: the caller reports what it was about to read."""
        self.units -= units
        return self.units >= 0


def _stretches(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """Where a phone may stand in a digit run: the stretches between the places it may start or end,
    those that 7-16 digits of whole stretches in a row can cover. A phone never starts or ends where one
    glue character joins two digits (`_is_phone` refuses "5 0161...", "...0066-7"), so "2024-01-02 2024-..."
    or "12 34 56 78 90 12 34" hold none, however long, and the matcher never reads them."""
    spans: list[list[int]] = []  # [start, end, digits]
    for g in _GROUP.finditer(text, start, end):
        sep = text[spans[-1][1]:g.start()] if spans else ""
        if spans and len(sep) == 1 and sep in _GLUE:
            spans[-1][1] = g.end()
            spans[-1][2] += g.end() - g.start()
        else:
            spans.append([g.start(), g.end(), g.end() - g.start()])
    wanted = [False] * len(spans)
    for i in range(len(spans)):
        total = 0
        for j in range(i, len(spans)):
            total += spans[j][2]
            if total > 16:
                break
            if total >= 7:
                wanted[i:j + 1] = [True] * (j + 1 - i)
    return [(a, b) for (a, b, _), w in zip(spans, wanted) if w]


def phones(text: str, regions: tuple[str, ...], blocked: Spans, budget: Budget) -> Scan:
    """Phone spans, with None per digit run read and per matcher call (see `Scan`)."""
    windows: list[list] = []  # [lo, hi, stretches]: at most _WINDOW_CHARS between the stretches' ends
    # A run longer than a piece is cut at its end: the rest, glued to the digit before it, holds no phone
    # that `_is_phone` would keep, but may still cost the matcher (within the budget).
    for m in in_pieces(_DIGIT_RUN, text, longest=64):
        yield None
        if m is None:
            continue
        if blocked.overlaps(m.start(), m.end()):
            continue  # digits of an e-mail, a URL, a card, an IBAN, an IP or a secret
        # What no region can make a phone of, tested once here rather than per region by the matcher.
        if (_DATE.fullmatch(m.group()) or _DOTTED.fullmatch(m.group()) or glued(_LETTER, text, m.start())
                or (text[m.start() - 1:m.start()] != "+" and not _phone_context_ok(text, m.start()))):
            continue
        # A long run is read in pieces, yielding between them; each piece reads on a little past its end, so
        # a stretch it starts is whole (one cut at a piece's start is only an extra candidate).
        for piece in range(m.start(), m.end(), _RUN_PIECE):
            for a, b in _stretches(text, piece, min(m.end(), piece + _RUN_PIECE + 64)):
                if a >= piece + _RUN_PIECE:
                    break
                lo, hi = max(0, a - 8), min(len(text), b + 16)
                if windows and lo <= windows[-1][1] and b - windows[-1][2][0][0] <= _WINDOW_CHARS:
                    windows[-1][1] = hi
                    windows[-1][2].append((a, b))
                else:
                    windows.append([lo, hi, [(a, b)]])
            yield None
    seen: set[tuple[int, int]] = set()
    for lo, hi, stretches in windows:
        if budget.units <= 0:
            for span in stretches:  # unread: reported whole, so that nothing is missed
                if span not in seen and not blocked.overlaps(*span):
                    seen.add(span)
                    budget.unread += 1
                    yield span
            continue
        chunk = text[lo:hi]
        groups = len(_GROUP.findall(chunk))
        matched: list[tuple[int, int]] = []
        for i, region in enumerate(regions):
            # Once every stretch of the window is in a number some region read (accepted or not: what
            # decides that is the same for every region), the other regions have nothing left to find.
            if i and all(any(a <= s0 and s1 <= b for a, b in matched) for s0, s1 in stretches):
                break
            budget.spend(_UNITS_PER_GROUP * groups)
            for match in phonenumbers.PhoneNumberMatcher(chunk, region, leniency=phonenumbers.Leniency.POSSIBLE):
                span = (lo + match.start, lo + match.end)
                matched.append(span)
                if span not in seen:
                    seen.add(span)
                    if _is_phone(text, span, match.raw_string, regions, blocked, budget):
                        yield span
            yield None


def _is_phone(text: str, span: tuple[int, int], raw: str, regions: tuple[str, ...],
              blocked: Spans, budget: Budget) -> bool:
    start, end = span
    if blocked.overlaps(start, end) or _DATE.fullmatch(raw) or _DOTTED.fullmatch(raw):
        return False
    # At POSSIBLE the matcher does not look around the number: part of a word, a hash or a longer run is not one.
    if _GLUED_BEFORE.search(text, max(0, start - 2), start) or _GLUED_AFTER.match(text, end):
        return False
    digits = re.sub(r"\D", "", re.split(r"(?i)[a-z#]", raw)[0])
    if not 7 <= len(digits) <= 16:
        return False  # E.164 allows 15 digits, one more for a trunk prefix; under 7: see _DIGIT_RUN
    if len(digits) == 13 and digits[:3] in ("978", "979") and stdnum_isbn.is_valid(digits):
        return False
    if raw.lstrip("(").startswith("+"):
        return True
    if not _phone_context_ok(text, start):
        return False
    if re.search(r"[\s\-.()/]", raw):
        return True
    # A bare digit run is as often a count or an id: only a number valid in a region, and written with a trunk
    # prefix (one leading 0, as most of these regions dial national numbers) or after a phone word.
    national = raw.startswith("0") and not raw.startswith("00")
    if not (national or _phone_word_before(text, start)) or _UNIT_AFTER.match(text, end):
        return False
    for region in regions:
        if not budget.spend(1):
            budget.unread += 1
            return True  # unread: a phone, so that nothing is missed
        try:
            if phonenumbers.is_valid_number(phonenumbers.parse(raw, region)):
                return True
        except phonenumbers.NumberParseException:
            continue
    return False
