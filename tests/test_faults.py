"""Named fault points (clawd.faults): the parser, the pass counting, and a kill that lands in a child."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys

import pytest

from clawd import faults
from tests.harness import ROOT


@pytest.fixture(autouse=True)
def clean():
    faults.reset()
    yield
    faults.reset()


def test_parse_exact_values():
    assert faults.parse("a=kill@2, b=enospc,c.d=hang@3+") == {
        "a": faults.Fault("kill", 2), "b": faults.Fault("enospc"), "c.d": faults.Fault("hang", 3, True)}
    assert faults.parse("") == {}


@pytest.mark.parametrize("spec", ["a", "a=explode", "=kill", "a=kill@0", "a=kill@x", "a=kill@"])
def test_a_malformed_spec_is_refused(spec):
    if spec == "a=kill@":  # an empty pass means every pass
        assert faults.parse(spec) == {"a": faults.Fault("kill")}
        return
    with pytest.raises(ValueError):
        faults.parse(spec)


def test_an_unarmed_point_does_nothing_and_is_not_counted():
    faults.point("nowhere")
    assert faults.passes("nowhere") == 0


def test_enospc_fires_at_the_chosen_pass_only():
    faults.arm("w", "enospc", at=2)
    faults.point("w")
    with pytest.raises(OSError) as exc:
        faults.point("w")
    assert exc.value.errno == errno.ENOSPC and "fault point w" in str(exc.value)
    faults.point("w")
    assert faults.passes("w") == 3


def test_onward_fires_from_the_pass_on():
    faults.arm("w", "eio", at=2, onward=True)
    faults.point("w")
    for _ in range(3):
        with pytest.raises(OSError) as exc:
            faults.point("w")
        assert exc.value.errno == errno.EIO


def test_the_environment_arms_a_child_process_and_kill_is_sigkill():
    code = "from clawd import faults\nfaults.point('x')\nprint('second', flush=True)\nfaults.point('x')\nprint('never')"
    env = {**os.environ, "PYTHONPATH": str(ROOT), faults.ENV: "x=kill@2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == -signal.SIGKILL
    assert done.stdout == "second\n"


def test_a_malformed_environment_fails_at_the_first_point(monkeypatch):
    monkeypatch.setenv(faults.ENV, "x=oops")
    with pytest.raises(ValueError, match="CLAWD_FAULTS"):
        faults.point("anything")
