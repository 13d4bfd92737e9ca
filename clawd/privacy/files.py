"""Private files: the state directory is clawd's alone, whatever the umask it was started with.

The state holds whole conversations (records, the journal, rejected batches) and the weights trained
on them. The daemon sets its umask once, before it writes anything, so every file it or its children
(the engine, the trainer) create is private from birth: 0700 directories and 0600 files, or 0750 /
0640 when an admin group shares them (clawd's group under systemd, or [admin] group). `tighten` walks
what an earlier run, or an operator's copy, left more open and closes it at start.

One opening is by configuration: `[privacy] weights_group` lets an engine run as another user (launch =
"none" on a shared filesystem) read the published weights, and nothing else: the state directory gets
search permission only (x, no listing) and `weights/` belongs to that group, setgid so that each new
version joins it; `share` opens each published version to the group as it is handed over.
"""
from __future__ import annotations

import grp
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger("clawd.privacy")


@dataclass(frozen=True)
class Modes:
    """The most open a directory and a file under the state directory may be, and the group that shares
    them (None: nobody else)."""
    gid: int | None

    @property
    def umask(self) -> int:
        return 0o077 if self.gid is None else 0o027

    @property
    def directory(self) -> int:
        return 0o700 if self.gid is None else 0o750

    @property
    def file(self) -> int:
        return 0o600 if self.gid is None else 0o640


def under_systemd() -> bool:
    """Started as clawd.service (Type=notify): systemd gave it $NOTIFY_SOCKET (clawd.ops.systemd). Not
    $INVOCATION_ID: every process a unit starts inherits that one, a CI runner's tests included."""
    return bool(os.environ.get("NOTIFY_SOCKET"))


def secure_state(state_dir: Path, admin_group: str, weights_group: str) -> Callable[[str], None] | None:
    """At start: tighten the state directory, and open its weights to `weights_group` when one is set.
    Returns what opens each new published version to that group (None without one)."""
    tighten(state_dir, modes_for(admin_group, under_systemd()))
    if not weights_group:
        return None
    gid = open_weights(state_dir, weights_group)
    return lambda path: share(Path(path), gid)


def modes_for(admin_group: str, under_systemd: bool) -> Modes:
    """The admin group, when there is one, may read the state (operators in it run clawctl and read records);
    under systemd that is the service's own group (User=/Group=clawd) even when [admin] group is not set."""
    if admin_group:
        try:
            return Modes(grp.getgrnam(admin_group).gr_gid)
        except KeyError:  # the admin socket's start names the missing group; the state stays owner-only
            return Modes(None)
    return Modes(os.getgid() if under_systemd else None)


def tighten(root: Path, modes: Modes) -> int:
    """Take away, under `root` (itself included), every permission bit beyond `modes`, and give entries to
    the admin group; symbolic links are left alone (their targets are not ours to change). Returns how many
    entries changed. A failure on one entry is logged and the walk goes on: a stricter file is never wrong."""
    changed = 0
    for directory, names, files in os.walk(root, onerror=lambda exc: log.warning("state: cannot walk: %s", exc)):
        here = Path(directory)
        entries = [(here, modes.directory)] if here == Path(root) else []
        entries += [(here / n, modes.directory) for n in names] + [(here / n, modes.file) for n in files]
        for path, most in entries:
            changed += _tighten_one(path, most, modes.gid)
    if changed:
        log.warning("state: %d file(s) or directories under %s were more open than clawd allows: tightened",
                    changed, root)
    return changed


def _tighten_one(path: Path, most: int, gid: int | None) -> int:
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return 0
        mode = stat.S_IMODE(st.st_mode)
        # Keep setgid on directories (weights/ uses it); drop setuid, sticky and every bit past `most`.
        allowed = most | (stat.S_ISGID if stat.S_ISDIR(st.st_mode) else 0)
        changed = 0
        if gid is not None and st.st_gid != gid:  # weights_group's share is given back after (open_weights)
            os.chown(path, -1, gid, follow_symlinks=False)
            changed = 1
        if mode & ~allowed:
            os.chmod(path, mode & allowed, follow_symlinks=False)
            changed = 1
        return changed
    except FileNotFoundError:  # removed while we walked (a pruned version)
        return 0
    except OSError as exc:
        log.warning("state: cannot tighten %s: %s", path, exc.strerror or exc)
        return 0


def open_weights(state_dir: Path, group: str) -> int:
    """`[privacy] weights_group`: state_dir/weights readable by `group` alone, new versions inheriting it;
    the state directory searchable (x) by others so that the engine's user can reach it, never listable.
    Returns the group's id. KeyError when the group does not exist."""
    gid = grp.getgrnam(group).gr_gid
    weights = Path(state_dir) / "weights"
    weights.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, stat.S_IMODE(os.stat(state_dir).st_mode) | 0o011)
    os.chown(weights, -1, gid)
    os.chmod(weights, 0o750 | stat.S_ISGID)
    for version in weights.iterdir():
        share(version, gid)
    return gid


def share(path: Path, gid: int) -> None:
    """One published version (a directory) readable by the weights group: 0750 directories, 0640 files."""
    for directory, _, files in os.walk(path):
        os.chown(directory, -1, gid)
        os.chmod(directory, 0o750 | stat.S_ISGID)
        for name in files:
            file = Path(directory) / name
            if not file.is_symlink():
                os.chown(file, -1, gid)
                os.chmod(file, 0o640)
