"""The verifiable task the demo and the learning bench teach by active rollouts (clawd/tools/sim/verifiable.py):
its questions, its held-out split and its grading, exact values; no daemon."""
from __future__ import annotations

import pytest

from clawd.rollouts import tasks
from clawd.rollouts.source import EVAL_SEED_BASE
from clawd.tools.sim import verifiable
from tests.harness import load_bench


def test_a_question_is_its_seeds_and_its_check_names_the_answer_and_forbids_the_other_number():
    item = verifiable.compare_item(5)
    assert item == {"id": "compare-5", "numbers": [89, 42],
                    "messages": [{"role": "user",
                                  "content": "Which number is smaller, 89 or 42? Reply with the number only."}],
                    "check": {"number": 42, "not_contains": ["89"]}}
    assert verifiable.compare_item(5) == item
    kinds = {verifiable.compare_item(s)["messages"][0]["content"].split(",")[0] for s in range(200)}
    assert kinds == {"Which number is larger", "Which number is smaller"}


@pytest.mark.parametrize("reply, solved, form", [
    ("42", True, True),
    ("The answer is 42.", True, True),
    ("42 is smaller than 89", False, False),  # right, but the other number is written: the rule says one number
    ("89 is smaller than 42", False, False),  # ends on the answer and says the opposite: the hack the rule closes
    ("89", False, True),                      # the form, the wrong one
    ("The smaller one.", False, False),
    ("142", False, False),                    # a number that merely contains the answer
    ("", False, False),
])
def test_grading_is_the_rollouts_own_rule_and_a_reply_ending_on_the_answer_is_not_enough(reply, solved, form):
    assert verifiable.score_reply(verifiable.compare_item(5), reply) == {"solved": solved, "form": form}


def test_the_held_out_questions_come_from_evaluation_seeds_and_are_never_in_the_training_set(tmp_path):
    train, held = verifiable.train_and_held_out(500, 64)
    assert [t["id"] for t in train] == [f"compare-{s}" for s in range(500)]
    assert len(held) == 64 and all(int(h["id"].split("-")[1]) >= EVAL_SEED_BASE for h in held)
    asked = {t["messages"][0]["content"] for t in train}
    assert not any(h["messages"][0]["content"] in asked for h in held)
    # The file the daemon's rollout source loads, scored by its rule: the same verdict as the evaluation's.
    verifiable.write_set(train[:20], tmp_path / "set.jsonl")
    loaded = tasks.load(tmp_path / "set.jsonl")
    assert [t.id for t in loaded] == [t["id"] for t in train[:20]]
    for task, item in zip(loaded, train[:20]):
        a, b = item["numbers"]
        for reply in (str(a), str(b), f"{a} or {b}"):
            assert tasks.local_score(task, reply) == float(verifiable.score_reply(item, reply)["solved"])


def _run(before: list[int], after: list[int]) -> dict:
    return {"before": [{"solved": bool(x), "form": True, "text": "w"} for x in before],
            "after": [{"solved": bool(x), "form": True, "text": "w w"} for x in after],
            "learner": {"steps": 3, "samples_trained": 96},
            "rollouts": {"solved": 10, "answers": 40, "dropped_agree": 1, "groups": 5}}


def test_an_arm_is_compared_with_its_control_question_by_question():
    arm = {1: _run([0, 0, 1, 0], [1, 1, 1, 0]), 2: _run([1, 0], [1, 1])}
    control = {1: _run([0, 0, 1, 0], [0, 1, 0, 0]), 2: _run([1, 0], [1, 0])}
    summary = verifiable.tally_arm(arm)
    assert (summary["solved"]["n"], summary["solved"]["before"], summary["solved"]["after"]) == (6, 2 / 6, 5 / 6)
    assert summary["words"] == {"before": 1.0, "after": 2.0}
    assert summary["by_seed"][2]["after"] == 1.0
    # per pair: the arm's change minus the control's: (+1 - 0), (+1 - +1), (0 - -1), (0 - 0), (0 - 0), (+1 - 0)
    result = verifiable.versus(arm, control)
    assert (result["n"], result["diff"], result["better"], result["worse"]) == (6, 0.5, 3, 0)


def test_the_learning_bench_takes_the_task_profile(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    learning = load_bench("learning")
    args = learning.parse_args(["--task", "compare", "--model", str(tmp_path)])
    assert (args.steps, args.batch, args.lr, args.arm_list, args.group, args.gate) == (10, 32, 2e-5, ["rl", "shuffled"],
                                                                                         8, False)
    assert args.out.endswith("learning-compare.json") and learning.settings(args)["task"] == "compare"
