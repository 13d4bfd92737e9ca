"""Privacy against a live daemon: consent and PII at work on real traffic, a person's data exported and then
forgotten with clawctl (records, journal bytes, the export's manifest), and a walk of the state directory
for modes after the run, started under a permissive umask with files an earlier run left open."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import time
import urllib.request

import openai
import pytest

from clawd.safety.versions import RETIRED, SERVING, Version, Versions

from .harness import Daemon
from .test_clawctl import clawctl, settle, thanked_conversation

EMAIL = "jane.doe@example.org"
KEYS = [{"name": "alice", "key": "alice-key-1234"}, {"name": "bob", "key": "bob-key-12345"},
        {"name": "bot", "key": "bot-key-123456", "train": False},
        {"name": "ghost", "key": "ghost-key-1234", "record": False}]


def conversation(daemon: Daemon, key: str, text: str) -> None:
    thanked_conversation(openai.OpenAI(base_url=daemon.url + "/v1", api_key=key, max_retries=0), text)


def state_bytes(root) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()
                    and not stat.S_ISSOCK(p.lstat().st_mode))


@pytest.mark.slow
def test_consent_pii_export_forget_and_private_modes(tiny_model, tmp_path):
    state = tmp_path / "state"
    (state / "records").mkdir(parents=True)
    (state / "records" / "left-open.txt").write_text("from an earlier run")
    # A history from an earlier run: v1 trained on carol's samples, v2 trained from it and serving.
    history = Versions(state / "versions.jsonl")
    history.add(Version(1, None, 1.0, RETIRED, steps=(1,), samples=2, principals={"carol": 2}))
    history.add(Version(2, 1, 2.0, SERVING, steps=(2,), samples=2, principals={"bob": 2}))
    os.chmod(state / "records" / "left-open.txt", 0o666)
    os.chmod(state, 0o755)
    old = os.umask(0o022)  # what clawd was started with must not matter
    try:
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 4},
                                   "engine": {"launch": "local"}, "auth": {"keys": KEYS}})
    finally:
        os.umask(old)
    try:
        conversation(daemon, "alice-key-1234", "Tell me about otters")
        conversation(daemon, "alice-key-1234", f"Write to {EMAIL} for me")
        conversation(daemon, "bob-key-12345", "Tell me about seals")
        conversation(daemon, "bot-key-123456", "MARKER-BOT dear diary")
        conversation(daemon, "ghost-key-1234", "MARKER-GHOST passing through")
        snap = settle(daemon, samples=3)  # alice's first, bob's, ghost's: the PII and the no-consent turns never train
        privacy = snap["privacy"]
        assert privacy["not_trained"] == {"pii": 2, "consent": 2}  # each conversation's two turns
        assert privacy["pii"]["found"] == {"email": 2} and privacy["pii"]["turns_with_pii"] == 2
        held = state_bytes(state)
        assert EMAIL.encode() not in held and b"MARKER-BOT" not in held  # redacted; recorded without words
        assert privacy["unrecorded_turns"] == 2  # ghost's turns: trained (in the journal), never recorded
        assert "ghost" not in {r["principal"] for kind in ("turns", "judge") for r in daemon.records(kind)}
        bot = [r for r in daemon.records() if r["principal"] == "bot"]
        assert len(bot) == 2 and all(r["content"] == "withheld" and r["excluded"] == "consent" for r in bot)
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert 'clawd_pii_findings_total{category="email"} 2.0' in metrics
        assert 'clawd_retention_sweeps_total 1.0' in metrics

        # An access request: everything about alice, with a manifest.
        out = tmp_path / "alice-export"
        done = clawctl(daemon, "export", "alice", str(out))
        assert done.returncode == 0, done.stderr
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["principal"] == "alice" and "uid" in manifest["asked_by"]
        assert manifest["files"]["turns.jsonl"]["lines"] == 4 and manifest["files"]["samples.jsonl"]["lines"] == 1
        assert manifest["files"]["judge.jsonl"]["lines"] == 4 and manifest["versions_trained_on"] == []
        for name, meta in manifest["files"].items():
            assert hashlib.sha256((out / name).read_bytes()).hexdigest() == meta["sha256"]
        turns = [json.loads(line) for line in (out / "turns.jsonl").read_text().splitlines()]
        assert {t["principal"] for t in turns} == {"alice"} and "[EMAIL]" in json.dumps(turns)
        assert stat.S_IMODE(out.stat().st_mode) == 0o700 and stat.S_IMODE((out / "turns.jsonl").stat().st_mode) == 0o600
        assert not list((state / "exports").iterdir())  # the staging went once clawctl had its copy
        assert "export of principal 'alice' asked by uid" in "".join(daemon.lines)

        # What a failed clawctl, a crash mid-export and a crash mid-rewrite leave behind: alice's words in a
        # staged export, in one half written (no manifest yet), and in a temporary copy of the records.
        words = '{"principal":"alice","text":"Tell me about otters"}\n'
        for name, manifest in (("alice-20261204T000000Z-abcdef", {"principal": "alice"}),
                               ("alice-20261204T000001Z-a1", None)):
            (state / "exports" / name).mkdir()
            (state / "exports" / name / "turns.jsonl").write_text(words)
            if manifest:
                (state / "exports" / name / "manifest.json").write_text(json.dumps(manifest))
        (state / "exports" / "bob-20261204T000002Z-b0").mkdir()
        (state / "exports" / "bob-20261204T000002Z-b0" / "manifest.json").write_text('{"principal": "bob"}')
        (state / "records" / "turns-2026-12-04.jsonl.tmp").write_text(words)
        for path in (state / "exports").rglob("*"):  # as clawd's umask would have made them
            os.chmod(path, 0o700 if path.is_dir() else 0o600)

        # A deletion request.
        done = clawctl(daemon, "forget", "alice")
        assert done.returncode == 0, done.stderr
        assert not (state / "exports" / "alice-20261204T000000Z-abcdef").exists()
        assert sorted(p.name for p in (state / "exports").iterdir()) == ["bob-20261204T000002Z-b0"]  # bob's stays
        assert "forgot principal 'alice'" in done.stdout and "no version was trained" in done.stdout
        forgotten = json.loads(clawctl(daemon, "forget", "alice", "--json").stdout)  # again: nothing left
        assert all(n == 0 for n in forgotten["removed"].values())
        # Someone whose samples trained an ancestor of the version serving: the report says so.
        carol = json.loads(clawctl(daemon, "forget", "carol", "--json").stdout)
        assert carol["versions_trained_on"] == [1] and carol["serving"] is True
        assert settle(daemon, samples=2)["queue"]["waiting"] == 2  # bob's and ghost's samples wait on
        held = state_bytes(state)
        assert b'"principal":"alice"' not in held and b"Tell me about otters" not in held
        assert b'"principal":"bob"' in held and b"Tell me about seals" in held
        log = "".join(daemon.lines)
        assert "forget of principal 'alice' asked by uid" in log and "otters" not in log
    finally:
        assert daemon.stop() == 0
    # The journal replays bob's and ghost's samples alone after the rewrite.
    assert [s.principal for s in daemon.samples()] == ["bob", "ghost"]

    # Modes: every directory 0700 and file 0600 (the admin socket keeps its own 0660 fence).
    loose = []
    for path in [state, *state.rglob("*")]:
        st = path.lstat()
        if stat.S_ISSOCK(st.st_mode) or stat.S_ISLNK(st.st_mode):
            continue
        if stat.S_IMODE(st.st_mode) & 0o077:
            loose.append(f"{path.relative_to(tmp_path)} {oct(stat.S_IMODE(st.st_mode))}")
    assert loose == []


@pytest.mark.slow
def test_forget_after_learning_leaves_no_trace_of_the_person_outside_weights(tiny_model, tmp_path):
    """A daemon that trained and published a version on alice's samples: after `clawctl forget alice`, a walk
    of every byte of the state directory finds neither her words nor her name, except inside weight files."""
    canary = "CANARY-7f3a91 otters hold hands"
    keys = [{"name": "alice", "key": "alice-key-1234"}, {"name": "bob", "key": "bob-key-12345"}]
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 4},
                               "engine": {"launch": "local"}, "auth": {"keys": keys},
                               "learner": {"enabled": True, "rollout_batch_size": 2, "min_batch_size": 2},
                               "train": {"checkpoint_every": 1}})
    state = daemon.state
    try:
        for i in range(2):
            conversation(daemon, "alice-key-1234", f"{canary} {i}")
        deadline = time.monotonic() + 120
        while daemon.get("/ready")[1]["policy_version"] < 1:  # a step on her samples, published
            assert time.monotonic() < deadline
            time.sleep(0.2)
        conversation(daemon, "bob-key-12345", "Tell me about seals")
        held = state_bytes(state)
        assert canary.encode() in held and b'"principal":"alice"' in held  # there before
        done = json.loads(clawctl(daemon, "forget", "alice", "--json").stdout)
        assert done["versions_trained_on"] == [1]
        left = [str(p.relative_to(state)) for p in sorted(state.rglob("*"))
                if p.is_file() and not stat.S_ISSOCK(p.lstat().st_mode)
                and any(mark in p.read_bytes() for mark in (canary.encode(), b"alice"))]
        assert [p for p in left if not p.endswith((".safetensors", ".distcp"))] == [], left
    finally:
        assert daemon.stop() == 0
