"""Reading etc/clawd.toml into the frozen `Config` (docs/ARCHITECTURE.md §9).

`load_config` rejects unknown keys, wrong types and impossible values with a `ConfigError` naming the file
and the dotted key, so a typo never starts a daemon that silently ignores it.
"""
from __future__ import annotations

import dataclasses
import logging
import tomllib
import typing
from pathlib import Path

from clawd import credentials
from clawd.config import train
from clawd.config.schema import Config

log = logging.getLogger("clawd.config")


class ConfigError(ValueError):
    """A configuration problem, already phrased for the operator."""


def load_config(path: str | Path) -> Config:
    """Read and check a TOML file; every problem names the file and the key."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except OSError as exc:  # permissions (0640 and not in clawd's group), a directory, an I/O error
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return config_from_dict(raw, source=str(path))


def config_from_dict(raw: dict, source: str = "<dict>") -> Config:
    sections = {}
    hints = typing.get_type_hints(Config)
    for key, value in raw.items():
        if key == "source" or key not in hints:
            raise ConfigError(f"{source}: unknown section [{key}]")
        sections[key] = _build(hints[key], value, key, source)
    cfg = Config(**sections, source=source)
    for key, problem in cfg.problems().items():
        raise ConfigError(f"{source}: {key}: {problem}")
    return cfg


def _build(cls, value, where: str, source: str):
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {where}: must be a table")
    if cls is train.TrainConfig:
        value = _regrouped(value, where, source)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, item in value.items():
        if key not in names:
            raise ConfigError(f"{source}: {where}.{key}: unknown key")
        kwargs[key] = _convert(hints[key], item, f"{where}.{key}", source)
    for key in credentials.SECRET_FIELDS & names:  # a secret may come from the environment or a file instead
        try:
            kwargs[key] = credentials.resolve(kwargs.get(key, ""), kwargs.get(f"{key}_env", ""),
                                              kwargs.get(f"{key}_file", ""))
        except credentials.SecretError as exc:
            raise ConfigError(f"{source}: {where}.{key}{exc.suffix}: {exc}") from None
    if cls is train.WorldConfig and kwargs.get("gpus") and "device" not in kwargs:
        kwargs["device"] = "cuda"
    obj = cls(**kwargs)
    for key, problem in obj.check().items():
        raise ConfigError(f"{source}: {where}.{key}: {problem}")
    return obj


def _regrouped(table: dict, where: str, source: str) -> dict:
    """A [train] table written before its groups: each flat key read in its group's place, and said so once."""
    table, moved, twice = train.regroup(table)
    if twice:
        old = twice[0]
        group, key = train.REGROUPED[old]
        raise ConfigError(f"{source}: {where}.{old}: given twice, also as {where}.{group}.{key}")
    if moved:
        log.warning("%s: [%s] keys from before its groups, read in their new places (write them there): %s", source,
                    where, ", ".join(f"{old} -> {where}.{new}" for old, new in moved))
    return table


def _convert(hint, value, where: str, source: str):
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{source}: {where}: must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if origin is tuple:
        item_hint = typing.get_args(hint)[0]
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {where}: must be a list")
        return tuple(_convert(item_hint, v, f"{where}[{i}]", source) for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where, source)
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    else:  # pragma: no cover - a field type this loader does not know is a programming error
        raise TypeError(f"unsupported config type {hint!r} at {where}")
    if not ok:
        shown = "" if where.rpartition(".")[2] in credentials.SECRET_FIELDS else f" {value!r}"  # never echo a secret
        raise ConfigError(f"{source}: {where}: must be {hint.__name__}, got {type(value).__name__}{shown}")
    return value
