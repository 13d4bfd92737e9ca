"""PII in chat text: e-mail, phone, payment card, IBAN, IP address and secrets, with exact character spans.
One file past 500 lines on purpose: the recognizers decide against each other (whose digits a phone may
not take, which of two overlapping findings stays), and those rules are read best in one place.

Not Presidio: its analyzer imports spaCy (whose thinc imports torch when torch is installed, and the daemon
never imports torch), its default NLP model is not on PyPI, and its e-mail recognizer fetches the public
suffix list over the network. clawd calls, in-process, the libraries such recognizers are built on:
`phonenumbers` (libphonenumber), `python-stdnum` (Luhn, IBAN, ISBN) and the stdlib `ipaddress`.
Secrets: a regex per public token format plus Shannon entropy, not Yelp's `detect-secrets`, which scans lines of
source files: no character offsets (redaction needs them), its ad-hoc scan calls words like "is" high-entropy
strings, and its import takes ~170 ms and pulls in requests; see bench/pii.py for this module's figures.

What each category takes (docs/ARCHITECTURE.md §18; the context words are English, with a few others):
  email   a regex candidate (unavoidable; Presidio does the same) whose domain is checked offline: labels of
          letters, digits and inner hyphens, at most 63 each, and a TLD of letters (or xn--). ASCII only.
  phone   (clawd.privacy.phones) `PhoneNumberMatcher` at leniency POSSIBLE, per region of `phone_regions`
          until every place a phone may stand is read, within a turn's `Budget`: "+CC ..." parses the same
          from any region, a national format ("(0161) 496 0066", "06 12 34 56 78") only from its own. Many real and generated numbers lie outside the ranges VALID
          knows, so a formatted number (+, brackets, separators) needs a possible length only; a bare run of
          digits, as often a count or an id, must be VALID in a region and either start with one trunk 0
          or follow a phone word (call, tel, number, ...) in its sentence, with no other number between.
          Never: under 7 digits or over 16, right after a word naming another number (order, invoice,
          tracking, ISBN, card, #, ...), glued to letters or to more digits, followed by a unit (bytes, EUR),
          a date, a decimal or dotted version, an ISBN-13, anything in an e-mail, a URL or another finding.
  card    12-19 digits (bare, or grouped by one kind of separator), first digit 2-6 (the card industries;
          12 digits only for Maestro's 50, 56-69; 15-digit JCB 1800/2131), a valid Luhn digit (`stdnum.luhn`),
          not right after a word naming another number (a tenth of all numbers pass Luhn: "tracking ...")
          unless a card word names it ("my card no. is ...").
  iban    country code, check digits and BBAN, compact or in groups of four (spaces or dashes), valid by
          `stdnum.iban` (length per country and mod 97). Upper case only.
  ip      a dotted quad IS an IP ("1.2.3.4" too), unless glued to a letter or to more dotted numbers
          ("v1.2.3.4", "1.3.6.1.4.1"); "3.11.4" never is. IPv6 with at least three groups (so "ab::cd" in
          code is not one); both checked by `ipaddress`.
  secret  known formats (AWS AKIA/ASIA key ids, GitHub ghp_/github_pat_, GitLab glpat-, Slack xox?-, Stripe
          sk_/rk_live|test, OpenAI/Anthropic sk-, Google AIza, PEM private key blocks, JWTs); the value of a
          `password=` / `"api_key": "..."` / `token: ...` / "password is ..." assignment (after ':' or 'is', not a
          plain word unless someone's own: "my password: letmein", but not "my password is wrong"; not a
          placeholder, $VAR or call) and of `Bearer`; high-entropy tokens: 20-512
          characters of [A-Za-z0-9+/_=-] with lower and upper case and a digit, no word-like part
          (SmolLM2-135M-Instruct), character classes changing like random text (not camelCase), Shannon
          entropy >= min(4.0, 0.8 log2(length)) bits, not after "base64,". A hex string (git SHA, hash,
          UUID) alone is not a secret; under a key-ish name it is.
Fullwidth forms (４１１１, ＠) are read as their ASCII characters. Every text field of a message is scanned (its
content, reasoning, tool-call arguments and `name`), and any JSON value (tool definitions: `scan_json`).
Overlaps keep the longer span, and at equal length the more specific category (_RANK).
Not detected: names, postal addresses, national ids; Unicode e-mail addresses; lower-case IBANs; phones
written in words or bare numbers outside VALID ranges; passwords in prose without a key-ish word, or one plain
word nobody names as their own ("the password: letmein"); random tokens without a digit, with a word-like part, or longer than 512 characters.
"""
from __future__ import annotations

import copy
import hashlib
import ipaddress
import math
import re
from collections import Counter, OrderedDict
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Generator, Iterable, Iterator, TypeVar

import phonenumbers
from stdnum import iban as stdnum_iban
from stdnum import luhn

from clawd.privacy.phones import OTHER_NUMBER, Budget, Scan, Spans, glued, in_pieces, phones

CATEGORIES = ("email", "phone", "card", "iban", "ip", "secret")
LABELS = {c: f"[{c.upper()}]" for c in CATEGORIES}
_MEMO_TEXTS = 8192  # texts whose findings `detect` remembers (digests and spans: a few MB at most)
# "+CC ..." numbers are found from any region; each listed region adds its national formats (and makes its bare
# numbers VALID). An unlisted country's national format is found only where a listed region's lengths allow it.
DEFAULT_PHONE_REGIONS = ("US", "GB", "DE", "FR", "IT", "ES", "NL", "IN", "BR", "JP")
# At equal span length the more specific wins: a checksum or a fixed format beats a phone's loose shape.
_RANK = {"secret": 0, "iban": 1, "card": 2, "email": 3, "ip": 4, "phone": 5}
# Fullwidth forms (４１１１, ＠) read as their ASCII letters, one character for one, so spans stay those of the text.
_FULLWIDTH = {0xFF01 + i: 0x21 + i for i in range(94)} | {0x3000: 0x20}


@dataclass(frozen=True)
class Finding:
    category: str
    start: int
    end: int


# --- e-mail and URLs ---------------------------------------------------------------------------------------------

_EMAIL = re.compile(r"(?<![\w.%+-])[A-Za-z0-9._%+-]{1,64}@(?:[A-Za-z0-9-]{1,63}\.){1,8}"
                    r"(?:[A-Za-z]{2,63}|xn--[A-Za-z0-9-]{1,59})"
                    r"(?![\w-])")
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\Z")
_DIGIT = re.compile(r"[0-9]")  # ASCII digits: a class `re` can skip through; \d is all of Unicode's
_URL = re.compile(r"(?i)\b(?:https?|ftp|wss?)://[^\s<>\"'`]+|\bwww\.[^\s<>\"'`]+")




def _emails(text: str) -> Scan:
    for m in in_pieces(_EMAIL, text, longest=1200):
        yield None
        if m is None:
            continue
        local, _, domain = m.group().rpartition("@")
        if local.startswith(".") or local.endswith(".") or ".." in local or len(m.group()) > 254:
            continue
        if all(_LABEL.match(label) for label in domain.split(".")):
            yield m.span()


# --- cards, IBANs, IPs ------------------------------------------------------------------------------------------

# The lookbehinds of these patterns are checked in code: a pattern that starts with a plain digit or letter class
# lets `re` skip ahead to candidates, one that starts with a lookbehind tries every position.
_CARD = re.compile(r"[0-9](?:[ -]?\d){11,18}(?![\w]|[ .,-]\d)")
_CARD_BEFORE = re.compile(r"[\w+.,-]|\d[ -]")
_MAESTRO_12 = re.compile(r"5[06-9]|6")


_BY_START = attrgetter("start", "end")
_NOT_CARD_WORDS = re.compile(OTHER_NUMBER.format(""))
_CARD_WORDS = re.compile(r"(?i)\b(?:card|visa|mastercard|amex|credit|debit)\b[\s.:#-]*(?:number|no\.?|nr\.?|num|#)?"
                         r"(?:\s+(?:is|was))?[\s.:#=-]*\Z")


def _cards(text: str) -> Scan:
    for m in in_pieces(_CARD, text, longest=40):
        if m is None:
            yield None
            continue
        if glued(_CARD_BEFORE, text, m.start()):
            continue
        raw = m.group()
        digits = raw.replace(" ", "").replace("-", "")
        seps = set(re.findall(r"[ -]", raw))
        if len(seps) > 1 or (seps and min(map(len, re.split(r"[ -]", raw)[:-1])) < 3):
            continue  # mixed separators or tiny groups: a phone, a date or a list, not a card as written
        if digits[0] not in "23456" and not (len(digits) == 15 and digits[:4] in ("1800", "2131")):
            continue  # not a card industry (old 15-digit JCB aside)
        if len(digits) == 12 and not _MAESTRO_12.match(digits):
            continue
        before = max(0, m.start() - 40)  # "card no. 4111...": a card, though "no." alone names another number
        if luhn.is_valid(digits) and (_CARD_WORDS.search(text, before, m.start())
                                      or not _NOT_CARD_WORDS.search(text, before, m.start())):
            yield m.span()  # a tenth of all numbers pass Luhn: "tracking 692287768091" is not a card


_IBAN = re.compile(r"[A-Z]{2}\d{2}(?:[ -]?[A-Z0-9]{1,4}){3,8}(?![\w])")


def _ibans(text: str) -> Scan:
    for m in in_pieces(_IBAN, text, longest=80):
        yield None
        if m is None:
            continue
        if glued(_WORD_BEFORE, text, m.start()) or (" " in m.group() and "-" in m.group()):
            continue
        # Grouped by fours (spaces or dashes), the pattern may have run into a following capitalised word: try
        # shorter.
        ends = [g.end() for g in re.finditer(r"[A-Z0-9]+", m.group())]
        for end in reversed(ends):
            candidate = m.group()[:end]
            if len(re.sub(r"[ -]", "", candidate)) >= 15 and stdnum_iban.is_valid(candidate):
                yield m.start(), m.start() + end
                break


_IPV4 = re.compile(r"[0-9]{1,3}(?:\.\d{1,3}){3}(?![\w]|\.\d)")
_IPV4_BEFORE = re.compile(r"[\w.]")
_WORD_BEFORE = re.compile(r"\w")
_IPV6 = re.compile(r"(?<![\w:.])[0-9A-Fa-f:]{2,39}(?:(?<=:)(?:\d{1,3}\.){3}\d{1,3})?(?:%[\w.]{1,16})?(?![\w:.]|\.\d)")


def _ips(text: str) -> Scan:
    for m in in_pieces(_IPV4, text, longest=24) if "." in text else ():
        yield None
        if m is None:
            continue
        if glued(_IPV4_BEFORE, text, m.start()):
            continue
        try:
            ipaddress.IPv4Address(m.group())
        except ValueError:
            continue
        yield m.span()
    for m in _IPV6.finditer(text) if "::" in text or text.count(":") >= 3 else ():
        yield None
        candidate = m.group().rstrip(":") if not m.group().endswith("::") else m.group()
        groups = [g for g in re.split(r"[:%]", candidate.split("%")[0]) if g]
        if candidate.count(":") < 2 or len(groups) + 3 * ("." in candidate) < 3:
            continue
        try:
            ipaddress.IPv6Address(candidate)
        except ValueError:
            continue
        yield m.start(), m.start() + len(candidate)


# --- secrets --------------------------------------------------------------------------------------------------------

# (substrings one of which a text must hold, the token's pattern): the substring test skips the regex on most text.
_SECRET_FORMATS = tuple((hints, re.compile(pattern)) for hints, pattern in (
    (("AKIA", "ASIA", "ABIA", "ACCA", "A3T"), r"\b(?:AKIA|ASIA|ABIA|ACCA|A3T[A-Z0-9])[A-Z0-9]{16}\b"),  # AWS key id
    (("ghp_", "gho_", "ghu_", "ghs_", "ghr_"), r"\bgh[pousr]_[A-Za-z0-9]{36,255}\b"),                  # GitHub
    (("github_pat_",), r"\bgithub_pat_[A-Za-z0-9_]{22,255}\b"),
    (("glpat-",), r"\bglpat-[A-Za-z0-9_-]{20,}"),                                                     # GitLab
    (("xox", "xapp-"), r"\bxox[abprse]-[A-Za-z0-9-]{10,}|\bxapp-\d-[A-Za-z0-9-]{10,}"),                # Slack
    (("hooks.slack.com",), r"https://hooks\.slack\.com/services/[A-Za-z0-9/]{20,}"),
    (("k_live_", "k_test_"), r"\b[sr]k_(?:live|test)_[A-Za-z0-9]{16,}"),                               # Stripe
    (("sk-",), r"\bsk-(?:proj-|svcacct-|admin-|ant-[a-z0-9]{2,8}-)?[A-Za-z0-9_-]{20,}"),  # OpenAI, Anthropic
    (("AIza",), r"\bAIza[0-9A-Za-z_-]{35}"),                                                          # Google API key
    (("eyJ",), r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"),                       # JWT
    # PEM private key blocks; a truncated one (no END line) runs to the end of its base64 body.
    (("-----BEGIN",), r"-----BEGIN[A-Z0-9 ]{0,30} PRIVATE KEY(?: BLOCK)?-----(?:[\s\S]*?-----END[A-Z0-9 ]{0,30}"
                      r" PRIVATE KEY(?: BLOCK)?-----|(?:[\sA-Za-z0-9+/=:,-]|\\n)*)"),
))
_KEY_HINTS = ("pass", "pwd", "secret", "key", "token", "credential")
_KEY_WORDS = (r"passw(?:or)?d|passphrase|pwd|secret(?:[_-]?access)?(?:[_-]?key)?|api[_-]?key|apikey"
              r"|access[_-]?key(?:[_-]?id)?|private[_-]?key"
              r"|(?:access|auth|refresh|bearer|session|api|bot)?[_-]?token|client[_-]?secret|credentials?")
_ASSIGNMENT = re.compile(
    rf"(?i)(?<![A-Za-z0-9])(?:{_KEY_WORDS})[\"']?(\s*(?:=|:|=>|:=)\s*|\s+is\s+)"
    r"(?:\"([^\"\n\\]{4,200})\"|'([^'\n\\]{4,200})'|([^\s\"'`,;\\}\]]{4,200}))")
_BEARER = re.compile(r"\b[Bb]earer\s+([A-Za-z0-9._~+/=-]{16,})")
_OWN = re.compile(r"(?i)\b(?:my|our|your|his|her|their)\s+(?:\w+\s+){0,2}\Z")
_STATES = frozenset("wrong right correct incorrect invalid valid expired missing empty blank weak strong long short "
                    "same different new old changed reset required optional secure insecure fine ok okay good bad "
                    "unknown forgotten lost locked hidden visible saved stored encrypted".split())
# Values that stand for a secret rather than hold one: literals, masks, $VARIABLES (one case), templates, paths.
_PLACEHOLDER = re.compile(r"(?i)\A(?:none|null|nil|true|false|undefined|required|optional|string|redacted|\[\w+\]"
                          r"|x+|\*+|\.+|<.*|\$(?-i:[A-Z_][A-Z0-9_]*|[a-z_][a-z0-9_]*|[{(].*)|%(?:\(\w+\))?[sdr]|%\w+%"
                          r"|\{.*|os\.\w+.*|process\.env.*|env\[.*"
                          r"|(?:~|\.{1,2})?/[\w.-]+/[\w./-]*|(?:~|\.{1,2})?/[a-z0-9._-]+)\Z")
_CALL = re.compile(r"[A-Za-z_][\w.]*\(.*\)")  # password=get_password(): code, not a value
_TOKEN = re.compile(r"(?<![A-Za-z0-9+/_=-])[A-Za-z0-9+/_=-]{20,512}(?![A-Za-z0-9+/_=-])")
_HEX = re.compile(r"[0-9a-fA-F-]+")
_WORD_PART = re.compile(r"[A-Z]?[a-z]{3,}|[A-Z]{3,}[a-z]*")


def entropy(s: str) -> float:
    """Shannon entropy of the characters of `s`, in bits per character."""
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values()) if n else 0.0


def _class_changes(token: str) -> float:
    """How often adjacent characters change class (lower, upper, digit, other): ~0.6 random, ~0.2 camelCase."""
    kinds = ["l" if c.islower() else "u" if c.isupper() else "d" if c.isdigit() else "o" for c in token]
    return sum(a != b for a, b in zip(kinds, kinds[1:])) / (len(token) - 1)


def _high_entropy(token: str) -> bool:
    if _HEX.fullmatch(token) or token.startswith("/"):
        return False  # hashes, SHAs and UUIDs alone; paths
    if not (re.search(r"[a-z]", token) and re.search(r"[A-Z]", token) and re.search(r"\d", token)):
        return False
    if any(_WORD_PART.fullmatch(part) for part in re.split(r"[-_/+=.]", token)) or _class_changes(token) < 0.4:
        return False  # names made of words: HuggingFaceTB/SmolLM2-135M-Instruct, veryLongIdentifierName2024
    return entropy(token) >= min(4.0, 0.8 * math.log2(len(token)))


def _secrets(text: str) -> Scan:
    for hints, pattern in _SECRET_FORMATS:
        if any(h in text for h in hints):
            yield from (m.span() for m in pattern.finditer(text))
    lowered = text.lower()
    assignments = in_pieces(_ASSIGNMENT, text, longest=2048) if any(h in lowered for h in _KEY_HINTS) else ()
    for m in assignments:
        yield None
        if m is None:
            continue
        group = next(g for g in (2, 3, 4) if m.group(g) is not None)
        start, value = m.start(group), m.group(group)
        if group == 4:
            while value.endswith(")") and value.count(")") > value.count("("):
                value = value[:-1]  # f(password=abc123): the call's parenthesis
            value = value.rstrip(".") if "=" not in m.group(1) else value  # "my password is hunter2."
            if _CALL.fullmatch(value) or len(value) < 4:
                continue
            # After ':' or 'is' in prose ("the token: expired", "password is wrong") a plain word is not a value,
            # unless someone's own key-ish thing is named ("my password: letmein") by a word that is no state.
            if ("=" not in m.group(1) and value.isalpha() and (value.islower() or value.istitle())
                    and (not _OWN.search(text, max(0, m.start() - 32), m.start()) or value.lower() in _STATES)):
                continue
        if not _PLACEHOLDER.match(value):
            yield start, start + len(value)
    for m in _BEARER.finditer(text) if "earer" in text else ():
        yield m.span(1)
    for m in in_pieces(_TOKEN, text, longest=514):
        if m is None:
            yield None
            continue
        if _high_entropy(m.group()) and not text.endswith("base64,", 0, m.start()):  # data: URIs hold data
            yield m.span()


# --- the detector -------------------------------------------------------------------------------------------------

class Detector:
    """Finds the configured categories in text; stateless after construction, so one serves every turn."""

    def __init__(self, categories: Iterable[str] = CATEGORIES, phone_regions: Iterable[str] = DEFAULT_PHONE_REGIONS):
        self.categories = tuple(categories)
        unknown = [c for c in self.categories if c not in CATEGORIES]
        if unknown:
            raise ValueError(f"unknown PII categories {unknown}; known: {', '.join(CATEGORIES)}")
        self._wanted = frozenset(self.categories)
        self._memo: OrderedDict[bytes, list[Finding]] = OrderedDict()
        self.phone_regions = tuple(r.upper() for r in phone_regions)
        bad = [r for r in self.phone_regions if r not in phonenumbers.SUPPORTED_REGIONS]
        if bad:
            raise ValueError(f"unknown phone regions {bad} (ISO 3166 alpha-2 codes libphonenumber knows)")

    def detect(self, text: str, budget: Budget | None = None) -> list[Finding]:
        """Findings sorted by start, none overlapping: of two that overlap the longer, then the more specific.
        Remembered for the last texts seen (by digest): a conversation's messages come back with every turn,
        and a text scanned is usually redacted next."""
        return finish(self.steps(text, budget))

    def steps(self, text: str, budget: Budget | None = None) -> Generator[None, None, list[Finding]]:
        """`detect` as a generator that yields between its costly steps, for a caller that must not hold the
        event loop for long (`finish` runs it whole)."""
        if not text:
            return []
        key = hashlib.blake2b(text.encode(errors="surrogatepass"), digest_size=16).digest()
        if (hit := self._memo.get(key)) is not None:
            self._memo.move_to_end(key)
            return hit
        found = yield from self._detect(text if text.isascii() else text.translate(_FULLWIDTH),
                                        Budget() if budget is None else budget)
        self._memo[key] = found
        if len(self._memo) > _MEMO_TEXTS:
            self._memo.popitem(last=False)
        return found

    def _detect(self, text: str, budget: Budget) -> Generator[None, None, list[Finding]]:
        # Gates in C (substring and one-class scans) skip the patterns a text cannot match: most prose has no digit.
        wanted = self._wanted if _DIGIT.search(text) else self._wanted - {"iban", "card", "phone"}
        found: list[Finding] = []
        emails: list[tuple[int, int]] = []
        if "@" in text:
            emails = yield from _collect(_emails(text))
        if "email" in wanted:
            found += [Finding("email", s, e) for s, e in emails]
        for category, scan in (("ip", _ips), ("iban", _ibans), ("secret", _secrets)):
            if category in wanted:
                found += [Finding(category, s, e) for s, e in (yield from _collect(scan(text)))]
        if wanted & {"card", "phone"}:
            # Digits inside an e-mail address or a URL are part of it, not a phone or a card.
            urls = [m.span() for m in _URL.finditer(text)] if "://" in text or "www." in text else []
            blocked = emails + urls
            if "card" in wanted:
                found += [Finding("card", s, e) for s, e in (yield from _collect(_cards(text)))
                          if not any(b0 <= s and e <= b1 for b0, b1 in blocked)]
            if "phone" in wanted and self.phone_regions:
                # Phones last, and never in another finding's digits: the costliest step skips them.
                blocked += [(f.start, f.end) for f in found]
                found_phones = yield from _collect(phones(text, self.phone_regions, Spans(blocked), budget))
                found += [Finding("phone", s, e) for s, e in found_phones]
        yield
        return _resolve(found)

    def redact(self, text: str, findings: list[Finding]) -> str:
        return redact(text, findings)

    def scan_messages(self, messages: Iterable[Any]) -> dict[str, int]:
        """{category: count} over every text field of OpenAI chat messages; categories with none left out."""
        counts: dict[str, int] = {}
        for message in messages:
            for text in message_texts(message):
                for f in self.detect(text):
                    counts[f.category] = counts.get(f.category, 0) + 1
        return counts

    def scan_json(self, value: Any) -> dict[str, int]:
        """{category: count} over every string inside a JSON value: tool definitions (descriptions, enums,
        defaults), which are in every prompt that offers them."""
        return self.scan_messages({"content": text} for text in json_strings(value))

    def redact_json(self, value: Any) -> Any:
        """A copy of a JSON value with every string in it redacted."""
        if isinstance(value, str):
            return redact(value, self.detect(value))
        if isinstance(value, list):
            return [self.redact_json(v) for v in value]
        if isinstance(value, dict):
            return {k: self.redact_json(v) for k, v in value.items()}
        return value

    def redact_messages(self, messages: Iterable[Any]) -> list[Any]:
        """A copy of the messages with every text field redacted (content, its text parts, reasoning_content,
        tool call arguments); the input is never changed."""
        out = []
        for message in messages:
            message = copy.deepcopy(message)
            if isinstance(message, dict):
                self._redact_message(message)
            out.append(message)
        return out

    def _redact_message(self, message: dict[str, Any]) -> None:
        def clean(text: str) -> str:
            return redact(text, self.detect(text))

        for key in ("content", "reasoning_content", "name"):
            value = message.get(key)
            if isinstance(value, str):
                message[key] = clean(value)
            elif isinstance(value, list):
                for part in value:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        part["text"] = clean(part["text"])
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                function["arguments"] = clean(function["arguments"])


def message_texts(message: Any) -> Iterator[str]:
    """Every text field of one chat message, in the shapes the OpenAI API allows (and tolerating others)."""
    if not isinstance(message, dict):
        return
    for key in ("content", "reasoning_content", "name"):  # a sender's name is trained with its message too
        value = message.get(key)
        if isinstance(value, str):
            yield value
        elif isinstance(value, list):
            yield from (p["text"] for p in value if isinstance(p, dict) and isinstance(p.get("text"), str))
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            yield function["arguments"]


def json_strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from json_strings(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from json_strings(v)


def _resolve(found: list[Finding]) -> list[Finding]:
    """Of findings that overlap, the longer stays, then the more specific (_RANK). Linear for findings that
    do not overlap (most texts; a log of 100,000 IPs), and no worse than the characters they cover otherwise."""
    found.sort(key=_BY_START)  # each scanner's are in order already: a merge
    reach = -1
    for f in found:
        if f.start < reach:
            break
        reach = f.end
    else:
        return [f for f in found if f.end > f.start]
    found = list(dict.fromkeys(found))
    taken = bytearray(max(f.end for f in found))  # 1 where a kept finding stands
    kept: list[Finding] = []
    for f in sorted(found, key=lambda f: (-(f.end - f.start), _RANK[f.category], f.start)):
        if f.end > f.start and taken.find(1, f.start, f.end) < 0:
            kept.append(f)
            taken[f.start:f.end] = b"\x01" * (f.end - f.start)
    return sorted(kept, key=lambda f: f.start)


def redact(text: str, findings: Iterable[Finding]) -> str:
    """`text` with each finding's span replaced by its label ([EMAIL], [PHONE], ...); findings must not overlap."""
    pieces, last = [], 0
    for f in sorted(findings, key=lambda f: f.start):
        pieces += [text[last:f.start], LABELS[f.category]]
        last = f.end
    pieces.append(text[last:])
    return "".join(pieces)


def _collect(scan: Scan) -> Generator[None, None, list[tuple[int, int]]]:
    """The spans of a scan, yielding at each candidate and piece it reads (a step is microseconds to a few ms)."""
    spans = []
    for span in scan:
        if span is None:
            yield
        else:
            spans.append(span)
    return spans


_T = TypeVar("_T")


def finish(steps: Generator[None, None, _T]) -> _T:
    """Runs a generator of steps (`Detector.steps`) to its end and returns its value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
