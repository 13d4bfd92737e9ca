"""The simulated users' question bank: questions with known answers, and how a reply is graded (pure).

Four kinds of `Item`: "fact" (the capital of Italy → Rome), "arithmetic" (7 times 8 → 56),
"conversion" (3 kilometres in metres → 3000) and "definition" (frozen water → ice). Facts and
definitions are listed here and in facts.jsonl and screened.jsonl (`MORE`, `SCREENED`: 869 easy
ones, each with a `paraphrase`, the same question in other words); arithmetic and conversions are
generated from the seed. Each item has its accepted answers (the first is canonical), `fact` (the
answer in words, for a correction that carries it) and `distractors` (the wrong candidates a hedging
reply would list).

`split(seed)` deals every kind's items into TRAIN and EVAL (held out) by a seeded shuffle: half each,
no question and no (kind, accepted answer) in both. TRAIN and EVAL are the split at SEED.

Grading (`grade`) compares normalised token sequences (`normalise`):
- Unicode is decomposed and accents dropped, case folded, curly apostrophes made straight,
  "n't" read as " not"; a comma between digits before exactly three digits is a thousands
  separator ("100,000" is "100000"); punctuation and spaces separate tokens, so do digits and
  letters ("3000m" is "3000 m", "H2O" is "h 2 o"); a decimal point between digits is kept
  ("1833.77" is one token, never "1833"); a minus sign is punctuation ("-5" reads "5").
- The articles "a", "an", "the" are dropped.
- Number words under a billion become digits: "twelve" → "12", "twenty-four" → "24", "one hundred
  and five" → "105", "a thousand" → "1000", "3 thousand" → "3000". A run of number words that
  cannot be one number splits ("one two" is "1 2"). Ordinals and fractions are words as they are.
  "one" is always a number ("no one" reads "no 1"), so no item's answer or distractor is 1.
- An answer is *named* when its tokens occur whole and contiguous in the reply's ("Au" is not in
  "Austria" or "aunt", "12" is not in "120" or "12.5"), not right after a negation ("not",
  "no", "never", "nor", "neither"): "not Rome" does not name Rome; "Rome, not Milan" names Rome
  and not Milan. A negation further away is not seen ("Rome is not it" names Rome).
- "correct": an accepted answer is named and no distractor is. "several": an accepted answer and a
  distractor are named (a hedge, a list of planets; also a comparison such as "Jupiter is bigger
  than Saturn", deliberately). "wrong": a distractor and no accepted answer. "missing": neither.
"""
from __future__ import annotations

import functools
import json
import random
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from clawd.quoting import APOSTROPHES

KINDS = ("fact", "arithmetic", "conversion", "definition")
CORRECT, SEVERAL, WRONG, MISSING = "correct", "several", "wrong", "missing"
SEED = 0
ARTICLES = frozenset({"a", "an", "the"})
NEGATIONS = frozenset({"not", "no", "never", "nor", "neither"})

_SMALL = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
          "sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_UNITS = {w: i for i, w in enumerate(_SMALL[:10])}
_TEENS = {w: i + 10 for i, w in enumerate(_SMALL[10:])}
_TEN = {w: i * 10 for i, w in enumerate(_TENS) if i >= 2}
_SCALES = {"thousand": 1000, "million": 1_000_000}
_NOT = re.compile(r"n't\b")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TOKEN = re.compile(r"\d+(?:\.\d+)?|[^\W\d_]+")


def number_words(n: int) -> str:
    """0 <= n < 1,000,000 in English words: 24 → "twenty-four", 3000 → "three thousand"."""
    if not 0 <= n < 1_000_000:
        raise ValueError(f"{n} is out of range")
    if n < 20:
        return _SMALL[n]
    if n < 100:
        return _TENS[n // 10] + (f"-{_SMALL[n % 10]}" if n % 10 else "")
    if n < 1000:
        return f"{_SMALL[n // 100]} hundred" + (f" {number_words(n % 100)}" if n % 100 else "")
    return f"{number_words(n // 1000)} thousand" + (f" {number_words(n % 1000)}" if n % 1000 else "")


def _read_number(words: list[str], i: int) -> tuple[int, int] | None:
    """(value, index after it) of the number that words[i:] starts with in words, else None."""
    total, group, last, j = 0, 0, None, i
    if words[i].isdigit() and i + 1 < len(words) and words[i + 1] in ("hundred", *_SCALES):
        group, last, j = int(words[i]), "digits", i + 1
    while j < len(words):
        w = words[j]
        if w in _UNITS and (last in (None, "ten", "hundred", "scale") and (w != "zero" or last is None)):
            group, last = group + _UNITS[w], "unit"
        elif (w in _TEENS or w in _TEN) and last in (None, "hundred", "scale"):
            group, last = group + _TEENS.get(w, _TEN.get(w, 0)), "teen" if w in _TEENS else "ten"
        elif w == "hundred" and last in (None, "unit", "teen", "digits") and group < 100:
            group, last = (group or 1) * 100, "hundred"
        elif w in _SCALES and last != "scale" and total < _SCALES[w]:
            total, group, last = total + (group or 1) * _SCALES[w], 0, "scale"
        elif not (w == "and" and last in ("hundred", "scale") and j + 1 < len(words)
                  and (words[j + 1] in _UNITS or words[j + 1] in _TEENS or words[j + 1] in _TEN)):
            break
        j += 1
    if j == i or last == "digits":
        return None
    return total + group, j


def normalise(text: str) -> tuple[str, ...]:
    """The text as the tokens grading compares (see the module's docstring)."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).translate(APOSTROPHES).casefold()
    text = _THOUSANDS.sub("", _NOT.sub(" not", text))
    words = [w for w in _TOKEN.findall(text) if w not in ARTICLES]
    out, i = [], 0
    while i < len(words):
        number = _read_number(words, i)
        if number is None:
            out.append(words[i])
            i += 1
        else:
            out.append(str(number[0]))
            i = number[1]
    return tuple(out)


def _occurs(phrase: tuple[str, ...], tokens: tuple[str, ...]) -> bool:
    n = len(phrase)
    return any(tokens[k:k + n] == phrase for k in range(len(tokens) - n + 1))


def names(tokens: tuple[str, ...], phrase: str) -> bool:
    """Does the normalised reply name `phrase`: its tokens, whole and contiguous, not right after a negation?"""
    want, n = normalise(phrase), len(normalise(phrase))
    return any(tokens[k:k + n] == want and (k == 0 or tokens[k - 1] not in NEGATIONS)
               for k in range(len(tokens) - n + 1))


@dataclass(frozen=True)
class Item:
    """One question with a known answer."""
    question: str
    answers: tuple[str, ...]      # accepted, the first canonical
    kind: str
    fact: str                     # "the capital of Italy is Rome": what a correction that carries the answer says
    distractors: tuple[str, ...] = ()
    paraphrase: str = ""          # the question in other words ("Which city is Spain's capital?"), or ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.question!r}: kind {self.kind!r} is not one of {KINDS}")
        asked = [normalise(self.question)] + ([normalise(self.paraphrase)] if self.paraphrase else [])
        if self.paraphrase and self.paraphrase == self.question:
            raise ValueError(f"{self.question!r}: the paraphrase is the question")
        for a in self.answers + self.distractors:
            if not normalise(a):
                raise ValueError(f"{self.question!r}: {a!r} has no tokens")
            if any(_occurs(normalise(a), said) for said in asked):  # an echo must not name an answer or distractor
                raise ValueError(f"{self.question!r}: the question or its paraphrase names {a!r}")
        for d in self.distractors:
            if any(_occurs(normalise(d), normalise(a)) or _occurs(normalise(a), normalise(d)) for a in self.answers):
                raise ValueError(f"{self.question!r}: distractor {d!r} overlaps an accepted answer")
        if not self.answers:
            raise ValueError(f"{self.question!r}: no accepted answer")

    @property
    def answer(self) -> str:
        return self.answers[0]

    @property
    def key(self) -> tuple[str, tuple[str, ...]]:
        """(kind, normalised canonical answer): what no two items of the bank share."""
        return self.kind, normalise(self.answer)


def grade(item: Item, text: str) -> str:
    """CORRECT, SEVERAL, WRONG or MISSING (see the module's docstring)."""
    tokens = normalise(text)
    named = any(names(tokens, a) for a in item.answers)
    other = any(names(tokens, d) for d in item.distractors)
    if named:
        return SEVERAL if other else CORRECT
    return WRONG if other else MISSING


def is_correct(item: Item, text: str) -> bool:
    return grade(item, text) == CORRECT


# --- the listed kinds: question | accepted answers | fact | distractors ("|" separates aliases) -----------

FACTS = (
    ("What is the capital of Italy?", "Rome", "the capital of Italy is Rome", "Milan|Naples|Venice|Florence|Turin"),
    ("What is the largest planet in the solar system?", "Jupiter", "Jupiter is the largest planet in the solar system",
     "Saturn|Neptune|Uranus|Mars|Venus|Mercury"),
    ("What is the chemical symbol for gold?", "Au", "the chemical symbol for gold is Au", "Ag|Fe|Cu|Pb|Gd"),
    ("What is the capital of France?", "Paris", "the capital of France is Paris", "Lyon|Marseille|Nice"),
    ("What is the capital of Japan?", "Tokyo", "the capital of Japan is Tokyo", "Kyoto|Osaka|Yokohama"),
    ("What is the capital of Australia?", "Canberra", "the capital of Australia is Canberra", "Sydney|Melbourne|Perth"),
    ("What is the capital of Canada?", "Ottawa", "the capital of Canada is Ottawa", "Toronto|Montreal|Vancouver"),
    ("Who wrote Romeo and Juliet?", "Shakespeare|William Shakespeare",
     "Romeo and Juliet was written by William Shakespeare", "Marlowe|Dickens|Chaucer|Milton"),
    ("How many legs does a spider have?", "8|eight", "a spider has eight legs", "10|12"),
    ("Which planet is known as the Red Planet?", "Mars", "Mars is known as the Red Planet", "Venus|Jupiter|Mercury|Saturn"),
    ("What is the chemical symbol for iron?", "Fe", "the chemical symbol for iron is Fe", "Ir|Au|Ag|Cu"),
    ("What is the chemical symbol for silver?", "Ag", "the chemical symbol for silver is Ag", "Au|Si|Sv|Fe"),
    ("How many continents are there?", "7|seven", "there are seven continents", "5|6|8"),
    ("What is the largest ocean on Earth?", "Pacific|Pacific Ocean", "the Pacific is the largest ocean on Earth",
     "Atlantic|Indian|Arctic|Southern"),
    ("What is the tallest animal?", "giraffe|giraffes", "the giraffe is the tallest animal", "elephant|camel|ostrich"),
    ("What language is mainly spoken in Brazil?", "Portuguese", "the main language of Brazil is Portuguese",
     "Spanish|French|English"),
    ("What do bees make from nectar?", "honey", "bees make honey from nectar", "milk|jam|syrup"),
    ("How many days are in a leap year?", "366", "a leap year has 366 days", "364|367|360"),
    ("How many hours are in a day?", "24", "a day has 24 hours", "12|36|48"),
    ("What is the boiling point of water in degrees Celsius at sea level?", "100",
     "water boils at 100 degrees Celsius at sea level", "90|50|80"),
    ("At what temperature in degrees Celsius does water freeze?", "0|zero", "water freezes at 0 degrees Celsius", "4|10"),
    ("What gas do plants take in from the air to make food?", "carbon dioxide|CO2",
     "plants take in carbon dioxide from the air", "nitrogen|hydrogen|helium"),
    ("What is the hardest natural substance?", "diamond|diamonds", "diamond is the hardest natural substance",
     "gold|iron|quartz|steel"),
    ("Which organ pumps blood through the body?", "heart", "the heart pumps blood through the body",
     "liver|lungs|kidney|kidneys|brain"),
    ("What is the largest mammal?", "blue whale|blue whales", "the blue whale is the largest mammal", "elephant|giraffe"),
    ("How many sides does a hexagon have?", "6|six", "a hexagon has six sides", "5|7|8"),
    ("What is the capital of Spain?", "Madrid", "the capital of Spain is Madrid", "Barcelona|Seville|Valencia"),
    ("What is the capital of Germany?", "Berlin", "the capital of Germany is Berlin", "Munich|Hamburg|Frankfurt|Bonn"),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci|da Vinci|Leonardo", "the Mona Lisa was painted by Leonardo da Vinci",
     "Michelangelo|Raphael|Picasso|Van Gogh"),
    ("What is the smallest prime number?", "2|two", "the smallest prime number is 2", "3|5"),
    ("What is the chemical formula for water?", "H2O", "the chemical formula for water is H2O", "CO2|NaCl"),
    ("What is the fastest land animal?", "cheetah|cheetahs", "the cheetah is the fastest land animal",
     "lion|horse|antelope|leopard"),
    ("What colour do you get by mixing blue and yellow?", "green", "blue and yellow make green", "purple|orange|brown"),
    ("Which planet is closest to the Sun?", "Mercury", "Mercury is the planet closest to the Sun", "Venus|Mars"),
    ("What is the capital of Egypt?", "Cairo", "the capital of Egypt is Cairo", "Alexandria|Giza|Luxor"),
    ("Who developed the theory of relativity?", "Einstein|Albert Einstein",
     "the theory of relativity was developed by Albert Einstein", "Newton|Darwin|Bohr|Galileo"),
    ("What is the longest river in Africa?", "Nile", "the Nile is the longest river in Africa", "Congo|Niger|Zambezi"),
    ("What language is mainly spoken in Mexico?", "Spanish", "the main language of Mexico is Spanish",
     "Portuguese|English|French"),
    ("How many strings does a violin have?", "4|four", "a violin has four strings", "5|6"),
    ("What is the capital of China?", "Beijing|Peking", "the capital of China is Beijing", "Shanghai|Hong Kong|Guangzhou"),
    ("How many players does a soccer team have on the field?", "11|eleven", "a soccer team has eleven players on the field",
     "9|10|12"),
    ("What is the largest country by area?", "Russia", "Russia is the largest country by area",
     "Canada|China|United States|USA|Brazil"),
    ("Which gas do humans need to breathe to live?", "oxygen", "humans need oxygen to live", "nitrogen|helium|hydrogen"),
    ("What is the capital of the United Kingdom?", "London", "the capital of the United Kingdom is London",
     "Manchester|Edinburgh|Birmingham"),
)

DEFINITIONS = (
    ("What do we call frozen water?", "ice", "frozen water is called ice", "steam|vapour|vapor"),
    ("What is the process plants use to make food from sunlight?", "photosynthesis",
     "plants make food from sunlight by photosynthesis", "respiration|transpiration|digestion|fermentation"),
    ("What do we call an animal that eats only plants?", "herbivore|herbivores", "an animal that eats only plants is a herbivore",
     "carnivore|carnivores|omnivore|omnivores"),
    ("What do we call meat-eating animals such as lions and wolves?", "carnivore|carnivores",
     "meat-eating animals are called carnivores",
     "herbivore|herbivores|omnivore|omnivores"),
    ("What is the word for a shape with three sides?", "triangle|triangles", "a shape with three sides is a triangle",
     "square|pentagon|rectangle"),
    ("What do we call a baby dog?", "puppy|puppies|pup", "a baby dog is called a puppy", "kitten|calf|cub"),
    ("What do we call a baby cat?", "kitten|kittens", "a baby cat is called a kitten", "puppy|cub|calf"),
    ("What is the name for a word that means the opposite of another word?", "antonym|antonyms",
     "a word with the opposite meaning is an antonym", "synonym|synonyms|homonym"),
    ("What is the name for a word with the same meaning as another word?", "synonym|synonyms",
     "a word with the same meaning is a synonym", "antonym|antonyms|homonym"),
    ("What do we call the study of living things?", "biology", "the study of living things is called biology",
     "chemistry|physics|geology"),
    ("What do we call the study of rocks and the Earth's structure?", "geology",
     "the study of rocks and the Earth's structure is called geology", "biology|astronomy|chemistry"),
    ("What do we call the force that pulls objects toward the ground?", "gravity|gravitation",
     "the force that pulls objects toward the ground is called gravity", "magnetism|friction|inertia"),
    ("What do we call a person who designs buildings?", "architect|architects", "a person who designs buildings is an architect",
     "engineer|builder|carpenter"),
    ("What is the name for a group of wolves?", "pack", "a group of wolves is called a pack", "herd|flock|pride"),
    ("What do we call a scientist who studies stars and planets?", "astronomer|astronomers",
     "a scientist who studies stars and planets is an astronomer", "astrologer|astronaut|geologist"),
    ("What is the name for molten rock that comes out of a volcano?", "lava",
     "molten rock that comes out of a volcano is called lava", "ash|basalt|granite"),
    ("What is the name for a period of ten years?", "decade|decades", "a period of ten years is a decade",
     "century|millennium"),
    ("What is the name for a period of one hundred years?", "century|centuries", "a period of one hundred years is a century",
     "decade|millennium"),
    ("What do we call a doctor who treats teeth?", "dentist|dentists", "a doctor who treats teeth is a dentist",
     "surgeon|optician|nurse"),
    ("What do we call the imaginary line around the middle of the Earth?", "equator",
     "the imaginary line around the middle of the Earth is the equator", "meridian|tropic"),
    ("What do we call an animal that is active at night?", "nocturnal", "an animal that is active at night is nocturnal",
     "diurnal|crepuscular"),
    ("What is the name for a number that can only be divided by 1 and itself?", "prime|prime number|prime numbers",
     "a number divisible only by 1 and itself is a prime number", "composite|even"),
    ("What do we call the amount of space an object takes up?", "volume", "the amount of space an object takes up is its volume",
     "mass|weight|density|area"),
    ("What do we call a word that describes a noun?", "adjective|adjectives", "a word that describes a noun is an adjective",
     "adverb|verb|pronoun"),
    ("What do we call a word for an action?", "verb|verbs", "a word for an action is a verb", "noun|adjective|adverb"),
    ("What do we call the outer layer of the Earth?", "crust", "the outer layer of the Earth is the crust", "mantle|core"),
    ("What do we call an area of land surrounded by water?", "island|islands", "land surrounded by water is an island",
     "peninsula|continent|lake"),
    ("What is the name for animals that carry their young in a pouch?", "marsupial|marsupials",
     "animals that carry their young in a pouch are marsupials", "reptile|reptiles|amphibian|amphibians"),
    ("What do we call a scientist who studies the past through old objects?", "archaeologist|archaeologists|archeologist",
     "a scientist who studies the past through old objects is an archaeologist", "historian|geologist|paleontologist"),
    ("What do we call the change from liquid water to water vapour?", "evaporation",
     "the change from liquid water to water vapour is evaporation", "condensation|precipitation|freezing"),
    ("What do we call a book about someone's life written by someone else?", "biography|biographies",
     "a book about someone's life written by someone else is a biography", "autobiography|novel|memoir"),
    ("What do we call a word that sounds like the sound it describes, such as buzz?", "onomatopoeia",
     "a word that sounds like what it describes is an onomatopoeia", "alliteration|metaphor|simile"),
)

# from, to, factor: "How many {to} are in {n} {from}?"
CONVERSIONS = (
    ("kilometres", "metres", 1000), ("metres", "centimetres", 100), ("hours", "minutes", 60),
    ("minutes", "seconds", 60), ("days", "hours", 24), ("weeks", "days", 7), ("kilograms", "grams", 1000),
    ("litres", "millilitres", 1000), ("centimetres", "millimetres", 10), ("years", "months", 12),
)
GENERATED = {"arithmetic": 40, "conversion": 40}
# More facts and definitions, each with a paraphrase: easy general knowledge (a small model answers many),
# so that a correctness guard has enough questions the base model gets right, and a corrections user can
# be probed on its facts reworded. One JSON object a line: kind, question, paraphrase, answers, fact, distractors.
MORE = Path(__file__).with_name("facts.jsonl")
# More of the same, each kept only because SmolLM2 answered it right greedily. The users ask them like any
# other, but a correctness guard leaves them out: chosen because version 0 was right, they can only be lost,
# so any change of weights reads on them as lost knowledge (docs/OPERATING.md, "What it shows today").
SCREENED = Path(__file__).with_name("screened.jsonl")


def _more() -> tuple[Item, ...]:
    return _read_items(MORE) + _read_items(SCREENED)


@functools.cache  # read once: bank(), every split and FROM_MORE share it (Items are frozen)
def _read_items(path: Path) -> tuple[Item, ...]:
    items = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            row = json.loads(line)
            if set(row) != {"kind", "question", "paraphrase", "answers", "fact", "distractors"}:
                raise ValueError(f"{path}:{n}: keys {sorted(row)}")
            items.append(Item(row["question"], tuple(row["answers"]), row["kind"], row["fact"],
                              tuple(row["distractors"]), row["paraphrase"]))
    return tuple(items)


def _numeric(question: str, n: int, kind: str, fact: str, wrong: set[int], said: set[int]) -> Item:
    answers = (str(n), f"{n:,}", number_words(n)) if n >= 1000 else (str(n), number_words(n))
    return Item(question, answers, kind, fact, tuple(str(w) for w in sorted(wrong - said - {n}) if w > 1))


def _arithmetic(rng: random.Random) -> Item:
    op = rng.choice(("plus", "minus", "times"))
    if op == "times":
        a, b = rng.randint(3, 12), rng.randint(3, 12)
        n, wrong = a * b, {a * b + 1, a * b - 1, a * (b + 1), (a + 1) * b, a + b}
    elif op == "plus":
        a, b = rng.randint(11, 89), rng.randint(11, 89)
        n, wrong = a + b, {a + b + 1, a + b - 1, a + b + 10, a + b - 10, abs(a - b)}
    else:
        a = rng.randint(30, 99)
        b = rng.randint(11, a - 11)
        while a - b == b:  # the question would name its own answer
            b = rng.randint(11, a - 11)
        n, wrong = a - b, {a - b + 1, a - b - 1, a - b + 10, a - b - 10, a + b}
    return _numeric(f"What is {a} {op} {b}?", n, "arithmetic", f"{a} {op} {b} is {n}", wrong, {a, b})


def _conversion(rng: random.Random) -> Item:
    src, dst, factor = rng.choice(CONVERSIONS)
    k = rng.randint(2, 9)
    n = k * factor
    wrong = {k * factor * 10, k * 100 if factor != 100 else k * 10, k * factor + factor, k * factor - factor}
    if n % 10 == 0:
        wrong.add(n // 10)
    return _numeric(f"How many {dst} are in {k} {src}?", n, "conversion", f"{k} {src} is {n:,} {dst}", wrong,
                    {k, factor})


def _generated(kind: str, seed: int) -> list[Item]:
    rng, items, keys = random.Random(f"{seed}:{kind}"), [], set()
    make = _arithmetic if kind == "arithmetic" else _conversion
    while len(items) < GENERATED[kind]:
        item = make(rng)
        if item.key not in keys:
            keys.add(item.key)
            items.append(item)
    return items


def _listed(kind: str, rows: tuple[tuple[str, str, str, str], ...]) -> list[Item]:
    return [Item(q, tuple(a.split("|")), kind, fact, tuple(d.split("|")) if d else ()) for q, a, fact, d in rows]


def bank(seed: int = SEED) -> dict[str, list[Item]]:
    """Every item, by kind (facts and definitions as listed here and in MORE; arithmetic and conversions
    from the seed). Raises ValueError when two items of a kind share a canonical answer or a question."""
    more = _more()
    out = {"fact": _listed("fact", FACTS) + [i for i in more if i.kind == "fact"],
           "arithmetic": _generated("arithmetic", seed), "conversion": _generated("conversion", seed),
           "definition": _listed("definition", DEFINITIONS) + [i for i in more if i.kind == "definition"]}
    for kind, items in out.items():
        if len({i.key for i in items}) < len(items):
            raise ValueError(f"two {kind} items share a canonical answer")
    asked = [q for items in out.values() for i in items for q in (i.question, i.paraphrase) if q]
    if len(set(asked)) < len(asked):
        raise ValueError("a question or paraphrase is asked twice in the bank")
    return out


def split(seed: int = SEED) -> tuple[tuple[Item, ...], tuple[Item, ...]]:
    """(train, eval): each kind's items shuffled with the seed, the first half to train, the rest held out."""
    train, held = [], []
    for kind, items in bank(seed).items():
        order = list(items)
        random.Random(f"{seed}:split:{kind}").shuffle(order)
        train += order[:len(order) // 2]
        held += order[len(order) // 2:]
    return tuple(train), tuple(held)


TRAIN, EVAL = split(SEED)


def listed_facts(seed: int = SEED) -> list[Item]:
    """The facts listed here (not MORE's) in the order `split` dealt them before MORE existed: what the OPD
    signal measurements (tests/test_opd_signal.py, bench/opd_signal.py) were taken on, kept comparable."""
    order = _listed("fact", FACTS)
    random.Random(f"{seed}:split:fact").shuffle(order)
    return order
# The items of MORE and SCREENED: the style and corrections users ask them; the older substance personas
# keep to the items listed above and generated (their catalogue and its tests predate MORE).
FROM_MORE = frozenset(i.question for i in _more())
FROM_SCREENING = frozenset(i.question for i in _read_items(SCREENED))


def of_kinds(items: tuple[Item, ...], kinds: tuple[str, ...]) -> tuple[Item, ...]:
    """The items of these kinds, kinds interleaved (a persona's first questions cover all its kinds)."""
    groups = [[i for i in items if i.kind == k] for k in kinds]
    if unknown := set(kinds) - set(KINDS):
        raise ValueError(f"unknown kinds {sorted(unknown)}")
    return tuple(i for row in zip(*groups) for i in row) + tuple(
        i for g in groups for i in g[min(map(len, groups)):])
