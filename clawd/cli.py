"""`bin/clawd`: parse arguments, load the configuration, run the daemon."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from clawd import credentials, startup
from clawd.config.loading import ConfigError, load_config
from clawd.config.logging import LOG_FORMAT

DEFAULT_CONFIG = "etc/clawd.toml"
# Exit statuses systemd must not answer with a restart (RestartPreventExitStatus in the unit).
EXIT_CONFIG = 2          # the configuration does not load
EXIT_UNREADABLE_STATE = 3  # the state directory holds what clawd will not read (a journal of unknown format)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clawd", description="Serve chat and learn from the people who use it.")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"TOML configuration (default {DEFAULT_CONFIG})")
    parser.add_argument("--check-config", action="store_true", help="check the configuration and exit")
    parser.add_argument("--plan", action="store_true",
                        help="print every process clawd would start (command, environment, GPUs), start none")
    parser.add_argument("--json", action="store_true", help="with --plan: as JSON")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        if cfg.gate.enabled and cfg.learner.enabled:  # the gate's evaluation set is configuration too
            from clawd.safety import evalset
            try:
                evalset.load(cfg.gate.set or evalset.default_path())
            except evalset.EvalSetError as exc:
                raise ConfigError(f"{args.config}: gate.set: {exc}") from None
        if cfg.rollouts.enabled and cfg.rollouts.set:  # and the rollouts' prompt set
            from clawd.rollouts import tasks
            from clawd.safety.evalset import EvalSetError
            try:
                items = tasks.load(cfg.rollouts.set)
            except EvalSetError as exc:
                raise ConfigError(f"{args.config}: rollouts.set: {exc}") from None
            if cfg.judge.backend == "rules" and (rubric := next((t for t in items if t.rubric), None)):
                raise ConfigError(f"{args.config}: rollouts.set: {rubric.id} has a rubric, which needs a judge model: "
                                  "judge.backend is \"rules\"")
    except ConfigError as exc:
        print(f"clawd: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    from clawd.ops.plan import memory_plan
    try:
        memory = memory_plan(cfg)  # the trainer's bytes per rank, from the base model's config.json
    except (OSError, ValueError) as exc:  # no model yet: the daemon says what is missing (`make model`)
        if args.check_config or args.plan:
            print(f"clawd: the trainer's memory is not planned: the base model's config.json: {exc!r}",
                  file=sys.stderr)
        memory = None
    if memory is not None and memory[1] is not None:
        print(f"clawd: {args.config}: train: {memory[1]}\nclawd: {memory[0]}", file=sys.stderr)
        return EXIT_CONFIG
    if args.check_config:
        print(f"clawd: {args.config} is valid" + (f"\nclawd: {memory[0]}" if memory else ""))
        return 0
    if args.plan:
        from clawd.ops.plan import plan_json, plan_text
        try:
            print(plan_json(cfg) if args.json else plan_text(cfg))
        except (OSError, ValueError) as exc:  # the base model's config.json, for the dtype
            print(f"clawd: cannot plan: {exc}", file=sys.stderr)
            return EXIT_CONFIG
        return 0
    logging.basicConfig(level=cfg.logging.level.upper(), stream=sys.stderr, format=LOG_FORMAT)
    # Secrets stay out of log lines whatever a module logs (an upstream's error may echo its key).
    credentials.remember(cfg)
    for handler in logging.getLogger().handlers:
        handler.addFilter(credentials.RedactingFilter())
    from clawd.privacy.files import modes_for, under_systemd
    # Before anything is written: every file clawd and its children create is private from birth.
    os.umask(modes_for(cfg.admin.group, under_systemd()).umask)
    startup.loading()  # while the daemon's modules import (clawd/startup.py)
    from clawd.daemon import run  # after logging is set up
    from clawd.ops.admin import AdminSocketError
    from clawd.learning.journal import JournalError, JournalUnreadable
    startup.loaded()
    try:
        return asyncio.run(run(cfg))
    except FileNotFoundError as exc:
        logging.getLogger("clawd").error("%s (run `make model` to prepare the default model)", exc)
        return 1
    except JournalUnreadable as exc:  # restarting cannot fix it: the operator must look
        logging.getLogger("clawd").error("journal: %s (exit %d: not restarted)", exc, EXIT_UNREADABLE_STATE)
        return EXIT_UNREADABLE_STATE
    except JournalError as exc:  # another clawd holds this state directory, or its final fsync failed
        logging.getLogger("clawd").error("journal: %s", exc)
        return 1
    except AdminSocketError as exc:  # another clawd answers on the socket, or the admin group is missing
        logging.getLogger("clawd").error("admin: %s", exc)
        return 1
