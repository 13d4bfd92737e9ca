"""API keys for the local engine, as SGLang 0.5.23 checks them (utils/auth.py), and its --config file.

Keys never travel on the command line (anyone can read a process's argv): like
SGLang's `--config PATH` (server_args_config_parser.py, ConfigArgumentMerger),
the engine reads a file ending in .yaml or .yml that holds a mapping of flag
names (dashes, e.g. `api-key`, `admin-api-key`) to values. clawd writes it as a
JSON object, which is valid YAML; that is the subset read here. Values in the
file stand behind flags given on the command line. Key values are never logged
nor echoed in an error.

Who may call what (SGLang's three levels, reduced to the two the engine has):
- /health*, /ready*, /metrics* and OPTIONS: always open;
- control endpoints (ADMIN_OPTIONAL): the admin key when one is set, and then the
  ordinary key is refused; else the ordinary key when one is set; else open;
- everything else: the ordinary key when one is set (the admin key does not
  open them), else open.
A refusal is 401 {"error": "Unauthorized"}. The key is read from
`Authorization: Bearer <key>` or from `x-api-key: <key>`.
"""
from __future__ import annotations

import argparse
import json
import secrets
from pathlib import Path

from aiohttp import web

from clawd.config.loading import ConfigError

OPEN_PREFIXES = ("/health", "/ready", "/metrics")
ADMIN_OPTIONAL = frozenset({
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
    "/flush_cache", "/abort_request", "/pause_generation", "/continue_generation",
    "/load_lora_adapter", "/unload_lora_adapter", "/release_memory_occupation",
    "/resume_memory_occupation", "/update_weight_version", "/get_weights_by_name", "/set_internal_state",
    "/init_weights_update_group", "/destroy_weights_update_group", "/begin_weight_update", "/end_weight_update",
})
KEY_OPTIONS = ("api_key", "admin_api_key")  # only ever from the --config file
CONFIG_SUFFIXES = (".yaml", ".yml")


def _presented(request: web.Request, expected: str) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token and secrets.compare_digest(token.encode(), expected.encode()):
        return True
    other = request.headers.get("x-api-key", "")
    return bool(other) and secrets.compare_digest(other.encode(), expected.encode())


def allowed(request: web.Request, api_key: str | None, admin_api_key: str | None) -> bool:
    """SGLang's decision for one request (utils/auth.py, decide_request_auth)."""
    if request.method == "OPTIONS" or request.path.startswith(OPEN_PREFIXES):
        return True
    if request.path in ADMIN_OPTIONAL:
        expected = admin_api_key or api_key
    else:
        expected = api_key
    return expected is None or _presented(request, expected)


def middleware(api_key: str | None, admin_api_key: str | None):
    @web.middleware
    async def check_key(request: web.Request, handler):
        if not allowed(request, api_key, admin_api_key):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)
    return check_key


# --------------------------------------------------------------------------
# --config PATH

# A --config file the engine will not start with is a ConfigError (clawd's own); its text never holds a value
# from the file (keys live there).
def read_config(path: str) -> dict:
    """The file's mapping of flag names to values."""
    p = Path(path)
    if p.suffix.lower() not in CONFIG_SUFFIXES:
        raise ConfigError(f"--config {path}: the file must end in .yaml or .yml")
    try:
        data = json.loads(p.read_text(encoding="utf-8") or "{}")
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError):
        raise ConfigError(f"--config {path}: not a JSON object (the YAML subset this engine reads)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: must hold a mapping of flag names to values")
    return data


def apply_config(ap: argparse.ArgumentParser, path: str) -> dict[str, str | None]:
    """Make the file's values the parser's defaults (so command-line flags win); return its keys.

    Names are flag names with dashes; an unknown name, `config`, `help` or a value
    of the wrong type is refused.
    """
    values = read_config(path)
    actions = {a.dest: a for a in ap._actions if a.dest not in ("help", "config")}
    keys: dict[str, str | None] = dict.fromkeys(KEY_OPTIONS)
    defaults = {}
    for name, value in values.items():
        dest = str(name).replace("-", "_")
        if dest in KEY_OPTIONS:
            if not isinstance(value, str) or not value:
                raise ConfigError(f"--config {path}: {name} must be a non-empty string")
            keys[dest] = value
            continue
        action = actions.get(dest)
        if action is None:
            known = ", ".join(sorted(k.replace("_", "-") for k in (*actions, *KEY_OPTIONS)))
            raise ConfigError(f"--config {path}: unknown option {name!r} (known: {known})")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ConfigError(f"--config {path}: {name} must be true or false")
        elif value is not None:
            kind = action.type or str
            if isinstance(value, bool) or not isinstance(value, (kind, str)):
                raise ConfigError(f"--config {path}: {name} has the wrong type")
            try:
                value = kind(value)
            except (TypeError, ValueError):
                raise ConfigError(f"--config {path}: {name} has the wrong type") from None
        action.required = False
        defaults[dest] = value
    ap.set_defaults(**defaults)
    return keys
