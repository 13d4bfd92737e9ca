"""The learner's recovery state (clawd/learning/recovery.py): each transition alone, exact values, no I/O."""
import dataclasses

import pytest

from clawd.learning.recovery import Held, Next, Recovery, held_needs
from clawd.safety.versions import CANDIDATE, REJECTED, RETIRED, ROLLED_BACK, SERVING

from .trainer_handlers import make_sample


def samples(*names: str):
    return [dataclasses.replace(make_sample(i), sample_id=name) for i, name in enumerate(names)]


def ids(batch) -> list[str]:
    return [s.sample_id for s in batch]


@pytest.mark.parametrize("candidate, owed, unpublished, expected", [
    (None, [], None, None),                                      # nothing owed: a step may start
    (("w/v3", 3), [], None, Next.DELIVER),                       # its gate or publish failed: again
    (("w/v3", 3), ["publish"], None, Next.PUBLISH),              # the trainer's writes come first
    (("w/v3", 3), ["checkpoint"], None, Next.CHECKPOINT),        # a candidate waits behind a checkpoint owed
    (None, ["publish", "checkpoint"], ("w/v2", 2), Next.PUBLISH),
    (None, ["checkpoint"], ("w/v2", 2), Next.SERVE),             # the engine moves before the checkpoint
    (None, [], ("w/v2", 2), Next.SERVE),
    (None, ["checkpoint"], None, Next.CHECKPOINT),
])
def test_what_is_settled_next(candidate, owed, unpublished, expected):
    assert Recovery(candidate=candidate, unpublished=unpublished).next(owed) is expected


@pytest.mark.parametrize("version, status, serving, published, gated, expected", [
    (4, SERVING, 4, True, True, Held.NOTHING),      # the trainer holds what serves
    (5, REJECTED, 4, True, True, Held.NOTHING),     # never again: the learner rolls back at start
    (5, ROLLED_BACK, 4, True, False, Held.NOTHING),
    (5, CANDIDATE, 4, True, True, Held.GATE),       # trained, never passed the gate
    (5, CANDIDATE, 4, True, False, Held.SERVE),     # no gate: a publish a stop cut short
    (5, None, 4, True, True, Held.SERVE),           # unrecorded but published and newer
    (5, RETIRED, 4, True, True, Held.SERVE),
    (5, CANDIDATE, 4, False, True, Held.RENUMBER),  # its directory rotated out: a new number
    (3, RETIRED, 4, True, True, Held.RENUMBER),     # older (checkpoint_every > 1): never served back under 3
])
def test_what_a_restarted_trainers_weights_need(version, status, serving, published, gated, expected):
    assert held_needs(version, status, serving, published, gated) is expected


def test_a_restart_sends_back_what_its_checkpoint_does_not_hold_once():
    rec = Recovery()
    assert rec.restarted(100, lambda: pytest.fail("the first child: nothing to compare")) == []
    assert rec.trainer_pid == 100
    rec.stepped(samples("a", "b"), None, None)
    rec.stepped(samples("c"), ("w/v1", 1), None)
    assert rec.restarted(100, lambda: pytest.fail("the same child: not a restart")) == []
    again = rec.restarted(200, lambda: {"a"})  # died after checkpointing step 1 (a), before c's
    assert (ids(again), ids(rec.unacked), rec.trainer_pid) == (["b", "c"], ["a"], 200)
    assert rec.restarted(200, lambda: set()) == [] and ids(rec.unacked) == ["a"]  # idempotent


def test_a_step_leaves_a_candidate_and_says_whether_its_directory_is_still_being_written():
    rec = Recovery()
    rec.stepped(samples("a"), None, None)  # skipped: no candidate
    assert (rec.candidate, rec.writing, ids(rec.unacked)) == (None, None, ["a"])
    rec.stepped(samples("b"), ("w/v2", 2), 2)
    assert (rec.candidate, rec.writing) == (("w/v2", 2), 2)
    rec.stepped(samples("c"), ("w/v3", 3), 2)  # the trainer still names an older write: not this one
    assert (rec.candidate, rec.writing, ids(rec.unacked)) == (("w/v3", 3), None, ["a", "b", "c"])
    rec.decided()
    assert (rec.candidate, rec.writing) == (None, None)


def test_only_a_candidate_the_dead_child_was_still_writing_is_lost():
    rec = Recovery(candidate=("w/v7", 7), writing=7)
    assert rec.lost(lambda path: True) is None and rec.candidate == ("w/v7", 7)  # written after all
    assert rec.lost(lambda path: False) == 7 and (rec.candidate, rec.writing) == (None, None)
    assert rec.lost(lambda path: False) is None  # nothing left to lose
    rec = Recovery(candidate=("w/v8", 8), writing=None)  # written before the reply: gated as usual
    assert rec.lost(lambda path: pytest.fail("not asked")) is None and rec.candidate == ("w/v8", 8)


def test_acknowledging_takes_everything_and_a_failed_write_puts_it_back_in_order():
    rec = Recovery()
    rec.stepped(samples("a", "b"), None, None)
    done = rec.acknowledged()
    assert (ids(done), rec.unacked) == (["a", "b"], [])
    rec.stepped(samples("c"), None, None)  # trained while the acknowledgement was written
    rec.unacknowledged(done)
    assert ids(rec.unacked) == ["a", "b", "c"]
    assert rec.acknowledged() and rec.acknowledged() == []


def test_a_rollback_keeps_what_is_in_the_target_and_what_made_a_doomed_version():
    rec = Recovery()
    rec.stepped(samples("a", "b", "c"), None, None)
    rec.rolled_back(samples("a"), samples("c"))  # b went back to the store to be trained again
    assert ids(rec.unacked) == ["a", "c"]
