"""Simulated users (clawd/tools/sim): personas' checkers and words, session plans, and a short run on a real daemon."""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from clawd.scoring import judging, rules
from clawd.tools.sim import personas
from clawd.tools.tomlfile import to_toml
from clawd.tools.sim.users import (RETRY_AFTER_MAX, STYLES, TOOLS, Reply, Users, by_persona, by_version, plan_sessions,
                             rate, retry_after, tool_result, version_of)

from .harness import Daemon, serving

# ---- checkers -----------------------------------------------------------------------------------


def test_word_count():
    assert personas.word_count("") == 0
    assert personas.word_count("  Paris.  ") == 1
    assert personas.word_count("The capital of France is Paris.") == 6
    assert personas.word_count("one\ntwo\tthree  four") == 4
    assert personas.word_count("e.g. x-ray, 3.14 🙂") == 4


@pytest.mark.parametrize("text, expected", [
    ("Boil water, add the egg, wait ten minutes.", False),
    ("Steps:\n- boil water\n- add the egg", True),
    ("* one\n* two", True),
    ("\u2022 a bullet", True),
    ("1. Boil water.\n2. Add the egg.", True),
    ("Then:\n  3) wait", True),
    ("a) first", True),
    ("It costs $3 - not much.", False),        # a dash inside a line
    ("Version 2.0 is out.", False),           # a number not starting a line
    ("-5 degrees outside", False),            # no space after the dash
    ("---\nA rule, not a list.", False),
    ("In 2024. we moved", False),             # four digits is a year, not an item number
])
def test_has_list(text, expected):
    assert personas.has_list(text) is expected


@pytest.mark.parametrize("text, expected", [
    ("How are you?", True),
    ("Nice. Want to hear more?  \n", True),
    ('She asked "why?"', True),
    ("Isn't that lovely?)", True),
    ("Really? No.", False),
    ("Is it ? ok", False),
    ("", False),
    ("Paris.", False),
])
def test_ends_with_question(text, expected):
    assert personas.ends_with_question(text) is expected


@pytest.mark.parametrize("text, expected", [
    ("Use Python for that.", True),
    ("python is fine", True),
    ("In PYTHON: print(x)", True),
    ("Pythonic code", False),
    ("CPython", False),
    ("a python_script.py", False),   # the underscore makes it part of a longer word
    ("(Python)", True),
])
def test_uses_term(text, expected):
    assert personas.uses_term(text, "Python") is expected


def test_uses_term_escapes_the_term():
    assert personas.uses_term("I write C++ daily", "C++")
    assert not personas.uses_term("I write C daily", "C++")


# ---- personas -----------------------------------------------------------------------------------

BRIEF = personas.Persona("brief", "under_words", 5, ("Q?",))


def test_under_words_boundary():
    assert BRIEF.satisfied("one two three four")          # 4 < 5
    assert not BRIEF.satisfied("one two three four five")  # 5 is not under 5
    assert not BRIEF.satisfied("one two")                  # under MIN_WORDS: not an answer
    assert BRIEF.preference == "under 5 words"


def test_every_persona_wants_an_answer_first():
    # The form-only catalogue (the substance personas' floor: tests/test_personas.py).
    for p in personas.FORM_ONLY_PERSONAS.values():
        assert not p.satisfied("")
        short = " ".join(["Python?"] * (p.min_words - 1))  # too few words, whatever the preference
        assert not p.satisfied(short)
        assert p.correction(short) == (personas.NOT_AN_ANSWER if p.min_words <= personas.MIN_WORDS else personas.too_short(p.min_words))
    plain = personas.FORM_ONLY_PERSONAS["plain"]
    assert plain.correction("Sure thing") == personas.NOT_AN_ANSWER
    assert plain.correction("The answer is sleep.") == "No, that's too short. Please answer in full sentences, at least 8 words."
    assert plain.satisfied("Keep a regular bedtime and avoid screens before sleep.")
    form = personas.FORM_ONLY_PERSONAS
    assert personas.MIN_WORDS == 3 and form["terse"].min_words == 1 and personas.PERSONAS["terse"].min_words == 1
    assert form["terse"].satisfied("Rome.") and not form["brief"].satisfied("Rome.")
    assert form["brief"].correction("Sure thing") == personas.NOT_AN_ANSWER


def test_min_words_validation():
    with pytest.raises(ValueError, match="min_words"):
        personas.Persona("x", "no_lists", None, ("Q?",), min_words=0)
    with pytest.raises(ValueError, match="integer above 1"):
        personas.Persona("x", "under_words", 1, ("Q?",), min_words=1)


def test_catalogue_preferences_and_corrections():
    got = {name: (p.preference, p.correction("This reply has more than enough words in it."))
           for name, p in personas.FORM_ONLY_PERSONAS.items()}
    assert got == {
        "brief": ("under 20 words", "No, that's too long. Please answer in under 20 words."),
        "terse": ("under 3 words", "No, that's too long. Please answer in under 3 words."),
        "plain": ("no lists, 8+ words",
                  "No, please don't use lists. Answer in plain sentences, without bullets or numbering."),
        "curious": ("ends with a question",
                    "No, you forgot to ask me something back. End your answer with a question."),
        "pythonista": ("uses the term 'Python'",
                       "No, you didn't use the term Python. Please use the word Python in your answer."),
    }


def test_catalogue_checks():
    form = personas.FORM_ONLY_PERSONAS
    plain, curious, py = form["plain"], form["curious"], form["pythonista"]
    assert plain.satisfied("Boil it for ten minutes, then cool it in cold water.")
    assert not plain.satisfied("Do this:\n1. Boil it for ten minutes.\n2. Eat it.")
    assert curious.satisfied("That sounds fun. What will you paint?") and not curious.satisfied("That sounds fun.")
    assert py.satisfied("In Python, use reversed(x).") and not py.satisfied("Use reversed(x) for that.")



def test_a_list_is_the_opposite_of_plain_on_the_same_questions():
    # bench/principals.py --same-questions: two users ask the same tips, one wants a list, the other none.
    lists, plain = personas.form_only("lists", "a_list", None, personas.TIPS, min_words=8), personas.persona("form:plain")
    listed, prose = "Try these:\n1. Keep a regular bedtime.\n2. Avoid screens late.", "Keep a regular bedtime and avoid screens late at night."
    assert lists.satisfied(listed) and not lists.satisfied(prose) and not lists.satisfied("1. Sleep more.")
    assert plain.satisfied(prose) and not plain.satisfied(listed) and lists.preference == "a list, 8+ words"
    said = lists.correction(prose)
    assert said == "No, please put that in a list: one numbered point per line."
    assert _rules(said) == (-1, rules.guidance(said)) and judging.accept_hint(rules.guidance(said))

def test_persona_spec():
    assert personas.persona("brief") is personas.PERSONAS["brief"]
    assert personas.persona("form:brief") is personas.FORM_ONLY_PERSONAS["brief"]
    assert personas.persona("form:brief:30").param == 30 and personas.persona("form:brief:30").questions == personas.FACTS[0::2]
    substance = personas.persona("brief:30")
    assert substance.param == 30 and substance.items == personas.PERSONAS["brief"].items
    assert substance.held_out == personas.PERSONAS["brief"].held_out and substance.judges_answers
    assert personas.persona("terse:4").min_words == 1 and personas.persona("form:terse:4").min_words == 1
    assert personas.persona("pythonista:Rust").param == "Rust" and personas.persona("form:pythonista:Rust").param == "Rust"
    for bad, message in [("nobody", "unknown persona"), ("brief:x", "not a word count"),
                         ("plain:3", "takes no parameter"), ("brief:3", "integer above 3"),
                         ("form:nobody", "unknown persona"), ("form:plain:3", "takes no parameter")]:
        with pytest.raises(ValueError, match=message):
            personas.persona(bad)


def test_persona_validation():
    with pytest.raises(ValueError, match="kind"):
        personas.Persona("x", "shouting", None, ("Q?",))
    with pytest.raises(ValueError, match="needs a term"):
        personas.Persona("x", "uses_term", " ", ("Q?",))
    with pytest.raises(ValueError, match="at least one question"):
        personas.Persona("x", "no_lists", None, ())


def test_follow_up_messages():
    short, long = "Paris is the capital.", "Paris is the capital of France, a big country."
    assert personas.follow_up(BRIEF, short, next_question="Why?", retry=False, i=0) == (
        True, "Thanks, that's just what I needed. Next question: Why?")
    assert personas.follow_up(BRIEF, short, next_question=None, retry=False, i=1) == (True, "Thank you, perfect.")
    assert personas.follow_up(BRIEF, long, next_question=None, retry=True) == (
        False, "No, that's too long. Please answer in under 5 words.")
    assert personas.follow_up(BRIEF, long, next_question="Why?", retry=False) == (
        False, "No, that's too long. Please answer in under 5 words. Anyway, next question: Why?")
    assert personas.thanks(5) == personas.THANKS[1]


# The rules judge must read the users' words as meant: +1 for thanks, -1 with the correction as hint.
def _rules(said: str, previous: str = "What is gravity?") -> tuple[int, str | None]:
    turn = SimpleNamespace(messages=[{"role": "user", "content": previous}])
    return rules.rules_vote(turn, [{"role": "user", "content": said}])


def test_the_rules_judge_reads_every_thanks_as_positive():
    questions = [q for c in (personas.PERSONAS, personas.FORM_ONLY_PERSONAS) for p in c.values()
                 for q in p.questions + tuple(i.question for i in p.held_out)]
    for i, q in itertools.product(range(len(personas.THANKS)), questions):
        assert _rules(personas.follow_up(BRIEF, "Paris is big.", next_question=q, retry=False, i=i)[1]) == (1, None)
        assert _rules(personas.thanks(i), previous=q) == (1, None)


def test_the_rules_judge_reads_every_correction_as_negative_with_it_as_hint():
    # The form-only catalogue; the substance personas' corrections: tests/test_personas.py.
    for p in list(personas.FORM_ONLY_PERSONAS.values()):
        for text in ("", "1. one\n2. two three four five six seven " * 8):
            if p.satisfied(text):
                continue
            said = p.correction(text)
            hint = rules.guidance(said)  # "No, that's not an answer. Please ..." -> "Please ..."
            assert _rules(said) == (-1, hint) and hint != said
            assert judging.accept_hint(hint) == hint
            for q in p.questions:  # moving on after a failed retry: still negative, the rest of the message the hint
                moved = personas.follow_up(p, text, next_question=q, retry=False)[1]
                assert _rules(moved, previous=said) == (-1, hint)  # the next question is not guidance


# ---- users (pure parts) ---------------------------------------------------------------------------

def test_version_of():
    assert version_of("clawd-v0") == 0 and version_of("clawd-v12") == 12
    assert version_of(None) is None and version_of("fp_44709d6fcb") is None and version_of("clawd-v") is None


def test_tool_result():
    assert json.loads(tool_result("lookup", '{"query": " bees "}')) == {
        "query": "bees", "summary": "The encyclopedia has a short article on bees."}
    assert json.loads(tool_result("search", "{}")) == {"error": "unknown tool 'search'"}
    assert json.loads(tool_result("lookup", "{not json")) == {"error": "arguments are not JSON"}
    assert json.loads(tool_result("lookup", '{"q": 1}')) == {"error": "lookup needs a query"}
    assert json.loads(tool_result("lookup", None)) == {"error": "arguments are not JSON"}
    # The rules judge reads these as the tool working, or not.
    assert not rules.is_tool_error(tool_result("lookup", '{"query": "bees"}'))
    assert rules.is_tool_error(tool_result("search", "{}"))
    assert TOOLS[0]["function"]["name"] == "lookup"


def test_plans_cycle_personas_and_styles_and_repeat_with_the_seed():
    ps = [personas.PERSONAS["brief"], personas.PERSONAS["plain"]]
    plans = list(itertools.islice(plan_sessions(ps, seed=3), 16))
    assert [p.persona.name for p in plans[:4]] == ["brief", "plain", "brief", "plain"]
    assert [p.style for p in plans[:8:2]] == ["stitched", "headed", "stitched_done", "headed_abandoned"]
    assert [(p.identity, p.ending) for p in plans[1:8:2]] == list(STYLES)
    assert plans == list(itertools.islice(plan_sessions(ps, seed=3), 16))
    assert plans != list(itertools.islice(plan_sessions(ps, seed=4), 16))
    for p in plans:
        assert 1 <= len(p.questions) <= 3 and len(set(p.questions)) == len(p.questions)
        assert set(p.questions) <= set(p.persona.questions)
        assert not (p.tools and p.stream)
    assert plans[0].session_id is None and plans[0].headers() == {}
    assert plans[0].headers(closing=True) == {"X-Session-Done": "1"}
    assert plans[2].session_id == "sim-3-2"
    assert plans[2].headers(closing=True) == {"X-Session-Id": "sim-3-2", "X-Session-Done": "1"}
    assert plans[2].user == "sim-3-2-brief"
    assert len({p.request_seed(0) for p in plans}) == 16
    with pytest.raises(ValueError):
        next(plan_sessions([], seed=0))
    with pytest.raises(ValueError):
        next(plan_sessions(ps, seed=0, questions=(2, 1)))


def _reply(version, persona, satisfied, kind="answer", attempt=0, words=10, correct=None, styled=None):
    correct, styled = (satisfied if x is None else x for x in (correct, styled))
    return Reply(0, persona, "headed", kind, 1, 0, attempt, version, satisfied, words, 12, "stop", 0.1, "",
                 correct, styled)


def test_summaries():
    # the first: the right answer in the wrong style; the second: the wrong answer in the right style
    replies = [_reply(0, "brief", False, correct=True), _reply(0, "brief", True, attempt=1),
               _reply(0, "plain", False, styled=True),
               _reply(0, "plain", None, kind="tool_call"), _reply(1, "brief", True), _reply(None, "brief", True),
               _reply(1, "plain", None, kind="closing")]
    assert rate(replies[:3]) == pytest.approx(1 / 3) and rate([]) is None
    assert (rate(replies[:3], "correct"), rate(replies[:3], "styled")) == (pytest.approx(2 / 3), pytest.approx(2 / 3))
    assert [(r.correct, r.styled) for r in replies[:4]] == [(True, False), (True, True), (False, True), (None, None)]
    assert [r.reward for r in replies[:4]] == [-1, 1, -1, None]
    assert by_version(replies) == {
        0: {"answers": 3, "satisfied": pytest.approx(1 / 3), "correct": pytest.approx(2 / 3),
            "styled": pytest.approx(2 / 3), "reward": pytest.approx(-1 / 3), "first_try": 0.0,
            "first_try_answers": 2, "personas": {"brief": 0.5, "plain": 0.0}},
        1: {"answers": 1, "satisfied": 1.0, "correct": 1.0, "styled": 1.0, "reward": 1.0, "first_try": 1.0,
            "first_try_answers": 1, "personas": {"brief": 1.0}}}
    assert by_persona(replies) == {
        "brief": {"n": 4, "satisfied": 0.75, "correct": 1.0, "styled": 0.75, "words": 10.0},
        "plain": {"n": 1, "satisfied": 0.0, "correct": 0.0, "styled": 1.0, "words": 10.0}}


def test_to_toml():
    assert to_toml({"a": {"x": 1, "s": "q\"", "b": True, "l": [1, "two"], "t": {"k": 0.5}}, "b": {}}) == (
        '[a]\nx = 1\ns = "q\\""\nb = true\nl = [1, "two"]\nt = { k = 0.5 }\n\n[b]\n')


# ---- users against a real daemon ------------------------------------------------------------------

SHORT, LONG = "Rome is the capital.", "Rome is the capital city of Italy, and it is very old indeed."
LOOKUP_CALL = '<tool_call>\n{"name": "lookup", "arguments": {"query": "spiders"}}\n</tool_call>'


class ScriptedModel:
    """The fake engine's answers: to a question, a lookup call when tools are offered, then (or without
    tools) a long answer; to a correction, a short answer."""

    def __init__(self, tiny_model):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
        self.eos = self.tok.token_to_id("<|im_end|>")

    def __call__(self, input_ids, sampling_params):
        prompt = self.tok.decode(input_ids, skip_special_tokens=False)
        turns = prompt.split("<|im_start|>user")[1:]  # tool results are rendered as user turns too
        said = [t for t in turns if "<tool_response>" not in t][-1]
        if "too long" in said:
            text = SHORT
        elif "# Tools" in prompt and "<tool_response>" not in turns[-1]:
            text = LOOKUP_CALL
        else:
            text = LONG
        return self.tok.encode(text, add_special_tokens=False).ids + [self.eos]


@pytest.mark.slow
async def test_users_form_the_sessions_they_mean(tiny_model, tmp_path):
    from .fake_sglang import FakeSGLang
    from .harness import wait_ready_async
    brief = personas.form_only("brief", "under_words", 5, personas.FACTS)
    plans = list(itertools.islice(plan_sessions([brief], seed=5, tool_share=0.5, stream_share=0.5), 8))
    assert {p.style for p in plans} == {"stitched", "headed", "stitched_done", "headed_abandoned"}
    assert any(p.tools for p in plans) and any(p.stream for p in plans) and any(len(p.questions) > 1 for p in plans)
    script = ScriptedModel(tiny_model)
    async with FakeSGLang(responder=script, eos_id=script.eos) as fake:
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)},
                                   "engine": {"launch": "none", "url": fake.url, "health_interval": 0.2},
                                   "sessions": {"session_idle_timeout": 1.0, "sweep_interval": 0.2},
                                   "auth": {"trust_user_field": True}},  # users told apart by `user`, as in the demo
                        wait_ready=False)
        try:
            await wait_ready_async(daemon)
            users = Users(daemon.url, [brief], seed=5, concurrency=4, keep_text=True)
            await asyncio.gather(*(users.session(p) for p in plans))
            probe = await users.probe(brief, 0, seed=3)
            await asyncio.sleep(2.0)  # the abandoned sessions reach their idle timeout
            await users.close()
        finally:
            assert daemon.stop() == 0
    assert users.errors == [] and users.ended == {"done": 4, "abandoned": 4}
    assert {r.version for r in users.replies} == {0}
    assert probe.kind == "probe" and probe.satisfied is False and probe.version == 0

    turns, judged = daemon.records(), daemon.records("judge")
    assert all(t["principal"] != "sim-probe" for t in turns)  # probes are side turns: never in the records
    verdicts = {(j["session_id"], j["turn_index"]): j for j in judged}
    for plan in plans:
        mine = sorted((t for t in turns if t["principal"] == plan.user), key=lambda t: t["turn_index"])
        replies = [r for r in users.replies if r.session == plan.index]
        assert [t["turn_index"] for t in mine] == list(range(len(replies)))
        sid = {t["session_id"] for t in mine}
        assert len(sid) == 1, plan  # one conversation, with or without a header
        sid = sid.pop()
        assert sid == plan.session_id if plan.identity == "headed" else not sid.startswith("sim-")
        assert mine[-1]["next_state"] is None
        assert mine[-1]["reason"] == ("session_done" if plan.ending == "done" else "idle_timeout")
        assert all(t["next_state"] and t["reason"] is None for t in mine[:-1])
        # The answers: long first (corrected), short after a correction (thanked).
        answers = [r for r in replies if r.kind == "answer"]
        assert [r.satisfied for r in answers] == [False, True] * len(plan.questions), [r.text for r in answers]
        assert replies[-1].kind == ("closing" if plan.ending == "done" else "answer")
        assert [r.kind == "tool_call" for r in replies].count(True) == (len(plan.questions) if plan.tools else 0)
        for r, t in zip(replies, mine):
            verdict = verdicts[(sid, t["turn_index"])]
            if t is mine[-1]:
                assert not verdict["emitted"] and verdict["reason"] == t["reason"]
            elif r.kind == "tool_call":  # a tool that answered says nothing about the call: score 0
                assert t["next_state"][0]["role"] == "tool" and verdict["reason"] == "score_zero"
                assert json.loads(t["next_state"][0]["content"])["query"] == "spiders"
            else:  # the rules judge read the user's words as the user meant them
                assert verdict["emitted"] and verdict["reward"] == r.reward
                assert verdict["hint"] is None  # rl mode asks for no hint


@pytest.mark.slow
async def test_users_see_the_policy_version_move(tiny_model, tmp_path):
    """The CPU engine on the tiny model, the learner on: replies carry the version that served them."""
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 8},
                               "engine": {"launch": "local", "seed": 1},
                               "learner": {"enabled": True, "rollout_batch_size": 4, "min_batch_size": 1},
                               "train": {"checkpoint_every": 1000, "optimizer": {"lr": 3e-2},
                                         "loss": {"reward_baseline": "batch_mean"}}})
    try:
        # Form-only: users.py judges a reply by its text alone (a substance persona needs the question).
        users = Users(daemon.url, [personas.FORM_ONLY_PERSONAS["terse"]], seed=2, concurrency=4, max_tokens=8)

        async def one_step() -> None:  # until a reply served by a published version came back
            for _ in range(900):
                if any(r.version for r in users.replies):
                    break
                await asyncio.sleep(0.1)
            users.stop()
        await asyncio.gather(users.run(), one_step())
        await users.close()
    finally:
        assert daemon.stop() == 0
    assert users.errors == []
    versions = by_version(users.replies)
    assert 0 in versions and max(versions) >= 1, versions
    assert all(r.version is not None for r in users.replies)


def test_the_demo_puts_the_repository_on_the_daemons_path_not_the_package():
    """clawd/ on sys.path would let its modules shadow the standard library's (it once made the demo's engine
    crash in a loop); the launcher's root is the directory that holds the package."""
    from clawd.tools.sim import launch
    assert (launch.REPO / "clawd" / "daemon.py").is_file() and (launch.REPO / "bin" / "clawd").is_file()


@pytest.mark.slow
def test_make_demo_runs_end_to_end_on_the_tiny_model(tiny_model, tmp_path):
    """`make demo`'s whole path (launch, users, training, evaluation before and after, summary and plot), short
    and on the tiny model: the suite runs no demo otherwise, and a broken launcher once went unnoticed."""
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "clawd.tools.sim.demo", "--model", str(tiny_model), "--minutes", "3",
                           "--steps", "1", "--probes", "2", "--guard", "3", "--concurrency", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["users"]["sessions"] > 0 and summary["versions"] and (out / "learning.png").stat().st_size > 0
    assert summary["daemon"]["exit"] == 0 and not summary["users"]["errors"], summary
    evaluation = summary["degeneration"]["evaluation"]  # the metrics the behaviour monitors watch
    assert evaluation["before"]["replies"] == evaluation["after"]["replies"] == 2 * len(summary["personas"])
    # each probe sampled and greedy, paired, and the guard's 3 greedy answers
    assert summary["evaluation"]["satisfied (sampled)"]["n"] == summary["evaluation"]["satisfied (greedy)"]["n"] == 2
    assert summary["evaluation"]["guard: correct"]["n"] == 3 and summary["headline"]["guard_n"] == 3
    assert summary["guard_questions"].startswith("3:")  # which questions: runs pooled must share them
    # The gate and the monitors run (the demo's default): every version has a record, each new one its verdict.
    history = {v["version"]: v for v in summary["safety"]["versions"]}
    assert 0 in history and all(v["gate"] is not None for n, v in history.items() if n > 0), summary["safety"]


def test_retry_after_reads_the_header_with_a_default_and_a_cap():
    assert [retry_after(h) for h in ({"retry-after": "2"}, {}, {"retry-after": "3600"},
                                     {"retry-after": "Wed, 21 Oct 2026 07:28:00 GMT"}, {"retry-after": "-5"})] \
        == [2.0, 1.0, RETRY_AFTER_MAX, 1.0, 0.0]


async def test_users_told_to_come_back_later_wait_before_the_next_session():
    """A 503 with Retry-After (what clawd answers while its engine restarts): each user waits it out before its
    next session, so two users over 1.5 s make 4 requests, not the hundreds that once turned a 12-second engine
    restart into 3,330 errors."""
    from aiohttp import web
    hits = []

    async def busy(request: web.Request) -> web.Response:
        hits.append(asyncio.get_running_loop().time())
        return web.json_response({"error": {"message": "The model engine is not ready", "type": "server_error",
                                            "param": None, "code": "engine_unavailable"}},
                                 status=503, headers={"Retry-After": "1"})
    app = web.Application()
    app.router.add_post("/v1/chat/completions", busy)
    async with serving(app) as url:
        users = Users(url, [personas.form_only("brief", "under_words", 5, personas.FACTS)], seed=1, concurrency=2)
        try:
            end = asyncio.get_running_loop().time() + 1.5
            await asyncio.wait_for(users.run(until=lambda: asyncio.get_running_loop().time() > end), 10)
        finally:
            await users.close()
    assert len(hits) == 4 and users.ended == {"error": 4} and len(users.errors) == 4
    assert min(b - a for a, b in zip(sorted(hits)[::2], sorted(hits)[2::2])) >= 0.95  # each waited its second
