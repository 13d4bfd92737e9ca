"""systemd: sd_notify and the watchdog against a fake notify socket, the unit, make install."""
from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from clawd.config.loading import load_config
from clawd.ops.systemd import datagram, extend_timeout, notify, notify_address, parse_watchdog, watchdog, watchdog_interval

from .harness import ROOT, Daemon

UNIT = ROOT / "systemd" / "clawd.service"
GPU_DROPIN = ROOT / "systemd" / "clawd-gpu.conf"


@pytest.fixture
def notify_socket(tmp_path, monkeypatch):
    """A bound datagram socket standing in for systemd's; NOTIFY_SOCKET points at it."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def received(sock: socket.socket, timeout: float = 5.0) -> str:
    sock.settimeout(timeout)
    return sock.recv(65536).decode()


def drain(sock: socket.socket) -> list[str]:
    sock.setblocking(False)
    out = []
    try:
        while True:
            out.append(sock.recv(65536).decode())
    except BlockingIOError:
        return out


# --- pure helpers ----------------------------------------------------------------------------

def test_datagram_joins_fields_with_newlines():
    assert datagram(["READY=1", "STATUS=serving v3"]) == b"READY=1\nSTATUS=serving v3"
    assert datagram(("EXTEND_TIMEOUT_USEC=30000000",)) == b"EXTEND_TIMEOUT_USEC=30000000"


def test_a_line_break_in_a_value_cannot_forge_an_assignment():
    assert datagram(["STATUS=reload failed:\nREADY=1\r\nend"]) == b"STATUS=reload failed: READY=1 end"


@pytest.mark.parametrize("bad", ["READY", "=1", "ready=1", "WATCH DOG=1", ""])
def test_a_field_that_is_not_key_value_is_a_programming_error(bad):
    with pytest.raises(ValueError):
        datagram([bad])
    with pytest.raises(ValueError):
        datagram([])


def test_extend_timeout():
    assert extend_timeout(90) == "EXTEND_TIMEOUT_USEC=90000000"
    assert extend_timeout(0.25) == "EXTEND_TIMEOUT_USEC=250000"
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            extend_timeout(bad)


def test_notify_addresses():
    assert notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert notify_address("@/org/freedesktop/systemd1/notify/123") == b"\0/org/freedesktop/systemd1/notify/123"
    for bad in ("relative/path", "@", "vsock:2:1234"):
        with pytest.raises(ValueError):
            notify_address(bad)


def test_parse_watchdog():
    pid = 4242
    assert parse_watchdog("200000", None, pid) == 0.1
    assert parse_watchdog("30000000", str(pid), pid) == 15.0
    assert parse_watchdog("30000000", "4243", pid) is None  # meant for another process
    assert parse_watchdog(None, None, pid) is None
    assert parse_watchdog("", str(pid), pid) is None
    for usec, wpid in (("0", None), ("-5", None), ("1.5e6", None), ("100", "x")):
        with pytest.raises(ValueError):
            parse_watchdog(usec, wpid, pid)


def test_watchdog_interval_from_the_environment(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "200000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval() == 0.1
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval() == 0.1
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    assert watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    monkeypatch.setenv("WATCHDOG_USEC", "soon")
    assert watchdog_interval() is None  # logged, not raised: the daemon runs on without a watchdog
    monkeypatch.delenv("WATCHDOG_USEC")
    assert watchdog_interval() is None


# --- notify against a fake socket ------------------------------------------------------------

def test_notify_sends_one_datagram(notify_socket):
    assert notify("READY=1", "STATUS=x") is True
    assert received(notify_socket) == "READY=1\nSTATUS=x"
    assert notify("STOPPING=1") is True
    assert received(notify_socket) == "STOPPING=1"


def test_notify_to_an_abstract_socket(monkeypatch):
    name = f"clawd-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("WATCHDOG=1") is True
        assert received(sock) == "WATCHDOG=1"


def test_without_notify_socket_nothing_is_sent(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "")
    assert notify("READY=1") is False


def test_a_failed_send_is_logged_not_raised(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens.sock"))
    assert notify("READY=1") is False
    assert "sd_notify" in caplog.text and "READY=1" in caplog.text
    monkeypatch.setenv("NOTIFY_SOCKET", "not/absolute")
    assert notify("READY=1") is False
    assert "not/absolute" in caplog.text


def test_a_full_receiver_does_not_block(notify_socket):
    """The receiver never reads: sends fail at once (EAGAIN) instead of stalling the loop."""
    results = [notify(f"STATUS={i}") for i in range(2000)]
    assert results[0] is True
    assert results[-1] is False
    drain(notify_socket)


# --- the watchdog task -----------------------------------------------------------------------

async def _pings(sock: socket.socket, n: int, timeout: float = 10.0) -> list[str]:
    loop = asyncio.get_running_loop()
    out = []
    async with asyncio.timeout(timeout):
        while len(out) < n:
            out.append((await loop.sock_recv(sock, 65536)).decode())
    return out


async def test_watchdog_pings_while_healthy_only(notify_socket):
    notify_socket.setblocking(False)
    interval = 0.02
    state = {"healthy": True}
    task = asyncio.create_task(watchdog(lambda: state["healthy"], interval))
    try:
        assert await _pings(notify_socket, 3) == ["WATCHDOG=1"] * 3
        # The predicate is checked and the ping sent in one step of the loop, so once
        # it says no, nothing more is sent.
        state["healthy"] = False
        drain(notify_socket)
        await asyncio.sleep(interval * 6)
        assert drain(notify_socket) == []
        state["healthy"] = True
        assert await _pings(notify_socket, 2) == ["WATCHDOG=1"] * 2
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_blocked_loop_stops_the_pings(notify_socket):
    """The pings come from the loop itself: while it is blocked, none are sent."""
    notify_socket.setblocking(False)
    interval = 0.02
    task = asyncio.create_task(watchdog(lambda: True, interval))
    try:
        await _pings(notify_socket, 1)
        drain(notify_socket)
        time.sleep(interval * 6)  # a wedged loop
        assert drain(notify_socket) == []
        assert await _pings(notify_socket, 1) == ["WATCHDOG=1"]
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_failing_predicate_propagates(notify_socket):
    def broken():
        raise RuntimeError("bug")
    with pytest.raises(RuntimeError, match="bug"):
        await watchdog(broken, 0.01)


# --- the unit files --------------------------------------------------------------------------

def _directives(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_the_unit_says_what_the_daemon_does():
    unit = _directives(UNIT.read_text())
    assert unit["Type"] == ["notify"] and unit["NotifyAccess"] == ["main"]
    assert unit["ExecStart"] == ["/opt/clawd/.venv/bin/python -P -m clawd --config /etc/clawd/clawd.toml"]
    assert unit["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert unit["KillMode"] == ["mixed"] and unit["KillSignal"] == ["SIGTERM"]
    # Above three drain phases at the default server.drain_timeout.
    drain_timeout = load_config(ROOT / "etc" / "clawd.toml").server.drain_timeout
    assert int(unit["TimeoutStopSec"][0]) > 3 * drain_timeout
    assert unit["User"] == ["clawd"] and unit["Group"] == ["clawd"]
    assert unit["RuntimeDirectory"] == unit["StateDirectory"] == unit["ConfigurationDirectory"] == ["clawd"]
    assert unit["WorkingDirectory"] == ["/var/lib/clawd"]


def test_the_gpu_dropin_relaxes_only_what_cuda_needs():
    dropin = _directives(GPU_DROPIN.read_text())
    assert dropin["PrivateDevices"] == ["no"]
    assert dropin["MemoryDenyWriteExecute"] == ["no"]
    assert "char-nvidia* rw" in dropin["DeviceAllow"]
    assert "ProtectSystem" not in dropin and "NoNewPrivileges" not in dropin and "User" not in dropin


def _unit_dir(tmp_path: Path, gpu: bool) -> Path:
    """A copy of the unit whose ExecStart exists here (verify checks it), with the drop-in if asked."""
    units = tmp_path / "units"
    (units / "clawd.service.d").mkdir(parents=True)
    python = os.path.realpath(sys.executable)
    (units / "clawd.service").write_text(UNIT.read_text().replace("/opt/clawd/.venv/bin/python", python))
    if gpu:
        shutil.copy(GPU_DROPIN, units / "clawd.service.d" / "gpu.conf")
    return units


needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def _analyze(units: Path, *args: str) -> subprocess.CompletedProcess:
    # SYSTEMD_UNIT_PATH ending in ":" adds our directory before the defaults, so the drop-in is found.
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:"}
    return subprocess.run(["systemd-analyze", *args, str(units / "clawd.service")], env=env,
                          capture_output=True, text=True, timeout=60)


@needs_analyze
@pytest.mark.parametrize("gpu", [False, True], ids=["base", "gpu"])
def test_systemd_analyze_verify_passes(tmp_path, gpu):
    out = _analyze(_unit_dir(tmp_path, gpu), "verify")
    assert out.returncode == 0, out.stdout + out.stderr
    warnings = [line for line in out.stderr.splitlines() if "clawd.service" in line]
    if _systemd_version() < 254:  # the restart backoff's keys came in 254: older ones ignore them
        warnings = [w for w in warnings if not re.search(r"Unknown key '(RestartSteps|RestartMaxDelaySec)'", w)]
    assert not warnings, out.stderr  # no other warning about our unit


def _systemd_version() -> int:
    out = subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True, timeout=60).stdout
    return int(re.match(r"systemd (\d+)", out).group(1))


def test_the_unit_bounds_memory_tasks_cores_and_restarts():
    unit = _directives(UNIT.read_text())
    assert unit["LimitCORE"] == ["0"] and unit["RuntimeDirectoryMode"] == ["0750"]
    assert unit["MemoryHigh"] and unit["MemoryMax"] and unit["TasksMax"]
    assert unit["RestartSteps"] and unit["RestartMaxDelaySec"]
    assert set(unit["RestartPreventExitStatus"][0].split()) == {"2", "3"}  # config error, unreadable state
    # The open-file limit covers the default connection cap.
    assert int(unit["LimitNOFILE"][0]) > load_config(ROOT / "etc" / "clawd.toml").server.max_connections


@needs_analyze
@pytest.mark.parametrize("gpu", [False, True], ids=["base", "gpu"])
def test_systemd_analyze_security_score(tmp_path, gpu):
    out = _analyze(_unit_dir(tmp_path, gpu), "security", "--offline=true", "--no-pager")
    line = next(line for line in out.stdout.splitlines() if "Overall exposure level" in line)
    score = float(line.split(":")[1].split()[0])
    print(f"systemd-analyze security ({'gpu' if gpu else 'base'}): {score}")
    assert score <= 2.5, out.stdout


# --- make install ----------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_install_stages_the_files(tmp_path):
    dest = tmp_path / "dest"

    def install(*args: str) -> str:
        out = subprocess.run(["make", "-s", "-C", str(ROOT), "install", f"DESTDIR={dest}", *args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    install()
    opt = dest / "opt" / "clawd"
    assert (opt / "clawd" / "ops" / "systemd.py").read_text() == (ROOT / "clawd" / "ops" / "systemd.py").read_text()
    assert (opt / "bin" / "clawd").exists() and (opt / "setup.cfg").exists()
    assert not list(opt.rglob("__pycache__"))
    assert not (opt / ".venv").exists()  # DESTDIR: files only

    assert (dest / "etc/systemd/system/clawd.service").read_text() == UNIT.read_text()
    assert not (dest / "etc/systemd/system/clawd.service.d").exists()  # GPU=1 only

    clawctl = dest / "usr/local/bin/clawctl"
    assert clawctl.read_text() == ("#!/bin/sh\n# clawctl of the clawd installed in /opt/clawd (make install).\n"
                                   'exec /opt/clawd/.venv/bin/python /opt/clawd/bin/clawctl "$@"\n')
    assert os.access(clawctl, os.X_OK)

    config_path = dest / "etc/clawd/clawd.toml"
    assert config_path.stat().st_mode & 0o777 == 0o640
    installed, default = load_config(config_path), load_config(ROOT / "etc" / "clawd.toml")
    assert installed.state.dir == "/var/lib/clawd"
    assert installed.model.path == "/var/lib/clawd/models/SmolLM2-135M-Instruct"
    # Nothing else differs from the documented defaults, comments included.
    from clawd.ops.reload import changed_keys
    assert list(changed_keys(default, installed)) == ["model.path", "state.dir"]
    assert len(config_path.read_text().splitlines()) == len((ROOT / "etc" / "clawd.toml").read_text().splitlines())

    # An operator's config is never overwritten; GPU=1 adds the drop-in; PREFIX moves the code.
    config_path.write_text('[logging]\nlevel = "debug"\n')
    out = install("GPU=1", "PREFIX=/srv/clawd")
    assert "keeping" in out
    assert config_path.read_text() == '[logging]\nlevel = "debug"\n'
    assert (dest / "etc/systemd/system/clawd.service.d/gpu.conf").read_text() == GPU_DROPIN.read_text()
    unit = (dest / "etc/systemd/system/clawd.service").read_text()
    assert "ExecStart=/srv/clawd/.venv/bin/python -P -m clawd" in unit and "/opt/clawd" not in unit
    assert "exec /srv/clawd/.venv/bin/python /srv/clawd/bin/clawctl" in clawctl.read_text()
    assert (dest / "srv/clawd/clawd/ops/systemd.py").exists()


# --- the real daemon under a fake systemd (needs the wiring in clawd/daemon.py) ---------------

class NotifyCollector:
    """Reads a fake notify socket on a thread, so the daemon's sends never find it full
    (Linux queues only net.unix.max_dgram_qlen datagrams, 10 by default)."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._seen = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            with self._seen:
                self.messages.append(data.decode())
                self._seen.notify_all()

    def wait_for(self, predicate, timeout: float, start: int = 0) -> int:
        """The index of the first message from `start` on that satisfies `predicate`."""
        deadline = time.monotonic() + timeout
        with self._seen:
            while True:
                for i in range(start, len(self.messages)):
                    if predicate(self.messages[i]):
                        return i
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no such notify message; got {self.messages!r}")
                self._seen.wait(left)

    def close(self):
        self._stop = True
        self._thread.join(5)
        self.sock.close()


def _fields(message: str) -> set[str]:
    return set(message.split("\n"))


@pytest.mark.slow
def test_daemon_notifies_ready_watchdog_and_stopping(tmp_path, monkeypatch, tiny_model):
    """READY=1 once the engine and the trainer are up, WATCHDOG=1 every WATCHDOG_USEC/2,
    STOPPING=1 on SIGTERM, then a clean exit."""
    collector = NotifyCollector(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", "500000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    daemon = None
    try:
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)}, "engine": {"launch": "local"},
                                   "learner": {"enabled": True}})
        ready = collector.wait_for(lambda m: "READY=1" in _fields(m), timeout=60)
        assert daemon.get("/ready")[0] == 200
        assert not any("STOPPING=1" in _fields(m) for m in collector.messages[:ready])
        ping = collector.wait_for(lambda m: m == "WATCHDOG=1", timeout=10, start=ready + 1)
        collector.wait_for(lambda m: m == "WATCHDOG=1", timeout=10, start=ping + 1)  # and again
        daemon.proc.send_signal(signal.SIGTERM)
        stopping = collector.wait_for(lambda m: "STOPPING=1" in _fields(m), timeout=30, start=ready + 1)
        assert daemon.stop() == 0
        assert not any("READY=1" in _fields(m) for m in collector.messages[stopping:])
    finally:
        if daemon is not None:
            daemon.stop()
        collector.close()


TRAINER_UNIT = ROOT / "systemd" / "clawd-trainer@.service"


def test_the_trainer_world_unit_runs_the_line_the_plan_prints_for_its_host():
    """clawd-trainer@N on another host runs exactly `world_argv(node_rank=N)`: the torchrun line the
    trainer child runs on node 0, with node rank N (the values from /etc/clawd/trainer-world.env)."""
    import shlex

    from clawd.config.train import TrainConfig, WorldConfig
    from clawd.trainer.worker.world import world_argv

    unit = _directives(TRAINER_UNIT.read_text())
    assert unit["Restart"] == ["always"] and unit["User"] == ["clawd"]
    assert unit["EnvironmentFile"] == ["/etc/clawd/trainer-world.env"]
    env = {"CLAWD_NNODES": "2", "CLAWD_NPROC": "4", "CLAWD_RDZV_HOST": "10.0.0.5", "CLAWD_RDZV_PORT": "29500",
           "CLAWD_COLLECTIVE_TIMEOUT": "300.0"}
    (line,) = unit["ExecStart"]
    line = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], line).replace("%i", "1")
    argv = shlex.split(line)
    assert argv[1] == "-P"  # the working directory is not on the import path
    train = TrainConfig(world=WorldConfig(nproc_per_node=4, nnodes=2, rdzv_endpoint="10.0.0.5:29500",
                                          collective_timeout=300.0))
    assert [argv[0], *argv[2:]] == world_argv(train, node_rank=1, endpoint=train.world.rdzv_endpoint,
                                                python="/opt/clawd/.venv/bin/python")


@needs_analyze
def test_the_trainer_world_unit_verifies(tmp_path):
    units = tmp_path / "units"
    units.mkdir()
    python = os.path.realpath(sys.executable)
    (units / "clawd-trainer@.service").write_text(TRAINER_UNIT.read_text().replace("/opt/clawd/.venv/bin/python",
                                                                                     python))
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{units}:"}
    out = subprocess.run(["systemd-analyze", "verify", str(units / "clawd-trainer@1.service")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not [line for line in out.stderr.splitlines() if "clawd-trainer" in line], out.stderr
