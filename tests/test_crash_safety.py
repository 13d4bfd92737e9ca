"""Crash safety (docs/ARCHITECTURE.md §7): SIGKILL the daemon, its engine or its trainer, and nothing
acknowledged is lost, no child is orphaned, and service comes back on the newest published weights."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import time
import urllib.error
import urllib.request
import uuid

import pytest

from clawd.tools.tomlfile import merged

from .harness import Daemon
from .load import (OK, ChatLoad, alive, expected_weight_version, free_port, newest_checkpoint, port_free,
                   read_journal, read_records, tagged_processes, thanked_conversation, wait_until,
                   witnessed_samples)

LIFE = "CLAWD_TEST_LIFE"  # set in each daemon's environment: every process of its tree carries it
KILLS = 5  # bench/crash.py holds the same invariants over 200 daemon kills (and 100 of the trainer)
BATCH = 2


def _learning(tiny_model, **sections) -> dict:
    base = {"model": {"path": str(tiny_model), "max_tokens_cap": 6},
            "engine": {"launch": "local", "restart_backoff_initial": 0.2},
            "learner": {"enabled": True, "rollout_batch_size": BATCH, "min_batch_size": 1,
                        # no stale drops: every ACK then means "trained, and the step checkpointed"
                        "max_staleness": 1_000_000},
            "journal": {"fsync": "always"},
            # a checkpoint before every publish (the default is every 10th): the assertions below rely on it
            "train": {"checkpoint_every": 1, "optimizer": {"lr": 1e-4}}}
    return merged(base, sections)


def _first(lines: list[str], pattern: str) -> re.Match | None:
    return next((m for m in (re.search(pattern, line) for line in lines) if m), None)


def _metric(daemon: Daemon, name: str) -> float | None:
    """One unlabelled sample of /metrics (Prometheus text format)."""
    with urllib.request.urlopen(daemon.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def _debug(daemon: Daemon) -> dict | None:
    try:
        return daemon.get("/debug/process")[1]
    except OSError:  # not listening (yet, or any more)
        return None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_random_sigkills_lose_no_acknowledged_sample(tiny_model, tmp_path, monkeypatch):
    """KILLS SIGKILLs of the daemon at seeded random moments under chat load, each followed by a restart on the
    same state directory; then a last life trains whatever is left and stops cleanly.

    Acknowledged sample: one whose `SampleStore.put` returned, i.e. whose journal APPEND was written and, with
    `[journal] fsync = "always"`, fsynced. Its witness is the judge record naming its sample_id: scoring
    writes it (one flushed write, so in the kernel before a SIGKILL can strike) only after `put` returned.
    The invariant, checked on the journal files after every kill (read by this test's own parser):
      * every witnessed sample has its APPEND on disk;
      * the journal only grows: the previous kill's records are a prefix of this one's, ACKs are never undone;
      * each such sample is live (not acked) or acked, and ACKs come only from checkpointed steps: stale drops
        are off (max_staleness huge), so |acked| <= rollout_batch_size * the newest checkpoint's step count;
      * the next start replays exactly the live ones ("journal: N sample(s) waiting from before");
    and at the end every witnessed sample has been trained and acked.
    After every kill: the daemon's whole process tree is gone within seconds (zombies count as gone) and its
    ports are free. After every restart: the trainer resumes at the newest checkpoint's step and the engine is
    launched on, and comes up serving, the newest checkpointed version, which is at least every version that
    served a turn before the kill (checkpoint_every = 1: a version is checkpointed before it is published).
    One segment holds the whole history (64 MiB segments), so compaction never hides an APPEND or an ACK.
    """
    rng = random.Random(20261146)  # kills 2 and 3 early, while the children start
    port = free_port()
    sections = _learning(tiny_model, server={"port": port, "drain_timeout": 10.0},
                         learner={"rollout_timeout": 1.0})  # the last life trains a short batch too
    state = tmp_path / "state"
    run = uuid.uuid4().hex[:8]
    load = ChatLoad(f"http://127.0.0.1:{port}/v1", users=3, tag="crash")
    previous = None  # the journal after the previous kill
    expect = {"live": 0, "version": "0", "step": 0, "holding": 0}  # what the next start must show
    lives = []       # per life, printed with the result
    started = time.monotonic()
    daemon = None
    load.start()
    try:
        for life in range(KILLS + 1):
            tag = f"{run}-{life}"
            monkeypatch.setenv(LIFE, tag)
            daemon = Daemon(tmp_path, sections, wait_ready=False)
            _check_start(daemon, expect)
            if life == KILLS:
                break  # the last life is not killed
            early = rng.random() < 0.4  # a kill while the children start; else once the trainer is up
            delay = rng.uniform(0.5, 3.0)
            if not early:
                daemon.wait_for(r"trainer \d+ ready", 90)
                daemon.wait_for(r"policy engine ready", 90)
            time.sleep(delay)
            debug = _debug(daemon)
            tree = tagged_processes(LIFE, tag)  # the daemon's whole tree, right before the kill
            assert daemon.proc.pid in tree, tree
            daemon.proc.kill()
            assert daemon.proc.wait(10) == -signal.SIGKILL
            daemon._reader.join(5)

            # No orphans: every process that carried this life's tag is gone, and its ports are free.
            assert wait_until(lambda: not tagged_processes(LIFE, tag), 10), \
                f"orphans after kill {life} (tree before: {tree}): {tagged_processes(LIFE, tag)}"
            assert wait_until(lambda: port_free(port), 10), f"port {port} still held after kill {life}"
            if debug is not None:
                engine_port = int(debug["engines"]["policy"]["url"].rsplit(":", 1)[1])
                assert wait_until(lambda: port_free(engine_port), 10), f"engine port held after kill {life}"
            _check_life(daemon, expect)

            # The invariant, on disk.
            scan = read_journal(state / "journal")
            witnessed = witnessed_samples(state)
            assert scan.segments == 1, scan.segments
            assert witnessed <= set(scan.appended), f"lost: {witnessed - set(scan.appended)}"
            if previous is not None:
                assert scan.appended[:len(previous.appended)] == previous.appended, "journal records lost"
                assert previous.acked <= scan.acked, "an ACK disappeared"
            ckpt = newest_checkpoint(state) or {"step": 0, "version": 0}
            assert len(scan.acked) <= BATCH * ckpt["step"], (len(scan.acked), ckpt["step"])
            version = expected_weight_version(state)
            served = max((t["policy_version"] for t in read_records(state, "turns")), default=0)
            assert served <= int(version), f"v{served} served before kill {life}, the restart serves v{version}"
            lives.append({"life": life, "early": early, "delay": round(delay, 2), "appended": len(scan.appended),
                          "acked": len(scan.acked), "live": len(scan.live), "witnessed": len(witnessed),
                          "step": ckpt["step"], "version": version, "torn_bytes": scan.bad_tail_bytes,
                          "ok_requests": load.counts()[OK]})
            previous = scan
            expect = {"live": len(scan.live), "version": version, "step": ckpt["step"], "holding": ckpt["version"]}

        # The last life: let it train what is left, then stop it cleanly.
        daemon.wait_ready(90)
        load.stop()
        drained = wait_until(lambda: (lambda d: d and d["scoring"]["pending"] == 0 and d["queue"]["journal_live"] == 0
                                      and d["learner"]["waiting_since"] is not None)(_debug(daemon)), 120, 0.2)
        if not drained:  # what held it: a digest first (CI shows only part of a failure), then in full
            state_now = _debug(daemon) or {}
            held = {k: state_now.get(k) for k in ("scoring", "queue", "learner", "trainer", "engines", "safety",
                                                    "paused")}
            print("not drained:", json.dumps(held, default=str))
            raise AssertionError(f"not drained: {_held_digest(held)}\n" + "".join(_not_chat(daemon.lines)[-25:]))
        assert daemon.stop() == 0
        _check_life(daemon, expect)
    finally:
        load.stop()
        if daemon is not None and daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()
    scan = read_journal(state / "journal")
    witnessed = witnessed_samples(state)
    print(f"\n{KILLS} kills in {time.monotonic() - started:.0f}s, requests: {dict(load.counts())}")
    for entry in lives:
        print(json.dumps(entry))
    assert scan.live == () and scan.bad_tail_bytes == 0
    assert witnessed and witnessed <= scan.acked, witnessed - scan.acked  # every one of them trained
    # Lives that ACKed samples before their kill: every life not killed early did in the measured runs (3 of
    # 3, seed 20261146: lives 0, 3 and 4); a life slowed by load may ACK nothing in its 0.5-3 s, hence the margin.
    acked = [0] + [entry["acked"] for entry in lives]
    assert sum(1 for a, b in zip(acked, acked[1:]) if b > a) >= 2
    assert lives[-1]["version"] != "0" and len(witnessed) >= 10


def _held_digest(held: dict) -> str:
    """The few status fields that say why a last life did not drain, on one short line."""
    learner, trainer = held.get("learner") or {}, held.get("trainer") or {}
    picks = {"pending": (held.get("scoring") or {}).get("pending"),
             "journal_live": (held.get("queue") or {}).get("journal_live"), "paused": held.get("paused"),
             **{k: learner.get(k) for k in ("waiting_since", "steps", "failed_steps", "failed_publishes",
                                           "failed_writes", "skipped_steps", "requeued_after_restart", "rollbacks")},
             **{f"trainer_{k}": trainer.get(k) for k in ("alive", "restarts", "step", "checkpoint_step", "owed",
                                                         "writing")}}
    return json.dumps(picks, default=str)


def _not_chat(lines: list[str]) -> list[str]:
    """The daemon's log without its per-request chat lines: what the learner, trainer and engines said."""
    return [line for line in lines if " clawd.chat: " not in line]


def _check_start(daemon: Daemon, expect: dict) -> None:
    """The start replays exactly the live samples (less those its checkpoint holds) and launches the engine on the newest checkpointed version."""
    replay = daemon.wait_for(r"journal: \d+ sample\(s\) waiting from before", 10)
    # Live samples the checkpoint already holds (a kill between the checkpoint and their ACK) are not trained again.
    dropped = sum(int(m.group(1)) for line in daemon.lines
                  if (m := re.search(r"journal: (\d+) sample\(s\) already in the checkpoint", line)))
    assert int(re.search(r"journal: (\d+) sample", replay).group(1)) + dropped == expect["live"], (replay, expect)
    launch = daemon.wait_for(r"starting policy engine: ", 10)
    assert re.search(r"--weight-version (\S+)", launch).group(1) == expect["version"], (launch, expect)
    if expect["version"] != "0":
        assert f"--model {daemon.state}/weights/v{int(expect['version']):06d} " in launch, launch


def _check_life(daemon: Daemon, expect: dict) -> None:
    """What a life that has ended logged: its first trainer resumed from the checkpoint the last kill left, and
    its engine first came up on that checkpoint's published version (either may not have got that far)."""
    trainer = _first(daemon.lines, r"trainer \d+ ready at step (\d+), holding version (\d+)")
    if trainer is not None:
        assert (int(trainer.group(1)), int(trainer.group(2))) == (expect["step"], expect["holding"]), \
            (trainer.group(0), expect)
    engine = _first(daemon.lines, r"policy engine ready at \S+ \(weight_version (\S+)\)")
    if engine is not None:
        assert engine.group(1) == expect["version"], (engine.group(0), expect)


@pytest.mark.slow
def test_engine_kill_answers_503_then_recovers(tiny_model, tmp_path):
    """SIGKILL the policy engine after the learner published v1: while it is down chat answers 503 with a
    Retry-After header; the supervisor restarts it (once) on the published weights, not the base model; the
    daemon serves again without a restart, and the next turn is served by v1."""
    daemon = Daemon(tmp_path, _learning(tiny_model, learner={"rollout_batch_size": 1},
                                        engine={"restart_backoff_initial": 1.0}))
    try:
        base = daemon.url + "/v1"
        thanked_conversation(base, "Tell me a fact.")
        assert wait_until(lambda: daemon.get("/debug/process")[1]["learner"]["publishes"] >= 1, 120), \
            daemon.get("/debug/process")[1]
        before = daemon.get("/debug/process")[1]
        assert before["policy"]["version"] == 1 and before["engines"]["policy"]["restarts"] == 0

        os.kill(before["engines"]["policy"]["pid"], signal.SIGKILL)
        assert wait_until(lambda: daemon.get("/ready")[0] == 503, 10)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "anyone there?"}]}).encode()
        request = urllib.request.Request(daemon.url + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 503
        assert int(refused.value.headers["Retry-After"]) >= 1
        assert json.loads(refused.value.read())["error"]["code"] == "engine_unavailable"

        assert wait_until(lambda: daemon.get("/ready")[0] == 200, 60)
        after = daemon.get("/debug/process")[1]
        assert after["engines"]["policy"]["restarts"] == 1
        assert after["engines"]["policy"]["pid"] != before["engines"]["policy"]["pid"] and not alive(before["engines"]["policy"]["pid"])
        assert after["pid"] == before["pid"]  # the same daemon
        launches = [line for line in daemon.lines if "starting policy engine:" in line]
        assert len(launches) == 2 and "--weight-version 1" in launches[1]
        assert f"--model {daemon.state}/weights/v000001 " in launches[1]
        readies = [line for line in daemon.lines if "policy engine ready at" in line]
        assert len(readies) == 2 and readies[1].rstrip().endswith("(weight_version 1)")

        client_ids = thanked_conversation(base, "And another fact?")
        assert daemon.get("/ready")[1]["policy_version"] >= 1
    finally:
        assert daemon.stop() == 0
    turns = {t["messages"][0]["content"]: t for t in daemon.records()}
    assert turns["And another fact?"]["weight_version"] == "1" and turns["And another fact?"]["policy_version"] == 1
    assert "anyone there?" not in turns  # refused: no turn
    assert all(cid for cid in client_ids)


@pytest.mark.slow
def test_trainer_kill_mid_step_is_restarted_and_the_batch_retried(tiny_model, tmp_path):
    """SIGKILL the trainer child while it trains a batch (the learner has taken it: waiting_since is None, no
    step counted yet; a few PPO epochs make the step last a second or more). The supervisor restarts the trainer once,
    the same batch is sent again to the new child and trained there (no failed step), its samples are acked,
    and the next step runs as usual. Nothing witnessed is lost."""
    batch = 4
    daemon = Daemon(tmp_path, _learning(tiny_model, learner={"rollout_batch_size": batch, "min_batch_size": batch},
                                        train={"ppo_epochs": 15}))
    try:
        base = daemon.url + "/v1"
        first = int(daemon.wait_for(r"trainer \d+ ready", 120).split("trainer ")[1].split()[0])
        for i in range(batch - 1):
            thanked_conversation(base, f"Question {i}?")
        assert wait_until(lambda: daemon.get("/debug/process")[1]["queue"]["waiting"] == batch - 1, 30)
        learner = daemon.get("/debug/process")[1]["learner"]
        assert learner["steps"] == 0 and learner["waiting_since"] is not None

        thanked_conversation(base, f"Question {batch - 1}?")  # the batch is complete: the step starts
        taken = wait_until(lambda: (lambda d: d["learner"]["waiting_since"] is None and d["queue"]["waiting"] == 0
                                    and d["learner"]["steps"] == 0)(daemon.get("/debug/process")[1]), 30, 0.02)
        assert taken, daemon.get("/debug/process")[1]
        os.kill(first, signal.SIGKILL)

        restarted = daemon.wait_for(r"trainer down \(exit code -9\); restarting in \S+ \(restart 1\)", 30)
        assert restarted
        retried = daemon.wait_for(rf"batch \w+, attempt 1/\d+: trainer {first} exited with code -9", 30)
        second = daemon.wait_for(rf"trainer (?!{first} )\d+ ready", 120)
        second = int(re.search(r"trainer (\d+) ready", second).group(1))
        assert second != first and not alive(first)
        done = wait_until(lambda: (lambda l: l if l["steps"] >= 1 and l["publishes"] >= 1 else None)(
            daemon.get("/debug/process")[1]["learner"]), 120)
        assert done and done["steps"] == 1 and done["failed_steps"] == 0 and done["samples_trained"] == batch, done
        assert wait_until(lambda: daemon.get("/debug/process")[1]["queue"]["journal_live"] == 0, 30)  # acked
        assert _metric(daemon, "clawd_trainer_restarts_total") == 1
        batch_id = re.search(r"batch (\w+), attempt 1", retried).group(1)

        for i in range(batch):  # steps go on with the new child
            thanked_conversation(base, f"Later question {i}?")
        assert wait_until(lambda: daemon.get("/debug/process")[1]["learner"]["steps"] >= 2, 120)
        assert wait_until(lambda: daemon.get("/debug/process")[1]["queue"]["journal_live"] == 0, 30)
    finally:
        assert daemon.stop() == 0
    assert not any("(restart 2)" in line for line in daemon.lines)  # restarted exactly once
    assert sum("exited with code -9" in line and batch_id in line for line in daemon.lines) == 1
    scan = read_journal(daemon.state / "journal")
    witnessed = witnessed_samples(daemon.state)
    assert len(witnessed) == 2 * batch and witnessed <= scan.acked and scan.live == ()
    assert newest_checkpoint(daemon.state)["step"] == 2  # the killed step counted once, on the new child
