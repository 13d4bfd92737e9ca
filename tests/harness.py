"""Running the real daemon as a subprocess, for component and end-to-end tests."""
from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from clawd.tools.sim import launch
from clawd.tools.tomlfile import merged

ROOT = Path(__file__).resolve().parent.parent


def load_bench(name: str, module: str | None = None):
    """bench/<name>.py as a module (the benches are scripts, not a package; their folder goes on sys.path
    so that they find bench/provenance.py as they do when run)."""
    import importlib.util
    bench = str(ROOT / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    spec = importlib.util.spec_from_file_location(module or name, ROOT / "bench" / f"{name}.py")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module or name] = loaded
    spec.loader.exec_module(loaded)
    return loaded


class Daemon:
    """`python -m clawd` with a config built from `sections`; stderr is kept for assertions."""

    def __init__(self, tmp: Path, sections: dict, *, wait_ready: bool = True, timeout: float = 120):
        self.tmp = Path(tmp)
        self.state = self.tmp / "state"
        # Tests score with the rules judge in rl mode and do not train unless they ask:
        # no reference engine, no trainer process; no promotion gate or monitors unless they ask.
        # A small disk floor: a CI machine's disk may hold less than the default's 1 GiB spare.
        # The raw reward: the fault tests' users all say thanks, and under the batch-mean baseline a batch
        # whose rewards all agree takes no step and publishes nothing. Tests of learning ask for batch_mean.
        # Steps of exactly rollout_batch_size samples (no backlog batches): tests count samples per step.
        cfg = {"server": {"port": 0, "debug_routes": True},
               "state": {"dir": str(self.state), "min_free_bytes": 64 * 1024 * 1024},
               "scoring": {"mode": "rl"}, "judge": {"backend": "rules"},
               "learner": {"enabled": False, "backlog_batches": 1},
               "train": {"loss": {"reward_baseline": "none"}}, "gate": {"enabled": False},
               "monitors": {"enabled": False}}
        cfg = merged(cfg, sections)
        self.config_path = self.tmp / "clawd.toml"
        self.lines: list[str] = []
        self._seen = threading.Condition()
        self.proc = launch.spawn(self.tmp, cfg, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = launch.listening(self.wait_for(launch.LISTENING.pattern, timeout))
        if wait_ready:
            self.wait_ready(timeout)

    def _read(self):
        with self.proc.stderr:  # closed at EOF: the pipe is this thread's
            for line in self.proc.stderr:
                sys.stderr.write(line)
                with self._seen:
                    self.lines.append(line)
                    self._seen.notify_all()

    def wait_for(self, pattern: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        with self._seen:
            while True:
                for line in self.lines:
                    if re.search(pattern, line):
                        return line
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise RuntimeError(f"daemon exited ({self.proc.returncode}) before {pattern!r}:\n"
                                       + "".join(self.lines[-30:]))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {pattern!r} in daemon log:\n" + "".join(self.lines[-30:]))
                self._seen.wait(min(left, 0.5))

    def get(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.get("/ready")[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError("daemon exited:\n" + "".join(self.lines[-30:]))
            time.sleep(0.1)
        raise TimeoutError("daemon not ready:\n" + "".join(self.lines[-30:]))

    def samples(self) -> list:
        """The samples in the journal (the daemon must be stopped: the journal is locked while it runs)."""
        from clawd.learning.journal import Journal
        from clawd.samples import Sample
        journal = Journal(self.state / "journal")
        try:
            return [Sample.from_json(payload) for _, payload in journal.open()]
        finally:
            # Nothing was appended, so close() never suspends: run it to completion here,
            # inside or outside a running event loop.
            with contextlib.suppress(StopIteration):
                journal.close().send(None)

    def records(self, kind: str = "turns") -> list[dict]:
        out = []
        for path in sorted((self.state / "records").glob(f"{kind}-*.jsonl")):
            out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return out

    def stop(self, timeout: float = 75) -> int:
        """SIGTERM, then SIGKILL after `timeout`: a bound against a hang, above the daemon's own 30 s
        drain_timeout plus its children's stop (under the parallel suite a replica restarting at the
        SIGTERM took 20 s to come up and the clean stop 30.0 s, which a 30 s bound killed)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode


async def wait_ready_async(daemon: Daemon, timeout: float = 60) -> None:
    """Like Daemon.wait_ready, for tests whose event loop also runs a fake engine."""
    import asyncio

    import aiohttp
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(daemon.url + "/ready") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if daemon.proc.poll() is not None:
                raise RuntimeError("daemon exited:\n" + "".join(daemon.lines[-30:]))
            await asyncio.sleep(0.1)
    raise TimeoutError("daemon not ready:\n" + "".join(daemon.lines[-30:]))


@contextlib.asynccontextmanager
async def serving(app):
    """An aiohttp `app` on 127.0.0.1 at a free port, for a test's own stand-in server; yields its base URL."""
    from aiohttp import web
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()

