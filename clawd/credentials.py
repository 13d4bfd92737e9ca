"""Secrets in the configuration: written inline, or read from the environment or a file.

Each secret key of the TOML file (`auth.keys[].key`, `engine.api_key`, `engine.admin_api_key`,
`judge.api_key`) has two siblings, `<key>_env` (the name of an environment variable) and
`<key>_file` (a path; a relative one is looked up in systemd's `$CREDENTIALS_DIRECTORY`, which
`LoadCredential=` fills). At most one of the three is set. They are resolved when the file is
loaded, so SIGHUP re-reads a rotated file (the API keys apply at once, the engine and judge keys
at the next start), and the rest of clawd sees only the value.
"""
from __future__ import annotations

import os
from pathlib import Path

SECRET_FIELDS = frozenset({"key", "api_key", "admin_api_key"})


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
