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
