"""Versions as first-class records, and rollback: the history file, what a rollback does to the samples,
the trainer restored to a version's checkpoint (weights and optimizer), and `clawctl rollback` on the
real daemon with the real trainer and the CPU engine."""
from __future__ import annotations

import json
import subprocess

import openai
import pytest
import torch

from clawd.learning.rollback import keep_for_inspection, sort_unacked
from clawd.samples import Sample
from clawd.safety.versions import CANDIDATE, REJECTED, RETIRED, ROLLED_BACK, SERVING, Version, Versions
from clawd.weights import checkpointed_versions

from .harness import ROOT, Daemon
from .test_learning_loop import _wait
from .test_trainer import flat_config, mixed_batch, same, sample, weights

CLAWCTL = str(ROOT / "bin" / "clawctl")


# --- the history file --------------------------------------------------------------------------

def test_versions_are_recorded_promoted_and_read_back(tmp_path):
    path = tmp_path / "versions.jsonl"
    history = Versions(path)
    history.add(Version(0, None, 1.0, SERVING, detail="served at start"))
    history.add(Version(1, 0, 2.0, CANDIDATE, steps=(1,), samples=8, principals={"alice": 5, "bob": 3}))
    history.promote(1, "gate passed")
    history.add(Version(2, 1, 3.0, CANDIDATE, steps=(2,), samples=8, principals={"alice": 8}))
    history.update(2, status=REJECTED, detail="gate: worse")
    with pytest.raises(ValueError, match="never reused"):
        history.add(Version(2, 1, 4.0, CANDIDATE))
    again = Versions(path)
    assert [(v.version, v.status, v.detail) for v in again] == [
        (0, RETIRED, "replaced by v1"), (1, SERVING, "gate passed"), (2, REJECTED, "gate: worse")]
    # Principals are kept as keyed pseudonyms, never their names (which a forget must not leave behind).
    assert again.get(1).principals == {again.pseudonym("alice"): 5, again.pseudonym("bob"): 3}
    assert "alice" not in path.read_text() and again.get(1).steps == (1,)
    assert again.pseudonym("alice") == history.pseudonym("alice") != Versions(tmp_path / "b" / "v.jsonl").pseudonym(
        "alice")  # the key is the state directory's own
    assert again.serving().version == 1 and again.newest == 2
    assert [v.version for v in again.good()] == [0, 1]
    assert again.lineage(2) == [2, 1, 0]
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "principal.key").stat().st_mode & 0o777) == "0o600"


def test_a_history_written_with_names_is_rewritten_with_pseudonyms_when_loaded(tmp_path):
    path = tmp_path / "versions.jsonl"
    path.write_text(json.dumps({"version": 1, "parent": 0, "created": 1.0, "status": "serving", "steps": [1],
                                "samples": 3, "principals": {"ana@example.org": 3}}) + "\n")
    history = Versions(path)
    assert history.get(1).principals == {history.pseudonym("ana@example.org"): 3}
    assert "ana@example.org" not in path.read_text()


def test_a_torn_last_line_is_dropped_and_not_joined_and_the_file_is_compacted(tmp_path):
    path = tmp_path / "versions.jsonl"
    history = Versions(path)
    history.add(Version(0, None, 1.0, SERVING))
    with open(path, "ab") as f:
        f.write(b'{"version": 1, "par')  # a crash while appending
    again = Versions(path)
    assert [v.version for v in again] == [0]
    again.add(Version(1, 0, 2.0, SERVING))
    assert [v.version for v in Versions(path)] == [0, 1]  # the append did not join the torn line
    for i in range(100):  # many changes of two versions: rewritten compacted, not grown without end
        again.update(1, detail=f"change {i}")
    assert len(path.read_text().splitlines()) <= 4 * 16 + 1
    assert Versions(path).get(1).detail == "change 99"


def test_sort_unacked_keeps_drops_and_retrains_by_the_ledger():
    unacked = [sample(i, 8, 3) for i in range(1, 7)]
    for s, sid in zip(unacked, ("a", "b", "c", "d", "e", "f")):
        object.__setattr__(s, "sample_id", sid)
    ledger = [{"step": 1, "version": 1, "samples": ["a"]},
              {"step": 2, "version": 2, "samples": ["b", "c"]},      # the target's step
              {"step": 3, "version": 3, "samples": ["d"]},           # a good version lost with the rollback
              {"step": 4, "version": 4, "samples": ["e"]},           # the rejected one
              {"step": 3, "version": 5, "samples": ["x"]}]           # a later branch's line for step 3 wins
    kept, dropped, again = sort_unacked(unacked, ledger, current_step=4, target_step=2, doomed={4})
    assert [s.sample_id for s in kept] == ["a", "b", "c"]
    assert [s.sample_id for s in dropped] == ["e"]
    assert [s.sample_id for s in again] == ["d", "f"]  # d's step was superseded; f was never in a step


def test_rejected_samples_are_kept_for_inspection(tmp_path):
    keep_for_inspection(tmp_path, [sample(1, 8, 3), sample(2, 9, 4)], [4, 5])
    lines = (tmp_path / "rejected" / "v000005.samples.jsonl").read_text().splitlines()
    assert [Sample.from_json(line.encode()).sample_id for line in lines] == ["s1", "s2"]
    keep_for_inspection(tmp_path, [], [6])
    assert not (tmp_path / "rejected" / "v000006.samples.jsonl").exists()


# --- the trainer restored ----------------------------------------------------------------------

@pytest.fixture
def make(tiny_model, tmp_path):
    from clawd.trainer.worker.step import Trainer

    return lambda name="state", **cfg: Trainer(tiny_model, tmp_path / name, flat_config(**{"lr": 1e-3, **cfg}))


def test_the_trainer_restores_a_versions_checkpoint_weights_and_optimizer(make):
    trainer = make(checkpoint_every=1)
    trainer.train_step(mixed_batch(), "combine")
    trainer.publish(1)
    trainer.checkpoint("after v1")
    at_v1 = weights(trainer)
    adam_v1 = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    for version in (2, 3):
        trainer.train_step(mixed_batch(), "combine")
        trainer.publish(version)
        trainer.checkpoint(f"after v{version}")
    assert not same(weights(trainer), at_v1)
    assert sorted(checkpointed_versions(trainer.state_dir)) == [2, 3]  # CHECKPOINTS_KEPT = 2

    deep = make("deep", checkpoint_every=1)
    deep.keep_checkpoints = 4
    for version in (1, 2, 3):
        deep.train_step(mixed_batch(), "combine")
        deep.publish(version)
        deep.checkpoint(f"after v{version}")
    assert sorted(checkpointed_versions(deep.state_dir)) == [1, 2, 3]
    deep.restore(1)
    assert same(weights(deep), at_v1) and deep.step == 1 and deep.weights_version == 1
    assert deep.version == 3  # v2 and v3 were served: the next version goes above them
    restored = deep.optimizer.state_dict()["state"][0]
    assert all(torch.equal(restored[k], adam_v1[k]) for k in adam_v1)
    with pytest.raises(ValueError, match="no checkpoint holds v7"):
        deep.restore(7)
    deep.publish(4)  # v1's weights again, under a new number
    deep.checkpoint("after the rollback")  # the abandoned branch's checkpoints (steps 2 and 3) go
    assert sorted(checkpointed_versions(deep.state_dir)) == [1, 4]
    deep.train_step(mixed_batch(), "combine")  # training goes on from v1's state
    deep.publish(5)
    assert deep.step == 2


# --- the daemon ----------------------------------------------------------------------------------

def _learn(daemon: Daemon, rounds: int, first: int = 0) -> None:
    """Two thanked turns a round, each round one step and one version above the one serving."""
    client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
    for r in range(first, first + rounds):
        before = daemon.get("/ready")[1]["policy_version"]
        for i in range(2):
            messages = [{"role": "user", "content": f"Tell me fact {r}-{i}."}]
            reply = client.chat.completions.create(model="m", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "Thanks, great answer!"}]
            client.chat.completions.create(model="m", messages=messages, extra_headers={"X-Session-Done": "1"})
        assert _wait(lambda: daemon.get("/ready")[1]["policy_version"] > before, 120)


def clawctl(daemon: Daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLAWCTL, "--socket", str(daemon.state / "clawd.sock"), *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_clawctl_rollback_serves_a_versions_weights_again_and_training_goes_on_from_it(tiny_model, tmp_path):
    sections = {"model": {"path": str(tiny_model), "max_tokens_cap": 6}, "engine": {"launch": "local"},
                "learner": {"enabled": True, "rollout_batch_size": 2, "min_batch_size": 1},
                "train": {"checkpoint_every": 1, "optimizer": {"lr": 1e-2}}, "versions": {"rollback_depth": 3}}
    daemon = Daemon(tmp_path, sections)
    try:
        _learn(daemon, 3)
        assert daemon.get("/ready")[1]["policy_version"] == 3
        listing = json.loads(clawctl(daemon, "versions", "--json").stdout)
        assert [(v["version"], v["parent"], v["status"]) for v in listing["versions"]] == [
            (0, None, RETIRED), (1, 0, RETIRED), (2, 1, RETIRED), (3, 2, SERVING)]
        assert listing["versions"][1]["samples"] == 2 and listing["versions"][1]["principals"] == {
            Versions(daemon.state / "versions.jsonl").pseudonym("anonymous"): 2}

        from safetensors.torch import load_file
        v1 = load_file(daemon.state / "weights" / "v000001" / "model.safetensors")  # before keep_versions drops it
        done = clawctl(daemon, "rollback", "1")
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "rolled back: v1 serves again as v4"
        assert daemon.get("/ready")[1]["policy_version"] == 4
        by = {v["version"]: v for v in json.loads(clawctl(daemon, "versions", "--json").stdout)["versions"]}
        assert (by[2]["status"], by[3]["status"]) == (ROLLED_BACK, ROLLED_BACK)
        assert (by[4]["status"], by[4]["parent"], by[4]["restored_from"]) == (SERVING, 1, 1)

        refused = clawctl(daemon, "rollback", "3")  # rolled back: not a target
        assert refused.returncode == 1 and "cannot be rolled back to" in refused.stderr
        _learn(daemon, 1, first=3)  # training goes on from v1's checkpoint
        assert daemon.get("/ready")[1]["policy_version"] == 5
        checkpoint = json.loads(clawctl(daemon, "checkpoint", "--json").stdout)
        assert checkpoint["version"] == 5
    finally:
        assert daemon.stop() == 0
    v4 = load_file(daemon.state / "weights" / "v000004" / "model.safetensors")
    assert v1.keys() == v4.keys() and all(torch.equal(v1[k], v4[k]) for k in v1)  # the same weights, renumbered
    history = Versions(daemon.state / "versions.jsonl")
    assert history.get(5).parent == 4 and history.serving().version == 5
    turns = daemon.records()
    assert {t["policy_version"] for t in turns} <= {0, 1, 2, 3, 4, 5}

    # A stop between a rejection and its rollback left the rejected v5 as the newest checkpoint: the restart
    # serves v4 from its first request (the newest version that served cleanly; v5 never serves again), rolls
    # the trainer back to v4's checkpoint before anything else, and keeps the history.
    history.update(5, status=REJECTED, detail="rejected; the rollback did not happen before the stop")
    again = Daemon(tmp_path, sections)
    try:
        assert again.get("/ready")[1]["policy_version"] == 4
        assert _wait(lambda: "serving again" in json.dumps(clawctl(again, "versions", "--json").stdout), 60)
        by = {v["version"]: v for v in json.loads(clawctl(again, "versions", "--json").stdout)["versions"]}
        assert sorted(by) == [0, 1, 2, 3, 4, 5]
        assert (by[4]["status"], by[5]["status"]) == (SERVING, REJECTED) and "v5 was rejected" in by[4]["detail"]
        assert _wait(lambda: json.loads(clawctl(again, "checkpoint", "--json").stdout)["version"] == 4, 30)
    finally:
        assert again.stop() == 0
