"""The [admin] section: the control socket clawctl talks to, and whether learning starts paused."""
from __future__ import annotations

import os
import typing
from dataclasses import dataclass
from pathlib import Path

from clawd.checks import is_group_name


@dataclass(frozen=True)
class AdminConfig:
    # The socket clawctl talks to; "" = clawd.sock in $RUNTIME_DIRECTORY, else the state directory
    socket: str = ""
    group: str = ""                      # a group whose members may also use the socket; "" = none
    # "last": the pause state clawctl left; true: start paused; false: running
    start_paused: typing.Literal["last", True, False] = "last"

    def check(self) -> dict[str, str]:
        if self.group and not is_group_name(self.group):
            return {"group": "must be a group name"}
        return {}

    def socket_path(self, state_dir: Path) -> Path:
        """Explicit path; else the systemd runtime directory; else the state directory."""
        if self.socket:
            return Path(self.socket)
        runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
        return Path(runtime or state_dir) / "clawd.sock"
