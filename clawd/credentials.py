"""Secrets in the configuration: written inline, or read from the environment or a file.

Each secret key of the TOML file (`auth.keys[].key`, `engine.api_key`, `engine.admin_api_key`,
`judge.api_key`) has two siblings, `<key>_env` (the name of an environment variable) and
`<key>_file` (a path; a relative one is looked up in systemd's `$CREDENTIALS_DIRECTORY`, which
`LoadCredential=` fills). At most one of the three is set. They are resolved when the file is
loaded, so SIGHUP re-reads a rotated file (the API keys apply at once, the engine and judge keys
at the next start), and the rest of clawd sees only the value.

The daemon's log handler carries a `RedactingFilter`: a secret value that reaches a log line anyway
(an upstream's error text that echoes the key it was sent, say) is written as "<redacted>".
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

SECRET_FIELDS = frozenset({"key", "api_key", "admin_api_key"})
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what a shell or systemd's Environment= can set
REDACTED = "<redacted>"
# Shorter values are not redacted: replacing every "abc" in every line would garble the log more than it
# hides (the API keys' own minimum is 8).
MIN_REDACTED = 8
_known: set[str] = set()  # every secret value this process has loaded (old ones stay: they were secret too)


class SecretError(ValueError):
    """A secret that cannot be read; `suffix` says which sibling key is at fault ("", "_env", "_file")."""

    def __init__(self, message: str, suffix: str = ""):
        super().__init__(message)
        self.suffix = suffix


def resolve(value: str, env: str, file: str) -> str:
    """The secret's value from whichever of the three ways it was given ("" when none)."""
    given = [name for name, v in (("", value), ("_env", env), ("_file", file)) if v]
    if len(given) > 1:
        raise SecretError("give the secret one way only: inline, _env or _file", given[1])
    if env:
        if not ENV_NAME.fullmatch(env):
            # Most likely the secret itself, written where its variable's name goes: errors reach the
            # journal, so it is never echoed (a real name is, below, to help find a missing variable).
            raise SecretError("not the name of an environment variable (letters, digits and _); "
                              "a secret itself goes in the key without _env", "_env")
        if not os.environ.get(env):
            raise SecretError(f"the environment variable {env} is not set or empty", "_env")
        return os.environ[env]
    if file:
        path = credential_path(file)
        try:
            text = path.read_text(encoding="utf-8").rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise SecretError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}", "_file") from None
        if not text:
            raise SecretError(f"{path} is empty", "_file")
        return text
    return value


def credential_path(file: str) -> Path:
    """A relative path names a systemd credential when the service has any; else it is relative to the cwd."""
    path = Path(file)
    credentials = os.environ.get("CREDENTIALS_DIRECTORY")
    if not path.is_absolute() and credentials:
        return Path(credentials) / path
    return path


def remember(cfg) -> None:
    """Add `cfg`'s secret values to those `redact` hides (at start, and for each file SIGHUP loads)."""
    values = [k.key for k in cfg.auth.keys] + [cfg.engine.api_key, cfg.engine.admin_api_key, cfg.judge.api_key]
    _known.update(v for v in values if len(v) >= MIN_REDACTED)


def redact(text: str) -> str:
    for value in sorted(_known, key=len, reverse=True):  # longest first: one key may contain another
        if value in text:
            text = text.replace(value, REDACTED)
    return text


class RedactingFilter(logging.Filter):
    """On a handler (a logger's filter would miss records propagated from its children): the message,
    and the traceback of an exception logged with it, with every remembered secret redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # arguments that do not fit the format: emit() reports it as logging always has
            message = None
        if message is not None and (clean := redact(message)) != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True
