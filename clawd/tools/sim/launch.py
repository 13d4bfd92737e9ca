"""Starting a clawd as an operator runs it, for the tests, the demo and the benches: the one way (`spawn`).

`spawn` writes the config from a dict and runs `python -m clawd --config FILE` in its own process, clawd's own
repository first on its path; `listening` finds the URL its log announces. `Clawd` is the demo's and the
learning bench's: its log goes to a file, and `status()` asks the admin socket what `clawctl status --json`
shows. tests/harness.Daemon and bench/abuse.launch_daemon start theirs with `spawn` too.
"""
from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from clawd.lifetime import die_with_parent
from clawd.tools.tomlfile import merged, to_toml
from clawd.ops.ctl import NotRunning, call

# The repository (this file is clawd/tools/sim/launch.py): clawd's own package goes first on the daemon's path,
# never clawd/ itself, whose modules would shadow the standard library's.
REPO = Path(__file__).resolve().parents[3]

LISTENING = re.compile(r"listening on (http://\S+)")
MAX_SOCKET_PATH = 107  # bytes in sun_path, less the terminating NUL


def spawn(run_dir: Path, cfg: dict, *, stdout=None, stderr=None, threads: int | None = None,
          own_session: bool = False, text: bool = False, python_args: tuple[str, ...] = ()) -> subprocess.Popen:
    """clawd on `cfg` (written as run_dir/clawd.toml), started in run_dir. `stdout`, `stderr`: as Popen's;
    `threads`: OMP_NUM_THREADS for it (its CPU engine and trainer inherit it; on 2 cores one each keeps them
    from stalling each other); `own_session`: a session of its own, so a Ctrl-C in the terminal reaches the
    caller alone (which stops clawd cleanly), and SIGTERM when the caller dies without doing so; python_args:
    before `-m clawd` (a profiler's, say)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "clawd.toml"
    config_path.write_text(to_toml(cfg))
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    extra = {"start_new_session": True, "preexec_fn": functools.partial(die_with_parent, signal.SIGTERM)} \
        if own_session else {}
    return subprocess.Popen([sys.executable, *python_args, "-m", "clawd", "--config", str(config_path)], cwd=run_dir,
                            env=env, stdout=stdout, stderr=stderr, text=text, **extra)


def listening(log: str) -> str | None:
    """The URL clawd's log says it listens on, or None yet."""
    m = LISTENING.search(log)
    return m.group(1) if m else None


class Clawd:
    """One clawd process on a fresh state directory under `run_dir`.

    `threads` sets OMP_NUM_THREADS for the daemon (its CPU engine and trainer inherit it):
    on 2 cores one thread each keeps the engine and the trainer from stalling each other.
    """

    def __init__(self, run_dir: Path, sections: dict[str, dict[str, Any]], *, threads: int | None = 1):
        self.run_dir = Path(run_dir).resolve()
        self.state = self.run_dir / "state"
        self.log_path = self.run_dir / "clawd.log"
        # The simulated users are told apart by the request's `user` field: trusted here, on loopback.
        cfg = {"server": {"port": 0}, "state": {"dir": str(self.state)}, "auth": {"trust_user_field": True}}
        cfg = merged(cfg, sections)
        self.socket = Path(cfg.get("admin", {}).get("socket") or self.state / "clawd.sock")
        if len(os.fsencode(self.socket)) > MAX_SOCKET_PATH:
            raise ValueError(f"admin socket path too long for a Unix socket: {self.socket} (use a shorter run dir)")
        self.config = cfg
        self.threads = threads
        self.proc: subprocess.Popen | None = None
        self.url = ""

    async def start(self, timeout: float = 600) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = spawn(self.run_dir, self.config, stdout=log, stderr=subprocess.STDOUT, threads=self.threads,
                              own_session=True)
        deadline = time.monotonic() + timeout
        while not self.url:
            self.url = listening(self.log_path.read_text(errors="replace")) or ""
            if not self.url:
                self._check_alive(deadline, "listening")
                await asyncio.sleep(0.2)
        while True:
            try:
                ready = self.status()["engines"]["policy"]["state"] == "ready"
            except (NotRunning, OSError):
                ready = False  # the socket is not there yet
            if ready:
                return
            self._check_alive(deadline, "ready")
            await asyncio.sleep(0.5)

    def _check_alive(self, deadline: float, what: str) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"clawd exited ({self.proc.returncode}) before {what}; its log:\n{self.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"clawd not {what} in time; its log:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def status(self, timeout: float = 5.0) -> dict:
        """`clawctl status --json`: the daemon's own snapshot, from its admin socket."""
        return call(self.socket, {"cmd": "status"}, timeout)

    def command(self, cmd: str, **args: Any) -> dict:
        return call(self.socket, {"cmd": cmd, **args}, 5.0)

    async def settle(self, timeout: float) -> bool:
        """Once no chat traffic comes in: wait until nothing is being scored and the learner waits for
        samples with fewer than a batch queued (no step in progress, none about to start). False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            learner = st.get("learner")
            if (st["scoring"]["pending"] == 0 and st["queue"]["effective"] < st["queue"]["batch_size"]
                    and (learner is None or learner["waiting_since"] is not None)):
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait (SIGKILL after `timeout`); the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def records(self, kind: str) -> list[dict]:
        """The daemon's records of one kind ("turns", "judge"), complete lines only."""
        out = []
        for path in sorted((self.state / "records").glob(f"{kind}-*.jsonl")):
            # What follows the last newline is a line still being written: not yet a record.
            complete = path.read_text().rpartition("\n")[0]
            out += [json.loads(line) for line in complete.split("\n") if line.strip()]
        return out
