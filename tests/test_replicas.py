"""Several policy replicas: the router's decisions (pure, exact values), rolling publishes against fake
SGLang servers, and two real CPU-engine replicas behind the daemon under load (publishes, a kill)."""
from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import threading
import time
from types import SimpleNamespace

import openai
import pytest

from clawd import faults
from clawd.config.loading import config_from_dict
from clawd.engine.client import (EngineClient, EngineDisconnected, EngineError, EngineRejected, EngineTimeout,
                                 EngineUnavailable)
from clawd.engine.replicas import Attempt, Load, Replicas, behind, choose, retryable
from clawd.engine.supervisor import EngineSupervisor
from clawd.learning.publisher import Publisher
from clawd.served import Policy
from clawd.serving.sessions import SessionTable

from .fake_sglang import FakeSGLang
from .harness import Daemon
from .load import load_until_published, log_time

# ---- the router's decisions -----------------------------------------------------------------------


def test_a_session_stays_on_its_home_while_it_is_in_rotation():
    loads = [Load(True, in_flight=9, sessions=9), Load(True, in_flight=0, sessions=0)]
    assert choose(loads, home=0) == 0
    assert choose(loads, home=None) == 1


def test_a_new_request_goes_to_the_least_loaded_replica_ties_by_sessions_then_index():
    assert choose([Load(True, 2, 0), Load(True, 1, 5), Load(True, 1, 3)]) == 2
    assert choose([Load(True, 1, 3), Load(True, 1, 3), Load(True, 1, 3)]) == 0
    assert choose([Load(True, 0, 4), Load(True, 0, 1)]) == 1


def test_replicas_out_of_rotation_or_excluded_are_skipped_and_a_draining_one_is_the_last_resort():
    assert choose([Load(False), Load(True, 5, 5)], home=0) == 1  # re-homed: its home left rotation
    assert choose([Load(True), Load(True, 3, 3)], exclude=frozenset({0})) == 1
    assert choose([Load(False), Load(False)]) is None
    assert choose([Load(True, 0, 0, draining=True), Load(True, 4, 4)]) == 1
    assert choose([Load(True, 0, 0, draining=True), Load(False)]) == 0
    assert choose([Load(True, 0, 0, draining=True), Load(True, 0, 0, draining=True)], home=1) == 1


def test_a_session_whose_home_drains_for_a_swap_is_served_elsewhere_and_comes_home_after():
    """The draining replica is paused through its swap: a session does not wait it out, nor move for good
    (after a rolling publish every session would sit on the replica swapped last)."""
    assert choose([Load(True, draining=True), Load(True, 4, 4)], home=0) == 1
    assert choose([Load(True, 9, 9, draining=True), Load(True, 0, 0, draining=True)], home=0) == 0  # all drain

    sups = [_sup(), _sup()]
    for sup in sups:
        sup.client = SimpleNamespace(generate=_answer(None))
    replicas = Replicas(sups)
    moved = []
    replicas.counts[0].draining = True
    attempt = Attempt(replicas, home=0, sessions=[1, 0], rehome=moved.append)
    assert attempt.next() == 1 and moved == [] and attempt.home == 0 and replicas.rehomed == 0
    attempt.end()
    replicas.counts[0].draining = False
    attempt = Attempt(replicas, home=0, sessions=[1, 0], rehome=moved.append)
    assert attempt.next() == 0 and moved == []
    attempt.end()
    # A home that left rotation is another matter: the session moves.
    sups[0].is_ready = False
    attempt = Attempt(replicas, home=0, sessions=[1, 0], rehome=moved.append)
    assert attempt.next() == 1 and moved == [1] and replicas.rehomed == 1
    attempt.end()


def test_only_engine_failures_before_a_byte_on_the_first_try_are_retried():
    assert retryable(EngineUnavailable("refused"), sent=False, attempts=1)
    assert retryable(EngineError("connection lost"), sent=False, attempts=1)  # status 502: a reset, a death
    assert retryable(EngineError("busy", status=503), sent=False, attempts=1)
    assert not retryable(EngineUnavailable("refused"), sent=True, attempts=1)
    assert not retryable(EngineUnavailable("refused"), sent=False, attempts=2)
    assert not retryable(EngineRejected("bad"), sent=False, attempts=1)
    assert not retryable(EngineTimeout("no first byte"), sent=False, attempts=1)
    assert not retryable(ValueError("x"), sent=False, attempts=1)


def test_behind_compares_version_numbers_and_ignores_the_base_model():
    published = Policy(version=3, weight_version="3", weights_dir="/w/v3")
    assert [behind(v, published) for v in ("2", "3", "4", None, "default")] == [True, False, False, True, True]
    assert not behind("default", Policy())  # the base model: whatever the engine calls it


def _sup(ready=True, version="0", answers=1, limit=None):
    return SimpleNamespace(is_ready=ready, info={"weight_version": version}, answers=answers, needs_realign=False,
                           input_limit=limit, client=SimpleNamespace(url="http://x"), unreachable=0,
                           mark_unreachable=lambda: None, state=SimpleNamespace(value="ready"))


def test_a_replica_a_request_found_broken_is_out_until_its_supervisor_answers_again():
    sups = [_sup(), _sup(limit=100), _sup(limit=80)]
    replicas = Replicas(sups)
    assert replicas.input_limit == 80
    replicas.failed(1, EngineDisconnected("connection reset"))
    replicas.failed(2, EngineRejected("bad request"))  # the request's fault: the replica stays
    replicas.failed(0, EngineError("engine answered 500", status=502))  # it answered: it stays
    assert [replicas.usable(i) for i in range(3)] == [True, False, True]
    assert [c.failures for c in replicas.counts] == [0, 1, 0]
    sups[1].answers += 1
    assert replicas.usable(1)
    sups[2].needs_realign = True
    assert replicas.choose(sessions=[5, 0, 0]) == 1
    # The last replica in rotation stays in: its supervisor alone takes it out, as with one engine.
    one = Replicas([_sup()])
    one.failed(0, EngineUnavailable("refused"))
    assert one.usable(0) and one.counts[0].failures == 1


def test_an_attempt_retries_once_elsewhere_and_re_homes_its_session():
    class Client:
        def __init__(self, fail: BaseException | None):
            self.fail, self.calls = fail, 0

        async def generate(self, payload, timeout=None):
            self.calls += 1
            if self.fail:
                raise self.fail
            return {"ok": True}

    async def run(fails):
        sups = [_sup() for _ in fails]
        for sup, fail in zip(sups, fails):
            sup.client = Client(fail)
        replicas = Replicas(sups)
        moved = []
        attempt = Attempt(replicas, home=0, sessions=[1, 0, 0][:len(fails)], rehome=moved.append)
        try:
            result = await attempt.run("generate", {})
        except EngineError as exc:
            result = type(exc).__name__
        attempt.end()
        return result, moved, [s.client.calls for s in sups], [c.in_flight for c in replicas.counts], replicas

    result, moved, calls, in_flight, replicas = asyncio.run(run([EngineUnavailable("refused"), None, None]))
    assert (result, moved, calls, in_flight) == ({"ok": True}, [1], [1, 1, 0], [0, 0, 0])
    assert replicas.rehomed == 1 and replicas.counts[0].retried_away == 1
    # Only once: the second failure is the client's answer.
    assert asyncio.run(run([EngineUnavailable("a"), EngineUnavailable("b"), None]))[:3] == (
        "EngineUnavailable", [1], [1, 1, 0])
    # Never a 400.
    assert asyncio.run(run([EngineRejected("bad"), None]))[:3] == ("EngineRejected", [], [1, 0])


def test_negative_control_with_the_retry_failed_by_a_fault_the_first_failure_is_the_answer():
    async def run():
        sups = [_sup(), _sup()]
        for sup, fail in zip(sups, [EngineUnavailable("refused"), None]):
            sup.client = SimpleNamespace(generate=_answer(fail))
        attempt = Attempt(Replicas(sups))
        try:
            return await attempt.run("generate", {})
        finally:
            attempt.end()

    faults.arm("engine.retry", "eio")
    try:
        with pytest.raises(EngineUnavailable, match="refused"):
            asyncio.run(run())
    finally:
        faults.reset()
    assert asyncio.run(run()) == {"ok": True}  # the same failure, retried


def _answer(fail: BaseException | None):
    async def generate(payload, timeout=None):
        if fail:
            raise fail
        return {"ok": True}
    return generate


def test_sessions_count_per_replica_and_release_it_when_closed():
    table = SessionTable(idle_timeout=10.0, max_turns=8, max_sessions=8, new_id=lambda: "x")
    a = table.begin("p", "a", [{"role": "user", "content": "hi"}], 0.0)
    b = table.begin("p", "b", [{"role": "user", "content": "yo"}], 0.0)
    assert table.replica_of(a) is None
    table.set_replica(a, 1)
    table.set_replica(b, 1)
    assert table.homed(2) == [0, 2]
    table.set_replica(b, 0)  # re-homed
    assert (table.homed(2), table.replica_of(b)) == ([1, 1], 0)
    table.cancel(a, 1.0)
    table.close_all(2.0)
    assert table.homed(2) == [0, 0]


# ---- rolling publishes against fake SGLang servers --------------------------------------------------


def _supervisors(fakes, policy, **engine):
    cfg = config_from_dict({"engine": {"launch": "none", "urls": [f.url for f in fakes], "health_interval": 0.1,
                                       **engine}})
    return [EngineSupervisor(cfg, EngineClient(f.url), "policy", policy, index=i) for i, f in enumerate(fakes)]


async def _run(sups):
    for s in sups:
        await s.client.start()
    tasks = [asyncio.create_task(s.run()) for s in sups]
    for s in sups:
        await asyncio.wait_for(s.ready.wait(), 10)
    return tasks


async def _stop(sups, tasks):
    for s in sups:
        await s.stop()
    for t in tasks:
        t.cancel()
    for s in sups:
        await s.client.close()


async def test_a_rolling_publish_swaps_one_replica_at_a_time_and_a_failed_one_is_realigned(tmp_path):
    """Each replica is paused, updated, continued and checked before the next is touched; a replica whose
    update fails is left out of rotation, and its supervisor moves it onto the published weights."""
    async with FakeSGLang() as a, FakeSGLang() as b:
        policy = Policy()
        sups = _supervisors([a, b], policy)
        tasks = await _run(sups)
        try:
            replicas = Replicas(sups, policy)
            a.calls.clear()
            b.calls.clear()
            await Publisher(replicas, 10).publish(str(tmp_path / "v1"), 1)
            controls = ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]
            assert [p for p, _ in a.calls] == controls and [p for p, _ in b.calls] == controls
            assert (a.weight_version, b.weight_version) == ("1", "1")
            policy.version, policy.weight_version, policy.weights_dir = 1, "1", str(tmp_path / "v1")
            # v2: replica 1's update fails; replica 0 confirms, so the publish stands.
            b.fail_next(500, {"error": "load failed"}, path="/update_weights_from_disk")
            await Publisher(replicas, 10).publish(str(tmp_path / "v2"), 2)
            assert sups[1].needs_realign and not replicas.usable(1) and replicas.usable(0)
            assert replicas.counts[1].swap_failures == 1 and not b.paused
            policy.version, policy.weight_version, policy.weights_dir = 2, "2", str(tmp_path / "v2")
            deadline = time.monotonic() + 5
            while not replicas.usable(1) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert replicas.usable(1) and b.weight_version == "2" and not sups[1].needs_realign
            # Every replica fails: nothing moved, the publish fails (retried by the learner).
            a.fail_next(500, {"error": "x"}, path="/update_weights_from_disk")
            b.fail_next(500, {"error": "x"}, path="/update_weights_from_disk")
            with pytest.raises(EngineError):
                await Publisher(replicas, 10).publish(str(tmp_path / "v3"), 3)
            assert not sups[0].needs_realign and not sups[1].needs_realign
        finally:
            await _stop(sups, tasks)


async def test_a_replica_found_behind_the_policy_is_out_of_rotation_until_realigned(tmp_path):
    async with FakeSGLang() as a, FakeSGLang(weight_version="1") as b:
        policy = Policy(version=1, weight_version="1", weights_dir=str(tmp_path / "v1"))
        sups = _supervisors([a, b], policy)
        tasks = await _run(sups)  # a comes up on "0" and is aligned before it counts as ready
        try:
            replicas = Replicas(sups, policy)
            assert a.weight_version == "1" and replicas.usable(0) and replicas.usable(1)
            sups[1].info = {**sups[1].info, "weight_version": "0"}  # as a poll finds it behind: out of rotation
            assert not replicas.usable(1)
            b.weight_version = "0"  # restarted behind clawd's back: its next poll says so
            b.calls.clear()
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not (b.weight_version == "1" and replicas.usable(1)):
                await asyncio.sleep(0.02)
            assert b.weight_version == "1" and replicas.usable(1)
            assert [p for p, _ in b.calls if p != "/model_info"] == ["/update_weights_from_disk"]
        finally:
            await _stop(sups, tasks)


# ---- two CPU-engine replicas behind the daemon -------------------------------------------------------

CHAT_LINE = re.compile(r"chat id=(\S+) rid=\S+ session=(\S+) turn=\S+ version=\d+ replica=(\S+) home=(\S+) "
                       r"served=(\S+)")
SWAP_LINE = re.compile(r"clawd.learner: published v(\d+) in ([0-9.]+)s")


@pytest.mark.slow
def test_two_cpu_replicas_publish_ten_times_keep_sessions_home_and_survive_a_kill(tiny_model, tmp_path):
    """One daemon (its start is the cost), two phases. Under closed-loop load through the openai client:
    ten rolling publishes fail no request, requests overlap each, every session stays on one replica and
    both serve. Then, under non-streamed load (every failure comes before a byte is sent), replica 1's engine
    is SIGKILLed while it serves: what it had not answered is retried on replica 0, nothing fails."""
    publishes = 10
    daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model), "max_tokens_cap": 8},
                               "engine": {"launch": "local", "replicas": 2, "restart_backoff_initial": 0.5},
                               "learner": {"enabled": True, "rollout_batch_size": 1, "min_batch_size": 1},
                               "train": {"optimizer": {"lr": 1e-4}}})
    try:
        # The daemon is ready with one replica up; the load must meet both (a loaded suite once finished its
        # ten publishes before replica 1 had loaded: every session homed on replica 0).
        for replica in (0, 1):
            daemon.wait_for(rf"policy-{replica} engine ready", 120)
        requests, learner = load_until_published(daemon, users=4, publishes=publishes, timeout=150)
        status = daemon.get("/debug/process")[1]
        chat_lines = len(daemon.lines)
        killed, busy, after = _kill_a_replica_under_load(daemon)
    finally:
        assert daemon.stop() == 0
    failures = [r["error"] for r in requests if not r["ok"]]
    assert failures == [] and learner["publishes"] >= publishes and learner["failed_publishes"] == 0
    # Requests overlapped every publish (from its start to its end, read off the learner's log line).
    windows = [(log_time(line) - float(m.group(2)), log_time(line)) for line in daemon.lines
               if (m := SWAP_LINE.search(line))][:publishes]
    during = [sum(1 for r in requests if r["start"] < end and r["end"] > start) for start, end in windows]
    print(f"\n{len(requests)} requests, 0 failed; publishes (s): {[round(e - s, 3) for s, e in windows]}; "
          f"requests overlapping each: {during}")
    assert len(windows) == publishes and all(during), during
    # Affinity: every session keeps one home replica (both healthy all along), and both are homes. A turn
    # asked while its home drained for a swap is served on the other one (counted, not asserted: timing).
    homes, away = collections.defaultdict(set), 0
    for line in daemon.lines[:chat_lines]:
        if (m := CHAT_LINE.search(line)) and m.group(2) != "-":
            homes[m.group(2)].add(m.group(4))
            away += m.group(3) != m.group(4)
    print(f"{len(homes)} sessions, {sum(len(r) == 1 for r in homes.values())} with one home; "
          f"homes: {collections.Counter(next(iter(r)) for r in homes.values())}; turns served away from home "
          f"while it drained: {away}")
    assert homes and {s: r for s, r in homes.items() if len(r) > 1} == {}
    assert {next(iter(r)) for r in homes.values()} == {"0", "1"}
    assert all(int(r["weight_version"]) >= publishes and r["in_rotation"] and r["swap_failures"] == 0
               for r in status["replicas"]), status["replicas"]
    # The kill.
    failures = [r["error"] for r in killed if not r["ok"]]
    print(f"kill: {len(killed)} requests, {len(failures)} failed; replica 1 had {busy} in flight; "
          f"retries {after['chat']['retries']}; replicas {after['replicas']}")
    assert failures == [] and len(killed) >= busy >= 1
    assert after["chat"]["retries"] >= 1 and after["replicas"][1]["retried_away"] >= 1


def _non_streamed_users(url: str, n: int, stop: threading.Event, out: list, max_tokens: int) -> list:
    def user(k: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        i = 0
        while not stop.is_set():
            i += 1
            rec = {"start": time.time(), "ok": True}
            try:
                client.chat.completions.create(model="m", max_tokens=max_tokens,
                                               messages=[{"role": "user", "content": f"user {k} asks {i}"}],
                                               extra_headers={"X-Session-Done": "1"})
            except Exception as exc:  # every failure is what the test counts
                rec.update(ok=False, error=repr(exc))
            rec["end"] = time.time()
            out.append(rec)
    threads = [threading.Thread(target=user, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    return threads


def _kill_a_replica_under_load(daemon: Daemon) -> tuple[list, int, dict]:
    """Non-streamed load; replica 1's engine SIGKILLed while it serves requests, the load kept up 2 s more.
    Returns the requests, replica 1's in-flight count when killed, and the status after."""
    requests: list = []
    stop = threading.Event()
    threads = _non_streamed_users(daemon.url, 4, stop, requests, max_tokens=8)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            snap = daemon.get("/debug/process")[1]
            if busy := snap["replicas"][1]["in_flight"]:
                os.kill(snap["engines"]["policy-1"]["pid"], signal.SIGKILL)
                break
            time.sleep(0.01)
        else:
            raise AssertionError("replica 1 never had a request in flight")
        time.sleep(2)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    return requests, busy, daemon.get("/debug/process")[1]


# ---- launching: every replica in the plan ----------------------------------------------------------


def test_the_plan_shows_each_sglang_replica_on_its_own_port_and_gpu_slice(tmp_path):
    from clawd.ops.plan import launches
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"], "dtype": "bfloat16"}')
    cfg = config_from_dict({"model": {"path": str(model)}, "state": {"dir": str(tmp_path / "state")},
                            "engine": {"launch": "sglang", "url": "http://127.0.0.1:30000", "gpus": "0,1,2,3",
                                       "replicas": 2, "sglang_args": ["--tp-size", "2"]},
                            "scoring": {"mode": "rl"}, "judge": {"backend": "rules"}, "learner": {"enabled": False}})
    found = [(p.role, p.port, p.devices, p.env.get("CUDA_VISIBLE_DEVICES"), p.argv[p.argv.index("--port") + 1])
             for p in launches(cfg)]
    assert found == [("policy-0", 30000, (0, 1), "0,1", "30000"), ("policy-1", 30001, (2, 3), "2,3", "30001")]
    assert all("--tp-size" in p.argv for p in launches(cfg))  # SGLang's own parallelism stays available
    local = config_from_dict({"model": {"path": str(model)}, "state": {"dir": str(tmp_path / "state")},
                              "engine": {"launch": "local", "replicas": 3}, "scoring": {"mode": "rl"},
                              "judge": {"backend": "rules"}, "learner": {"enabled": False}})
    assert [p.role for p in launches(local)] == ["policy-0", "policy-1", "policy-2"]
