"""ops' two stages: the process's vitals, built first and stopped last, and the operator's side, built last.

`Vitals`: the event loop's lag gauge, the disk budget's poll, and systemd's watchdog pings, which must keep
going until the very end of a drain (a drain may take minutes; the watchdog would otherwise end it). `Ops`: the
admin socket clawctl speaks to, SIGHUP's reload, and READY=1 once the service works end to end. ops reads the
stages and owns none of them (docs/ARCHITECTURE.md §1).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Callable

from clawd.config.judge import JudgeConfig
from clawd.config.schema import Config
from clawd.engine.stage import Engines
from clawd.learning.stage import Learning
from clawd.lifetime import Stage
from clawd.ops import systemd
from clawd.ops.admin import AdminServer
from clawd.ops.commands import admin_commands
from clawd.ops.disk import DiskBudget
from clawd.ops.metrics import Metrics
from clawd.ops.people import Holdings
from clawd.ops.reload import ReloadTargets, reload
from clawd.ops.status import Status
from clawd.pauses import Pauses
from clawd.privacy.policy import Privacy
from clawd.rollouts.stage import Rollouts
from clawd.safety.versions import Versions
from clawd.served import Policy
from clawd.serving.auth import Authenticator
from clawd.serving.stage import Serving

log = logging.getLogger("clawd")


class Vitals(Stage):
    def __init__(self, metrics: Metrics, disk: DiskBudget):
        self.metrics, self.disk = metrics, disk
        self._tasks: list[asyncio.Task] = []

    async def start(self, tasks: asyncio.TaskGroup) -> None:
        self._tasks = [tasks.create_task(self.metrics.watch_loop(), name="loop-lag"),
                       tasks.create_task(self.disk.run(), name="disk-budget")]  # a low disk pauses learning
        if (interval := systemd.watchdog_interval()) is not None:  # a stalled loop stops the pings
            self._tasks.append(tasks.create_task(systemd.watchdog(lambda: True, interval), name="watchdog"))

    async def drain(self) -> None:
        for task in self._tasks:
            task.cancel()


class Ops(Stage):
    def __init__(self, cfg: Config, *, status: Status, pauses: Pauses, versions: Versions, people: Holdings,
                 learning: Learning | None, engines: Engines, serving: Serving, policy: Policy, auth: Authenticator,
                 privacy: Privacy, set_judge: Callable[[JudgeConfig], None], rollouts: Rollouts | None = None):
        self.cfg, self.learning, self.engines, self.serving, self.policy = cfg, learning, engines, serving, policy
        self.admin = AdminServer(cfg.admin.socket_path(cfg.state_dir), admin_commands(
            pauses, status, None if learning is None else learning.learner, versions, policy, people,
            None if rollouts is None else rollouts.source),
            group=cfg.admin.group)
        self.on_reload = _reloader(cfg, ReloadTargets(
            set_log_level=lambda level: logging.getLogger().setLevel(level.upper()),
            set_api_keys=lambda keys: (auth.set_keys(keys), privacy.set_keys(keys)), set_judge=set_judge))
        self._announce: asyncio.Task | None = None

    async def open(self, exits: contextlib.AsyncExitStack) -> None:
        await self.admin.start()
        exits.push_async_callback(self.admin.close)
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.on_reload)

    async def start(self, tasks: asyncio.TaskGroup) -> None:
        self._announce = tasks.create_task(self._announce_ready(), name="announce-ready")

    def stopping(self) -> None:
        if self._announce is not None:
            self._announce.cancel()

    async def _announce_ready(self) -> None:
        """READY=1 once every engine answers and the trainer has resumed: the service works end to end."""
        for engine in self.engines.supervisors:
            await engine.ready.wait()
        if self.learning is not None:
            await self.learning.trainer.ready_info()
        log.info("ready: serving policy v%d on %s", self.policy.version, self.serving.url)
        systemd.notify("READY=1", f"STATUS=serving on {self.serving.url}, policy v{self.policy.version}")


def _reloader(cfg: Config, targets: ReloadTargets):
    """The SIGHUP handler: the file read again, what can change live applied, the rest named."""
    running = cfg

    def on_reload() -> None:
        nonlocal running
        running, line = reload(cfg.source, running, targets)
        log.log(logging.WARNING if line.startswith("reload failed") else logging.INFO, "SIGHUP: %s", line)
        systemd.notify(f"STATUS={line}")

    return on_reload
