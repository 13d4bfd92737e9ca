"""Talking to systemd: sd_notify and the watchdog, without libsystemd.

systemd passes `$NOTIFY_SOCKET` to a `Type=notify` service: a Unix datagram
socket (a filesystem path, or an abstract name written with a leading "@").
Each datagram is newline-separated `KEY=value` assignments: READY=1 once the
service works, STOPPING=1 when it begins to stop, STATUS=<text> for
`systemctl status`, EXTEND_TIMEOUT_USEC=<µs> while a slow start or stop is
still making progress, WATCHDOG=1 as the keep-alive `WatchdogSec=` asks for.

Outside systemd (no `$NOTIFY_SOCKET`) every call is a no-op. A failed send is
logged and reported as False, never raised: a hiccup of the notify socket must
not take the service down (a lost WATCHDOG=1 is covered by the next one, which
comes well before the deadline).
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Callable, Mapping

log = logging.getLogger("clawd.systemd")


def notify_address(value: str) -> str | bytes:
    """The sendto() address for a `$NOTIFY_SOCKET` value: "@name" is the abstract socket "\\0name".

    systemd's vsock: addresses (for virtual machines) are not supported: ValueError.
    """
    if value.startswith("@") and len(value) > 1:
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    raise ValueError(f"NOTIFY_SOCKET={value!r} is neither an absolute path nor an abstract name (@...)")


def datagram(fields: tuple[str, ...] | list[str]) -> bytes:
    """One notify message: the assignments, one per line.

    The protocol reads one assignment per line, so a line break inside a value
    (a multi-line STATUS text) becomes a space rather than a bogus assignment.
    """
    if not fields:
        raise ValueError("a notify message needs at least one KEY=value field")
    lines = []
    for item in fields:
        key, eq, _ = item.partition("=")
        if not eq or not key or not key.replace("_", "").isalnum() or not key.isupper():
            raise ValueError(f"notify field {item!r} is not KEY=value")
        lines.append(" ".join(item.splitlines()) if "\n" in item or "\r" in item else item)
    return "\n".join(lines).encode()


def extend_timeout(seconds: float) -> str:
    """The field asking systemd for `seconds` more from now to finish starting (or stopping)."""
    if not seconds > 0:
        raise ValueError(f"an extension must be positive, got {seconds!r}")
    return f"EXTEND_TIMEOUT_USEC={round(seconds * 1_000_000)}"


def notify(*fields: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Send the fields as one datagram to `$NOTIFY_SOCKET`; True when it was sent.

    False without a notify socket (not under systemd), or when the send failed
    (logged). A field that is not KEY=value is a programming error: ValueError.
    """
    target = environ.get("NOTIFY_SOCKET")
    if not target:
        return False
    payload = datagram(fields)
    try:
        address = notify_address(target)
    except ValueError as exc:
        log.warning("sd_notify: %s; not sent: %s", exc, payload.decode())
        return False
    try:
        # A fresh non-blocking socket per message: a full or vanished receiver
        # gives an error at once instead of stalling the event loop.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as sock:
            sock.sendto(payload, address)
    except OSError as exc:
        log.warning("sd_notify to %s failed (%s): %s", target, exc.strerror or exc, payload.decode())
        return False
    return True


def parse_watchdog(usec: str | None, watchdog_pid: str | None, pid: int) -> float | None:
    """The ping interval in seconds for `$WATCHDOG_USEC`/`$WATCHDOG_PID`: half the period.

    None when no watchdog is configured, or when it is meant for another process
    (systemd sets WATCHDOG_PID to the main process; a child inheriting the
    environment must not ping for it). A malformed value is a ValueError.
    """
    if not usec:
        return None
    if watchdog_pid:
        if not watchdog_pid.isdigit():
            raise ValueError(f"WATCHDOG_PID={watchdog_pid!r} is not a process id")
        if int(watchdog_pid) != pid:
            return None
    if not usec.isdigit() or int(usec) == 0:
        raise ValueError(f"WATCHDOG_USEC={usec!r} is not a positive number of microseconds")
    return int(usec) / 2 / 1_000_000


def watchdog_interval(environ: Mapping[str, str] = os.environ) -> float | None:
    """The ping interval systemd asks this process for (seconds), or None."""
    try:
        return parse_watchdog(environ.get("WATCHDOG_USEC"), environ.get("WATCHDOG_PID"), os.getpid())
    except ValueError as exc:
        log.warning("watchdog disabled: %s", exc)
        return None


async def watchdog(healthy: Callable[[], bool], interval: float) -> None:
    """Send WATCHDOG=1 every `interval` seconds while `healthy()` says so; runs until cancelled.

    The task runs on the daemon's event loop, so a blocked loop stops the pings
    by itself; `healthy()` is the daemon's own verdict on top (its predicate,
    its policy). Withheld pings let systemd kill and restart the service once
    WatchdogSec passes. An exception from `healthy()` is a bug and propagates.
    """
    withholding = False
    while True:
        if healthy():
            if withholding:
                log.info("watchdog: healthy again, pinging systemd")
                withholding = False
            notify("WATCHDOG=1")
        elif not withholding:
            log.warning("watchdog: unhealthy, withholding pings (systemd restarts clawd after WatchdogSec)")
            withholding = True
        await asyncio.sleep(interval)
