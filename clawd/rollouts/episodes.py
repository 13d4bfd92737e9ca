"""Environments, worker side: what the deployment worker (clawd.rollouts.worker) calls to run an episode's
environment; the daemon never imports a deployment's environment (docs/ARCHITECTURE.md §19).

An environment is a class (named "module:Class" in the config, built with no arguments) with

    tools: list[dict]                          the OpenAI function tools the model is offered
    reset(seed: int) -> str | list[dict]       the task, as the user says it; or the conversation so far (a
                                               worked example first, say), ending with the user's message
    step(action: dict) -> (observation: str, reward: float, done: bool, info: dict)

where an action is {"tool": name, "arguments": {...}} for a tool call, or {"answer": text} for a reply without
one. The worker keeps each live episode's environment by id between calls; `close_episode` forgets one (the worker's
death forgets them all: the daemon ends those episodes). What a step returns is checked here, so a
malformed environment fails its own call, never the daemon.
"""
from __future__ import annotations

import math
from typing import Any

from clawd.rollouts.worker import import_target

MAX_OBSERVATION_CHARS = 8000  # an observation longer than this is cut: it goes into the next prompt
MAX_LIVE = 256                # episodes a worker holds at once; the oldest is dropped beyond it

_live: dict[str, Any] = {}


def open_episode(environment: str, episode: str, seed: int) -> dict:
    """A new episode of `environment` ("module:Class"): its opening messages and its tools."""
    env = import_target(environment)()
    opening = env.reset(seed)
    messages = [{"role": "user", "content": opening}] if isinstance(opening, str) else opening
    tools = getattr(env, "tools", [])
    if not (isinstance(messages, list) and messages and all(_message(m) for m in messages)
            and messages[-1]["role"] == "user" and messages[-1]["content"].strip()):
        raise ValueError(f"{environment}.reset returned {opening!r:.80}: the task's text, or chat messages ending "
                         "with the user's")
    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"{environment}.tools must be a list of OpenAI tool objects")
    while len(_live) >= MAX_LIVE:
        _live.pop(next(iter(_live)))
    _live[episode] = env
    return {"messages": [{**m, "content": m["content"][:MAX_OBSERVATION_CHARS]} for m in messages], "tools": tools}


def _message(m) -> bool:
    return (isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool")
            and isinstance(m.get("content"), str))


def act(episode: str, action: dict) -> dict:
    """One action in a live episode: {observation, reward, done, info}; a done episode is forgotten."""
    env = _live.get(episode)
    if env is None:
        raise KeyError(f"no live episode {episode!r} in this worker")
    out = env.step(action)
    if not (isinstance(out, tuple) and len(out) == 4):
        raise ValueError(f"step must return (observation, reward, done, info), not {out!r:.80}")
    observation, reward, done, info = out
    if not isinstance(observation, str) or not isinstance(done, bool) or not isinstance(info, dict):
        raise ValueError("step's observation is a string, done a bool and info a dict")
    if not (isinstance(reward, (int, float)) and not isinstance(reward, bool) and math.isfinite(reward)
            and -1 <= reward <= 1):
        raise ValueError(f"step's reward must be a number in [-1, 1], not {reward!r}")
    if done:
        _live.pop(episode, None)
    return {"observation": observation[:MAX_OBSERVATION_CHARS], "reward": float(reward), "done": done,
            "info": info}


def close_episode(episode: str) -> bool:
    """Forget an episode (ended by the daemon: a bound reached); whether it was live."""
    return _live.pop(episode, None) is not None
