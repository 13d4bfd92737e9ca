"""PII detection (clawd.privacy.pii): precision and recall per category on a labelled set, and its cost per KB.

The set is built independently of the detector: Faker, in ten locales, writes the e-mails, phone numbers
(each locale's `phone_number`), card numbers (`credit_card_number`, a third of them grouped by fours as
people type them), IBANs and IP addresses; this script writes the secrets itself from their public formats
(AWS AKIA key ids and secret keys, GitHub ghp_ / github_pat_, GitLab glpat-, Slack xoxb-/xoxp-, Stripe
sk_live_, OpenAI sk- / sk-proj-, Anthropic sk-ant-, Google AIza, PEM private key blocks, JWTs, passwords in
assignments, bare random tokens). Each value is put in a natural sentence and the generator records its span.
Hard negatives (no label at all): order and invoice numbers, version strings, dates, times, prices, tracking
numbers, UUIDs, ISBNs, card-length digit strings failing Luhn, postal codes, git SHAs, paths, counts.
Sentences are joined into chat-sized messages of 2-6 sentences, in a shuffled order.

Scoring is by span: a labelled span is found (recall) when a detection of its category overlaps it; a
detection is right (precision) when it overlaps a labelled span of its category. Cost: µs per KB of the
labelled messages, and of PII-free Faker prose (what most turns are), best of three passes.
Targets: recall >= 0.95 for email, phone, card and secret; precision >= 0.9 for every category.
Exit status: 0 when every target was met; 1 when one was missed; 2 when it could not measure (a category
with no labelled span or no detection). Seeded: the same arguments give the same set and figures.
The JSON carries `provenance` (bench/provenance.py) and `pass`.

    .venv/bin/python bench/pii.py               # ~5 s on 2 cores; writes bench/results/pii.json
    .venv/bin/python bench/pii.py --per-locale 50 --seed 2 --show 10
"""
from __future__ import annotations

import argparse
import base64
import json
import random
import string
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from faker import Faker  # noqa: E402

from clawd.privacy.pii import CATEGORIES, Detector  # noqa: E402
import provenance  # noqa: E402  (bench/provenance.py: this script's folder is on sys.path)

RESULTS = ROOT / "bench" / "results"
LOCALES = ("en_US", "en_GB", "de_DE", "fr_FR", "it_IT", "es_ES", "nl_NL", "ja_JP", "pt_BR", "en_IN")
RECALL_TARGET = {"email": 0.95, "phone": 0.95, "card": 0.95, "secret": 0.95}
PRECISION_TARGET = 0.9
# Faker 40's en_IN iban() writes GB IBANs of 21 characters; the IBAN registry gives GB 22: not IBANs.
IBAN_SKIP = ("en_IN",)

TEMPLATES = {
    "email": ["Please send the contract to {} before Friday.", "My email is {} if you need anything else.",
              "Could you cc {} on the thread?", "Reply to {}, she handles the refunds.",
              "I wrote to {} twice and never heard back.", "Contact: {}"],
    "phone": ["Call me at {} tomorrow morning.", "My number is {}.", "You can reach the office on {} after 9.",
              "Ring {} if the delivery is late.", "Her mobile is {}, text first.", "WhatsApp: {}",
              "The hotel's phone number is {} and they speak English.", "Tel. {}", "fax {} (ask for Anna)",
              "Sure, it's {}, talk soon.", "Sorry, I meant {} not the old one."],  # no phone word
    "card": ["My card number is {}, expiry 04/27.", "Charge it to {} please.", "I paid with {} but got no receipt.",
             "Visa {} was declined twice.", "card: {}", "my card no. is {}"],
    "iban": ["Please transfer the deposit to {}.", "My IBAN is {}, the account is in my name.",
             "IBAN: {} (BIC on the invoice)", "Send the refund to {} not the old account."],
    "ip": ["The server at {} stopped answering pings.", "Whitelist {} in the firewall.",
           "My home IP is {} if that helps.", "ssh into {} and check the logs", "Requests from {} get a 403."],
    "secret": ["Here is my key: {} can you check why it fails?", "I set the token to {} in the config.",
               "export OPENAI_API_KEY={}", "The bot uses {} to post messages.", "{}",
               "curl -H 'Authorization: Bearer {}' https://api.example.com/v1/me",
               "I accidentally committed {} to the repo, what now?"],
}
NEGATIVES = [
    "Your order #{order} has shipped.", "Order number {order} was cancelled yesterday.",
    "Invoice INV-{year}-{n5} is overdue.", "See invoice no. {order} from last month.",
    "I upgraded to v{ver} and it broke.", "Python {py} fixed it.", "Release {ver}-rc1 is out.",
    "The meeting is on {date}.", "It happened on {date2} at {time}.", "Deadline: {date3}, {time}.",
    "It costs {price}.", "Total: {price} including VAT.", "Tracking number {ups} shows it in Memphis.",
    "USPS tracking: {usps}", "FedEx tracking {fedex} says delivered.", "The request id was {uuid}.",
    "ISBN {isbn13} is the second edition.", "The old ISBN {isbn10} is out of print.",
    "Reference {fake_card} on your statement.", "The postal code is {postcode}.", "Commit {sha} broke the build.",
    "The checksum is {md5}.", "Open /home/user/projects/app_v2/src/main.py line {n3}.", "It has {count} rows.",
    "Population {count_sep}, area {n3} km2.", "Meet at {time}, room {n3}.", "Version {ver} of the library.",
    "Run it {n2} times with seed {n5}.", "Error code {n5} again.", "The file is {count} bytes.",
]
PEM_KINDS = ("RSA PRIVATE KEY", "PRIVATE KEY", "EC PRIVATE KEY", "OPENSSH PRIVATE KEY")
ALNUM = string.ascii_letters + string.digits
FULLWIDTH = {0x21 + i: 0xFF01 + i for i in range(94)}  # ASCII to its fullwidth form, one character for one


def _rand(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def _b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def make_secret(rng: random.Random, fake: Faker) -> tuple[str, str]:
    """(template to use or "", the secret), from the token formats the providers document."""
    kind = rng.randrange(14)
    if kind == 0:
        return "", "AKIA" + _rand(rng, string.ascii_uppercase + "234567", 16)
    if kind == 1:
        return "aws_secret_access_key = {}", _rand(rng, ALNUM + "+/", 40)
    if kind == 2:
        return "", "ghp_" + _rand(rng, ALNUM, 36)
    if kind == 3:
        return "", "github_pat_" + _rand(rng, ALNUM, 22) + "_" + _rand(rng, ALNUM, 59)
    if kind == 4:
        return "", "glpat-" + _rand(rng, ALNUM + "_-", 20)
    if kind == 5:
        pre = rng.choice(("xoxb", "xoxp"))
        return "", f"{pre}-{_rand(rng, string.digits, 12)}-{_rand(rng, string.digits, 13)}-{_rand(rng, ALNUM, 24)}"
    if kind == 6:
        return "", rng.choice(("sk_live_", "rk_live_", "sk_test_")) + _rand(rng, ALNUM, 24)
    if kind == 7:
        return "", "sk-" + _rand(rng, ALNUM, 48)
    if kind == 8:
        return "", "sk-proj-" + _rand(rng, ALNUM + "_-", 120)
    if kind == 9:
        return "", "sk-ant-api03-" + _rand(rng, ALNUM + "_-", 93) + "AA"
    if kind == 10:
        return "", "AIza" + _rand(rng, ALNUM + "_-", 35)
    if kind == 11:
        pem = rng.choice(PEM_KINDS)
        body = base64.b64encode(rng.randbytes(rng.choice((120, 270, 600)))).decode()
        lines = "\n".join(body[i:i + 64] for i in range(0, len(body), 64))
        block = f"-----BEGIN {pem}-----\n{lines}\n-----END {pem}-----"
        return "Here is the key file:\n{}\nwhy does ssh reject it?", block
    if kind == 12:
        header = _b64url(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
        claims = {"sub": str(rng.randrange(10**9)), "name": fake.name(), "iat": 1700000000 + rng.randrange(10**7)}
        return "", f"{header}.{_b64url(json.dumps(claims).encode())}.{_b64url(rng.randbytes(32))}"
    if kind == 13 and rng.random() < 0.3:  # a short plain word someone names as their own password
        return rng.choice(("my password: {}", "our wifi password is {}.", "My PIN password is {}")), \
            rng.choice(("letmein", "sunshine", "dragon", "monkey", "football", "princess", "qwerty", "trustno"))
    shape = rng.choice(('DB_PASSWORD="{}"', "password={}", '{{"user": "admin", "password": "{}"}}',
                        "my password is {} but it does not work", "api_key: '{}'"))
    return shape, fake.password(length=rng.randrange(10, 18))


def negative(rng: random.Random, fake: Faker) -> str:
    def not_luhn() -> str:
        digits = [rng.choice("3456")] + [str(rng.randrange(10)) for _ in range(14)]
        total = sum(int(d) * (2 if i % 2 == 0 else 1) // 10 + int(d) * (2 if i % 2 == 0 else 1) % 10
                    for i, d in enumerate(reversed(digits)))
        good = (10 - total % 10) % 10
        return "".join(digits) + str((good + rng.randrange(1, 10)) % 10)
    fields = {
        "order": str(rng.randrange(10**6, 10**10)), "year": str(rng.randrange(2015, 2027)),
        "n5": f"{rng.randrange(10**5):05d}", "n3": str(rng.randrange(1, 999)), "n2": str(rng.randrange(2, 99)),
        "ver": f"{rng.randrange(10)}.{rng.randrange(30)}.{rng.randrange(20)}",
        "py": f"3.{rng.randrange(6, 14)}.{rng.randrange(12)}", "date": fake.date(),
        "date2": fake.date(pattern=rng.choice(("%d.%m.%Y", "%m/%d/%Y", "%d/%m/%Y"))),
        "date3": fake.date(pattern="%d %B %Y"), "time": fake.time(pattern=rng.choice(("%H:%M", "%H:%M:%S"))),
        "price": rng.choice((fake.pricetag(), f"{rng.randrange(1, 99999):,}.{rng.randrange(100):02d} EUR",
                             f"¥{rng.randrange(100, 10**6):,}")),
        "ups": "1Z" + _rand(rng, string.ascii_uppercase + string.digits, 16),
        "usps": " ".join(_rand(rng, string.digits, 4) for _ in range(5)) + " " + _rand(rng, string.digits, 2),
        "fedex": _rand(rng, string.digits, 12), "uuid": fake.uuid4(), "isbn13": fake.isbn13(),
        "isbn10": fake.isbn10(), "fake_card": not_luhn(), "postcode": fake.postcode(), "sha": fake.sha1(),
        "md5": fake.md5(), "count": str(rng.randrange(10**5, 10**9)), "count_sep": f"{rng.randrange(10**5, 10**9):,}",
    }
    return rng.choice(NEGATIVES).format(**fields)


def positive(category: str, rng: random.Random, fake: Faker) -> tuple[str, str]:
    """(template, value) for one labelled value of `category`."""
    if category == "email":
        value = rng.choice((fake.email, fake.free_email, fake.company_email, fake.ascii_safe_email))()
    elif category == "phone":
        value = fake.phone_number()
    elif category == "card":
        value = fake.credit_card_number()
        if rng.random() < 1 / 3:
            value = rng.choice((" ", "-")).join(value[i:i + 4] for i in range(0, len(value), 4))
    elif category == "iban":
        value = fake.iban()
        if rng.random() < 0.5:
            value = rng.choice((" ", "-")).join(value[i:i + 4] for i in range(0, len(value), 4))
    elif category == "ip":
        value = rng.choice((fake.ipv4, fake.ipv4_private, fake.ipv6))()
    else:
        template, value = make_secret(rng, fake)
        if template:
            return template, value
    if category in ("phone", "card") and rng.random() < 0.1:  # typed on a CJK keyboard: fullwidth digits
        value = value.translate(FULLWIDTH)
    return rng.choice(TEMPLATES[category]), value


def build(per_locale: int, negatives_per_locale: int, seed: int) -> list[tuple[str, list[tuple[str, int, int]]]]:
    """Messages of 2-6 sentences, each message with its labelled spans (category, start, end)."""
    rng = random.Random(seed)
    sentences: list[tuple[str, list[tuple[str, int, int]]]] = []
    for i, locale in enumerate(LOCALES):
        fake = Faker(locale)
        fake.seed_instance(seed * 1000 + i)
        for category in CATEGORIES:
            if category == "iban" and locale in IBAN_SKIP:
                continue
            for _ in range(per_locale):
                template, value = positive(category, rng, fake)
                before = template.split("{}")[0].replace("{{", "{")
                sentence, span = template.format(value), (len(before), len(before) + len(value))
                assert sentence[span[0]:span[1]] == value, (template, value)  # the label is where the value is
                sentences.append((sentence, [(category, *span)]))
        sentences += [(negative(rng, fake), []) for _ in range(negatives_per_locale)]
    rng.shuffle(sentences)
    messages = []
    while sentences:
        take = sentences[:rng.randrange(2, 7)]
        del sentences[:len(take)]
        text, labels = "", []
        for s, spans in take:
            if text:
                text += rng.choice((" ", "\n", "\n\n"))
            labels += [(c, len(text) + a, len(text) + b) for c, a, b in spans]
            text += s
        messages.append((text, labels))
    return messages


def score(detector: Detector, messages: list, show: int) -> dict:
    per = {c: {"tp": 0, "fp": 0, "fn": 0, "found": 0, "support": 0, "misses": [], "false": []} for c in CATEGORIES}
    for text, labels in messages:
        found = detector.detect(text)
        for c, a, b in labels:
            cell = per[c]
            cell["support"] += 1
            if any(f.category == c and f.start < b and a < f.end for f in found):
                cell["found"] += 1
            else:
                cell["fn"] += 1
                if len(cell["misses"]) < show:
                    cell["misses"].append(text[a:b])
        for f in found:
            cell = per[f.category]
            if any(c == f.category and f.start < b and a < f.end for c, a, b in labels):
                cell["tp"] += 1
            else:
                cell["fp"] += 1
                if len(cell["false"]) < show:
                    cell["false"].append(text[max(0, f.start - 25):f.end + 10].replace("\n", " "))
    for c, cell in per.items():
        detections = cell["tp"] + cell["fp"]
        cell["precision"] = round(cell["tp"] / detections, 4) if detections else None
        cell["recall"] = round(cell["found"] / cell["support"], 4) if cell["support"] else None
    return per


def log_text(rng: random.Random, kb: int) -> str:
    """A log-like text of about `kb` KB: ids, dates, decimals, order numbers and private IPs on every line."""
    lines, size = [], 0
    while size < kb * 1024:
        line = (f"row {rng.randint(1, 99999)}: id={rng.randint(10**6, 10**9)} t=2026-11-{rng.randint(1, 28):02d} "
                f"v={rng.random():.4f} order #{rng.randint(10**5, 10**7)} host 10.0.{rng.randint(0, 255)}."
                f"{rng.randint(1, 254)}\n")
        lines.append(line)
        size += len(line)
    return "".join(lines)


def us_per_kb(detector: Detector, texts: list[str]) -> float:
    """The cost of a first scan: each round asks a fresh detector (one remembers the texts it has seen)."""
    kb = sum(len(t.encode()) for t in texts) / 1024
    best = float("inf")
    for _ in range(3):
        fresh = Detector(detector.categories, detector.phone_regions)
        t0 = time.perf_counter()
        for t in texts:
            fresh.detect(t)
        best = min(best, time.perf_counter() - t0)
    return round(best / kb * 1e6, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--per-locale", type=int, default=100, help="labelled values per category per locale")
    p.add_argument("--negatives", type=int, default=200, help="hard-negative sentences per locale")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--show", type=int, default=5, help="misses and false detections kept per category")
    p.add_argument("--out", type=Path, default=RESULTS / "pii.json")
    args = p.parse_args(argv)
    prov = provenance.stamp()
    t0 = time.monotonic()
    detector = Detector()
    messages = build(args.per_locale, args.negatives, args.seed)
    per = score(detector, messages, args.show)
    prose_fake = Faker("en_US")
    prose_fake.seed_instance(args.seed)
    prose = [prose_fake.paragraph(nb_sentences=8) for _ in range(200)]
    cost = {"labelled_us_per_kb": us_per_kb(detector, [t for t, _ in messages]),
            "prose_us_per_kb": us_per_kb(detector, prose),
            # one large tool output, dense with numbers and addresses: what a long text costs at once
            "log_100kb_us_per_kb": us_per_kb(detector, [log_text(random.Random(args.seed), 100)]),
            "labelled_kb": round(sum(len(t.encode()) for t, _ in messages) / 1024, 1)}
    measured = all(cell["support"] and cell["precision"] is not None for cell in per.values())
    met = {}
    for c, cell in per.items():
        met[f"{c} precision"] = cell["precision"] is not None and cell["precision"] >= PRECISION_TARGET
        if c in RECALL_TARGET:
            met[f"{c} recall"] = cell["recall"] is not None and cell["recall"] >= RECALL_TARGET[c]
    res = {"provenance": prov, "pass": measured and all(met.values()), "measured": measured,
           "targets": {"recall": RECALL_TARGET, "precision": PRECISION_TARGET}, "met": met,
           "per_category": per, "cost": cost, "messages": len(messages),
           "phone_regions": list(detector.phone_regions), "locales": list(LOCALES),
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    res["wall_s"] = round(time.monotonic() - t0, 1)
    print(f"{'category':<8} {'precision':>9} {'recall':>7} {'support':>7} {'tp':>5} {'fp':>4} {'fn':>4}  targets")
    for c, cell in per.items():
        marks = [f"P>={PRECISION_TARGET} {'met' if met[f'{c} precision'] else 'MISSED'}"]
        if c in RECALL_TARGET:
            marks.append(f"R>={RECALL_TARGET[c]} {'met' if met[f'{c} recall'] else 'MISSED'}")
        shown = ["-" if v is None else f"{v:.3f}" for v in (cell["precision"], cell["recall"])]
        print(f"{c:<8} {shown[0]:>9} {shown[1]:>7} {cell['support']:>7} {cell['tp']:>5} {cell['fp']:>4} "
              f"{cell['fn']:>4}  {', '.join(marks)}")
    for c, cell in per.items():
        for m in cell["misses"]:
            print(f"  {c} missed: {m!r}")
        for m in cell["false"]:
            print(f"  {c} false: {m!r}")
    print(f"\ncost: {cost['labelled_us_per_kb']} us/KB on the labelled messages ({cost['labelled_kb']} KB), "
          f"{cost['prose_us_per_kb']} us/KB on PII-free prose, {cost['log_100kb_us_per_kb']} us/KB on one 100 KB log")
    missed = ", ".join(k for k, v in met.items() if not v)
    verdict = ("could not measure (a category had no span or no detection)" if not measured
               else "PASS: every target met" if res["pass"] else f"FAIL: {missed} MISSED")
    print(f"overall: {verdict} in {res['wall_s']:.1f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")
    return 2 if not measured else (0 if res["pass"] else 1)


if __name__ == "__main__":
    sys.exit(main())
