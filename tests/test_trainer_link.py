"""The trainer link: framing exact against multiprocessing, and real spawned children (no mocks).

The children run the handler of tests/trainer_handlers.py, whose factory travels pickled by reference.
"""
import asyncio
import json
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from clawd.config.logging import LoggingConfig
from clawd.config.model import ModelConfig
from clawd.config.schema import Config
from clawd.config.scoring import ScoringConfig
from clawd.config.state import StateConfig
from clawd.config.train import LossConfig, OptimizerConfig, TrainConfig, WorldConfig
from clawd.samples import Sample
from clawd.trainer.errors import HandlerError, TrainerDied, TrainerError, TrainerTimeout, TrainerUnavailable, TrainFailed
from clawd.trainer.link import Ready, TrainerLink, TrainerSupervisor
from clawd.trainer.options import trainer_options
from clawd.trainer.wire import (ProtocolError, encode_message, frame_header, message_frames, read_frame, read_message,
                                recv_message, send_message)
from tests.trainer_handlers import build, calls, make_sample

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_new_threads():
    before = threading.active_count()
    yield
    assert threading.active_count() == before


def options(tmp_path, **extra) -> dict:
    return {"dir": str(tmp_path), **extra}


def train_msg(batch_id: str, version: int, samples: list[Sample]) -> dict:
    return {"type": "train", "batch_id": batch_id, "version": version, "samples": samples}


async def until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def stream_of(*chunks: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    for chunk in chunks:
        reader.feed_data(chunk)
    reader.feed_eof()
    return reader


def framed(frames) -> bytes:
    return b"".join(frame_header(len(f)) + f for f in frames)


# ---- framing, no child ------------------------------------------------------------------------

def test_frame_header_is_what_send_bytes_writes():
    a, b = socket.socketpair()
    conn = Connection(a.detach())
    for n in (0, 1, 16384, 16385, 70000):
        payload = bytes(range(256)) * (n // 256) + b"x" * (n % 256)
        conn.send_bytes(payload)
        raw = b""
        while len(raw) < 4 + n:
            raw += b.recv(1 << 20)
        assert raw == frame_header(n) + payload
    conn.close()
    b.close()
    assert frame_header(5) == b"\x00\x00\x00\x05"
    assert frame_header(2**31 - 1) == b"\x7f\xff\xff\xff"  # the largest short form
    assert frame_header(2**31) == b"\xff\xff\xff\xff" + b"\x00\x00\x00\x00\x80\x00\x00\x00"


async def test_long_form_header_is_read_by_both_ends():
    long_form = struct.pack("!i", -1) + struct.pack("!Q", 5) + b"hello"
    a, b = socket.socketpair()
    a.sendall(long_form)
    assert Connection(b.detach()).recv_bytes() == b"hello"  # multiprocessing accepts it at any size
    a.close()
    assert await read_frame(stream_of(long_form)) == b"hello"
    with pytest.raises(ProtocolError):
        await read_frame(stream_of(struct.pack("!i", -2)))


async def test_messages_travel_as_a_head_and_one_frame_per_list_element():
    samples = [make_sample(0), make_sample(1, 7)]
    msg = train_msg("b1", 3, samples)
    frames = await encode_message(msg)
    assert frames == list(message_frames(msg))
    assert json.loads(frames[0]) == {"type": "train", "batch_id": "b1", "version": 3, "parts": [["samples", 2]]}
    assert frames[1:] == [s.to_json() for s in samples]

    reader = stream_of(framed(frames) + framed(message_frames({"type": "pong", "n": 1})))
    got = await read_message(reader)
    assert got == {"type": "train", "batch_id": "b1", "version": 3,
                   "samples": [json.loads(s.to_json()) for s in samples]}
    assert await read_message(reader) == {"type": "pong", "n": 1}
    assert await read_message(reader) is None  # a clean end of stream

    with pytest.raises(ProtocolError):  # ends inside a message
        await read_message(stream_of(framed(frames[:2])))
    with pytest.raises(ProtocolError):  # ends inside a header
        await read_message(stream_of(b"\x00\x00"))
    with pytest.raises(ProtocolError):
        await read_message(stream_of(framed([b'{"type":"x","parts":7}'])))

    a, b = socket.socketpair()  # the child's side: plain Connection calls
    ours, theirs = Connection(a.detach()), Connection(b.detach())
    ours.send_bytes(frames[0])  # small enough for the socket buffer
    for f in frames[1:]:
        ours.send_bytes(f)
    got = recv_message(theirs)
    assert [Sample.from_json(raw) for raw in got.pop("samples")] == samples
    assert got == {"type": "train", "batch_id": "b1", "version": 3}
    send_message(theirs, {"type": "pong", "n": 2})
    assert json.loads(ours.recv_bytes()) == {"type": "pong", "n": 2}
    ours.close()
    theirs.close()


def test_trainer_options_carry_the_config_itself(tmp_path):
    cfg = Config(model=ModelConfig(path=str(tmp_path / "model"), dtype="bfloat16"),
                 state=StateConfig(dir=str(tmp_path / "state")), scoring=ScoringConfig(mode="opd"),
                 train=TrainConfig(optimizer=OptimizerConfig(lr=0.5), loss=LossConfig(opd_clip=0.0),
                                   world=WorldConfig(gpus="3", device="cuda")), logging=LoggingConfig(level="debug"))
    options = trainer_options(cfg)
    assert options == {"mode": "opd", "model_dir": str(tmp_path / "model"), "state_dir": str(tmp_path / "state"),
                       "train": cfg.train, "dtype": "bfloat16", "log_level": "debug", "min_free_bytes": 1 << 30,
                       "keep_checkpoints": 5, "checkpoint_base": True,  # [versions] rollback_depth = 3
                       "lineages": False,  # one adapter (or none) for everyone
                       "env": {"CUDA_VISIBLE_DEVICES": "3"}}  # the child sets it before torch starts CUDA
    assert pickle.loads(pickle.dumps(options)) == options  # what the spawn sends


# ---- one child --------------------------------------------------------------------------------

async def test_the_child_sets_its_gpus_and_drops_scrubbed_variables_before_building_the_handler(
        tmp_path, monkeypatch):
    monkeypatch.setenv("CLAWD_TEST_SCRUBBED", "1")  # inherited through the spawn, then removed by the child
    env = {"CUDA_VISIBLE_DEVICES": "3", "CLAWD_TEST_SCRUBBED": None}
    link = TrainerLink(options(tmp_path, env=env, report_env=["CUDA_VISIBLE_DEVICES", "CLAWD_TEST_SCRUBBED"]),
                       factory=build)
    await link.start()
    assert await link.stop(10) == 0
    assert json.loads((tmp_path / "env.json").read_text()) == {"CUDA_VISIBLE_DEVICES": "3", "CLAWD_TEST_SCRUBBED": None}


async def test_handshake_ping_handler_errors_checkpoint_and_shutdown(tmp_path):
    link = TrainerLink(options(tmp_path, script={"1": "raise", "2": "retryable"}), factory=build)
    ready = await link.start()
    assert ready == Ready(pid=link.pid, step=0, version=0, weights_version=0)
    assert link.alive and link.pid != os.getpid()
    assert await link.ping(10) >= 0

    samples = [make_sample(0)]
    state = {"step": 0, "version": 0, "weights_version": 0, "checkpoint_step": None, "owed": [], "writing": None}
    assert link.state == state
    reply = await link.request(train_msg("b1", 1, samples), 30)
    assert reply == {"type": "error", "batch_id": "b1", "message": "ValueError: scripted failure",
                     "retryable": False, "kind": "request", "fatal": False, "state": state}
    reply = await link.request(train_msg("b1", 1, samples), 30)
    assert reply["type"] == "error" and reply["retryable"] is True and reply["kind"] == "request"
    assert link.alive
    await link.ping(10)

    reply = await link.request(train_msg("b1", 1, samples), 30)
    state = {**state, "step": 1, "version": 1, "weights_version": 1}
    assert reply == {"type": "trained", "batch_id": "b1", "version": 1, "weights_dir": str(tmp_path / "v1"),
                     "metrics": {"step": 1, "pid": link.pid, "call": 3, "n": 1}, "per_sample": [], "checkpointed": False,
                     "failed": None, "state": state}
    assert link.state == state  # every reply's state is kept
    ck = await link.checkpoint(10)
    assert ck.step == 1 and json.loads(Path(ck.path).read_text()) == {"step": 1, "version": 1}
    assert await link.publish(2, 10) == str(tmp_path / "v2")  # the same weights as a new version
    assert json.loads(Path(ck.path).read_text()) == {"step": 1, "version": 2}
    reply = await link.request({"type": "bogus"}, 10)
    assert reply["type"] == "error" and "bogus" in reply["message"]

    assert await link.stop(10) == 0
    assert not link.alive and link.exitcode == 0
    with pytest.raises(TrainerDied):
        await link.ping(1)


async def test_a_handler_that_cannot_be_built_fails_the_start(tmp_path):
    link = TrainerLink(options(tmp_path, fail_build=True), factory=build)
    with pytest.raises(TrainerError, match="no model here"):
        await link.start()
    assert link.exitcode == 1 and not link.alive


async def test_the_child_logs_at_the_level_it_is_given(tmp_path, capfd):
    link = TrainerLink(options(tmp_path, log_level="info"), factory=build)
    await link.start()
    assert await link.stop(10) == 0
    err = capfd.readouterr().err
    assert f"INFO tests.trainer_handlers: scripted handler built in {link.pid}" in err  # the daemon's format
    assert "scripted handler options" not in err  # debug, below the level


async def test_an_idle_child_exits_at_the_end_of_its_stream(tmp_path):
    link = TrainerLink(options(tmp_path), factory=build)
    await link.start()
    link._writer.close()  # what the daemon's death does to the child's socket
    await link.wait_closed()
    assert link.exitcode == 0


async def test_ping_times_out_when_the_child_is_stuck(tmp_path):
    link = TrainerLink(options(tmp_path, script={"1": "hang"}), factory=build)
    await link.start()
    training = asyncio.create_task(link.request(train_msg("b1", 1, [make_sample(0)])))
    await until(lambda: len(calls(tmp_path)) == 1)
    with pytest.raises(TrainerTimeout):
        await link.ping(0.5)
    await link.wait_closed()
    assert not link.alive and link.exitcode == -signal.SIGKILL
    with pytest.raises(TrainerDied):
        await training


async def test_stop_terminates_a_child_that_does_not_finish_its_message(tmp_path):
    link = TrainerLink(options(tmp_path, script={"1": "hang"}), factory=build)
    await link.start()
    training = asyncio.create_task(link.request(train_msg("b1", 1, [make_sample(0)])))
    await until(lambda: len(calls(tmp_path)) == 1)
    assert await link.stop(0.2) == -signal.SIGTERM
    with pytest.raises(TrainerDied):
        await training


@pytest.mark.slow
async def test_20_mb_each_way_while_the_loop_keeps_running(tmp_path):
    samples = [make_sample(i, 4000) for i in range(200)]
    size = sum(len(s.to_json()) for s in samples)
    assert size > 20_000_000
    link = TrainerLink(options(tmp_path, echo=True), factory=build)
    await link.start()
    bytes_before = link.stats["bytes_in"]
    seen = {"writing": 0, "reading": 0}
    gaps = [0.0]

    async def spin():  # one tick per loop iteration
        while True:
            if link.buffered_out > 0:
                seen["writing"] += 1
            if bytes_before < link.stats["bytes_in"] < bytes_before + size:
                seen["reading"] += 1
            await asyncio.sleep(0)

    async def tick():  # the loop's longest stall, for the record
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last - 0.01)
            last = now

    tickers = [asyncio.create_task(spin()), asyncio.create_task(tick())]
    reply = await link.request(train_msg("big", 1, samples), 120)
    for t in tickers:
        t.cancel()
    assert reply["type"] == "trained" and reply["metrics"]["n"] == len(samples)
    assert reply["per_sample"] == [json.loads(s.to_json()) for s in samples]
    assert link.stats["bytes_in"] - bytes_before > size
    assert seen["writing"] > 0  # the loop ran while the batch still sat in our write buffer
    assert seen["reading"] > 0  # ... and while the reply was half here
    print(f"\n{size / 1e6:.1f} MB each way; longest loop stall {max(gaps) * 1000:.0f} ms")
    assert await link.stop(10) == 0


# ---- kept alive -------------------------------------------------------------------------------

async def test_sigkill_mid_train_restarts_from_the_checkpoint_and_retries_the_batch(tmp_path):
    sup = TrainerSupervisor(options(tmp_path, script={"2": "hang"}), factory=build, backoff_initial=0.05)
    runner = asyncio.create_task(sup.run())
    samples = [make_sample(0), make_sample(1)]
    first = await sup.train("b0", 1, samples)
    assert first.metrics["step"] == 1
    assert (await sup.checkpoint(10)).step == 1
    first_pid = sup.pid

    training = asyncio.create_task(sup.train("b1", 2, samples))
    await until(lambda: len(calls(tmp_path)) == 2)
    os.kill(first_pid, signal.SIGKILL)
    trained = await training
    assert (trained.batch_id, trained.version, trained.metrics["step"]) == ("b1", 2, 2)
    assert trained.metrics["pid"] == sup.pid != first_pid
    assert sup.restarts == 1 and sup.link.ready == Ready(pid=sup.pid, step=1, version=1, weights_version=1)
    assert [(c["batch_id"], c["n"]) for c in calls(tmp_path)] == [("b0", 2), ("b1", 2), ("b1", 2)]
    await sup.stop(10)
    await runner
    assert sup.link.exitcode == 0 and not sup.alive


async def test_attempts_are_bounded_and_handler_errors_are_not_retried(tmp_path):
    script = {"1": "retryable", "2": "exit", "3": "exit", "5": "raise"}
    sup = TrainerSupervisor(options(tmp_path, script=script), factory=build, backoff_initial=0.05, attempts=3)
    runner = asyncio.create_task(sup.run())
    samples = [make_sample(0)]
    with pytest.raises(TrainFailed) as failed:
        await sup.train("b1", 1, samples)
    assert failed.value.attempts == 3 and isinstance(failed.value.__cause__, TrainerDied)
    await until(lambda: sup.restarts == 2)  # the supervisor brings up a third child regardless

    assert (await sup.train("b1", 1, samples)).metrics["call"] == 4  # the caller kept the batch
    with pytest.raises(HandlerError) as refused:
        await sup.train("b2", 2, samples)
    assert not refused.value.retryable and refused.value.batch_id == "b2"
    assert len(calls(tmp_path)) == 5 and sup.restarts == 2 and sup.alive
    await sup.stop(10)
    await runner


async def test_a_trainer_that_dies_while_the_daemon_drains_is_not_restarted(tmp_path):
    """hold_restarts (the drain's first act): the child that exits then stays down, and a caller waiting for a
    trainer gives up at once, as at a stop, instead of waiting for a new child."""
    sup = TrainerSupervisor(options(tmp_path, script={"2": "exit"}), factory=build, backoff_initial=0.05)
    runner = asyncio.create_task(sup.run())
    assert (await sup.train("b1", 1, [make_sample(0)])).metrics["call"] == 1
    sup.hold_restarts()
    with pytest.raises(TrainerError):
        await sup.train("b2", 2, [make_sample(1)])  # the child dies on it
    await asyncio.wait_for(runner, 10)  # run() ended instead of starting another child
    assert sup.restarts == 0 and not sup.alive and len(calls(tmp_path)) == 2
    with pytest.raises(TrainerUnavailable):
        await asyncio.wait_for(sup.ready_info(), 5)
    await sup.stop(10)


PARENT = """
import asyncio, json, sys, threading
from clawd.trainer.link import TrainerSupervisor
from tests.trainer_handlers import build, calls, make_sample

async def main(d):
    threads = [threading.active_count()]
    sup = TrainerSupervisor({"dir": d, "script": {"1": "exit", "3": "hang"}}, factory=build, backoff_initial=0.05)
    asyncio.create_task(sup.run())
    await sup.train("b1", 1, [make_sample(0)])  # the first child dies; the second trains it
    threads.append(threading.active_count())
    asyncio.create_task(sup.train("b2", 2, [make_sample(1)]))
    while len(calls(d)) < 3:
        await asyncio.sleep(0.02)
    threads.append(threading.active_count())
    print(json.dumps({"child": sup.pid, "restarts": sup.restarts, "threads": threads,
                      "torch": "torch" in sys.modules, "handler": "clawd.trainer.worker.handler" in sys.modules}),
          flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1]))
"""


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"  # dead, waiting for a reaper that is not its parent


def test_the_child_dies_with_its_parent(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert select.select([parent.stdout], [], [], 60)[0], "the parent said nothing"
        report = json.loads(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    assert report["threads"] == [1, 1, 1] and report["restarts"] == 1
    assert report["torch"] is False and report["handler"] is False  # the real trainer stays in its child
    deadline = time.monotonic() + 30
    while not gone(report["child"]):  # it was busy training, so only the parent-death signal can end it
        assert time.monotonic() < deadline, "the trainer outlived its parent"
        time.sleep(0.02)


def test_every_message_of_the_catalogue_is_its_wire_json_and_reads_back_as_itself():
    import dataclasses

    from clawd.trainer.catalogue import (Checkpoint, Checkpointed, JoinGroup, Joined, LeaveGroup, Left, Ping, Pong,
                                         Published, PublishWeights, Ready, Restore, Restored, SendWeights, Sent,
                                         Train, Trained, WaitWritten, Written, message, read_reply, read_request)
    sample = make_sample(0)
    train = Train("b1", 3, [sample.to_json()])
    assert message(train) == {"type": "train", "batch_id": "b1", "version": 3, "samples": [sample.to_json()],
                              "deferred": False}
    assert read_request(message(train)) == Train("b1", 3, [sample])   # the samples decoded
    requests = [PublishWeights(4), WaitWritten(4), Checkpoint(), Restore(2), Ping(7), LeaveGroup("p"),
                JoinGroup("p", "127.0.0.1", 5000, 2, "gloo", 60.0, 1 << 20), SendWeights("p", 4, 1 << 20)]
    assert [read_request(message(r)) for r in requests] == requests
    assert message(PublishWeights(4)) == {"type": "publish", "version": 4}
    replies = [Published(4, "/w/v4"), Written(4, "/w/v4"), Checkpointed("/c/1", 1), Restored(2, 5),
               Joined("p", [{"names": ["a"]}]), Sent("p", 4, 10, 1, 0.5), Left("p"), Pong(7), Ready(11, 1, 2, 2, 1)]
    # A reply read back keeps only its own fields: the `state` every reply carries is the link's to keep, but
    # a train's, which the learner reads with the step.
    assert [read_reply({**message(r), "state": {"step": 1}}) for r in replies] == replies
    trained = Trained("b1", 3, "/w/v3", {"loss": 0.5}, [], True, None)
    assert read_reply({**message(trained), "state": {"step": 1}}) == dataclasses.replace(trained, state={"step": 1})
    assert message(Train("b1", 3, [], deferred=True))["deferred"] is True
    assert message(Written(4, "/w/v4")) == {"type": "written", "version": 4, "weights_dir": "/w/v4"}
    with pytest.raises(ValueError, match="unknown message type"):
        read_request({"type": "reboot"})
