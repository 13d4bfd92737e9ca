"""SIGHUP: reload what can change live, and say what needs a restart.

`plan_reload` compares the running configuration with the file as it is now,
key by key; `apply_reload` hands the changed live settings to the daemon's
setters and returns the line the daemon logs (and shows as the systemd
STATUS). A file that does not load leaves everything as it was
(`load_for_reload` returns the error text instead of raising).

Live settings are the ones read per request or per call: the log level, the
API keys, and the judge's call settings. Anything that shapes what was built
at start-up (engines, URLs, the judge backend and its concurrency, the model,
the state directory, the trainer) needs a restart.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from clawd import credentials
from clawd.config.auth import ApiKey
from clawd.config.judge import JudgeConfig
from clawd.config.loading import ConfigError, load_config
from clawd.config.schema import Config

RELOADABLE: frozenset[str] = frozenset({
    "logging.level",
    "auth.keys",
    # How each judge/teacher call is made, not which backend makes it.
    "judge.timeout", "judge.retries", "judge.backoff_initial", "judge.backoff_max",
    "judge.temperature", "judge.max_new_tokens", "judge.record_text_chars",
})

# Config fields that are not settings: where the file was read from.
_NOT_SETTINGS = frozenset({"source"})


@dataclass(frozen=True)
class ReloadPlan:
    apply: tuple[str, ...] = ()  # dotted keys that changed and take effect now
    refused: tuple[str, ...] = ()  # dotted keys that changed but need a restart


@dataclass(frozen=True)
class ReloadTargets:
    """The daemon's setters; each is called only when one of its keys changed."""

    set_log_level: Callable[[str], None]  # "debug" | "info" | "warning" | "error"
    set_api_keys: Callable[[tuple[ApiKey, ...]], None]
    set_judge: Callable[[JudgeConfig], None]


def changed_keys(old: Any, new: Any, prefix: str = "") -> Iterator[str]:
    """Dotted names of the fields that differ, in declaration order (sections are recursed into)."""
    for f in dataclasses.fields(old):
        if not prefix and f.name in _NOT_SETTINGS:
            continue
        a, b = getattr(old, f.name), getattr(new, f.name)
        if dataclasses.is_dataclass(a) and type(a) is type(b):
            yield from changed_keys(a, b, f"{prefix}{f.name}.")
        elif a != b:
            yield prefix + f.name


def plan_reload(old: Config, new: Config) -> ReloadPlan:
    changed = list(changed_keys(old, new))
    return ReloadPlan(apply=tuple(k for k in changed if k in RELOADABLE),
                      refused=tuple(k for k in changed if k not in RELOADABLE))


def apply_reload(plan: ReloadPlan, new: Config, targets: ReloadTargets) -> str:
    """Call the setters whose keys changed; the summary line for the log.

    A setter that raises is a bug in the daemon and propagates; the setters run
    in the order below, so an earlier one has already taken effect.
    """
    if "logging.level" in plan.apply:
        targets.set_log_level(new.logging.level)
    if "auth.keys" in plan.apply:
        targets.set_api_keys(new.auth.keys)
    if any(k.startswith("judge.") for k in plan.apply):
        targets.set_judge(new.judge)
    return summary(plan)


def summary(plan: ReloadPlan) -> str:
    parts = []
    if plan.apply:
        parts.append("reloaded " + ", ".join(plan.apply))
    if plan.refused:
        parts.append("needs a restart: " + ", ".join(plan.refused))
    return "; ".join(parts) or "no changes"


def in_effect(old: Config, new: Config, plan: ReloadPlan) -> Config:
    """The configuration running after the reload: `old` with the applied keys taken from `new`.

    The next SIGHUP compares against this, so a refused change is reported again
    until the daemon restarts.
    """
    sections: dict[str, dict[str, Any]] = {}
    for key in plan.apply:
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = getattr(getattr(new, section), name)
    return dataclasses.replace(old, **{s: dataclasses.replace(getattr(old, s), **values)
                                       for s, values in sections.items()})


def load_for_reload(path: str | Path) -> Config | str:
    """The configuration in `path`, or the text of what is wrong with it (never raises for a bad file)."""
    try:
        return load_config(path)
    except ConfigError as exc:
        return str(exc)


def reload(path: str | Path, running: Config, targets: ReloadTargets) -> tuple[Config, str]:
    """One SIGHUP: (the configuration now in effect, the line to log).

    A file that does not load keeps `running` and says why.
    """
    new = load_for_reload(path)
    if isinstance(new, str):
        return running, f"reload failed, keeping the running configuration: {new}"
    credentials.remember(new)  # a rotated key is kept out of the log from the moment it is read
    plan = plan_reload(running, new)
    line = apply_reload(plan, new, targets)
    return in_effect(running, new, plan), line
