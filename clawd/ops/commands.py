"""What `clawctl` can ask the running daemon over the admin socket (clawd.ops.admin): pause, resume,
status, versions, rollback [VERSION], checkpoint, export / export-done / forget PRINCIPAL, rollouts ACTION."""
from __future__ import annotations

import logging

from clawd.learning.learner import Learner
from clawd.ops.admin import BAD_ARGUMENT, AdminError, argument
from clawd.ops.people import Holdings, remove_export
from clawd.ops.status import Status, finite
from clawd.pauses import OPERATOR, Pauses
from clawd.rollouts.source import RolloutSource
from clawd.safety.versions import Versions
from clawd.samples import PSEUDO_PRINCIPAL
from clawd.served import Policy

log = logging.getLogger("clawd")


def admin_commands(pauses: Pauses, status: Status, learner: Learner | None, versions: Versions, policy: Policy,
                   people: Holdings | None = None, rollouts: RolloutSource | None = None) -> dict:
    """What `clawctl` can ask: pause (learning; with serving=true, chat too), resume, status, versions,
    rollback [version], checkpoint, a person's data (export, export-done, forget), and the active rollouts
    (pause, resume, status)."""
    async def pause_cmd(request: dict) -> dict:
        pauses.hold(OPERATOR, argument(request, "reason", str) or "", serving=argument(request, "serving", bool, False))
        return pauses.snapshot()

    async def resume_cmd(request: dict) -> dict:
        still = pauses.resume()
        log.warning("resumed by clawctl%s", f"; still held: {', '.join(still)}" if still else "")
        return pauses.snapshot()

    async def status_cmd(request: dict) -> dict:
        return finite(status.snapshot())

    async def versions_cmd(request: dict) -> dict:
        last = argument(request, "last", int, 50)
        return finite({"serving": policy.version, "versions": [
            {**v, "gate": None if v["gate"] is None else {k: x for k, x in v["gate"].items() if k != "outcomes"}}
            for v in versions.snapshot(last)]})

    def learning() -> Learner:
        if learner is None:
            raise AdminError(BAD_ARGUMENT, "learning is off ([learner] enabled = false): nothing to roll back")
        return learner

    async def rollback_cmd(request: dict) -> dict:
        target = argument(request, "version", int)
        try:
            serving = await learning().rollback(target, reason="clawctl rollback")
        except ValueError as exc:
            raise AdminError(BAD_ARGUMENT, str(exc)) from None
        return {"serving": serving, "restored": versions.get(serving).restored_from}

    async def checkpoint_cmd(request: dict) -> dict:
        return await learning().checkpoint()

    def principal(request: dict) -> str:
        name = argument(request, "principal", str)
        if not name:
            raise AdminError(BAD_ARGUMENT, "principal: an API key's name, or the principal of a keyless request")
        if name.startswith(PSEUDO_PRINCIPAL):
            raise AdminError(BAD_ARGUMENT, f"{name} is the active rollouts' principal: it holds no person's data")
        return name

    def asker(request: dict) -> str:
        peer = request.get("peer") or {}
        return f"uid {peer.get('uid')} ({peer.get('user') or 'no passwd entry'}, pid {peer.get('pid')})"

    async def export_cmd(request: dict) -> dict:
        return await people.export(principal(request), asker(request))

    async def export_done_cmd(request: dict) -> dict:
        try:
            remove_export(people.state_dir, argument(request, "path", str))
        except ValueError as exc:
            raise AdminError(BAD_ARGUMENT, str(exc)) from None
        return {"removed": request["path"]}

    async def forget_cmd(request: dict) -> dict:
        return await people.forget(principal(request), asker(request))

    async def rollouts_cmd(request: dict) -> dict:
        if rollouts is None:
            raise AdminError(BAD_ARGUMENT, "rollouts are off ([rollouts] enabled = false)")
        action = argument(request, "action", str, "status")
        if action not in ("pause", "resume", "status"):
            raise AdminError(BAD_ARGUMENT, f"action: pause, resume or status, not {action!r}")
        if action != "status":
            (rollouts.running.clear if action == "pause" else rollouts.running.set)()
            log.warning("rollouts %sd by clawctl", action)
        return finite(rollouts.snapshot())

    commands = {"pause": pause_cmd, "resume": resume_cmd, "status": status_cmd, "versions": versions_cmd,
                "rollback": rollback_cmd, "checkpoint": checkpoint_cmd, "rollouts": rollouts_cmd}
    if people is not None:
        commands |= {"export": export_cmd, "export-done": export_done_cmd, "forget": forget_cmd}
    return commands
