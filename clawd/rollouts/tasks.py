"""A prompt set for active rollouts: prompts with a checker each (docs/ARCHITECTURE.md §19). Pure but `load`.

The file is the gate's evaluation-set format (clawd.safety.evalset: JSON Lines, `id`, `messages`, `check`),
and a check may use the gate's rules (contains_any, regex, rubric, ...) and these, all of which must hold:

- `number` (a number) and `tolerance` (>= 0, default 1e-6): the reply's final number (`final_number`) is
  within `tolerance` of it, absolutely or relative to it, whichever is larger.
- `exact` (a string): the reply's final answer (`final_answer`) is this, compared as the gate compares
  (`evalset.fold`: NFKC, straight apostrophes, case-folded).
- `callable` ("module:function"): the deployment's own checker, called in the worker
  (clawd.rollouts.worker) as function(reply, item_id, messages) and returning a score: a bool, or a number
  in [0, 1]. It runs under `[rollouts] checker_timeout`; one that fails or times out scores the answer 0.

The gate's `rubric` (a yes/no question about the reply) is asked of clawd's judge model (the source's
`judge`), and only once every other rule holds: a reply the rules already fail costs no judge call. A set with
a rubric needs a judge model (`[judge] backend` other than "rules"), checked with the config.

A reply scores 1 when every local rule holds (the rubric's answer YES, if it has one) and 0 otherwise; with
`callable`, the product of that and the checker's score.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawd.checks import is_finite, is_import_path
from clawd.safety import evalset

ROLLOUT_RULES = ("number", "tolerance", "exact", "callable")
# A number as people and models write it: a sign, thousands grouped by commas, a decimal part, an exponent.
_NUMBER = re.compile(r"(?<![\w.])[-+−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w])")
_ANSWER_MARK = re.compile(r"(?i)answer\s*(?:is|:)\s*")  # "answer:", "Answer is", "final answer:"


@dataclass(frozen=True)
class Task:
    """One item of the set. `check` holds the gate's rules (None when it uses only the rollouts' own)."""
    id: str
    messages: tuple[dict[str, str], ...]
    check: evalset.Check | None
    number: float | None = None
    tolerance: float = 1e-6
    exact: str | None = None
    callable: str | None = None

    def chat(self) -> list[dict[str, str]]:
        return [dict(m) for m in self.messages]

    @property
    def rubric(self) -> str | None:
        return self.check.rubric if self.check is not None else None


def final_number(text: str | None) -> float | None:
    """The last number written in `text` ("1,234.5", "-3", "2e3"; a Unicode minus too); None when none."""
    if text is None:
        return None
    found = _NUMBER.findall(text)
    if not found:
        return None
    return float(found[-1].replace(",", "").replace("−", "-"))


def final_answer(text: str | None) -> str | None:
    """What follows the last "answer:" / "answer is" in `text`, else its last non-blank line; stripped of
    surrounding spaces, quotes, asterisks and a final period."""
    if text is None or not text.strip():
        return None
    said = list(_ANSWER_MARK.finditer(text))
    rest = text[said[-1].end():].strip() if said else ""
    if rest:  # the first line written after the last one ("Answer:" may end its own line)
        answer = rest.split("\n", 1)[0]
    else:
        answer = [line for line in text.splitlines() if line.strip()][-1]
    return answer.strip().strip("*\"'`").strip().rstrip(".").strip()


def local_score(task: Task, text: str | None, rubric_answer: bool | None = None) -> float:
    """1.0 when every rule but `callable` holds for the reply `text`, else 0.0 (the gate's rules as the gate
    reads them; a rubric needs its judge's `rubric_answer`)."""
    if text is None:
        return 0.0
    if task.check is not None and not evalset.verdict(task.check, text, rubric_answer):
        return 0.0
    if task.number is not None:
        got = final_number(text)
        if got is None or abs(got - task.number) > max(task.tolerance, task.tolerance * abs(task.number)):
            return 0.0
    if task.exact is not None:
        answer = final_answer(text)
        if answer is None or evalset.fold(answer) != evalset.fold(task.exact):
            return 0.0
    return 1.0


def checker_score(value: Any) -> float:
    """A deployment checker's return value as a score in [0, 1]; ValueError for anything else."""
    if isinstance(value, bool):
        return float(value)
    if is_finite(value) and 0 <= value <= 1:
        return float(value)
    raise ValueError(f"a checker returns a bool or a number in [0, 1], not {value!r:.80}")


def parse_task(raw: Any, default_id: str) -> Task:
    """A task from its JSON object; ValueError saying what is wrong."""
    pid, messages, check = evalset.prompt_parts(raw, default_id)
    if not isinstance(check, dict) or not check:
        return Task(pid, messages, evalset.parse_check(check))  # the gate's parser says what is wrong
    ours = {k: v for k, v in check.items() if k in ROLLOUT_RULES}
    theirs = {k: v for k, v in check.items() if k not in ROLLOUT_RULES}
    if "tolerance" in ours and "number" not in ours:
        raise ValueError("tolerance goes with number")
    number, tolerance = ours.get("number"), ours.get("tolerance", 1e-6)
    if number is not None and not is_finite(number):
        raise ValueError(f"number must be a finite number, not {number!r}")
    if not (is_finite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be a finite number >= 0, not {tolerance!r}")
    exact = ours.get("exact")
    if exact is not None and not (isinstance(exact, str) and exact.strip() and len(exact) <= evalset.MAX_TEXT):
        raise ValueError(f"exact must be a non-blank string of at most {evalset.MAX_TEXT} characters")
    target = ours.get("callable")
    if target is not None and not is_import_path(target):
        raise ValueError(f"callable must name a function as \"package.module:function\", not {target!r}")
    return Task(pid, messages, evalset.parse_check(theirs) if theirs else None,
                None if number is None else float(number), float(tolerance), exact, target)


def load(path: str | Path) -> tuple[Task, ...]:
    """Every task of a set file, in file order; evalset.EvalSetError (file, line) for anything wrong."""
    return evalset.items(path, parse_task, "a rollout set")
