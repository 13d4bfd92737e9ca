"""Simulated users' personas: what they ask, what they want from a reply, the words they answer with (pure).

Two catalogues. `PERSONAS` ask questions with known answers (clawd/tools/sim/questions.py):
- `concise` (the demo's user) wants one complete sentence that names what was asked, and judges the
  style alone: its answer is graded and reported beside, never rewarded (RL on one set of facts cannot
  teach other facts, so a reward that multiplies correctness in cannot show learning on held-out
  questions). The topic check makes a collapsed or wrong-topic reply fail it.
- `corrector` wants the right answer alone and its corrections carry the answer: what on-policy
  distillation can learn from; it is probed on paraphrases of its own questions (`probes`).
- brief, plain, terse, curious and pythonista want substance AND style: a reply satisfies only if it
  names the right answer (`questions.grade` is "correct") and meets the persona's preference. They
  keep to the bank's original items (not questions.MORE's).
`FORM_ONLY_PERSONAS` are the old users who judge form alone; kept as the documented example of
collapse: against them the demo's policy learnt answers such as "The answer is a planet." (short, no
list, thanked) and went from 38 % to 100 % satisfied while saying nothing.

Preferences (`kind`/`param`): "under_words" N (fewer than N words), "no_lists", "a_list", "ends_with_question",
"uses_term" TERM, "one_sentence" (`one_sentence`), "answer" (none: the right answer alone). Every persona first wants an answer at all: a reply under `min_words` words
(MIN_WORDS unless said otherwise) never satisfies (an empty reply must never be the easy way to be
thanked for brevity); `plain` wants at least 8.

The words are written for clawd's `rules` judge (clawd/scoring/judging.py): every thank-you
matches a positive phrase and no negative one; every correction opens with "No," (a negative
phrase), so the judge scores the reply -1 and keeps the whole correction as the hint. A substance
persona's correction says what was wrong: the answer (missing, wrong, or hedged among several, and
with `tells_answer` the answer itself: "No, that doesn't answer it: the capital of Italy is Rome.")
before the style ("Please answer in under 20 words."); a right answer in the wrong style gets the
style correction alone, as the form-only personas word it. tests/test_sim.py and
tests/test_personas.py check each message against `rules_vote`.

A substance persona judges a reply to a question: `satisfied(text, question)`, `correction(text,
question)`, `follow_up(..., question=...)`, `grade(text, question)`, the question as its text or its
`Item`; called without one they raise. Its `questions` are TRAIN items; `held_out` are EVAL items of
the same kinds (never asked in sessions), for evaluation probes (`probe_question`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

from clawd.tools.sim import questions as bank
from clawd.tools.sim.questions import CORRECT, MISSING, SEVERAL, WRONG, Item

MIN_WORDS = 3
NOT_AN_ANSWER = "No, that's not an answer. Please answer the question in a full sentence."
RIGHT_BUT_SHORT = "No, that's too short. Please answer in a full sentence."
OFF_TOPIC = "No, that doesn't answer what I asked."
FORM_PREFIX = "form:"  # persona("form:brief") is FORM_ONLY_PERSONAS["brief"]
KINDS = ("under_words", "no_lists", "a_list", "ends_with_question", "uses_term", "one_sentence", "answer")
PROBES = ("held_out", "paraphrases")

# A list item: a line that starts with a bullet, or with a number or letter and "." or ")".
_LIST_ITEM = re.compile(r"^\s*(?:[-*+\u2022\u25e6\u2013]|\d{1,3}[.)]|[a-zA-Z][.)])\s+\S", re.MULTILINE)
_CLOSERS = "\"'\u201d\u2019)]*_ \t\r\n"  # closing quotes, brackets and markup after a final "?"

THANKS = (
    "Thanks, that's just what I needed.",
    "Thank you, perfect.",
    "Great, thanks!",
    "Thanks, that works for me.",
)


def too_short(n: int) -> str:
    """The correction of an answer under a persona's own `min_words` (above MIN_WORDS)."""
    return f"No, that's too short. Please answer in full sentences, at least {n} words."


def word_count(text: str) -> int:
    """Words as a reader counts them: runs of non-space characters."""
    return len(text.split())


def has_list(text: str) -> bool:
    """Does the text hold a bulleted or numbered list (one item is enough)?"""
    return _LIST_ITEM.search(text) is not None


def ends_with_question(text: str) -> bool:
    """Is the last thing in the text a question mark (closing quotes and brackets aside)?"""
    return text.rstrip(_CLOSERS).endswith("?")


# A sentence ends at ".", "!" or "?" (closing quotes and brackets after it) followed by more text.
_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*\s+(?=\S)")
# Words too common to say what a question is about ("What is the capital of Spain?" is about capital, spain).
_FUNCTION_WORDS = frozenset((
    "what which who whom whose how many much why when where is are was were be been do does did done can could "
    "would should will shall may might must the a an of in on at to for from by with about as into than then "
    "and or but not no it its this that these those there their they them he she his her you your we our us "
    "me my i call called name named word term kind type usually most some any one").split())


def one_sentence(text: str) -> bool:
    """Is the text a single sentence that ends as a statement: no line break, no sentence end (".", "!" or
    "?" then more text) before the last, and a final "." or "!" (closers aside)? A reply cut off at the token
    limit mid-sentence has no final stop, so it is not one. Abbreviations ("Dr. Seuss") read as two sentences."""
    t = text.strip()
    return bool(t) and "\n" not in t and t.rstrip(_CLOSERS)[-1:] in (".", "!") and not _SENTENCE_END.search(t)


def topic_words(question: str) -> frozenset[str]:
    """The question's content words (questions.normalise tokens): not function words, 3+ letters or a number."""
    return frozenset(w for w in bank.normalise(question)
                     if w not in _FUNCTION_WORDS and (len(w) >= 3 or w.isdigit()))


def on_topic(text: str, question: str) -> bool:
    """Does the reply name one of the question's content words (a plural "s" either way)? "A kitten is a young
    cat." is on the topic of "What do we call a baby cat?"; "The answer is a planet." is not, nor is a reply
    about something else: a collapsed or wrong-topic answer fails a style that wants this."""
    said = set(bank.normalise(text))
    said |= {w[:-1] for w in said if w.endswith("s")} | {w + "s" for w in said}
    return bool(topic_words(question) & said)


def uses_term(text: str, term: str) -> bool:
    """Does the text use the term as a whole word, in any case?"""
    return re.search(r"(?<!\w)" + re.escape(term) + r"(?!\w)", text, re.IGNORECASE) is not None


class Grade(NamedTuple):
    """A reply judged: `answer` is questions.CORRECT/SEVERAL/WRONG/MISSING (None for a form-only persona),
    `styled` the preference and the word floor together (and the topic, for a persona that wants it),
    `wants_answer` whether the persona's thanks need the right answer too (a style-only persona's do not:
    its answer is graded, to report beside, never multiplied into its verdict)."""
    answer: str | None
    styled: bool
    wants_answer: bool = True

    @property
    def satisfied(self) -> bool:
        return self.styled and (not self.wants_answer or self.answer in (None, CORRECT))


@dataclass(frozen=True)
class Persona:
    """One kind of user: what it asks about and what it wants from every reply.

    kind/param: "under_words" N (fewer than N words), "no_lists", "a_list" (a bulleted or numbered list),
    "ends_with_question",
    "uses_term" TERM, "one_sentence" (one complete sentence), "answer" (no style: the right answer alone).
    A reply under `min_words` words is no answer to any of them.
    With `items` (questions with known answers) the persona asks those (`questions` are then the items'
    questions: pass `()`), `held_out` are its evaluation items, and it wants the right answer too unless
    `wants_answer` is False (a style-only user: the answer is graded and reported, never rewarded);
    `tells_answer` says whether a correction of a wrong answer says the right one. `on_topic`: the style
    also wants the reply to name a content word of the question (`on_topic`), so that a collapsed or
    wrong-topic reply fails it. `probes`: what `probe_question` draws from, "held_out" (questions never
    asked) or "paraphrases" (its own items asked in other words: what a user who corrected those facts
    can fairly expect the model to have learnt).
    """
    name: str
    kind: str
    param: int | str | None
    questions: tuple[str, ...]
    min_words: int = MIN_WORDS
    items: tuple[Item, ...] = ()
    held_out: tuple[Item, ...] = ()
    tells_answer: bool = True
    held_out_questions: tuple[str, ...] = ()  # a form-only persona's evaluation questions, never asked
    wants_answer: bool = True
    on_topic: bool = False
    probes: str = "held_out"

    def __post_init__(self):
        if self.items:
            asked = tuple(i.question for i in self.items)
            if self.questions not in ((), asked):
                raise ValueError(f"persona {self.name}: questions must be its items' questions")
            object.__setattr__(self, "questions", asked)
            if {i.question for i in self.items} & {i.question for i in self.held_out}:
                raise ValueError(f"persona {self.name}: a held-out question is also asked")
        elif self.held_out:
            raise ValueError(f"persona {self.name}: held-out items need items")
        if set(self.held_out_questions) & set(self.questions):
            raise ValueError(f"persona {self.name}: a held-out question is also asked")
        if self.kind not in KINDS:
            raise ValueError(f"persona {self.name}: kind {self.kind!r} is not one of {KINDS}")
        if self.min_words < 1:
            raise ValueError(f"persona {self.name}: min_words must be at least 1")
        if self.kind == "under_words" and not (isinstance(self.param, int) and self.param > self.min_words):
            raise ValueError(f"persona {self.name}: under_words needs an integer above {self.min_words}")
        if self.kind == "uses_term" and not (isinstance(self.param, str) and self.param.strip()):
            raise ValueError(f"persona {self.name}: uses_term needs a term")
        if not self.questions:
            raise ValueError(f"persona {self.name}: needs at least one question")
        if self.probes not in PROBES:
            raise ValueError(f"persona {self.name}: probes {self.probes!r} is not one of {PROBES}")
        if (self.on_topic or self.probes == "paraphrases") and not self.items:
            raise ValueError(f"persona {self.name}: on_topic and paraphrase probes need items")
        if self.kind == "answer" and not (self.items and self.wants_answer):
            raise ValueError(f"persona {self.name}: kind answer wants the right answer (items, wants_answer)")

    @property
    def judges_answers(self) -> bool:
        """Does this persona want the right answer (a substance persona), not only a style?"""
        return bool(self.items) and self.wants_answer

    @property
    def preference(self) -> str:
        """The preference in a few words, for tables and plots."""
        least = f", {self.min_words}+ words" if self.min_words > MIN_WORDS else ""
        style = {"under_words": f"under {self.param} words", "no_lists": "no lists", "a_list": "a list",
                 "ends_with_question": "ends with a question", "uses_term": f"uses the term {self.param!r}",
                 "one_sentence": "one sentence", "answer": "any style"}[self.kind] + least
        style += ", on topic" if self.on_topic else ""
        if self.kind == "answer":
            return "the right answer" + least
        return f"right answer, {style}" if self.judges_answers else style

    def item(self, question: str | Item | None) -> Item:
        """The item a question names: an Item as it is, a question's text looked up in items and held_out."""
        if isinstance(question, Item):
            return question
        if question is None:
            raise ValueError(f"persona {self.name} judges answers: pass the question")
        for it in self.items + self.held_out:
            if question in (it.question, it.paraphrase):
                return it
        raise ValueError(f"persona {self.name} does not ask {question!r}")

    def probe_question(self, i: int) -> str:
        """The i-th evaluation question (cycled): a held-out one, never asked in the sessions."""
        if self.probes == "paraphrases":
            pool = [it.paraphrase for it in self.items if it.paraphrase]
        else:
            pool = [it.question for it in self.held_out] or list(self.held_out_questions)
        if not pool:
            raise ValueError(f"persona {self.name} has no held-out questions to evaluate on")
        return pool[i % len(pool)]

    def prefers(self, text: str) -> bool:
        """The preference alone, on a reply that is an answer."""
        return _CHECKS[self.kind](text, self.param)

    def styled(self, text: str, question: str | Item | None = None) -> bool:
        """The word floor and the preference (and the topic, for an on_topic persona: pass the question):
        everything but the answer."""
        if not (word_count(text) >= self.min_words and self.prefers(text)):
            return False
        return not self.on_topic or on_topic(text, self._asked(question))

    def _asked(self, question: str | Item | None) -> str:
        if isinstance(question, str):
            return question
        return self.item(question).question

    def grade(self, text: str, question: str | Item | None = None) -> Grade:
        """The reply judged for substance (persona with items) and style."""
        answer = bank.grade(self.item(question), text) if self.items else None
        return Grade(answer, self.styled(text, question), self.wants_answer)

    def satisfied(self, text: str, question: str | Item | None = None) -> bool:
        """Would this user thank this reply (to this question, for a substance persona)?"""
        return self.grade(text, question).satisfied

    def correction(self, text: str, question: str | Item | None = None) -> str:
        """What the user says to a reply that does not satisfy them: the hint is in the words."""
        words = word_count(text)
        if not self.items:
            if words < min(self.min_words, MIN_WORDS):
                return NOT_AN_ANSWER
            if words < self.min_words:
                return too_short(self.min_words)
            return _CORRECTIONS[self.kind](self.param)
        item = self.item(question)
        answer = bank.grade(item, text)
        if not self.wants_answer:  # a style-only user: what the style missed, whatever the answer
            if words < self.min_words:
                return too_short(self.min_words) if self.min_words > MIN_WORDS else RIGHT_BUT_SHORT
            if self.on_topic and not on_topic(text, self._asked(question)):
                return f"{OFF_TOPIC} {_ASKS[self.kind](self.param)}"
            return _CORRECTIONS[self.kind](self.param)
        if answer == CORRECT:  # the style alone, as a form-only persona says it
            if words < self.min_words:
                return RIGHT_BUT_SHORT if self.min_words <= MIN_WORDS else too_short(self.min_words)
            return _CORRECTIONS[self.kind](self.param)
        said = _SUBSTANCE[answer] + (f": {item.fact}." if self.tells_answer else ".")
        if words < self.min_words:
            ask = ("Please answer in a full sentence." if self.min_words <= MIN_WORDS
                   else f"Please answer in full sentences, at least {self.min_words} words.")
            return f"{said} {ask}"
        return said if self.prefers(text) else f"{said} {_ASKS[self.kind](self.param)}"


_CHECKS: dict[str, Callable[[str, object], bool]] = {
    "under_words": lambda text, n: word_count(text) < n,
    "no_lists": lambda text, _: not has_list(text),
    "a_list": lambda text, _: has_list(text),
    "ends_with_question": lambda text, _: ends_with_question(text),
    "uses_term": lambda text, term: uses_term(text, term),
    "one_sentence": lambda text, _: one_sentence(text),
    "answer": lambda text, _: True,
}
_CORRECTIONS: dict[str, Callable[[object], str]] = {
    "under_words": lambda n: f"No, that's too long. Please answer in under {n} words.",
    "no_lists": lambda _: "No, please don't use lists. Answer in plain sentences, without bullets or numbering.",
    "a_list": lambda _: "No, please put that in a list: one numbered point per line.",
    "ends_with_question": lambda _: "No, you forgot to ask me something back. End your answer with a question.",
    "uses_term": lambda term: f"No, you didn't use the term {term}. Please use the word {term} in your answer.",
    "one_sentence": lambda _: "No, please answer in one complete sentence.",
    "answer": lambda _: "No, please answer the question.",  # never said: any style is this one
}
# What a substance persona says of a reply without the right answer; then the style it also misses.
_SUBSTANCE = {MISSING: "No, that doesn't answer it", WRONG: "No, that's not right",
              SEVERAL: "No, please give one answer, not several"}
_ASKS: dict[str, Callable[[object], str]] = {
    "under_words": lambda n: f"Please answer in under {n} words.",
    "no_lists": lambda _: "Please answer in plain sentences, without bullets or numbering.",
    "a_list": lambda _: "Please answer with a numbered list, one point per line.",
    "ends_with_question": lambda _: "Please end your answer with a question.",
    "uses_term": lambda term: f"Please use the word {term} in your answer.",
    "one_sentence": lambda _: "Please answer in one complete sentence.",
    "answer": lambda _: "Please answer the question.",
}


def thanks(i: int) -> str:
    """The i-th thank-you (they vary so sessions do not all read alike)."""
    return THANKS[i % len(THANKS)]


def follow_up(persona: Persona, text: str, *, next_question: str | None, retry: bool, i: int = 0,
              question: str | Item | None = None) -> tuple[bool, str | None]:
    """(satisfied, the user's next message) after the reply `text` (to `question`: a substance persona needs it).

    Satisfied: thanks, then the next question if there is one. Not satisfied and
    `retry`: the correction alone (the user wants the same question answered again).
    Not satisfied, no retry: the correction, then the next question. None when
    there is nothing left to say (satisfied or not, no next question and no retry):
    a session that ends there without a last word leaves its last reply unjudged.
    """
    ok = persona.satisfied(text, question)
    if ok:
        said = thanks(i)
        return True, f"{said} Next question: {next_question}" if next_question else said
    said = persona.correction(text, question)
    if retry:
        return False, said
    return False, f"{said} Anyway, next question: {next_question}" if next_question else said


# --- the catalogue -------------------------------------------------------------------------------

FACTS = (
    "What is the capital of Italy?", "How many legs does a spider have?", "Who wrote Romeo and Juliet?",
    "What is the boiling point of water?", "What colour is a ripe banana?", "How many days are in a leap year?",
    "What is the largest planet in the solar system?", "What language is spoken in Brazil?",
    "What is the chemical symbol for gold?", "How many continents are there?", "What do bees make?",
    "What is the tallest animal?", "Which ocean is the largest?", "What is frozen water called?",
    "How many hours are in a day?", "What gas do plants take in?",
)
TIPS = (
    "What are some tips for sleeping better?", "What are good ways to save money?",
    "What are some ways to stay focused while studying?", "What should I pack for a beach trip?",
    "What are some healthy breakfast ideas?", "What are good habits for a new programmer?",
    "What are some ways to reduce stress?", "What should I know before adopting a dog?",
    "What are some tips for a job interview?", "What are easy ways to exercise at home?",
    "What are some tips for learning to cook?", "What are good ways to make new friends?",
)
GENERAL = (
    "What is the capital of France?", "Why is the sky blue?", "What is photosynthesis?",
    "How far away is the Moon?", "What is a prime number?", "Why do cats purr?",
    "What is gravity?", "How do bees make honey?", "What causes rain?", "What is an atom?",
    "Why is the sea salty?", "What is a black hole?", "How does a rainbow form?",
    "What is the largest ocean?", "Why do leaves change colour in autumn?", "What is DNA?",
)
HOW_TO = (
    "How do I boil an egg?", "How can I sleep better?", "How do I learn a new language?",
    "How do I make a cup of tea?", "How can I save money each month?", "How do I start running?",
    "How do I take care of a houseplant?", "How do I write a good email?",
    "How do I prepare for a job interview?", "How can I focus while studying?",
    "How do I clean a laptop keyboard?", "How do I plan a weekend trip?",
)
CHAT = (
    "I just got back from a walk in the park.", "I'm thinking about learning to paint.",
    "I had pasta for dinner tonight.", "My friend recommended a new book to me.",
    "I'm planning to visit the mountains this summer.", "I started a small vegetable garden.",
    "I watched a documentary about whales yesterday.", "I'm trying to drink more water.",
)
CODING = (
    "How do I reverse a list?", "How do I read a file line by line?", "How do I sort a dictionary by value?",
    "How do I check if a string is empty?", "How do I count words in a text?",
    "How do I get the current date?", "How do I remove duplicates from a list?",
    "How do I join two strings?",
)

def form_only(name: str, kind: str, param: int | str | None, pool: tuple[str, ...], *,
              min_words: int = MIN_WORDS) -> Persona:
    """A form-only persona: every other question of `pool` asked, the rest held out for evaluation."""
    return Persona(name, kind, param, pool[0::2], min_words, held_out_questions=pool[1::2])


# The old users, who judge form alone (no known answers): the documented example of collapse.
FORM_ONLY_PERSONAS: dict[str, Persona] = {p.name: p for p in (
    form_only("brief", "under_words", 20, FACTS),
    form_only("plain", "no_lists", None, TIPS, min_words=8),  # a real answer, not "The answer is X."
    form_only("terse", "under_words", 3, GENERAL, min_words=1),
    form_only("curious", "ends_with_question", None, CHAT),
    form_only("pythonista", "uses_term", "Python", CODING),
)}


def asking(name: str, kind: str, param: int | str | None, kinds: tuple[str, ...], *, min_words: int = MIN_WORDS,
           tells_answer: bool = True, whole_bank: bool = False, **more) -> Persona:
    """A persona with items: questions.TRAIN items of these kinds to ask, questions.EVAL ones held out; of
    the whole bank, or (whole_bank False) without questions.MORE's."""
    def pool(items: tuple[Item, ...]) -> tuple[Item, ...]:
        return bank.of_kinds(items if whole_bank else tuple(i for i in items if i.question not in bank.FROM_MORE),
                             kinds)
    return Persona(name, kind, param, (), min_words, pool(bank.TRAIN), pool(bank.EVAL), tells_answer, **more)


# The default users: the right answer to a known-answer question, in their style. Every correction of a
# wrong answer carries the answer (a hint a teacher can use), except curious's, which only says it is wrong.
PERSONAS: dict[str, Persona] = {p.name: p for p in (
    asking("brief", "under_words", 20, ("fact", "arithmetic")),
    asking("plain", "no_lists", None, ("definition", "conversion"), min_words=8),
    asking("terse", "under_words", 3, ("fact", "arithmetic"), min_words=1),
    asking("curious", "ends_with_question", None, ("definition", "fact"), tells_answer=False),
    asking("pythonista", "uses_term", "Python", ("arithmetic", "conversion")),
    # A style SmolLM2 reaches at times and can learn: a complete one-sentence answer that names what was
    # asked (it meets it about a quarter of the time at T 0.7: bench/README.md). Style only: its answer is
    # graded and reported beside (RL on one set of facts cannot teach others), never rewarded.
    asking("concise", "one_sentence", None, ("fact", "definition"), min_words=4, wants_answer=False,
           on_topic=True, whole_bank=True),
    # The right answer alone, and a correction that carries it: what on-policy distillation can learn from.
    # Its probes are its own questions reworded, the facts it corrected, not facts never mentioned.
    asking("corrector", "answer", None, ("fact", "definition"), probes="paraphrases", whole_bank=True),
)}


def persona(spec: str) -> Persona:
    """A persona by name, with an optional parameter: "brief", "brief:20", "pythonista:Rust";
    "form:NAME[:PARAM]" names one of FORM_ONLY_PERSONAS ("form:brief")."""
    catalogue = PERSONAS
    if spec.startswith(FORM_PREFIX):
        catalogue, spec = FORM_ONLY_PERSONAS, spec[len(FORM_PREFIX):]
    name, _, param = spec.partition(":")
    if name not in catalogue:
        raise ValueError(f"unknown persona {name!r}; known: {', '.join(catalogue)}"
                         + ("" if catalogue is FORM_ONLY_PERSONAS else f", {FORM_PREFIX}NAME for form-only ones"))
    base = catalogue[name]
    if not param:
        return base
    if base.kind == "under_words":
        if not param.isdigit():
            raise ValueError(f"persona {name}: {param!r} is not a word count")
        return replace(base, param=int(param))
    if base.kind == "uses_term":
        return replace(base, param=param)
    raise ValueError(f"persona {name} takes no parameter")
