"""The question bank (clawd/tools/sim/questions.py) and the substance personas (personas.PERSONAS): grading
a reply's answer, the held-out split, and users who want the right answer in their style."""
from __future__ import annotations

import itertools
import random
from collections import Counter
from types import SimpleNamespace

import pytest

from clawd.scoring import judging, rules
from clawd.tools.sim import personas, questions
from clawd.tools.sim.questions import CORRECT, MISSING, SEVERAL, WRONG, Item, grade, normalise

ALL = questions.TRAIN + questions.EVAL
PLANET = next(i for i in ALL if i.question == "What is the largest planet in the solar system?")
ITALY = next(i for i in ALL if i.question == "What is the capital of Italy?")
GOLD = next(i for i in ALL if i.question == "What is the chemical symbol for gold?")
BOILING = next(i for i in ALL if i.question.startswith("What is the boiling point of water"))
TWELVE = Item("What is 3 times 4?", ("12", "twelve"), "arithmetic", "3 times 4 is 12", ("13", "120", "7"))
BIG = Item("How many metres are in 100 kilometres?", ("100000", "100,000"), "conversion",
           "100 kilometres is 100,000 metres", ("10000",))


# ---- normalising ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, tokens", [
    ("The capital of Italy is Rome.", ("capital", "of", "italy", "is", "rome")),
    ("The answer is a planet.", ("answer", "is", "planet")),
    ("ROME!!", ("rome",)),
    ("It's Au.", ("it", "s", "au")),
    ("It isn\u2019t Rome", ("it", "is", "not", "rome")),
    ("twelve", ("12",)), ("Twenty-four hours", ("24", "hours")), ("one hundred and five", ("105",)),
    ("a thousand", ("1000",)), ("3 thousand", ("3000",)), ("one hundred thousand", ("100000",)),
    ("100,000 metres", ("100000", "metres")), ("1,000,000", ("1000000",)), ("3,4", ("3", "4")),
    ("1833.77 degrees", ("1833.77", "degrees")), ("It is 56.", ("it", "is", "56")),
    ("one two", ("1", "2")), ("twenty twelve", ("20", "12")), ("3000m", ("3000", "m")),
    ("CO\u2082 and H2O", ("co", "2", "and", "h", "2", "o")), ("S\u00e3o Paulo", ("sao", "paulo")),
    ("-5 degrees", ("5", "degrees")), ("", ()),
])
def test_normalise(text, tokens):
    assert normalise(text) == tokens


def test_number_words_read_back_as_digits():
    rng = random.Random(0)
    for n in [*range(1000), *(rng.randrange(1_000_000) for _ in range(500)), 999_999]:
        assert normalise(questions.number_words(n)) == (str(n),), n
    assert questions.number_words(24) == "twenty-four" and questions.number_words(3000) == "three thousand"
    with pytest.raises(ValueError):
        questions.number_words(1_000_000)


# ---- grading --------------------------------------------------------------------------------------

@pytest.mark.parametrize("item, text, expected", [
    (PLANET, "Jupiter is the largest planet.", CORRECT),
    (PLANET, "jupiter", CORRECT),
    (PLANET, "The answer is a planet.", MISSING),                      # the collapsed reply
    (PLANET, "Saturn is the largest planet.", WRONG),
    (PLANET, "The planets are Mercury, Venus, Earth, Mars, Jupiter, Saturn.", SEVERAL),
    (PLANET, "Jupiter or maybe Saturn.", SEVERAL),
    (PLANET, "Jupiter, not Saturn.", CORRECT),                          # a negated distractor is not named
    (PLANET, "Jupiter is bigger than Saturn.", SEVERAL),                # a comparison names two: not counted
    (ITALY, "Rome.", CORRECT), (ITALY, "It is ROME", CORRECT),
    (ITALY, "Not Rome.", MISSING),                                      # negated: the answer is not named
    (ITALY, "It isn't Rome, it is Milan.", WRONG),
    (ITALY, "It is never Rome", MISSING),
    (ITALY, "Rome is not it.", CORRECT),                                # a negation further on is not seen
    (ITALY, "Romeo went to Roma.", MISSING),                            # whole words only
    (GOLD, "The symbol for gold is Au.", CORRECT),
    (GOLD, "Austria has an aunt.", MISSING),                            # "Au" is not in "Austria" or "aunt"
    (GOLD, "Au or Ag", SEVERAL),
    (TWELVE, "3 times 4 is 12.", CORRECT), (TWELVE, "It is twelve.", CORRECT), (TWELVE, "12!", CORRECT),
    (TWELVE, "It is 120.", WRONG), (TWELVE, "It is 12.5", MISSING), (TWELVE, "Maybe 120 or 12", SEVERAL),
    (TWELVE, "One hundred twenty.", WRONG), (TWELVE, "112", MISSING),
    (BIG, "There are 100,000 metres.", CORRECT), (BIG, "100000", CORRECT),
    (BIG, "one hundred thousand metres", CORRECT), (BIG, "100 thousand", CORRECT), (BIG, "100 000", MISSING),
    (BOILING, "The boiling point of water is 1833.77 degrees Fahrenheit.", MISSING),  # the collapsed reply
    (BOILING, "Water boils at 100 degrees Celsius.", CORRECT),
    (BOILING, "One hundred degrees.", CORRECT),
    (BOILING, "", MISSING),
])
def test_grade(item, text, expected):
    assert grade(item, text) == expected
    assert questions.is_correct(item, text) is (expected == CORRECT)


def test_every_item_grades_its_own_words():
    for item in ALL:
        assert grade(item, item.fact) == CORRECT, item          # the correction's words carry the answer
        assert all(grade(item, f"It is {a}.") == CORRECT for a in item.answers), item
        assert grade(item, item.question) == MISSING, item      # echoing the question is no answer
        for d in item.distractors:
            assert grade(item, f"It is {d}.") == WRONG, (item, d)
            assert grade(item, f"{item.answer} or {d}") == SEVERAL, (item, d)
            assert grade(item, f"{item.answer}, not {d}") == CORRECT, (item, d)


def test_item_validation():
    with pytest.raises(ValueError, match="kind"):
        Item("Q?", ("a1",), "trivia", "x")
    with pytest.raises(ValueError, match="names"):
        Item("What is 12 minus 6?", ("6",), "arithmetic", "12 minus 6 is 6")
    with pytest.raises(ValueError, match="overlaps"):
        Item("Largest ocean?", ("Pacific Ocean",), "fact", "x", ("Pacific",))
    with pytest.raises(ValueError, match="no tokens"):
        Item("Q?", ("the",), "fact", "x")


# ---- the bank and its split -----------------------------------------------------------------------

def test_the_split_is_disjoint_and_deterministic():
    train, held = questions.TRAIN, questions.EVAL
    assert (train, held) == questions.split(questions.SEED) == questions.split(0)
    assert questions.split(1) != (train, held)                           # the generated kinds follow the seed
    assert not {i.question for i in train} & {i.question for i in held}
    assert not {i.key for i in train} & {i.key for i in held}
    aliases = lambda items: {(i.kind, normalise(a)) for i in items for a in i.answers}
    assert not aliases(train) & aliases(held)                            # no accepted alias either
    assert len({i.question for i in ALL}) == len({i.key for i in ALL}) == len(ALL)
    for seed in (1, 2):
        t, e = questions.split(seed)
        assert not {i.key for i in t} & {i.key for i in e} and not {i.question for i in t} & {i.question for i in e}


def test_the_bank_size_per_kind_and_split():
    train, held = Counter(i.kind for i in questions.TRAIN), Counter(i.kind for i in questions.EVAL)
    assert train == {"fact": 339, "arithmetic": 20, "conversion": 20, "definition": 133}
    assert held == {**train, "fact": 340}  # an odd count: the extra one is held out
    assert len(questions.FROM_MORE) == 869  # 635 facts and 234 definitions, each with a paraphrase


def test_generated_items_are_integers_with_their_operands_allowed():
    for item in ALL:
        if item.kind in ("arithmetic", "conversion"):
            assert item.answer.isdigit() and normalise(item.answers[-1]) == (item.answer,)
            said = set(normalise(item.question))
            assert not said & {normalise(d)[0] for d in item.distractors}  # "7 times 8 is 56" names no distractor
    assert questions.of_kinds(questions.TRAIN, ("fact", "arithmetic"))[:2] != ()
    with pytest.raises(ValueError, match="unknown kinds"):
        questions.of_kinds(questions.TRAIN, ("riddles",))


# ---- substance personas ---------------------------------------------------------------------------

def _shortest(item: Item) -> str:
    return min(item.answers, key=lambda a: (len(a.split()), len(a)))


PAD = " I hope this helps you with whatever you are working on today, and good luck with all of it later on as well."
STYLED = {  # a right answer in each persona's style
    "brief": lambda a: f"It is {a}.", "plain": lambda a: f"The answer to your question is {a}, as far as I know.",
    "terse": lambda a: f"{a}.", "curious": lambda a: f"It is {a}. Did you know that already?",
    "pythonista": lambda a: f"In Python, that gives {a}.",
}
UNSTYLED = {  # the same right answer, the style missed
    "brief": lambda a: f"It is {a}.{PAD}", "plain": lambda a: f"Here you are:\n- {a}\n- that is what I know about it",
    "terse": lambda a: f"It is {a}.", "curious": lambda a: f"It is {a}, as far as I know.",
    "pythonista": lambda a: f"That gives {a}, as far as I know.",
}


# The users who want the right answer in their style (the new style-only and corrections users have tests
# of their own below).
SUBSTANCE = [p for p in personas.PERSONAS.values() if p.judges_answers and p.kind != "answer"]


def _each():
    for p in SUBSTANCE:
        for item in p.items + p.held_out:
            yield p, item


def test_the_catalogue():
    got = {n: (p.preference, sorted({i.kind for i in p.items}), p.tells_answer) for n, p in personas.PERSONAS.items()}
    assert got == {
        "brief": ("right answer, under 20 words", ["arithmetic", "fact"], True),
        "plain": ("right answer, no lists, 8+ words", ["conversion", "definition"], True),
        "terse": ("right answer, under 3 words", ["arithmetic", "fact"], True),
        "curious": ("right answer, ends with a question", ["definition", "fact"], False),
        "pythonista": ("right answer, uses the term 'Python'", ["arithmetic", "conversion"], True),
        "concise": ("one sentence, 4+ words, on topic", ["definition", "fact"], True),
        "corrector": ("the right answer", ["definition", "fact"], True),
    }
    for p in SUBSTANCE:
        assert p.judges_answers and not personas.FORM_ONLY_PERSONAS[p.name].judges_answers
        assert set(p.items) <= set(questions.TRAIN) and set(p.held_out) <= set(questions.EVAL)
        assert p.questions == tuple(i.question for i in p.items)
        assert {i.kind for i in p.items} == {i.kind for i in p.held_out}
        kinds = sorted({i.kind for i in p.items})
        assert sorted(i.kind for i in p.items[:2]) == kinds                  # the first questions cover the kinds
        assert p.probe_question(0) == p.held_out[0].question
        assert p.probe_question(len(p.held_out) + 1) == p.held_out[1].question
    for p in personas.FORM_ONLY_PERSONAS.values():  # form-only personas hold every other question out
        assert not set(p.held_out_questions) & set(p.questions) and len(p.held_out_questions) >= 4
        assert {p.probe_question(i) for i in range(50)} == set(p.held_out_questions)
    assert personas.FORM_ONLY_PERSONAS["brief"].probe_question(0) == personas.FACTS[1]
    with pytest.raises(ValueError, match="no held-out questions"):
        personas.Persona("x", "no_lists", None, ("Q?",)).probe_question(0)
    with pytest.raises(ValueError, match="also asked"):
        personas.Persona("x", "no_lists", None, ("Q?",), held_out_questions=("Q?",))


def test_right_and_styled_is_thanked_and_each_half_alone_is_not():
    for p, item in _each():
        right = _shortest(item)
        assert p.satisfied(STYLED[p.name](right), item), (p.name, item)
        assert p.satisfied(STYLED[p.name](right), item.question)            # by its text, too
        assert p.grade(STYLED[p.name](right), item) == (CORRECT, True, True)
        # negative controls: correct but unstyled; styled but wrong (a distractor, or no answer at all)
        assert p.grade(UNSTYLED[p.name](right), item) == (CORRECT, False, True), (p.name, item)
        assert not p.satisfied(UNSTYLED[p.name](right), item)
        for wrong in [*item.distractors[:1], "that"]:
            assert p.grade(STYLED[p.name](wrong), item).styled
            assert not p.satisfied(STYLED[p.name](wrong), item), (p.name, item, wrong)


@pytest.mark.parametrize("text", [
    "The answer is a planet.", "The boiling point of water is 1833.77 degrees Fahrenheit.", "You", "I", "A", "",
])
def test_the_collapsed_replies_satisfy_nobody(text):
    for p, item in _each():
        assert not p.satisfied(text, item)
    assert personas.FORM_ONLY_PERSONAS["brief"].satisfied("The answer is a planet.")  # what went wrong before


def test_corrections_say_what_was_wrong():
    brief, plain, curious = (personas.PERSONAS[n] for n in ("brief", "plain", "curious"))
    fact = "Jupiter is the largest planet in the solar system."
    assert brief.correction("The answer is a planet.", PLANET) == f"No, that doesn't answer it: {fact}"
    assert brief.correction("Saturn is the largest planet.", PLANET) == f"No, that's not right: {fact}"
    assert brief.correction("Jupiter, Saturn and Mars are big.", PLANET) == (
        f"No, please give one answer, not several: {fact}")
    assert brief.correction("Jupiter." , PLANET) == "No, that's too short. Please answer in a full sentence."
    assert brief.correction("Jupiter is the largest." + PAD, PLANET) == (
        "No, that's too long. Please answer in under 20 words.")
    assert brief.correction("Saturn is the largest." + PAD, PLANET) == (
        f"No, that's not right: {fact} Please answer in under 20 words.")
    assert brief.correction("", PLANET) == f"No, that doesn't answer it: {fact} Please answer in a full sentence."
    assert brief.correction("The capital is Milan.", ITALY.question) == (
        "No, that's not right: the capital of Italy is Rome.")
    item = plain.items[0]
    assert plain.correction(f"It is {item.answer}.", item) == personas.too_short(8)
    assert plain.correction("No idea.", item) == (
        f"No, that doesn't answer it: {item.fact}. Please answer in full sentences, at least 8 words.")
    assert plain.correction(f"Here:\n- {item.answer}\n- nothing more to say about it now", item) == (
        "No, please don't use lists. Answer in plain sentences, without bullets or numbering.")
    assert plain.correction("Here:\n- no idea\n- nothing more to say about it now, sorry", item) == (
        f"No, that doesn't answer it: {item.fact}. Please answer in plain sentences, without bullets or numbering.")
    item = curious.items[0]  # curious says the answer is wrong, never what it is
    assert curious.correction("I am not sure about that one.", item) == (
        "No, that doesn't answer it. Please end your answer with a question.")
    assert curious.correction("I am not sure. Do you know?", item) == "No, that doesn't answer it."
    assert curious.correction(f"It is {item.answer}.", item) == (
        "No, you forgot to ask me something back. End your answer with a question.")


def test_a_substance_persona_needs_the_question():
    brief = personas.PERSONAS["brief"]
    for call in (lambda: brief.satisfied("Jupiter is big."), lambda: brief.correction("Jupiter is big."),
                 lambda: personas.follow_up(brief, "Jupiter is big.", next_question=None, retry=True)):
        with pytest.raises(ValueError, match="pass the question"):
            call()
    with pytest.raises(ValueError, match="does not ask"):
        brief.satisfied("Jupiter is big.", "Who are you?")
    assert brief.item(PLANET) is PLANET and brief.item(PLANET.question) == PLANET  # held out, still known
    with pytest.raises(ValueError, match="items' questions"):
        personas.Persona("x", "no_lists", None, ("Q?",), items=(PLANET,))
    with pytest.raises(ValueError, match="held-out items need items"):
        personas.Persona("x", "no_lists", None, ("Q?",), held_out=(PLANET,))
    with pytest.raises(ValueError, match="also asked"):
        personas.Persona("x", "no_lists", None, (), items=(PLANET,), held_out=(PLANET,))


def test_follow_up_with_the_question():
    brief = personas.PERSONAS["brief"]
    assert personas.follow_up(brief, "Jupiter is the largest.", next_question="Why?", retry=False, i=2,
                              question=PLANET) == (True, "Great, thanks! Next question: Why?")
    assert personas.follow_up(brief, "The answer is a planet.", next_question=None, retry=True, question=PLANET) == (
        False, "No, that doesn't answer it: Jupiter is the largest planet in the solar system.")
    assert personas.follow_up(brief, "Saturn.", next_question="Why?", retry=False, question=PLANET) == (
        False, "No, that's not right: Jupiter is the largest planet in the solar system. "
               "Please answer in a full sentence. Anyway, next question: Why?")


# ---- the rules judge reads every message as meant ----------------------------------------------------

def _rules(said: str, previous: str) -> tuple[int, str | None]:
    turn = SimpleNamespace(messages=[{"role": "user", "content": previous}])
    return rules.rules_vote(turn, [{"role": "user", "content": said}])


def test_the_rules_judge_reads_every_thanks_as_positive():
    shortest = min(personas.THANKS, key=len)  # the thanks a next question weighs most in (restatement)
    for p in SUBSTANCE:
        asked = [i.question for i in p.items + p.held_out]
        for i, previous in enumerate(asked):
            ok, said = personas.follow_up(p, STYLED[p.name](_shortest(p.item(previous))), next_question=asked[i - 1],
                                          retry=False, i=i, question=previous)
            assert ok and said == f"{personas.thanks(i)} Next question: {asked[i - 1]}"
            assert _rules(said, previous) == (1, None), (p.name, said)
        for previous, q in itertools.permutations(asked, 2):  # any question may follow any other
            assert _rules(f"{shortest} Next question: {q}", previous) == (1, None), (p.name, previous, q)


def test_the_rules_judge_reads_every_correction_as_negative_with_it_as_hint():
    for p, item in _each():
        replies = ["", "You", "The answer is a planet.", STYLED[p.name]("that"), UNSTYLED[p.name](_shortest(item)),
                   "1. one\n2. two three four five six seven " * 8, *(STYLED[p.name](d) for d in item.distractors[:1]),
                   f"{_shortest(item)} or {item.distractors[0]}"]
        for text in replies:
            assert not p.satisfied(text, item), (p.name, item, text)
            said = p.correction(text, item)
            hint = rules.guidance(said)  # the correction less its leading "No, that's not right"
            assert said.startswith("No, ") and _rules(said, item.question) == (-1, judging.accept_hint(hint)), said
            if grade(item, text) != CORRECT:  # a substance correction: the answer in it, or never
                assert (item.fact in said) is p.tells_answer, said
                if p.tells_answer:  # and the hint carries it
                    assert item.fact in hint and judging.accept_hint(hint) == hint, said
            moved = personas.follow_up(p, text, next_question=p.questions[0], retry=False, question=item)[1]
            assert moved.startswith(said + " Anyway, next question: ")
            assert _rules(moved, said) == (-1, judging.accept_hint(hint))  # the hint never holds the next question
