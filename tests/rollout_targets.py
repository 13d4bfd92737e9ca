"""Deployment functions for tests/test_rollouts.py's worker, imported in the worker only."""
import os
import time


def add(a, b):
    return a + b


def echo(*args):
    return list(args)


def pid():
    return os.getpid()


def hang(seconds=3600.0):
    while True:  # a busy loop that no signal handler interrupts: only SIGKILL ends it
        if time.monotonic() < 0:
            return seconds


def boom(message):
    raise ValueError(message)


def die():
    os._exit(7)


def not_json():
    return {1, 2}


NOT_CALLABLE = 3


class HangingEnv:
    """Its tool never returns: the daemon cuts the call and ends the episode."""
    tools = [{"type": "function", "function": {"name": "wait", "parameters": {"type": "object", "properties": {}}}}]

    def reset(self, seed):
        return "Call the wait tool."

    def step(self, action):
        hang()


class RaisingEnv:
    """Its tool raises (a deployment's bug): the model is told, the episode goes on; an answer ends it."""
    tools = [{"type": "function", "function": {"name": "explode", "parameters": {"type": "object", "properties": {}}}}]

    def reset(self, seed):
        return "Call the explode tool, then answer."

    def step(self, action):
        if "tool" in action:
            raise RuntimeError("the tool broke")
        return "ok", 0.5, True, {}


class BadStepEnv:
    tools = []

    def reset(self, seed):
        return "Say anything."

    def step(self, action):
        return "not a tuple of four"


def half_credit(reply, item_id, messages):
    """A deployment's checker: half a point for a reply that mentions the item's id."""
    return 0.5 if item_id in reply else 0.0


def odd_length(reply, item_id, messages):
    """A checker whose verdict varies from answer to answer: the tiny model's replies are noise."""
    return len(reply) % 2 == 1
