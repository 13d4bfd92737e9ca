"""Launching and watching the policy engine, without threads.

`EngineSupervisor.run()` is one long-lived task (owned by `daemon.run`): start
the child, wait until `/model_info` answers, then wait for it to exit, and
restart it with exponential backoff. The child's exit is noticed through a
pidfd registered with the event loop (asyncio's own child watcher would start
a thread per child on Python 3.11). With `launch = "none"` it only polls the
configured URL. Liveness is `/model_info`, never `/health` (docs/ARCHITECTURE.md §14).

A ready engine, launched or not, is polled every `health_interval` (each poll waits as long, at least
1 s, so a loaded machine does not make a healthy engine miss one). Busy is not hung: a hang is no progress.
It counts as hung on any of: `health_failures` polls in a row that fail; `health_failures` generation
calls in a row that ran past their first-byte, idle or total deadline with no byte from any call in
between (SGLang's HTTP front end answers /model_info while its scheduler is stuck, so the polls alone
would miss that hang; a busy engine that serves anything resets the count); calls that have waited
`health_interval` x `health_failures` with no byte from any of them while the engine's /health_generate
(which answers as soon as its scheduler puts out anything, and 503 when nothing comes in its own wait)
says nothing moves; or a control call that ran past its own timeout. While a weight publish is under way
(a control call in flight, or paused and not yet continued) neither polls nor calls count, since it
legitimately holds generation for up to `learner.publish_timeout`; a publish call that times out is itself the evidence. A hung launched engine
has its calls abandoned and its process group killed, and is restarted like a dead one (backoff, restart
counter; its state shows "hung" until the restart). A hung remote engine is marked "hung" (not ready, so
chat gets a quick 503) and counts as ready again once /model_info and a one-token generation both answer.
The CPU engine runs each model step on a compute thread, so its HTTP loop answers the polls during a long
prefill, and its /health_generate counts each decoder layer run as progress.

An engine that becomes ready is told `/continue_generation` (a publish cut short may have left it
paused; harmless otherwise), and its input limit is read from `/server_info` so over-long prompts get
clawd's own 400. A supervisor given `after` events starts its child only once those are set: on GPUs
the reference engine waits for the policy engine, so the two do not measure free memory at once.

With several policy replicas (`[engine] replicas`) each has its own supervisor (`index`, named
"policy-<index>"). A replica whose rolling-publish swap failed is marked `needs_realign` (out of
rotation, clawd.engine.replicas); so is one found serving an older version than the policy. Its watcher
loads the policy's weights onto it at the next poll; a launched engine that refuses is restarted, which
starts it on those weights. A swap and a realignment never interleave (`swap_lock`).
"""
from __future__ import annotations

import asyncio
import enum
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from clawd.config.schema import Config
from clawd.served import Policy
from clawd.engine.output import EngineOutput
from clawd.engine.client import (NEUTRAL_SAMPLING, EngineClient, EngineError, EngineUnavailable,
                                 EngineUnresponsive)
from clawd.engine.launch import engine_launch, keys_file_path, replica_name, write_keys_file
from clawd.engine.replicas import behind
from clawd.lifetime import die_with_parent

log = logging.getLogger("clawd.engine")
# Between fork and exec: SIGTERM when clawd dies, so the engine stops cleanly.
_ENGINE_DIES_WITH_US = functools.partial(die_with_parent, signal.SIGTERM)

POLL_TIMEOUT_FLOOR = 1.0  # seconds a liveness poll waits at least, however short health_interval is


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DOWN = "down"
    HUNG = "hung"
    STOPPED = "stopped"


# Sampling keys clawd sets on every trainable turn (clawd.serving.completion). SGLang merges its
# --preferred-sampling-params into the keys a request leaves unset, so only keys outside this set could
# change what a trainable turn samples: clawd warns about those.
EXPLICIT_SAMPLING = frozenset({*NEUTRAL_SAMPLING, "temperature", "max_new_tokens", "stop_token_ids", "no_stop_trim",
                               "skip_special_tokens"})


class EngineSupervisor:
    def __init__(self, cfg: Config, client: EngineClient, role: str = "policy", policy: Policy | None = None,
                 after: tuple[asyncio.Event, ...] = (), index: int = 0):
        self.cfg = cfg
        self.after = after  # start the child only once these are set (staged start on GPUs)
        self.client = client
        self.role = role  # "policy" (serves chat, receives publishes) or "reference" (frozen)
        self.index = index  # which policy replica (its port offset and GPU slice)
        self.name = replica_name(cfg, role, index)
        self.answers = 0  # good /model_info answers so far: a replica a request found broken waits for the next
        self.needs_realign = False  # a swap onto new weights failed: out of rotation until realigned
        self.swap_lock = asyncio.Lock()  # a publish's swap and a realignment never interleave
        self._restart_reason: str | None = None  # the watcher restarts it for this reason, not as hung
        # The policy role serves the published version: a (re)started engine loads it, not the base model.
        self.policy = policy if role == "policy" else None
        self.state = EngineState.STARTING
        self.restarts = 0
        self.hangs = 0  # times the engine was found hung
        self.hang_reason: str | None = None  # why, the last time
        self.ready = asyncio.Event()
        self.info: dict = {}
        self.adapter_version: str | None = None  # LoRA mode: the version whose adapter it was confirmed to hold
        self.input_limit: int | None = None  # prompts of this many tokens or more are refused (max_req_input_len)
        self._proc: subprocess.Popen | None = None
        self._output: EngineOutput | None = None  # the current process's output pump
        self._dropped_before = 0  # lines earlier processes' pumps dropped
        self._sock: socket.socket | None = None
        self._stopping = False
        self._held = False  # hold_restarts: the daemon drains
        self._killed_hung = False  # the running child was killed as hung

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def is_ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def lora(self) -> bool:
        """Serving the trainer's adapters beside the base (the policy role in LoRA mode)."""
        return self.policy is not None and self.cfg.train.lora.enabled

    @property
    def served_version(self) -> str | None:
        """The version it serves: its adapter's in LoRA mode (the base's weight_version never moves then)."""
        return self.adapter_version if self.lora else self.info.get("weight_version")

    def _weights(self) -> tuple[str, str]:
        """(model directory, weight_version) to start the engine on: in LoRA mode always the base."""
        if self.policy is not None and self.policy.weights_dir is not None and not self.lora:
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
        return engine_launch(self.cfg, self.role, weights, weight_version, fd=fd, keys_file=keys,
                             replica=self.index)

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
            if self._held:
                log.warning("%s engine exited with %s while clawd drains: not restarted", self.name, code)
                break
            self.restarts += 1
            # A child that ran a good while earns a fresh backoff.
            if time.monotonic() - started > 60:
                backoff = self.cfg.engine.restart_backoff_initial
            if self._killed_hung:  # the hang was logged when it was found
                log.info("restarting the hung %s engine in %.1fs (restart %d)", self.name, backoff, self.restarts)
            else:
                log.error("%s engine exited with %s; restarting in %.1fs (restart %d)", self.name, code, backoff,
                          self.restarts)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.cfg.engine.restart_backoff_max)

    async def _run_child_once(self) -> int | None:
        launch = self._launch()
        self.adapter_version = None  # a new process holds no adapter until `_align` loads it
        self._set(EngineState.STARTING)
        log.info("starting %s engine%s: %s", self.name,
                 f" on GPU(s) {','.join(map(str, launch.devices))}" if launch.devices else "", " ".join(launch.argv))
        fds = (self._sock.fileno(),) if self._sock is not None else ()
        # Its own process group, so a hung engine goes with its helpers (SGLang's scheduler processes).
        # Its output reaches clawd's log through a pipe, secrets taken out (SGLang logs its keys as it starts).
        self._proc = subprocess.Popen(launch.argv, pass_fds=fds, preexec_fn=_ENGINE_DIES_WITH_US, process_group=0,
                                      env=launch.environ(dict(os.environ)), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self._dropped_before = self.output_dropped
        self._output = EngineOutput().start(self._proc.stdout)
        self._killed_hung = False
        self.needs_realign = False  # a new process, started on the policy's weights
        self._startup = launch.startup_timeout
        exited = asyncio.get_running_loop().create_future()
        pidfd = os.pidfd_open(self._proc.pid)
        loop = asyncio.get_running_loop()
        loop.add_reader(pidfd, lambda: exited.done() or exited.set_result(None))
        try:
            waiter = asyncio.ensure_future(self._supervise(exited))
            await asyncio.wait([waiter, exited], return_when=asyncio.FIRST_COMPLETED)
            if not waiter.done():
                waiter.cancel()
            await exited
            self._kill_group()  # helpers the engine left behind (exited, not yet reaped: the group is ours)
            return self._proc.wait()  # reaps at once: the pidfd said it has exited
        finally:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            if self._proc.poll() is None:
                self._kill_group()
                self._proc.wait()
            self._set(EngineState.STOPPED if self._stopping else
                      EngineState.HUNG if self._killed_hung else EngineState.DOWN)

    @property
    def output_dropped(self) -> int:
        """Lines of the engine's output its log refused (clawd.engine.output)."""
        return self._dropped_before + (self._output.dropped if self._output is not None else 0)

    def _kill_group(self) -> None:
        """SIGKILL the child's process group; only while the child is unreaped, so its pid is still ours."""
        if self._proc is not None and self._proc.returncode is None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # the group is gone already
                pass

    async def _supervise(self, exited: asyncio.Future) -> None:
        """Until the child exits: wait for it to be ready, then watch it; kill it once it is hung."""
        if not await self._await_ready(exited):
            return
        reason = await self._watch(remote=False)
        if reason is None:  # being stopped: an engine shutting down is no hang
            return
        if self._restart_reason is not None:
            log.error("%s engine: %s; restarting it on the published weights", self.name, self._restart_reason)
            self._restart_reason = None
            self._kill_group()
            return
        self._killed_hung = True
        self._hung(reason, f"killing its process group (pid {self._proc.pid}) to restart it")
        self._kill_group()

    async def _await_ready(self, exited: asyncio.Future) -> bool:
        deadline = time.monotonic() + self._startup
        while not exited.done():
            try:
                self.info = await self.client.model_info()
                self.answers += 1
                await self._on_up()
                self._became_ready()
                log.info("%s engine ready at %s (weight_version %s)", self.name, self.client.url,
                         self.info.get("weight_version"))
                return True
            except EngineUnavailable:
                if time.monotonic() > deadline:
                    log.error("%s engine not ready after %.0fs; killing it", self.name, self._startup)
                    self._kill_group()
                    return False
                await asyncio.sleep(0.25)
        return False

    def _became_ready(self) -> None:
        self.needs_realign = False  # aligned by _on_up
        self.client.clear_evidence()
        self._set(EngineState.READY)

    def _hung(self, reason: str, action: str) -> None:
        self.hangs += 1
        self.hang_reason = reason
        self._set(EngineState.HUNG)
        log.error("%s engine at %s is hung (%s); %s", self.name, self.client.url, reason, action)
        self.client.abandon(f"the {self.name} engine is hung ({reason})")

    async def _watch(self, remote: bool) -> str | None:
        """Poll a ready engine every health_interval until it is hung; returns why it counts as hung, or None
        once the supervisor is stopping. A remote engine that refuses the poll (or answers it with an error)
        raises here, to be marked down as when a call finds it so."""
        eng = self.cfg.engine
        failures, last = 0, ""
        due = time.monotonic()
        while not self._stopping:
            due += eng.health_interval
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if self._stopping:
                break
            if remote and not self.is_ready:  # a call found it unreachable (mark_unreachable)
                raise EngineUnavailable("a call found the engine unreachable")
            publishing = self.client.publishing
            try:
                self.info = await self.client.model_info(timeout=max(eng.health_interval, POLL_TIMEOUT_FLOOR))
                self.answers += 1
                failures = 0
            except EngineUnresponsive as exc:
                failures, last = (0, "") if publishing or self.client.publishing else (failures + 1, str(exc))
            except EngineError as exc:
                if remote:
                    raise
                failures, last = failures + 1, str(exc)
            if self._stopping:
                break
            if self.client.control_timed_out:
                return f"a control call ran past its timeout: {self.client.control_timed_out}"
            if self.client.publishing:
                continue
            if failures >= eng.health_failures:
                return f"{failures} liveness polls in a row failed; last: {last}"
            if failures == 0 and not await self._realign(remote):
                return None if self._stopping else "restart"
            if self.client.stalls >= eng.health_failures:
                return (f"{self.client.stalls} engine calls in a row timed out with no answer in between; "
                        f"last: {self.client.last_stall}")
            # Its front end answers (polls failing are the rule above); is its scheduler moving?
            quiet = self.client.quiet_for()
            if failures == 0 and quiet >= eng.health_interval * eng.health_failures and not await self._progressing():
                return (f"no progress: calls waited {quiet:.1f}s with no byte, and /health_generate saw the "
                        f"scheduler put out nothing")
        return None

    async def _progressing(self) -> bool:
        """Calls have waited a while with no byte: ask the engine whether its scheduler is moving (a
        non-streamed answer comes whole, so our own bytes cannot tell a long one from a hang). A publish that
        began meanwhile holds generation legitimately, so it counts as moving."""
        moving = await self.client.health_generate(timeout=self.cfg.engine.first_byte_timeout)
        return moving or self.client.publishing or self._stopping

    async def _watch_remote(self) -> None:
        eng = self.cfg.engine
        while not self._stopping:
            try:
                self.info = await self.client.model_info()
                self.answers += 1
                if self.state is EngineState.HUNG:  # its scheduler too, not only its HTTP front end
                    await self.client.probe(eng.first_byte_timeout)
                if self.state is not EngineState.READY:
                    await self._on_up()
                    log.info("%s engine at %s is ready", self.name, self.client.url)
                    self._became_ready()
                reason = await self._watch(remote=True)
                if reason is not None:
                    self._hung(reason, "marked unreachable until it answers again")
            except EngineError as exc:
                if self.state is EngineState.READY:
                    log.error("%s engine at %s is down: %s", self.name, self.client.url, exc)
                    self._set(EngineState.DOWN)
                await asyncio.sleep(min(eng.health_interval, 1.0))

    async def _on_up(self) -> None:
        """Before an engine that answers counts as ready: not paused, its input limit known, on the published
        weights."""
        try:
            await self.client.control("/continue_generation", {}, self.cfg.learner.publish_timeout)
            info = await self.client.server_info()
        except EngineUnavailable:
            raise
        except EngineError as exc:  # e.g. a key it refuses: chat may still work, publishes will say why not
            log.error("%s engine refused a control call: %s", self.name, exc)
            info = None
        limit = (info or {}).get("max_req_input_len")
        self.input_limit = limit if isinstance(limit, int) and limit > 0 else None
        if info is None:
            log.warning("%s engine has no /server_info: its input limit is unknown", self.name)
        preferred = self.info.get("preferred_sampling_params") or {}
        if isinstance(preferred, str):
            preferred = json.loads(preferred or "{}")
        if unsent := sorted(set(preferred) - EXPLICIT_SAMPLING):
            log.warning("%s engine merges preferred sampling params into requests that leave them unset: %s "
                        "(clawd does not send these; they change what is sampled)", self.name, ", ".join(unsent))
        await self._align(force=self.needs_realign)

    async def _realign(self, remote: bool) -> bool:
        """A replica marked `needs_realign`, or found behind the policy, is moved onto the policy's weights.
        False: a launched engine refused, and `_restart_reason` says why it is to be restarted."""
        if self.policy is None or self.client.publishing:
            return True
        if not self.needs_realign and not behind(self.served_version, self.policy):
            return True
        try:
            async with self.swap_lock:
                await self._align(force=self.needs_realign)
        except EngineError as exc:
            if remote:  # nothing to restart: it stays out of rotation, tried again at the next poll
                log.error("%s engine could not be realigned onto v%s: %s", self.name, self.policy.weight_version,
                          exc)
                return True
            self._restart_reason = f"could not be realigned onto v{self.policy.weight_version}: {exc}"
            return False
        self.needs_realign = False
        log.info("%s engine realigned onto weight_version %s", self.name, self.served_version)
        return True

    async def _align(self, force: bool = False) -> None:
        """An engine that comes up on other weights than the published version (one we do not launch
        and that restarted on its base model) is moved onto them before it counts as ready. `force`: also
        when it names that version (a failed swap may have left it on anything)."""
        if self.policy is None or (self.policy.weights_dir is None and not self.policy.principals):
            self.needs_realign = False  # the base model: nothing was published to realign onto
            return
        if self.lora:
            await self._align_adapter()
            return
        if force or self.info.get("weight_version") != self.policy.weight_version:
            log.warning("%s engine serves weight_version %r, not the published %s: loading %s", self.name,
                        self.info.get("weight_version"), self.policy.weight_version, self.policy.weights_dir)
            await self.client.control("/update_weights_from_disk",
                                      {"model_path": self.policy.weights_dir,
                                       "weight_version": self.policy.weight_version},
                                      self.cfg.learner.publish_timeout)
            self.info = await self.client.model_info()

    async def _align_adapter(self) -> None:
        """LoRA: load the policy's adapter, and every principal's own (adapters per principal), unless the engine
        lists it (a restart drops them all)."""
        held = [p for p in (self.policy, *self.policy.principals.values()) if p.adapter is not None]
        loaded = await self.client.loaded_adapters() if held else ()
        for policy in held:
            if policy.adapter not in loaded:
                log.warning("%s engine does not hold adapter %s: loading %s", self.name, policy.adapter,
                            policy.weights_dir)
                await self.client.load_adapter(policy.adapter, policy.weights_dir, self.cfg.learner.publish_timeout)
        if self.policy.adapter is not None:
            self.adapter_version = self.policy.weight_version

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

    def hold_restarts(self) -> None:
        """The daemon drains: an engine that exits from now on stays down (it would come up to a daemon that is
        leaving); the one running keeps serving the requests in flight."""
        self._held = True

    def kill(self) -> None:
        """At once, for a forced stop: no restart."""
        self._stopping = True
        self._kill_group()

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            deadline = time.monotonic() + timeout
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if proc.poll() is None:
                self._kill_group()
                proc.wait()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if (keys := keys_file_path(self.cfg, self.role)) is not None:  # no copy of the state carries the keys
            keys.unlink(missing_ok=True)
        self._set(EngineState.STOPPED)
