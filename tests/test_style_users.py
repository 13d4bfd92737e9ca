"""The style-only user (`concise`: one complete sentence that names what was asked, whatever the answer) and
the corrections user (`corrector`: the right answer alone, probed on paraphrases of its own questions), and
the demo's held-out evaluation over them (clawd/tools/sim/evaluation.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from clawd.scoring import judging, rules
from clawd.tools.sim import evaluation, personas, questions
from clawd.tools.sim.personas import one_sentence, on_topic, topic_words
from clawd.tools.sim.questions import CORRECT, MISSING, WRONG
from clawd.tools.sim.users import Reply

CONCISE, CORRECTOR = personas.PERSONAS["concise"], personas.PERSONAS["corrector"]
ITALY = next(i for i in questions.TRAIN + questions.EVAL if i.question == "What is the capital of Italy?")


@pytest.mark.parametrize("text, expected", [
    ("The capital of Italy is Rome.", True),
    ("  Rome is the capital of Italy!  ", True),
    ('He said "Rome is the capital."', True),             # closers after the final stop
    ("Pi is about 3.14 in most uses.", True),              # a decimal point is not a sentence end
    ("Rome is the capital. It is old.", False),
    ("Rome is the capital! It is old.", False),
    ("Is Rome the capital? Yes.", False),
    ("Is Rome the capital?", False),                      # a question, not an answer
    ("The capital of Italy is", False),                   # cut off at the token limit
    ("Rome is the capital.\nIt is old.", False), ("Rome\nis the capital.", False),
    ("Dr. Seuss wrote it.", False),                       # abbreviations read as two sentences (documented)
    ("", False), ("   ", False),
])
def test_one_sentence(text, expected):
    assert one_sentence(text) is expected


def test_topic_words_and_on_topic():
    assert topic_words("What do we call a baby cat?") == {"baby", "cat"}
    assert topic_words("What is the capital of Italy?") == {"capital", "italy"}
    assert topic_words("What is 45 plus 62?") == {"45", "plus", "62"}
    assert on_topic("A kitten is a young cat.", "What do we call a baby cat?")
    assert on_topic("Kittens are baby cats.", "What do we call a baby cat?")          # a plural either way
    assert on_topic("Rome is Italy\u2019s capital.", "What is the capital of Italy?")
    assert not on_topic("The answer is a planet.", "What is the capital of Italy?")  # the collapsed reply
    assert not on_topic("I like turtles very much.", "What is the capital of Italy?")


def test_the_style_user_thanks_a_styled_reply_right_or_wrong_and_reports_the_answer():
    right, wrong = "The capital of Italy is Rome.", "The capital of Italy is Milan."
    assert CONCISE.grade(right, ITALY) == (CORRECT, True, False) and CONCISE.satisfied(right, ITALY)
    assert CONCISE.grade(wrong, ITALY) == (WRONG, True, False) and CONCISE.satisfied(wrong, ITALY)
    assert not CONCISE.judges_answers and CONCISE.satisfied(right, ITALY.question)
    # negative controls: right but two sentences, cut off, off the topic, collapsed, too short
    for text, said in [
        ("The capital of Italy is Rome. It is old.", "No, please answer in one complete sentence."),
        ("The capital of Italy is Rome, which", "No, please answer in one complete sentence."),
        ("Rome is a lovely old city.", f"{personas.OFF_TOPIC} Please answer in one complete sentence."),
        ("The answer is a planet.", f"{personas.OFF_TOPIC} Please answer in one complete sentence."),
        ("Italy: Rome.", personas.too_short(4)),
    ]:
        assert not CONCISE.satisfied(text, ITALY), text
        assert CONCISE.correction(text, ITALY) == said
        # the rules judge reads it as a -1 with the correction as the hint, the answer never in it
        turn = SimpleNamespace(messages=[{"role": "user", "content": ITALY.question}])
        assert rules.rules_vote(turn, [{"role": "user", "content": said}]) == (
            -1, judging.accept_hint(rules.guidance(said)))
        assert "Rome" not in said
    with pytest.raises(ValueError, match="pass the question"):
        CONCISE.styled(right)


def test_the_corrections_user_wants_the_answer_alone_and_is_probed_on_paraphrases():
    item = next(i for i in CORRECTOR.items if i.paraphrase)
    assert CORRECTOR.satisfied(f"It is {item.answer}, I think; at least that is what I remember.", item)
    assert CORRECTOR.satisfied(f"Surely:\n- {item.answer}\n- and more", item)  # no style wanted
    assert CORRECTOR.grade("No idea at all, sorry.", item) == (MISSING, True, True)
    assert CORRECTOR.correction("No idea at all, sorry.", item) == f"No, that doesn't answer it: {item.fact}."
    paraphrases = [i.paraphrase for i in CORRECTOR.items if i.paraphrase]
    assert len(paraphrases) >= 100
    assert [CORRECTOR.probe_question(k) for k in range(3)] == paraphrases[:3]
    assert CORRECTOR.item(item.paraphrase) is item            # a paraphrase grades as its item
    assert not set(paraphrases) & set(CORRECTOR.questions)    # a probe is never asked as such in a session
    with pytest.raises(ValueError, match="need items"):
        personas.Persona("x", "no_lists", None, ("Q?",), probes="paraphrases")
    with pytest.raises(ValueError, match="kind answer"):
        personas.Persona("x", "answer", None, (), items=(ITALY,), wants_answer=False)


def test_the_bank_is_big_enough_for_a_guard_with_power():
    guard = evaluation.guard_persona()
    assert guard.name == evaluation.GUARD and guard.probes == "held_out"
    assert {i.kind for i in guard.held_out} == {"fact", "definition"} and len(guard.held_out) >= 200
    assert not {i.question for i in guard.held_out} & set(CONCISE.questions)  # held out from the style user too
    assert len(CONCISE.held_out) >= 64


def test_the_guard_counts_no_question_chosen_on_the_base_models_answer():
    guard = [i.question for i in evaluation.guard_persona().held_out]
    held = [i.question for i in CORRECTOR.held_out]
    screened = set(held) & questions.FROM_SCREENING
    assert len(questions.FROM_SCREENING) == 242 and len(screened) == 127
    assert guard == [q for q in held if q not in screened] and len(guard) == 346
    assert [i.question for i in evaluation.guard_persona(limit=3).held_out] == guard[:3]


def _reply(persona: str, style: str, question: int, satisfied: bool, correct: bool) -> Reply:
    return Reply(-1, persona, style, "probe", 0, question, 0, 0, satisfied, 5, 7, "stop", 0.1, "", correct, satisfied)


def test_the_evaluation_pairs_by_persona_style_and_question_and_the_guard_counts_v0s_right_answers():
    before = [_reply("concise", "sampled", q, q < 2, True) for q in range(4)]
    before += [_reply("concise", "greedy", q, False, True) for q in range(4)]
    before += [_reply(evaluation.GUARD, "greedy", q, q < 3, q < 3) for q in range(4)]
    after = [_reply("concise", "sampled", q, True, q != 0) for q in range(4)]
    after += [_reply("concise", "greedy", q, q == 3, True) for q in range(4)]
    after += [_reply(evaluation.GUARD, "greedy", q, q in (0, 3), q in (0, 3)) for q in range(4)]
    got = evaluation.compare(list(reversed(before)), after)
    assert (got["satisfied (sampled)"]["before"], got["satisfied (sampled)"]["after"]) == (0.5, 1.0)
    assert (got["satisfied (greedy)"]["before"], got["satisfied (greedy)"]["after"]) == (0.0, 0.25)
    assert got["correct (sampled)"]["diff"] == -0.25
    kept = got["guard: v0's right answers kept"]       # questions 0-2 were right at v0; only 0 still is
    assert (kept["n"], kept["before"], kept["after"], kept["worse"]) == (3, 1.0, 1 / 3, 2)
    assert (got["guard: correct"]["n"], got["guard: correct"]["after"]) == (4, 0.5)
    head = evaluation.headline(got)
    assert (head["guard_n"], head["guard_v0_right"], head["guard_non_inferior"]) == (4, 3, False)  # 75 % -> 50 %
    assert evaluation.retry_share([_reply("concise", "s", 0, True, True)]) == {
        "thanked": 0, "from_retries": 0, "share": None}


def test_no_question_of_the_bank_restates_another_as_the_rules_judge_reads_it():
    """A thanks followed by the next question must read +1: a next question the rules judge takes for a
    restatement of the last (word overlap) reads as a retry, -1. The bank had four such pairs ("mixing blue and
    yellow" / "mixing red and blue")."""
    shortest = min(personas.THANKS, key=len)  # the thanks a next question weighs most in
    asked = [i.question for i in questions.TRAIN + questions.EVAL]
    restated = [(a, b) for a in asked for b in asked if a != b
                and rules.is_rephrase(f"{shortest} Next question: {b}", a)]
    assert restated == []
    for p in (CONCISE, CORRECTOR):
        item = p.items[0]
        ok, said = personas.follow_up(p, "The answer to that is quite simple here.", next_question=None,
                                      retry=True, question=item)
        assert not ok and rules.rules_vote(SimpleNamespace(messages=[{"role": "user", "content": item.question}]),
                                           [{"role": "user", "content": said}])[0] == -1
