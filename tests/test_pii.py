"""clawd.privacy.pii: exact spans per category, hard negatives, overlaps, redaction and chat-message shapes."""
from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings, strategies as st

from clawd.privacy.phones import PHONE_BUDGET_UNITS, Budget
from clawd.privacy.pii import CATEGORIES, Detector, Finding, entropy, redact

DETECTOR = Detector()


def found(text: str, detector: Detector = DETECTOR) -> list[tuple[str, str]]:
    return [(f.category, text[f.start:f.end]) for f in detector.detect(text)]


def test_email_exact_span():
    assert DETECTOR.detect("Write to ana.lopez@mail.example.co.uk today") == [Finding("email", 9, 37)]
    assert found("cc: j_doe+news@example.org, then x@y.de.") == [("email", "j_doe+news@example.org"),
                                                                  ("email", "x@y.de")]


def test_email_domain_must_be_labels_and_a_letter_tld():
    assert found("user@localhost, a@b.c1, a@-bad.com, a@host.123, a..b@example.com") == []


def test_phones_international_and_national_formats():
    assert DETECTOR.detect("Call +1 (415) 555-2671 or +44 20 7946 0958.") == [
        Finding("phone", 5, 22), Finding("phone", 26, 42)]
    assert DETECTOR.detect("Ruf an: 030 12345678, appelle 06 12 34 56 78") == [
        Finding("phone", 8, 20), Finding("phone", 30, 44)]
    assert found("My number is 3420837783.", Detector(phone_regions=("IT",))) == [("phone", "3420837783")]
    # A number in a region that is not configured is still found when written with its country code.
    assert found("Her mobile is +81 90-1234-5678.", Detector(phone_regions=("US",))) == [
        ("phone", "+81 90-1234-5678")]


def test_cards_grouped_and_bare_with_luhn():
    assert DETECTOR.detect("Visa 4111 1111 1111 1111 and 5500-0000-0000-0004 and 378282246310005.") == [
        Finding("card", 5, 24), Finding("card", 29, 48), Finding("card", 53, 68)]
    assert found("card 4111 1111 1111 1112") == []  # fails Luhn


def test_ibans_grouped_and_compact():
    assert DETECTOR.detect("IBAN DE89 3704 0044 0532 0130 00 AND GB82WEST12345698765432.") == [
        Finding("iban", 5, 32), Finding("iban", 37, 59)]
    assert found("IBAN DE88 3704 0044 0532 0130 00") == []  # wrong check digits


def test_ips_v4_and_v6():
    assert DETECTOR.detect("hosts 192.168.1.10:8080, [2001:db8::1]:443 and fe80::1ff:fe23:4567:890a") == [
        Finding("ip", 6, 18), Finding("ip", 26, 37), Finding("ip", 47, 71)]
    assert found("a dotted quad is an IP: 1.2.3.4") == [("ip", "1.2.3.4")]
    assert found("mapped ::ffff:10.0.0.1 here") == [("ip", "::ffff:10.0.0.1")]


def test_secrets_by_format():
    jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
    pem = "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\nabc+/=\n-----END RSA PRIVATE KEY-----"
    tokens = ["AKIAIOSFODNN7EXAMPLE", "ghp_abcdefghijklmnopqrstuvwxyz0123456789", "glpat-abcdefghij0123456789",
              "xoxb-1234567890-0987654321-AbCdEfGhIjKlMnOp", "sk_live_abcdefghijklmnop1234",
              "sk-proj-Abc123Def456Ghi789Jkl012Mno345", "AIzaSyA1234567890abcdefghijklmnopqrstuv", jwt, pem]
    for token in tokens:
        text = f"here: {token} ok"
        assert DETECTOR.detect(text) == [Finding("secret", 6, 6 + len(token))], token


def test_secrets_assignments_bearer_and_entropy():
    assert DETECTOR.detect("keys AKIAIOSFODNN7EXAMPLE and ghp_abcdefghijklmnopqrstuvwxyz0123456789") == [
        Finding("secret", 5, 25), Finding("secret", 30, 70)]
    assert DETECTOR.detect('password=hunter2 and {"api_key": "s3cr3t-value"}') == [
        Finding("secret", 9, 16), Finding("secret", 34, 46)]
    assert found("export DB_PASSWORD='p@ss w0rd'; my password is Tr0ub4dor&3.") == [
        ("secret", "p@ss w0rd"), ("secret", "Tr0ub4dor&3")]
    assert DETECTOR.detect("Authorization: Bearer abcdefghijklmnopQRST1234") == [Finding("secret", 22, 46)]
    assert found("use X9fQ2kLm7PzR4tVw8YbN3cJh please") == [("secret", "X9fQ2kLm7PzR4tVw8YbN3cJh")]
    # Not a $VARIABLE (one case) nor a path (words between slashes): a value that merely starts like one.
    assert found("password=$UT2sZUNb7 secret_key=/xRtgQhJaEMV+4HPKAKZj") == [
        ("secret", "$UT2sZUNb7"), ("secret", "/xRtgQhJaEMV+4HPKAKZj")]
    # A hex string is not a secret by its looks (a git SHA, a hash); under a key-ish name it is.
    sha = "3f786850e387550fdab836ed7e6dc881de23001b"
    assert found(f"commit {sha} broke it") == []
    assert found(f"secret_key = {sha}") == [("secret", sha)]


@pytest.mark.parametrize("text", [
    "Your order #48213377 has shipped; order number 8627125991 too.",
    "Invoice INV-2024-00042 and invoice no. 1774609867.",
    "Upgrade to v2.13.0 or Python 3.11.4; v1.2.3.4 is old; OID 1.3.6.1.4.1.",
    "On 2024-03-15, 15.03.2024, 03/15/2024 at 14:30:00.",
    "It costs $1,299.99 or 1.299,99 EUR or ¥128,000.",
    "Tracking 1Z999AA10123456784, USPS 9400 1000 0000 0000 0000 00, FedEx tracking 123456789012.",
    "request 123e4567-e89b-12d3-a456-426614174000, commit 3f786850e387550fdab836ed7e6dc881de23001b",
    "ISBN 978-3-16-148410-0 and ISBN 0-306-40615-2.",
    "Reference 4111111111111112 is not a card.",
    "Postal code 75008, zip 94103-1234, PLZ 10115.",
    "It has 190741209 rows and 292625520 bytes.",
    "/usr/lib/python3.11/site-packages/torch/__init__.py and getUserAccountSettingsV2Handler",
    "the token: expired; password: required; the password is incorrect; password = get_password()",
    "PWD=/home/user password=<your password> token=$GITHUB_TOKEN max_tokens=1024 num_tokens: 2048 password: ****",
    "password=$(cat ~/.pw) HOME=/Users/me secret=${SECRET} password: %(password)s",
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5Er"
    "kJggg==",
    "from_pretrained('HuggingFaceTB/SmolLM2-135M-Instruct'); veryLongIdentifierNameForTestingPurposes2024 = 1",
    "pi 3.14159265358979, call 1-800-FLOWERS, unix time 1700000000",
    "std::vector and a::b, MAC 00:1a:2b:3c:4d:5e, time 12:30:45",
    "see https://example.com/orders/4155552671?id=33 or www.example.com/p/4155552671",
])
def test_hard_negatives(text):
    assert found(text) == []


def test_overlaps_keep_the_longer_and_more_specific():
    # A card number is not also a phone; an IBAN not a phone; digits inside an e-mail or a URL are not one.
    assert found("card 4111 1111 1111 1111") == [("card", "4111 1111 1111 1111")]
    assert found("IBAN FR14 2004 1010 0505 0001 3M02 606") == [("iban", "FR14 2004 1010 0505 0001 3M02 606")]
    assert found("mail 4155552671@example.com") == [("email", "4155552671@example.com")]
    assert found("open https://x.example/call/+14155552671 now") == []
    assert found("AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE") == [("secret", "AKIAIOSFODNN7EXAMPLE")]
    # The resolver itself: longer first, then the more specific category at equal length.
    assert DETECTOR.detect("") == []


def test_categories_subset_and_bad_configuration():
    only_email = Detector(categories=("email",))
    assert found("a@example.com +1 415 555 2671 4111111111111111", only_email) == [("email", "a@example.com")]
    assert Detector(categories=()).detect("a@example.com") == []
    with pytest.raises(ValueError, match="unknown PII categories"):
        Detector(categories=("email", "ssn"))
    with pytest.raises(ValueError, match="unknown phone regions"):
        Detector(phone_regions=("XX",))
    assert CATEGORIES == ("email", "phone", "card", "iban", "ip", "secret")


def test_redact_exact_output():
    text = ("Mail a@example.com, call +1 415 555 2671, card 4111111111111111, from 10.0.0.1 with "
            "sk_live_abcdefghijklmnop1234")
    assert redact(text, DETECTOR.detect(text)) == "Mail [EMAIL], call [PHONE], card [CARD], from [IP] with [SECRET]"
    assert DETECTOR.redact("IBAN GB82WEST12345698765432.", [Finding("iban", 5, 27)]) == "IBAN [IBAN]."
    assert redact("nothing here", []) == "nothing here"


def test_entropy():
    assert entropy("") == 0.0
    assert entropy("aaaa") == 0.0
    assert entropy("abcd") == 2.0


MESSAGES = [
    {"role": "system", "content": None},
    {"role": "user", "content": "I'm a@example.com, call +1 415 555 2671"},
    {"role": "user", "content": [{"type": "text", "text": "card 4111111111111111"},
                                 {"type": "image_url", "image_url": {"url": "https://x.example/1.png"}}]},
    {"role": "assistant", "content": None, "reasoning_content": "the user gave 10.0.0.1",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "pay", "arguments": '{"iban": "GB82WEST12345698765432", "n": 2}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
]


@pytest.mark.parametrize("text, found", [
    ("my card no. is 4111 1111 1111 1111", [("card", "4111 1111 1111 1111")]),   # a card word before "no."
    ("Visa nr: 4111-1111-1111-1111", [("card", "4111-1111-1111-1111")]),
    ("see invoice no. 4111 1111 1111 1111", []),                                   # still another number
    ("IBAN DE89-3704-0044-0532-0130-00 thanks", [("iban", "DE89-3704-0044-0532-0130-00")]),
    ("IBAN DE89 3704-0044 0532 0130 00", []),                                      # mixed separators
    ("call ０１６１ ４９６ ００６６ now", [("phone", "０１６１ ４９６ ００６６")]),  # fullwidth digits
    ("card: ４１１１１１１１１１１１１１１１", [("card", "４１１１１１１１１１１１１１１１")]),
    ("write to ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ", [("email", "ｊｏｈｎ＠ｅｘａｍｐｌｅ．ｃｏｍ")]),
    ("my password: letmein", [("secret", "letmein")]),                             # someone's own, a plain word
    ("our new wifi password is sunshine.", [("secret", "sunshine")]),
    ("my password is wrong", []), ("your token: expired", []), ("the password: letmein", []),
])
def test_what_earlier_versions_missed(text, found):
    assert [(f.category, text[f.start:f.end]) for f in DETECTOR.detect(text)] == found


def test_a_name_field_and_json_values_are_scanned_and_redacted():
    named = {"role": "user", "name": "jane.doe@example.org", "content": "hi"}
    assert DETECTOR.scan_messages([named]) == {"email": 1}
    assert DETECTOR.redact_messages([named]) == [{"role": "user", "name": "[EMAIL]", "content": "hi"}]
    tools = [{"function": {"description": "Calls +44 20 7946 0958", "parameters": {"enum": ["a@b.example", 3]}}}]
    assert DETECTOR.scan_json(tools) == {"phone": 1, "email": 1}
    assert DETECTOR.redact_json(tools) == [{"function": {"description": "Calls [PHONE]",
                                                         "parameters": {"enum": ["[EMAIL]", 3]}}}]


def test_scan_messages_counts_every_text_field():
    assert DETECTOR.scan_messages(MESSAGES) == {"email": 1, "phone": 1, "card": 1, "ip": 1, "iban": 1}
    assert DETECTOR.scan_messages([{"role": "user", "content": "hello"}]) == {}
    assert DETECTOR.scan_messages(["not a dict", {"role": "user"}]) == {}


def test_redact_messages_returns_a_redacted_copy_and_leaves_the_input():
    before = copy.deepcopy(MESSAGES)
    out = DETECTOR.redact_messages(MESSAGES)
    assert MESSAGES == before
    assert out == [
        {"role": "system", "content": None},
        {"role": "user", "content": "I'm [EMAIL], call [PHONE]"},
        {"role": "user", "content": [{"type": "text", "text": "card [CARD]"},
                                     {"type": "image_url", "image_url": {"url": "https://x.example/1.png"}}]},
        {"role": "assistant", "content": None, "reasoning_content": "the user gave [IP]",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "pay", "arguments": '{"iban": "[IBAN]", "n": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    assert out[2]["content"] is not MESSAGES[2]["content"]


def test_import_pulls_in_no_torch_no_spacy_and_uses_no_network():
    code = textwrap.dedent("""
        import socket, sys
        def refuse(*a, **k):
            raise AssertionError("network use")
        socket.socket.connect = refuse
        socket.create_connection = refuse
        socket.getaddrinfo = refuse
        import clawd.privacy.pii as pii
        d = pii.Detector()
        assert d.scan_messages([{"role": "user", "content": "a@example.com +1 415 555 2671 GB82WEST12345698765432"}])
        bad = sorted(m for m in sys.modules if m.split(".")[0] in
                     ("torch", "spacy", "thinc", "presidio_analyzer", "transformers", "requests", "detect_secrets"))
        print(bad)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- the bound on digit-dense text ----------------------------------------------------------------------------

def test_stretches_are_where_a_phone_may_start_and_end():
    from clawd.privacy.phones import _DIGIT_RUN, _stretches

    def stretches(text):
        return [text[a:b] for m in _DIGIT_RUN.finditer(text) for a, b in _stretches(text, *m.span())]

    # One glue character (space, dot, dash, slash) joins digits: no phone starts or ends inside such a stretch.
    assert stretches("2024-01-02 2024-01-02 2024-01-02") == []
    assert stretches("12 34 56 78 90 12 34 56 78") == []
    assert stretches("0161 496 0066") == ["0161 496 0066"]
    # Wider gaps and brackets are places a phone may start or end; stretches that no 7-16 digits cover go.
    assert stretches("(0161) 496 0066") == ["0161", "496 0066"]
    assert stretches("1234567  1234567") == ["1234567", "1234567"]
    assert stretches("12345678901234567  123") == []


@pytest.mark.parametrize("text", ["2024-01-02 " * 727, "12 34 " * 1400, "1234567 " * 1000, "1 2 3 4 5 6 7 8 9 " * 450])
def test_glued_digits_never_reach_the_phone_matcher(text):
    """Each of these cost the old detector ~1 s per 8 KB (the matcher reading all of it in ten regions)."""
    budget = Budget()
    assert Detector(categories=("phone",)).detect(text, budget) == []
    assert budget.units == PHONE_BUDGET_UNITS


def test_a_turn_that_spends_its_phone_budget_reports_the_rest_unread():
    text = "0123456  " * 900  # 900 possible national numbers
    budget = Budget()
    findings = Detector(categories=("phone",)).detect(text, budget)
    assert budget.units <= 0 and budget.unread > 0
    # Nothing is missed: every digit is in a finding, read or not (a run cut between two pieces of the text
    # may come back as two findings).
    covered = set().union(*(range(f.start, f.end) for f in findings))
    assert all(i in covered for i, c in enumerate(text) if c.isdigit())
    assert all(text[f.start:f.end].strip("0123456789") == "" for f in findings)
    # A fresh budget for the next turn; a spent one makes the next text's possible phones unread at once.
    spent = Budget(units=0)
    assert found_with(spent, "Call 020 7946 0958 today") == ["020 7946 0958"] and spent.unread == 1


def found_with(budget, text):
    return [text[f.start:f.end] for f in Detector(categories=("phone",)).detect(text, budget)]


def test_detection_in_steps_equals_detection_whole():
    text = "Mail a@b.org, call +44 20 7946 0958, card 4111 1111 1111 1111, " * 40 + "0123456  " * 300
    whole = Detector().detect(text)
    steps, n = Detector().steps(text), 0
    while True:
        try:
            next(steps)
            n += 1
        except StopIteration as stop:
            assert stop.value == whole
            break
    assert n > 100  # it gave the loop back many times


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["4111 1111 1111 1111", "10.0.0.1", "a@b.co", "password = hunter22", " ", "  ",
                                 "1", "-", ".", "x", "\n", "5", "token: Zq8vR2mT4pW9kL3n", " " * 30]), max_size=60),
       st.sampled_from([16, 32, 64]))
def test_searching_in_pieces_finds_what_searching_whole_finds(parts, piece):
    """Pieces small enough that matches cross their ends, and whatever the text around them."""
    from clawd.privacy import phones, pii

    text = "".join(parts)
    saved, phones._SEARCH_PIECE = phones._SEARCH_PIECE, piece
    try:
        for pattern in (pii._CARD, pii._IPV4, pii._EMAIL, pii._ASSIGNMENT, pii._TOKEN):
            for longest in (64, 128):  # at least the longest match here; a lookahead cut at the end is read again
                got = [m.span() for m in phones.in_pieces(pattern, text, longest) if m is not None]
                assert got == [m.span() for m in pattern.finditer(text)], (pattern.pattern[:40], longest)
    finally:
        phones._SEARCH_PIECE = saved
