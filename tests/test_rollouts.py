"""Active rollouts (clawd/rollouts): group advantages (exact values), and the worker that runs a deployment's
code under a time limit, on real processes."""
import asyncio
import json
import math
import os
import time

import pytest

from clawd.rollouts.groups import agree, group_advantages, turn_returns
from clawd.rollouts.tasks import checker_score, final_answer, final_number, local_score, parse_task
from clawd.rollouts.tasks import load as load_tasks
from clawd.rollouts.worker import CallFailed, DeploymentWorker
from clawd.safety.evalset import EvalSetError

T = "tests.rollout_targets"


@pytest.fixture
async def worker():
    """A deployment worker, closed (its process killed) when the test ends."""
    w = DeploymentWorker()
    yield w
    await w.close()


# --- group advantages ---------------------------------------------------------------------------

def test_a_groups_advantages_are_its_rewards_less_their_mean():
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([1.0, 0.0, 0.0, 0.0]) == [0.75, -0.25, -0.25, -0.25]  # a hard prompt: one right
    assert group_advantages([0.2, 0.6]) == pytest.approx([-0.2, 0.2], abs=1e-15)


def test_with_std_they_are_divided_by_the_groups_standard_deviation():
    got = group_advantages([1.0, 0.0, 0.0, 0.0], "std")
    std = math.sqrt((0.75 ** 2 + 3 * 0.25 ** 2) / 4)  # population std: 0.4330...
    assert got == pytest.approx([0.75 / (std + 1e-6), -0.25 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 2, rel=1e-12)
    assert group_advantages([1.0, 0.0], "std") == pytest.approx([1.0, -1.0], abs=1e-5)  # ±1 std from the mean


def test_a_group_whose_rewards_agree_or_that_has_one_answer_is_dropped():
    assert agree([1.0, 1.0, 1.0]) and not agree([1.0, 1.0, 0.0])
    assert group_advantages([1.0, 1.0, 1.0]) is None and group_advantages([0.0, 0.0], "std") is None
    assert group_advantages([1.0]) is None and group_advantages([]) is None
    assert group_advantages([1.0, math.nan]) is None
    with pytest.raises(ValueError, match="scale"):
        group_advantages([1.0, 0.0], "max")


def test_an_episodes_reward_reaches_its_turns_discounted_by_the_turns_after_them():
    assert turn_returns(1.0, 3) == [1.0, 1.0, 1.0]
    assert turn_returns(1.0, 3, 0.5) == [0.25, 0.5, 1.0]
    assert turn_returns(-0.5, 1, 0.9) == [-0.5]
    for bad in ((1.0, 0), (1.0, 2, 0.0), (1.0, 2, 1.5)):
        with pytest.raises(ValueError):
            turn_returns(*bad)


# --- the deployment worker -----------------------------------------------------------------------

async def test_calls_run_in_a_worker_process_and_their_answers_come_back_as_json(worker):
    assert await worker.call(f"{T}:add", 2, 3, timeout=30) == 5
    assert await worker.call(f"{T}:echo", "x", [1, 2], {"k": [3]}, timeout=30) == ["x", [1, 2], {"k": [3]}]
    child = await worker.call(f"{T}:pid", timeout=30)
    assert child == worker.pid != os.getpid()


async def test_a_call_past_its_limit_is_cut_and_the_next_call_gets_a_fresh_worker(worker):
    first = await worker.call(f"{T}:pid", timeout=30)
    started = time.monotonic()
    with pytest.raises(CallFailed) as info:
        await worker.call(f"{T}:hang", timeout=0.5)  # a busy loop: only SIGKILL ends it
    assert info.value.kind == "timeout" and time.monotonic() - started < 5
    assert worker.timeouts == 1 and worker.pid is None
    second = await worker.call(f"{T}:pid", timeout=30)
    assert second != first and worker.restarts == 1


async def test_the_loop_runs_while_a_call_hangs(worker):
    await worker.call(f"{T}:pid", timeout=30)
    ticks = 0

    async def tick():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    with pytest.raises(CallFailed):
        await worker.call(f"{T}:hang", timeout=0.5)
    ticker.cancel()
    assert ticks >= 20  # 0.5 s of 10 ms ticks, allowing for a loaded machine


async def test_an_exception_is_the_calls_answer_and_the_worker_lives_on(worker):
    first = await worker.call(f"{T}:pid", timeout=30)
    for target, args, kind, text in [(f"{T}:boom", ("no",), "raised", "ValueError: no"),
                                     (f"{T}:not_json", (), "raised", "TypeError"),
                                     (f"{T}:missing", (), "bad_target", "AttributeError"),
                                     (f"{T}:NOT_CALLABLE", (), "bad_target", "not callable"),
                                     ("no.such.module:f", (), "bad_target", "ModuleNotFoundError"),
                                     ("add", (), "bad_target", "module:function")]:
        with pytest.raises(CallFailed) as info:
            await worker.call(target, *args, timeout=30)
        assert info.value.kind == kind and text in info.value.message, (target, info.value)
    assert await worker.call(f"{T}:pid", timeout=30) == first and worker.restarts == 0


async def test_a_worker_that_dies_fails_its_call_and_is_replaced(worker):
    first = await worker.call(f"{T}:pid", timeout=30)
    with pytest.raises(CallFailed) as info:
        await worker.call(f"{T}:die", timeout=30)
    assert info.value.kind == "died"
    assert await worker.call(f"{T}:add", 1, 1, timeout=30) == 2 and worker.pid != first


# --- prompt sets and their checkers ----------------------------------------------------------------

@pytest.mark.parametrize("text, number", [
    ("The answer is 1,234.5.", 1234.5), ("−3 degrees", -3.0), ("from 2 to 2e3", 2000.0),
    ("12 apples and 7 pears: 19", 19.0), ("no digits here", None), ("x2 and v3", None), (None, None),
    ("it is 0.5", 0.5), ("1,23 is not grouped", 23.0),
])
def test_a_replys_final_number(text, number):
    assert final_number(text) == number


@pytest.mark.parametrize("text, answer", [
    ("Let me think.\nAnswer: Paris.", "Paris"), ("The final answer is **Lisbon**", "Lisbon"),
    ("Rome\n\n", "Rome"), ("first line\nsecond line.", "second line"), ("   ", None), (None, None),
    ("answer: 3. Answer: 4", "4"), ("Answer:\n\n  Oslo\nbecause", "Oslo"), ("no marker answer", "no marker answer"),
])
def test_a_replys_final_answer(text, answer):
    assert final_answer(text) == answer


def test_a_task_scores_one_when_every_rule_holds():
    task = parse_task({"id": "sum", "messages": [{"role": "user", "content": "17 + 25?"}],
                       "check": {"number": 42, "max_words": 20}}, "line-1")
    assert (task.number, task.tolerance, task.check.max_words, task.callable) == (42.0, 1e-6, 20, None)
    assert local_score(task, "It is 42.") == 1.0
    assert local_score(task, "It is 41.") == 0.0 and local_score(task, None) == 0.0
    assert local_score(task, "42 " + "word " * 30) == 0.0  # the gate's rule holds too
    close = parse_task({"messages": [{"role": "user", "content": "pi?"}],
                        "check": {"number": 3.14159, "tolerance": 0.001}}, "line-2")
    assert close.id == "line-2" and close.check is None
    assert local_score(close, "about 3.1416") == 1.0 and local_score(close, "3.15") == 0.0
    exact = parse_task({"messages": [{"role": "user", "content": "Capital of France?"}],
                        "check": {"exact": "paris", "callable": "pkg.mod:check"}}, "line-3")
    assert exact.callable == "pkg.mod:check"
    assert local_score(exact, "Answer: Paris") == 1.0 and local_score(exact, "Paris, France") == 0.0
    gate_only = parse_task({"messages": [{"role": "user", "content": "Hi"}], "check": {"contains": "hi"}}, "l")
    assert gate_only.number is None and local_score(gate_only, "Hi there") == 1.0


@pytest.mark.parametrize("check, problem", [
    ({"tolerance": 0.1}, "tolerance goes with number"),
    ({"number": 1, "tolerance": -1}, "tolerance must be a finite number >= 0"),
    ({"number": "7"}, "number must be a finite number"),
    ({"exact": " "}, "exact must be a non-blank string"),
    ({"callable": "not a path"}, "callable must name a function"),
    ({"callable": "os:system", "bogus": 1}, "unknown check rule"),
    ({}, "check is empty"),
])
def test_a_bad_task_says_what_is_wrong(check, problem):
    with pytest.raises(ValueError, match=problem):
        parse_task({"messages": [{"role": "user", "content": "q"}], "check": check}, "line-1")


def test_a_set_file_loads_with_the_gates_rules_and_names_the_line_of_a_mistake(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "2+2?"}], "check": {"number": 4}}\n\n'
                    '{"id": "b", "messages": [{"role": "user", "content": "Hi"}], "check": {"contains_any": ["hi"]}}\n')
    assert [t.id for t in load_tasks(path)] == ["a", "b"]
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "2+2?"}], "check": {"number": 4}}\n'
                    '{"id": "a", "messages": [{"role": "user", "content": "3+3?"}], "check": {"number": NaN}}\n')
    with pytest.raises(EvalSetError, match=r"set.jsonl:2: NaN is not a number JSON allows"):
        load_tasks(path)


def test_a_checkers_answer_is_a_bool_or_a_score_in_zero_to_one():
    assert (checker_score(True), checker_score(False), checker_score(0.25), checker_score(1)) == (1.0, 0.0, 0.25, 1.0)
    for bad in (1.5, -0.1, math.nan, "1", None):
        with pytest.raises(ValueError, match="a checker returns"):
            checker_score(bad)


# --- environments and the agent loop -----------------------------------------------------------------

CALC = "clawd.rollouts.envs.calculator:Calculator"


def test_the_calculator_answers_its_tools_and_says_what_is_wrong_as_an_observation():
    from clawd.rollouts.envs.calculator import Calculator, convert, evaluate, question
    assert question(3) == question(3) and evaluate("213 * 23") == 4899.0 and evaluate("2 ** 10 - 1") == 1023.0
    assert convert(26.2, "mi", "km") == pytest.approx(42.16481, rel=1e-6) and convert(212, "F", "C") == 100.0
    env = Calculator()
    text, answer, tolerance = question(2)
    assert env.reset(2).startswith(text) and (answer, tolerance) == (213 * 23, 0.0)
    assert env.step({"tool": "calculate", "arguments": {"expression": "213*23"}}) == ("4899", 0.0, False, {})
    for action, said in [({"tool": "calculate", "arguments": {"expression": "__import__('os')"}}, "is not allowed"),
                         ({"tool": "calculate", "arguments": {"expression": "1/0"}}, "division by zero"),
                         ({"tool": "calculate", "arguments": {"expression": "9**99"}}, "exponents above 64"),
                         ({"tool": "convert", "arguments": {"value": 1, "from_unit": "mi", "to_unit": "kg"}},
                          "cannot convert length"),
                         ({"tool": "search", "arguments": {}}, "there is no tool named 'search'")]:
        observation, reward, done, info = env.step(action)
        assert said in observation and (reward, done, info) == (0.0, False, {"error": True}), observation
    assert env.step({"answer": "The answer is 4,899."})[1:3] == (1.0, True)
    env.reset(2)
    assert env.step({"answer": "4898"})[1:3] == (0.0, True)


class ScriptedEngine:
    """An engine's /generate in SGLang 0.5.23's shape, answering each turn with the next scripted text."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.payloads = tokenizer, list(texts), []

    async def __call__(self, payload):
        self.payloads.append(payload)
        ids = self.tokenizer.encode(self.texts.pop(0))
        return {"text": "", "output_ids": ids, "meta_info": {
            "output_token_logprobs": [[-0.25 - i / 100, t, None] for i, t in enumerate(ids)],
            "finish_reason": {"type": "stop"}}}


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_model):
    from clawd.tokenizer import ChatTokenizer
    return ChatTokenizer(tiny_model)


async def test_an_episode_keeps_each_turns_exact_ids_and_ends_with_the_environments_reward(chat_tokenizer, worker):
    from clawd.rollouts.episode import run_episode
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "213*23"}}</tool_call>'
    engine = ScriptedEngine(chat_tokenizer, [call, "The answer is 4899."])
    episode = await run_episode(CALC, 2, worker, engine, chat_tokenizer)
    assert (episode.ended, episode.reward, episode.errors, len(episode.turns)) == ("done", 1.0, 0, 2)
    first, second = episode.turns
    assert [p["input_ids"] for p in engine.payloads] == [first.prompt_ids, second.prompt_ids]
    assert first.output_ids == chat_tokenizer.encode(call) and first.text == call
    assert first.logprobs == [-0.25 - i / 100 for i in range(len(first.output_ids))]
    roles = [m["role"] for m in episode.transcript]
    assert roles == ["user", "assistant", "tool", "assistant", "user"]
    assert episode.transcript[2]["content"] == "4899" and episode.transcript[1]["tool_calls"][0]["function"] == \
        {"name": "calculate", "arguments": '{"expression": "213*23"}'}
    # the second prompt is the conversation rendered with the tool's answer in it
    assert second.prompt_ids == chat_tokenizer.encode_chat(episode.transcript[:3], episode_tools())


def episode_tools():
    from clawd.rollouts.envs.calculator import CALCULATOR_TOOLS
    return CALCULATOR_TOOLS


async def test_malformed_calls_and_a_raising_tool_are_observations_and_the_turn_bound_holds(chat_tokenizer, worker):
    from clawd.rollouts.episode import EpisodeLimits, run_episode
    bad_markup = "<tool_call>{not json</tool_call>"
    bad_args = '<tool_call>{"name": "calculate", "arguments": "2+2"}</tool_call>'
    loop = '<tool_call>{"name": "calculate", "arguments": {"expression": "1+1"}}</tool_call>'
    engine = ScriptedEngine(chat_tokenizer, [bad_markup, bad_args, loop, loop])
    episode = await run_episode(CALC, 5, worker, engine, chat_tokenizer, EpisodeLimits(max_turns=4))
    assert (episode.ended, episode.reward, episode.errors, len(episode.turns)) == ("max_turns", 0.0, 2, 4)
    said = [m["content"] for m in episode.transcript if m["role"] in ("tool", "user")][1:]
    assert "could not be read" in said[0] and "must be a JSON object" in said[1] and said[2:] == ["2", "2"]
    engine = ScriptedEngine(chat_tokenizer, ['<tool_call>{"name": "explode", "arguments": {}}</tool_call>',
                                             "done"])
    episode = await run_episode("tests.rollout_targets:RaisingEnv", 0, worker, engine, chat_tokenizer)
    assert (episode.ended, episode.reward, episode.errors) == ("done", 0.5, 1)
    assert episode.transcript[2]["content"] == "error: RuntimeError: the tool broke"
    engine = ScriptedEngine(chat_tokenizer, ["anything"] * 6)  # a step that breaks the protocol: an error
    episode = await run_episode("tests.rollout_targets:BadStepEnv", 0, worker, engine, chat_tokenizer)
    assert (episode.ended, episode.errors, len(episode.turns)) == ("max_turns", 6, 6)
    assert "step must return (observation, reward, done, info)" in episode.transcript[2]["content"]


async def test_an_environment_that_hangs_is_cut_and_ends_its_episode(chat_tokenizer, worker):
    from clawd.rollouts.episode import EpisodeLimits, run_episode
    engine = ScriptedEngine(chat_tokenizer, ['<tool_call>{"name": "wait", "arguments": {}}</tool_call>'])
    started = time.monotonic()
    episode = await run_episode("tests.rollout_targets:HangingEnv", 0, worker, engine, chat_tokenizer,
                                EpisodeLimits(env_timeout=0.5))
    assert (episode.ended, episode.reward, len(episode.turns)) == ("env_failed", 0.0, 1)
    assert time.monotonic() - started < 10 and worker.timeouts == 1
    episode = await run_episode("no.such:Env", 0, worker, engine, chat_tokenizer)
    assert episode.ended == "env_failed" and episode.turns == []


@pytest.mark.slow
async def test_an_episode_on_the_real_cpu_engine_keeps_what_the_engine_consumed_and_produced(tiny_model,
                                                                                             chat_tokenizer, worker):
    from clawd.engine.client import EngineClient
    from clawd.engine.local.scheduler import Engine
    from clawd.engine.local.server import parse_args
    from clawd.rollouts.episode import EpisodeLimits, run_episode
    from tests.local_engine import running

    async with running(Engine(parse_args(["--model", str(tiny_model), "--threads", "1", "--seed", "0"]))) as url:
        client = EngineClient(url)
        await client.start()
        try:
            episode = await run_episode(CALC, 11, worker, client.generate, chat_tokenizer,
                                        EpisodeLimits(max_turns=3, max_new_tokens=12, temperature=1.0))
        finally:
            await client.close()
    assert episode.turns and episode.ended in ("done", "max_turns")
    first = episode.turns[0]
    assert first.prompt_ids == chat_tokenizer.encode_chat(episode.transcript[:1], episode_tools())
    for turn in episode.turns:  # every turn as the engine produced it: ids, one log-prob each, the text they are
        assert 0 < len(turn.output_ids) == len(turn.logprobs) <= 12 and all(lp <= 0 for lp in turn.logprobs)
        assert turn.text == chat_tokenizer.decode(turn.output_ids)


def test_a_groups_members_become_samples_with_their_advantages_spread_over_their_turns():
    from clawd.rollouts.groups import Member, group_samples
    turn = lambda k: ([1, 2, 3], [10 + k, 20 + k], [-0.5, -0.25])  # noqa: E731
    members = [Member((turn(0), turn(1)), 1.0), Member((turn(2),), 0.0), Member((), 0.0)]  # the last: no turn
    samples, advantages = group_samples("g1", members, source="env", principal="@rollouts", policy_version=3,
                                        temperature=0.7, discount=0.5, created=1.0, scored=2.0)
    assert advantages == [1 - 1 / 3, 0 - 1 / 3, 0 - 1 / 3]  # undiscounted: the members', as the record keeps them
    # advantages 1 - 1/3 and -1/3 (the turnless member counts in the mean, as its reward does)
    assert [(s.sample_id, s.turn_index, s.advantage, s.reward) for s in samples] == [
        ("g1-0-0", 0, (1 - 1 / 3) * 0.5, 1.0), ("g1-0-1", 1, 1 - 1 / 3, 1.0), ("g1-1-0", 0, 0 - 1 / 3, 0.0)]
    first = samples[0]
    assert (first.tokens, first.response_length, first.loss_mask, first.rollout_logprobs) == \
        ([1, 2, 3, 10, 20], 2, [1, 1], [-0.5, -0.25])
    assert (first.source, first.principal, first.policy_version, first.temperature, first.has_hint, first.mode) == \
        ("env", "@rollouts", 3, 0.7, False, "rl")
    assert group_samples("g2", [Member((turn(0),), 1.0)] * 3, source="set", principal="@rollouts",
                         policy_version=0, temperature=1.0) == ([], None)  # all solved: nothing to tell apart


# --- the rollout source --------------------------------------------------------------------------------

class Store:
    """What the source needs of the sample store: a put, and the waiting samples by principal."""

    def __init__(self):
        self.samples = []

    async def put(self, sample):
        self.samples.append(sample)

    def waiting(self):
        import collections
        return dict(collections.Counter(s.principal for s in self.samples))


def source_for(chat_tokenizer, engine, store, worker, tasks=(), environments=(), live=lambda: 0, record=None,
               priority=None, judge=None, **cfg):
    from clawd.config.rollouts import RolloutsConfig
    from clawd.rollouts.source import RolloutSource
    config = RolloutsConfig(enabled=True, environments=tuple(environments), **cfg)
    return RolloutSource(config, tasks=tuple(tasks), tokenizer=chat_tokenizer, generate=engine, put=store.put,
                         waiting=store.waiting, live=live, version=lambda: 7, worker=worker, record=record,
                         priority=priority, judge=judge)


async def test_a_set_items_answers_are_scored_and_become_one_group(chat_tokenizer, worker):
    task = parse_task({"id": "sum", "messages": [{"role": "user", "content": "17 + 25?"}],
                       "check": {"number": 42, "callable": f"{T}:half_credit"}}, "x")
    engine = ScriptedEngine(chat_tokenizer, ["It is 42 (sum)", "41", "42", "42, sum"])
    store = Store()
    source = source_for(chat_tokenizer, engine, store, worker, [task], samples_per_prompt=4, temperature=0.5,
                        priority=-100)
    samples = await source.group("set", task)
    assert [p["priority"] for p in engine.payloads] == [-100] * 4  # each call yields to live ones at the engine
    # scores: 42 and "sum" in it: 1 × 0.5; 41: 0; 42 without "sum": 1 × 0 (the checker's 0); 42 with it: 0.5
    assert [s.reward for s in samples] == [0.5, 0.0, 0.0, 0.5]
    assert [s.advantage for s in samples] == [0.25, -0.25, -0.25, 0.25]
    assert {(s.source, s.principal, s.policy_version, s.temperature) for s in samples} == \
        {("set", "@rollouts/set", 7, 0.5)}
    assert [s.response_ids for s in samples] == [chat_tokenizer.encode(t) for t in
                                                ["It is 42 (sum)", "41", "42", "42, sum"]]
    assert samples[0].prompt_ids == chat_tokenizer.encode_chat(task.chat(), None)
    assert source.stats.groups == 1 and source.stats.answers == 4 and source.stats.dropped_agree == 0


class RubricJudge:
    """The judge model's `complete`: YES when the quoted reply says "Blue", NO otherwise, and no answer at all
    (JudgeFailed, as a judge past its retries) when it says "Grey"."""

    def __init__(self):
        self.asked = []

    async def complete(self, messages):
        from clawd.scoring.judges import JudgeFailed
        text = "\n".join(m["content"] for m in messages)
        self.asked.append(text)
        if "Grey" in text:
            raise JudgeFailed("timeout")
        return "YES" if "Blue" in text else "NO"


async def test_a_rubric_is_asked_of_the_judge_once_the_other_rules_hold(chat_tokenizer, worker):
    task = parse_task({"id": "sky", "messages": [{"role": "user", "content": "The sky's colour, and 6 x 7?"}],
                       "check": {"number": 42, "rubric": "Does the reply say the sky is blue?"}}, "x")
    assert task.rubric == "Does the reply say the sky is blue?"
    engine = ScriptedEngine(chat_tokenizer, ["Blue; 42", "Blue; 41", "Green; 42", "Grey; 42"])
    judge = RubricJudge()
    source = source_for(chat_tokenizer, engine, Store(), worker, [task], samples_per_prompt=4, judge=judge)
    samples = await source.group("set", task)
    # YES; the number wrong (the judge not asked); NO; the judge gave no answer (scored 0, counted)
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 0.0]
    assert [s.advantage for s in samples] == [0.75, -0.25, -0.25, -0.25]
    assert len(judge.asked) == 3 and not any("Blue; 41" in a for a in judge.asked)  # (a nonce may hold "41")
    assert all("Does the reply say the sky is blue?" in a for a in judge.asked)
    assert source.stats.judge_failures == 1


def test_a_set_with_a_rubric_is_refused_with_the_config_when_no_judge_model_answers_it(tmp_path, capsys):
    from clawd.cli import EXIT_CONFIG, main
    from clawd.tools.tomlfile import to_toml
    (tmp_path / "set.jsonl").write_text(json.dumps({"id": "sky", "messages": [{"role": "user", "content": "Sky?"}],
                                                    "check": {"rubric": "Does it say blue?"}}) + "\n")
    path = tmp_path / "clawd.toml"
    for backend, expected in (("rules", EXIT_CONFIG), ("sglang", 0)):
        path.write_text(to_toml({"state": {"dir": str(tmp_path / "state")}, "judge": {"backend": backend},
                                 "scoring": {"mode": "rl"}, "learner": {"enabled": True},
                                 "rollouts": {"enabled": True, "set": str(tmp_path / "set.jsonl")}}))
        assert main(["--config", str(path), "--check-config"]) == expected, backend
    assert "sky has a rubric, which needs a judge model" in capsys.readouterr().err


async def test_a_group_whose_answers_agree_is_dropped_and_an_environment_group_spreads_over_turns(chat_tokenizer,
                                                                                                   worker):
    task = parse_task({"id": "t", "messages": [{"role": "user", "content": "2+2?"}], "check": {"number": 4}}, "x")
    store = Store()
    source = source_for(chat_tokenizer, ScriptedEngine(chat_tokenizer, ["4", "4"]), store, worker, [task],
                        samples_per_prompt=2)
    assert await source.group("set", task) == [] and source.stats.dropped_agree == 1
    from clawd.rollouts.envs.calculator import question
    text, answer, _ = question(0)  # the calculator's first training seed
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "1+1"}}</tool_call>'
    engine = ScriptedEngine(chat_tokenizer, [call, f"Answer: {answer:g}", "Answer: 0"])
    records = []
    source = source_for(chat_tokenizer, engine, store, worker, environments=[CALC], samples_per_prompt=2,
                        concurrency=1, discount=0.5, record=records.append)
    samples = await source.group("env", CALC)
    # member 0: a tool call, then the right answer (reward 1, two turns); member 1: wrong at once (0, one turn)
    assert [(s.sample_id.rsplit("-", 2)[1:], s.reward, s.advantage) for s in samples] == [
        (["0", "0"], 1.0, 0.25), (["0", "1"], 1.0, 0.5), (["1", "0"], 0.0, -0.5)]
    assert {s.source for s in samples} == {"env"} and source.stats.solved == 1
    # the record keeps each member's own advantage, not its first turn's discounted share
    [record] = records
    assert [(a["reward"], a["advantage"], a["turns"], a["ended"]) for a in record["answers"]] == \
        [(1.0, 0.5, 2, "done"), (0.0, -0.5, 1, "done")]
    assert (record["source"], record["item"], record["seed"], record["kept"], record["samples"]) == \
        ("env", CALC, 0, True, 3)


async def test_the_source_waits_for_live_requests_and_for_the_learner(chat_tokenizer, worker):
    task = parse_task({"id": "t", "messages": [{"role": "user", "content": "2+2?"}], "check": {"number": 4}}, "x")
    live = [3]
    store = Store()
    engine = ScriptedEngine(chat_tokenizer, ["4", "5"] * 20)
    source = source_for(chat_tokenizer, engine, store, worker, [task], samples_per_prompt=2, live=lambda: live[0],
                        live_headroom=1, backlog=4)
    run = asyncio.create_task(source.run())
    try:
        await asyncio.sleep(0.5)
        assert engine.payloads == [] and source.stats.waited_live >= 1  # 3 live requests in flight > 1
        live[0] = 1
        for _ in range(100):
            await asyncio.sleep(0.05)
            if source.stats.waited_backlog:
                break
        assert len(store.samples) == 4 and source.stats.waited_backlog >= 1  # two groups, then the backlog is full
        assert len(engine.payloads) == 4
        source.running.clear()  # `clawctl rollouts pause`
        store.samples.clear()
        await asyncio.sleep(0.5)
        assert len(engine.payloads) == 4
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


async def test_the_lookup_environment_teaches_recovery_from_a_key_written_the_wrong_way(chat_tokenizer, worker):
    from clawd.rollouts.envs.lookup import Lookup, table
    from clawd.rollouts.episode import run_episode
    env = Lookup()
    task = env.reset(3)
    key, value = f"{env.country}:{env.field}", table()[f"{env.country}:{env.field}"]
    assert env.country.title() in task and table() == table()  # the same table every time
    wrong = '<tool_call>{"name": "lookup", "arguments": {"key": "%s of %s"}}</tool_call>' % (env.field, env.country)
    right = '<tool_call>{"name": "lookup", "arguments": {"key": "%s"}}</tool_call>' % key
    engine = ScriptedEngine(chat_tokenizer, [wrong, right, f"The answer is {value}."])
    episode = await run_episode("clawd.rollouts.envs.lookup:Lookup", 3, worker, engine, chat_tokenizer)
    assert (episode.ended, episode.reward, episode.errors, len(episode.turns)) == ("done", 1.0, 1, 3)
    observations = [m["content"] for m in episode.transcript if m["role"] == "tool"]
    assert "keys are written country:field" in observations[0] and observations[1] == value
    assert env.step({"answer": "I do not know"})[1:3] == (0.0, True)


async def test_each_model_turn_of_a_rollout_waits_for_live_requests(chat_tokenizer, worker):
    """Not only a group's start: an episode in progress holds its next turn while live users are served."""
    live = [0]
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "1+1"}}</tool_call>'

    class Busy(ScriptedEngine):
        async def __call__(self, payload):
            live[0] = 2  # a live request arrives while this turn generates
            return await super().__call__(payload)

    engine = Busy(chat_tokenizer, [call, "Answer: 2"])
    store = Store()
    source = source_for(chat_tokenizer, engine, store, worker, environments=[CALC], samples_per_prompt=2,
                        concurrency=1, live=lambda: live[0], live_headroom=1)
    group = asyncio.create_task(source._episode(CALC, 0, "r"))
    try:
        await asyncio.sleep(1.0)
        assert len(engine.payloads) == 1 and source.stats.waited_live >= 2  # the second turn waits
        live[0] = 0
        member = await asyncio.wait_for(group, 30)
        assert len(engine.payloads) == 2 and len(member.turns) == 2
    finally:
        group.cancel()


async def test_a_group_that_fails_is_counted_and_the_source_goes_on(chat_tokenizer, worker):
    """An engine error (a replica restarting) fails its group, never the source's task: the daemon's task group
    would end with it."""
    from clawd.engine.client import EngineDisconnected
    task = parse_task({"id": "t", "messages": [{"role": "user", "content": "2+2?"}], "check": {"number": 4}}, "x")

    class Flaky(ScriptedEngine):
        async def __call__(self, payload):
            if len(self.payloads) < 2:
                self.payloads.append(payload)
                raise EngineDisconnected("engine connection lost")
            return await super().__call__(payload)

    engine = Flaky(chat_tokenizer, ["4", "5"] * 4)
    store = Store()
    source = source_for(chat_tokenizer, engine, store, worker, [task], samples_per_prompt=2, backlog=2)
    run = asyncio.create_task(source.run())
    try:
        for _ in range(100):
            await asyncio.sleep(0.05)
            if store.samples:
                break
        assert source.stats.failed_groups == 1 and len(store.samples) == 2 and not run.done()
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
