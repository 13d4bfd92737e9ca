"""Launching and watching the policy engine, without threads.

`EngineSupervisor.run()` is one long-lived task (owned by `daemon.run`): start
the child, wait until `/model_info` answers, then wait for it to exit, and
restart it with exponential backoff. The child's exit is noticed through a
pidfd registered with the event loop (asyncio's own child watcher would start
a thread per child on Python 3.11). With `launch = "none"` it only polls the
configured URL. Liveness is `/model_info`, never `/health` (docs/ARCHITECTURE.md §14).

An engine that becomes ready is told `/continue_generation` (a publish cut short may have left it
paused; harmless otherwise), and its input limit is read from `/server_info` so over-long prompts get
clawd's own 400. A supervisor given `after` events starts its child only once those are set: on GPUs
the reference engine waits for the policy engine, so the two do not measure free memory at once.
"""
from __future__ import annotations

import asyncio
import ctypes
import enum
import json
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from clawd.config import Config
from clawd.served import Policy
from clawd.engine.client import NEUTRAL_SAMPLING, EngineClient, EngineError, EngineUnavailable
from clawd.engine.launch import engine_launch, keys_file_path, write_keys_file

log = logging.getLogger("clawd.engine")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DOWN = "down"
    STOPPED = "stopped"


# Sampling keys clawd sets on every trainable turn (clawd.serving.completion). SGLang merges its
# --preferred-sampling-params into the keys a request leaves unset, so only keys outside this set could
# change what a trainable turn samples: clawd warns about those.
EXPLICIT_SAMPLING = frozenset({*NEUTRAL_SAMPLING, "temperature", "max_new_tokens", "stop_token_ids", "no_stop_trim",
                               "skip_special_tokens"})


class EngineSupervisor:
    def __init__(self, cfg: Config, client: EngineClient, role: str = "policy", policy: Policy | None = None,
                 after: tuple[asyncio.Event, ...] = ()):
        self.cfg = cfg
        self.after = after  # start the child only once these are set (staged start on GPUs)
        self.client = client
        self.role = role  # "policy" (serves chat, receives publishes) or "reference" (frozen)
        # The policy role serves the published version: a (re)started engine loads it, not the base model.
        self.policy = policy if role == "policy" else None
        self.state = EngineState.STARTING
        self.restarts = 0
        self.ready = asyncio.Event()
        self.info: dict = {}
        self.input_limit: int | None = None  # prompts of this many tokens or more are refused (max_req_input_len)
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def is_ready(self) -> bool:
        return self.state is EngineState.READY

    def _weights(self) -> tuple[str, str]:
        """(model directory, weight_version) to start the engine on."""
        if self.policy is not None and self.policy.weights_dir is not None:
            return self.policy.weights_dir, self.policy.weight_version
        return str(Path(self.cfg.model.path).resolve()), "0"

    def _launch(self):
        eng = self.cfg.engine
        weights, weight_version = self._weights()
        fd = None
        if eng.launch == "local":
            if self._sock is None:
                # The daemon owns the listening socket, so the port survives engine restarts.
                self._sock = socket.create_server(("127.0.0.1", 0), backlog=1024)
                self.client.set_url(f"http://127.0.0.1:{self._sock.getsockname()[1]}")
            fd = self._sock.fileno()
        keys = keys_file_path(self.cfg, self.role)
        if keys is not None:  # written at each start: a SIGHUP-rotated key file reaches a restarted engine
            write_keys_file(keys, eng.api_key, eng.admin_api_key)
        return engine_launch(self.cfg, self.role, weights, weight_version, fd=fd, keys_file=keys)

    async def run(self) -> None:
        for event in self.after:
            await event.wait()
        if self.cfg.engine.launch == "none":
            await self._watch_remote()
            return
        backoff = self.cfg.engine.restart_backoff_initial
        while not self._stopping:
            started = time.monotonic()
            code = await self._run_child_once()
            if self._stopping:
                break
            self.restarts += 1
            # A child that ran a good while earns a fresh backoff.
            if time.monotonic() - started > 60:
                backoff = self.cfg.engine.restart_backoff_initial
            log.error("%s engine exited with %s; restarting in %.1fs (restart %d)", self.role, code, backoff,
                      self.restarts)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.cfg.engine.restart_backoff_max)

    async def _run_child_once(self) -> int | None:
        launch = self._launch()
        self._set(EngineState.STARTING)
        log.info("starting %s engine%s: %s", self.role,
                 f" on GPU(s) {','.join(map(str, launch.devices))}" if launch.devices else "", " ".join(launch.argv))
        fds = (self._sock.fileno(),) if self._sock is not None else ()
        self._proc = subprocess.Popen(launch.argv, pass_fds=fds, preexec_fn=_die_with_parent,
                                      env=launch.environ(dict(os.environ)), stdin=subprocess.DEVNULL)
        self._startup = launch.startup_timeout
        exited = asyncio.get_running_loop().create_future()
        pidfd = os.pidfd_open(self._proc.pid)
        loop = asyncio.get_running_loop()
        loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            waiter = asyncio.ensure_future(self._await_ready(exited))
            await asyncio.wait([waiter, exited], return_when=asyncio.FIRST_COMPLETED)
            if not waiter.done():
                waiter.cancel()
            await exited
            return self._proc.wait()  # reaps at once: the pidfd said it has exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._set(EngineState.STOPPED if self._stopping else EngineState.DOWN)

    async def _await_ready(self, exited: asyncio.Future) -> None:
        deadline = time.monotonic() + self._startup
        while not exited.done():
            try:
                self.info = await self.client.model_info()
                await self._on_up()
                self._set(EngineState.READY)
                log.info("%s engine ready at %s (weight_version %s)", self.role, self.client.url,
                         self.info.get("weight_version"))
                return
            except EngineUnavailable:
                if time.monotonic() > deadline:
                    log.error("%s engine not ready after %.0fs; killing it", self.role, self._startup)
                    self._proc.kill()
                    return
                await asyncio.sleep(0.25)

    async def _watch_remote(self) -> None:
        while not self._stopping:
            try:
                self.info = await self.client.model_info()
                if self.state is not EngineState.READY:
                    await self._on_up()
                    log.info("%s engine at %s is ready", self.role, self.client.url)
                self._set(EngineState.READY)
            except EngineError as exc:
                if self.state is EngineState.READY:
                    log.error("%s engine at %s is down: %s", self.role, self.client.url, exc)
                self._set(EngineState.DOWN)
            await asyncio.sleep(self.cfg.engine.health_interval if self.is_ready
                                else min(self.cfg.engine.health_interval, 1.0))

    async def _on_up(self) -> None:
        """Before an engine that answers counts as ready: not paused, its input limit known, on the published
        weights."""
        try:
            await self.client.control("/continue_generation", {}, self.cfg.learner.publish_timeout)
            info = await self.client.server_info()
        except EngineUnavailable:
            raise
        except EngineError as exc:  # e.g. a key it refuses: chat may still work, publishes will say why not
            log.error("%s engine refused a control call: %s", self.role, exc)
            info = None
        limit = (info or {}).get("max_req_input_len")
        self.input_limit = limit if isinstance(limit, int) and limit > 0 else None
        if info is None:
            log.warning("%s engine has no /server_info: its input limit is unknown", self.role)
        preferred = self.info.get("preferred_sampling_params") or {}
        if isinstance(preferred, str):
            preferred = json.loads(preferred or "{}")
        if unsent := sorted(set(preferred) - EXPLICIT_SAMPLING):
            log.warning("%s engine merges preferred sampling params into requests that leave them unset: %s "
                        "(clawd does not send these; they change what is sampled)", self.role, ", ".join(unsent))
        await self._align()

    async def _align(self) -> None:
        """An engine that comes up on other weights than the published version (one we do not launch
        and that restarted on its base model) is moved onto them before it counts as ready."""
        if self.policy is None or self.policy.weights_dir is None:
            return
        if self.info.get("weight_version") != self.policy.weight_version:
            log.warning("%s engine serves weight_version %r, not the published %s: loading %s", self.role,
                        self.info.get("weight_version"), self.policy.weight_version, self.policy.weights_dir)
            await self.client.control("/update_weights_from_disk",
                                      {"model_path": self.policy.weights_dir,
                                       "weight_version": self.policy.weight_version},
                                      self.cfg.learner.publish_timeout)
            self.info = await self.client.model_info()

    def mark_unreachable(self) -> None:
        """A request found the engine gone before the watcher did."""
        if self.cfg.engine.launch == "none" and self.state is EngineState.READY:
            self._set(EngineState.DOWN)

    def _set(self, state: EngineState) -> None:
        self.state = state
        if state is EngineState.READY:
            self.ready.set()
        else:
            self.ready.clear()

    def kill(self) -> None:
        """At once, for a forced stop: no restart."""
        self._stopping = True
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._set(EngineState.STOPPED)
