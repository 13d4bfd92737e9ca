"""The held-out evaluation the demo reports: style probes sampled and greedy, and a correctness guard.

Three sets of probes, each asked of one policy version with `X-Clawd-No-Train` (never trained on):
- every persona's first `probes` evaluation questions (held out, or for a corrections user the
  paraphrases of its own questions), once sampled at the users' temperature with a fixed seed per
  question and once greedy: the sampled answers are what users get, the greedy ones the policy's mode;
- the guard: greedy answers to every held-out known-answer question of the given kinds, asked by a user
  who wants the right answer alone, less those kept in the bank because the base model answered them
  right (questions.SCREENED: chosen on version 0's answer they can only be lost, so they read any change
  of weights as a cost). A style user's reward never carries correctness, so this says what
  learning the style cost in knowledge. The non-inferiority figure is the paired change in correctness
  over all the guard's questions (symmetric: a question lost counts against one gained). Also reported:
  of the questions version 0 answered right, how many the later version still does. That one only counts
  losses, so any change of weights lowers it (greedy answers to what a small model half knows flip either
  way: in one run 18 of 121 were lost while 13 of 127 wrong ones were won); it says how much churned.

`compare(before, after)` pairs the two versions' answers by (persona, sampled or greedy, question): the
same prompt and the same random draw, so only the weights differ (clawd.safety.paired's bootstrap).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from clawd.safety import paired
from clawd.tools.sim import questions
from clawd.tools.sim.personas import PERSONAS, Persona
from clawd.tools.sim.users import Reply, Users

GUARD = "guard"
STYLES = ("sampled", "greedy")
NON_INFERIOR = -0.05  # the guard's paired lower bound must stay above this (5 points)


def guard_persona(kinds: tuple[str, ...] = ("fact", "definition"), *, limit: int | None = None) -> Persona:
    """A user who wants the right answer alone, probing the held-out items of these kinds that were not
    chosen on the base model's answers (the first `limit` of them; default all)."""
    base = PERSONAS["corrector"]
    held = tuple(i for i in base.held_out if i.kind in kinds and i.question not in questions.FROM_SCREENING)
    return replace(base, name=GUARD, probes="held_out", held_out=held[:limit])


async def run(users: Users, personas: Sequence[Persona], probes: int, seed: int,
              guard: Persona | None, *, concurrency: int | None = None) -> list[Reply]:
    """Every probe of one version: `probes` a persona sampled and greedy, and the whole guard greedy,
    `concurrency` at a time (default the users'; the engine batches them: more at once run faster per answer)."""
    out = await users.evaluate(probes, seed=seed, personas=personas, concurrency=concurrency)
    out += await users.evaluate(probes, seed=seed, greedy=True, personas=personas, concurrency=concurrency)
    if guard is not None:
        out += await users.evaluate(len(guard.held_out), seed=seed, greedy=True, personas=[guard],
                                    concurrency=concurrency)
    return out


def pairs(before: Sequence[Reply], after: Sequence[Reply]) -> list[tuple[Reply, Reply]]:
    """Answers before and after paired by (persona, sampled or greedy, question)."""
    later = {(r.persona, r.style, r.question): r for r in after}
    return [(r, later[(r.persona, r.style, r.question)]) for r in before
            if (r.persona, r.style, r.question) in later]


def _compare(pairs_: list[tuple[Reply, Reply]], of: str) -> dict | None:
    judged = [(b, a) for b, a in pairs_ if getattr(b, of) is not None and getattr(a, of) is not None]
    if not judged:
        return None
    return paired.compare([getattr(b, of) for b, a in judged], [getattr(a, of) for b, a in judged])


def compare(before: Sequence[Reply], after: Sequence[Reply]) -> dict[str, dict]:
    """{name: clawd.safety.paired.compare result}: the personas' satisfied, styled and correct, sampled and
    greedy, then the guard's correctness on v0's right answers and on all its questions."""
    matched = pairs(before, after)
    out: dict[str, dict] = {}
    users = [(b, a) for b, a in matched if b.persona != GUARD]
    for style in STYLES:
        mine = [(b, a) for b, a in users if b.style == style]
        for of in ("satisfied", "styled", "correct"):
            result = _compare(mine, of)
            if result is not None:
                out[f"{of} ({style})"] = result
    guard = [(b, a) for b, a in matched if b.persona == GUARD]
    if guard:
        out["guard: v0's right answers kept"] = _compare([(b, a) for b, a in guard if b.correct], "correct") \
            or paired.compare([], [])
        out["guard: correct"] = _compare(guard, "correct") or paired.compare([], [])
    return out


def headline(results: dict[str, dict]) -> dict[str, Any]:
    """What the demo claims, each as a verdict: style satisfaction up (sampled, the users' answers), the
    guard non-inferior (the paired lower bound of its correctness change >= NON_INFERIOR), with the guard's
    size and how many of its questions version 0 answered right."""
    style = results.get("satisfied (sampled)")
    guard = results.get("guard: correct")
    kept = results.get("guard: v0's right answers kept")
    return {"style_up": bool(style and style["n"] and style["low"] > 0),
            "guard_non_inferior": None if not guard or not guard["n"] else guard["low"] >= NON_INFERIOR,
            "guard_n": guard["n"] if guard else 0, "guard_v0_right": kept["n"] if kept else 0}


def retry_share(replies: Sequence[Reply]) -> dict[str, Any]:
    """Of the users' +1 rewards (thanked answers), how many came from a retry, whose context already
    holds the correction (and often the answer): learning from those is not learning to answer first time."""
    thanked = [r for r in replies if r.kind == "answer" and r.satisfied]
    retries = sum(r.attempt > 0 for r in thanked)
    return {"thanked": len(thanked), "from_retries": retries,
            "share": round(retries / len(thanked), 4) if thanked else None}
