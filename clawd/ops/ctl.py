"""`bin/clawctl`: pause, resume and inspect a running clawd over its admin socket (docs/ARCHITECTURE.md §8).

Exit status: 0 ok, 1 error (an error reply, bad usage, a malformed reply), 3 clawd is
not running (no socket file, or nobody listening on it). Kept light: stdlib and
clawd.config only, so it answers instantly; `export-model` alone (offline, clawd.ops.export)
imports torch, when it runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from clawd.ops.admin import AdminError, decode_reply
from clawd.config.loading import ConfigError, load_config
from clawd.config.schema import Config

EXIT_OK, EXIT_ERROR, EXIT_NOT_RUNNING = 0, 1, 3
RUN_SOCKET = Path("/run/clawd/clawd.sock")  # systemd's RuntimeDirectory, invisible to clawctl's environment
SYSTEM_CONFIG = Path("/etc/clawd/clawd.toml")
MAX_REPLY = 16 * 1024 * 1024


class NotRunning(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # bad usage is exit 1 here, not argparse's 2
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: {message}\n")


def find_socket(socket_arg: str | None, config_arg: str | None, environ=os.environ,
                run_socket: Path = RUN_SOCKET) -> Path:
    """--socket, then $CLAWD_SOCKET, then the config's [admin] socket (ConfigError if unreadable)."""
    if socket_arg:
        return Path(socket_arg)
    if environ.get("CLAWD_SOCKET"):
        return Path(environ["CLAWD_SOCKET"])
    config = config_arg or environ.get("CLAWD_CONFIG")
    if not config:
        config = SYSTEM_CONFIG if SYSTEM_CONFIG.exists() else Path("etc/clawd.toml")
        cfg = load_config(config) if Path(config).exists() else Config()  # no config anywhere: defaults
    else:
        cfg = load_config(config)  # named by the operator: it must be there
    path = cfg.admin.socket_path(cfg.state_dir)
    if path.parent == cfg.state_dir and run_socket.exists():
        return run_socket
    return path


def call(path: Path, request: dict, timeout: float) -> dict:
    """Send one request, return the result (AdminError for an error reply, NotRunning, OSError)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise NotRunning(f"clawd is not running ({path}: {exc.strerror})") from None
        sock.sendall(json.dumps(request).encode() + b"\n")
        reply = b""
        while not reply.endswith(b"\n") and len(reply) < MAX_REPLY:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    if not reply:
        raise ValueError(f"{path}: clawd closed the connection without a reply (shutting down?)")
    try:
        return decode_reply(reply)
    except ValueError:
        raise ValueError(f"malformed reply from {path}: {reply[:200]!r}") from None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    prog = "clawctl"
    if args.cmd == "export-model":
        return _export_model(args)
    try:
        path = find_socket(args.socket, args.config)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    request = {"cmd": args.cmd}
    if args.cmd in ("rollback", "checkpoint") and args.timeout == 5.0:  # a trainer write and a publish: minutes
        args.timeout = 900.0
    if args.cmd in ("export", "forget"):
        request["principal"] = args.principal
        if args.timeout == 5.0:  # records are read or rewritten whole, the journal too
            args.timeout = 300.0
        if args.cmd == "export" and os.path.lexists(args.dir):
            print(f"{prog}: export: {args.dir} exists (give a new directory)", file=sys.stderr)
            return EXIT_ERROR
    if args.cmd == "versions":
        request["last"] = args.last
    if args.cmd == "rollback" and args.version is not None:
        request["version"] = args.version
    if args.cmd == "rollouts":
        request["action"] = args.action
    if args.cmd == "pause":
        request["serving"] = args.serving
        if args.reason:
            request["reason"] = args.reason
    try:
        result = call(path, request, args.timeout)
    except NotRunning as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except AdminError as exc:
        print(f"{prog}: {args.cmd}: {exc.message} (error {exc.code})", file=sys.stderr)
        return EXIT_ERROR
    except TimeoutError:
        print(f"{prog}: no reply from {path} within {args.timeout:g}s", file=sys.stderr)
        return EXIT_ERROR
    except (OSError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.cmd == "export":
        return _collect_export(path, result, Path(args.dir), args)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    elif args.cmd == "forget":
        print(format_forget(result), end="")
    elif args.cmd == "status":
        print(format_status(result), end="")
    elif args.cmd == "versions":
        print(format_versions(result), end="")
    elif args.cmd == "rollback":
        print(f"rolled back: v{result['restored']} serves again as v{result['serving']}")
    elif args.cmd == "checkpoint":
        print(f"checkpointed v{result['version']} (step {result['step']}): {result['path']}")
    elif args.cmd == "rollouts":
        print(format_rollouts(result))
    else:
        print(format_pause(result))
    return EXIT_OK


def format_rollouts(r: dict) -> str:
    """`clawctl rollouts`: one line of the active rollouts' counts."""
    solved = f"{r['solved']}/{r['answers']} solved" if r["answers"] else "no answers yet"
    return (f"rollouts {'running' if r['running'] else 'paused'}: {r['groups']} groups ({r['dropped_agree']} dropped: "
            f"answers agreed), {r['samples']} samples, {solved}, {r['backlog']} waiting for the learner; "
            f"checker failures {r['checker_failures']}, environments failed {r['env_failed']}, action errors "
            f"{r['action_errors']}, groups failed {r['failed_groups']}")


def _collect_export(path: Path, result: dict, dest: Path, args) -> int:
    """clawd staged the export under its state directory (the only place it may write under systemd):
    copy it to the operator's directory, private, then have clawd remove the staging."""
    staged = Path(result["path"])
    try:
        old = os.umask(0o077)
        try:
            shutil.copytree(staged, dest)
        finally:
            os.umask(old)
    except OSError as exc:
        print(f"clawctl: export: cannot copy {staged} to {dest}: {exc} (the export stays at {staged} until "
              "clawd's retention sweep removes it)", file=sys.stderr)
        return EXIT_ERROR
    try:
        call(path, {"cmd": "export-done", "path": str(staged)}, args.timeout)
    except (AdminError, NotRunning, OSError, ValueError) as exc:
        print(f"clawctl: export: copied, but {staged} was not removed: {exc}", file=sys.stderr)
    if args.json:
        print(json.dumps({**result, "path": str(dest)}, indent=2, sort_keys=True))
    else:
        files = ", ".join(f"{name} ({meta.get('lines', meta['bytes'])})" for name, meta in result["files"].items())
        print(f"exported principal {result['principal']!r} to {dest}: {files}; manifest.json lists each file's "
              f"sha256; versions trained on their samples: {_versions(result['versions_trained_on'])}")
    return EXIT_OK


def format_forget(result: dict) -> str:
    removed = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in result["removed"].items())
    lines = [f"forgot principal {result['principal']!r}: removed {removed}"]
    if result["versions_trained_on"]:
        lines.append(f"versions already trained on their samples: {_versions(result['versions_trained_on'])}"
                     + (" (the version serving descends from one of them: `clawctl rollback VERSION` to one "
                        "older than the first serves weights that never saw them)" if result["serving"] else ""))
    else:
        lines.append("no version was trained on their samples")
    if result["removed"]["samples_in_flight"]:
        lines.append("the training step in progress had taken some of their samples: the version it makes will "
                     "list them (clawctl versions)")
    return "\n".join(lines) + "\n"


def _versions(versions: list[int]) -> str:
    return ", ".join(f"v{v}" for v in versions) or "none"


def _export_model(args) -> int:
    """Offline: reads the config's state directory, needs no running clawd (clawd.ops.export)."""
    from clawd.ops.export import ExportError, export_model

    try:
        config = args.config or os.environ.get("CLAWD_CONFIG") or (
            SYSTEM_CONFIG if SYSTEM_CONFIG.exists() else Path("etc/clawd.toml"))
        dest = export_model(load_config(config), args.version, Path(args.dir))
    except (ConfigError, ExportError, OSError, ValueError) as exc:
        print(f"clawctl: export-model: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps({"version": args.version, "path": str(dest)}) if args.json else f"v{args.version} exported to {dest}")
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="clawctl", description="Control a running clawd.")
    _common(parser, top=True)
    commands = parser.add_subparsers(dest="cmd", required=True, parser_class=_Parser,
                                     metavar="{pause,resume,status,versions,rollback,checkpoint,export,forget,"
                                             "rollouts,export-model}")
    pause = commands.add_parser("pause", help="stop learning (serving continues)")
    pause.add_argument("--serving", action="store_true", help="also refuse new chat requests (503) until resume")
    pause.add_argument("--reason", help="why, shown by status")
    resume = commands.add_parser("resume", help="resume learning and serving")
    status = commands.add_parser("status", help="a summary of what clawd is doing")
    versions = commands.add_parser("versions", help="every version: parent, status, gate score, monitors")
    versions.add_argument("--last", type=int, default=50, help="the newest N versions (default 50)")
    rollback = commands.add_parser("rollback", help="serve an earlier version again (under a new number) and "
                                   "train on from its checkpoint")
    rollback.add_argument("version", type=int, nargs="?", help="the version to return to (default: the newest "
                          "that served cleanly before the one serving)")
    checkpoint = commands.add_parser("checkpoint", help="checkpoint the version serving now (a rollback target)")
    person = commands.add_parser("export", help="write everything clawd holds about a principal into DIR, "
                                 "with a manifest")
    person.add_argument("principal", help="an API key's name (or the principal of keyless requests)")
    person.add_argument("dir", help="where to write it (must not exist)")
    forget = commands.add_parser("forget", help="delete everything clawd holds about a principal and list the "
                                 "versions trained on their samples")
    forget.add_argument("principal", help="an API key's name (or the principal of keyless requests)")
    rollouts = commands.add_parser("rollouts", help="the active rollouts beside live chat: pause or resume them, "
                                   "or their counts")
    rollouts.add_argument("action", choices=("pause", "resume", "status"), nargs="?", default="status")
    export = commands.add_parser("export-model", help="write a published version as a full Hugging Face model "
                                 "(LoRA: merged into the base)")
    export.add_argument("version", type=int, help="the version number, as status shows it")
    export.add_argument("dir", help="where to write it (must not exist)")
    for sub in (pause, resume, status, versions, rollback, checkpoint, person, forget, rollouts, export):
        _common(sub, top=False)
    return parser


def _common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The options work before or after the command; SUPPRESS keeps the later from undoing the former."""
    d = (lambda value: value) if top else (lambda value: argparse.SUPPRESS)
    parser.add_argument("--socket", default=d(None), help="admin socket (default: $CLAWD_SOCKET, else the config's)")
    parser.add_argument("--config", default=d(None), help="clawd.toml to find the socket in (default: "
                        f"$CLAWD_CONFIG, else {SYSTEM_CONFIG} if present, else etc/clawd.toml)")
    parser.add_argument("--json", action="store_true", default=d(False), help="print the result as JSON")
    parser.add_argument("--timeout", type=float, default=d(5.0), metavar="S",
                        help="seconds to wait for the reply (default 5)")


def format_pause(result: dict) -> str:
    """The reply to pause or resume: the pause state after it (Pauses.snapshot())."""
    reasons = result.get("reasons") or []
    operator = next((p for p in reasons if p["reason"] == "operator"), None)
    others = [p for p in reasons if p["reason"] != "operator"]
    still = "; still paused by " + ", ".join(_pause_text(p) for p in others) if others else ""
    if operator is not None:
        detail = f" ({operator['detail']})" if operator.get("detail") else ""
        if operator.get("serving"):
            return f"paused learning and serving{detail}: new chat requests get 503 until `clawctl resume`{still}"
        return f"paused learning{detail}: chat is still served, no turn becomes a sample{still}"
    if others:
        return "resumed serving; learning " + still.removeprefix("; ")
    return "resumed: learning and serving"


def format_versions(result: dict, now: float | None = None) -> str:
    """`clawctl versions`: one line per version, newest last; the gate and the monitors in short."""
    now = time.time() if now is None else now
    lines = [f"{'version':>8} {'parent':>6} {'status':<11} {'age':>8} {'samples':>7}  gate / monitors"]
    for v in result.get("versions", []):
        gate = v.get("gate") or {}
        cells = []
        if gate.get("score") is not None:
            diff = "" if gate.get("diff") is None else (f" ({100 * gate['diff']:+.0f} pts"
                                                        f" [{100 * gate['low']:+.0f}, {100 * gate['high']:+.0f}])")
            cells.append(f"gate {100 * gate['score']:.0f}%{diff}{'' if gate.get('passed', True) else ' REJECTED'}")
        alarms = (v.get("monitors") or {}).get("alarms") or []
        if alarms:
            cells.append("; ".join(f"{a['action']}: {a['detail']}" for a in alarms))
        elif (v.get("monitors") or {}).get("clean"):
            cells.append("monitors clean")
        if v.get("detail"):
            cells.append(v["detail"])
        parent = "-" if v.get("parent") is None else f"v{v['parent']}"
        mark = "*" if v["version"] == result.get("serving") else " "
        lines.append(f"{mark}{'v' + str(v['version']):>7} {parent:>6} {v['status']:<11} "
                     f"{human_age(now - v['created']):>8} {v.get('samples', 0):>7}  {' | '.join(cells)}")
    return "\n".join(lines) + "\n"


def _pause_text(pause: dict) -> str:
    detail = f" ({pause['detail']})" if pause.get("detail") else ""
    return f"{pause['reason']}{detail}, lifted by {pause.get('lifted_by', '?')}"


def human_age(seconds: float) -> str:
    s = max(0, int(seconds))
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if s >= size:
            return f"{s // size}{unit} {s % size // sub_size}{sub}"
    return f"{s}s"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _counts(d: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted((d or {}).items())) or "none"


def _num(x) -> str:
    if x is None:  # the snapshot's null for a non-finite value (a step with no loss tokens)
        return "n/a"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


METRICS = ("loss", "loss_policy", "loss_kl", "loss_entropy", "approx_kl", "clip_fraction", "grad_norm", "tokens",
           "entropy", "response_tokens_mean", "updates")


def format_status(snapshot: dict, now: float | None = None) -> str:
    """`clawctl status`: Status.snapshot() as aligned lines in sections; absent parts read "off"."""
    now = time.time() if now is None else now
    get = lambda name: snapshot.get(name) or {}  # noqa: E731
    lines: list[str] = []

    def section(title, *rows):
        lines.append(title)
        lines.extend(f"  {key:<20}{value}" for key, value in rows)

    def ago(t):
        return "unknown" if t is None else f"{human_age(now - t)} ago"

    paused = get("paused")
    state = ("learning and serving paused" if paused.get("serving") else
             "learning paused, serving" if paused.get("learning") else "no")
    for pause in paused.get("reasons") or []:
        state += f"\n  {'':<20}{pause['reason']} since {ago(pause.get('since'))}" + (
            f": {pause['detail']}" if pause.get("detail") else "") + f" (lifted by {pause.get('lifted_by', '?')})"
    uptime = snapshot.get("uptime_s")
    section("clawd", ("pid", snapshot.get("pid", "?")), ("up", "?" if uptime is None else human_age(uptime)),
            ("mode", f"{snapshot.get('mode', '?')} (judge {snapshot.get('judge', '?')})"), ("paused", state))
    policy = get("policy")
    served = f"adapter {policy['adapter']}" if policy.get("adapter") else f"weights {policy.get('weight_version', '?')}"
    section("policy", ("version", f"{policy.get('version', '?')} ({served})"),
            ("published", ago(policy.get("published_at"))), ("weights", policy.get("weights") or "base model"))
    if adapters := snapshot.get("adapters"):  # LoRA mode
        lines.append(f"  {'adapters':<20}{len(adapters['retired'])} retired still loaded, {adapters['unloaded']} "
                     f"unloaded, {adapters['failed_unloads']} failed unloads")
    q = get("queue")
    section("queue", ("waiting", f"{q.get('waiting', '?')} ({q.get('in_flight', 0)} in flight)"),
            ("effective", f"{q.get('effective', '?')} / {q.get('batch_size', '?')} toward the next batch"),
            ("in journal", q.get("journal_live", "?")))
    rates = get("rates")
    section("traffic", ("sessions", f"{get('sessions').get('live', '?')} live"),
            ("requests", f"{rates.get('requests_per_min', 0):.1f}/min"),
            ("turns", f"{rates.get('turns_per_min', 0):.1f}/min"))
    sc = get("scoring")
    section("scoring", ("turns", f"{sc.get('turns', 0)} ({sc.get('pending', 0)} pending)"),
            ("samples", sc.get("samples", 0)), ("votes", _counts(sc.get("votes"))),
            ("excluded", _counts(sc.get("excluded"))),
            ("hints", f"{sc.get('hints_accepted', 0)} accepted of {sc.get('hints_offered', 0)} offered"),
            ("paused, unlearned", sc.get("not_learned_while_paused", 0)))
    learner = snapshot.get("learner")
    if not learner:
        section("learner", ("state", "off"))
    else:
        m = learner.get("last_metrics") or {}
        last = ", ".join(f"{k} {_num(m[k])}" for k in METRICS if k in m) or "none yet"
        if m.get("skipped"):
            last += f" (skipped: {m.get('skip_reason')})"
        publish = learner.get("last_publish_seconds")
        section("learner", ("steps", f"{learner.get('steps', 0)} ({learner.get('skipped_steps', 0)} skipped, "
                                     f"{learner.get('failed_steps', 0)} failed)"),
                ("publishes", f"{learner.get('publishes', 0)} ({learner.get('failed_publishes', 0)} failed"
                              + ("" if publish is None else f", last took {publish:.2f}s") + ")"),
                ("samples", f"{(snapshot.get('queue') or {}).get('collected', 0)} collected, "
                            f"{learner.get('samples_trained', 0)} trained, {learner.get('stale_dropped', 0)} dropped "
                            f"as stale, {learner.get('dropped_after_rollback', 0)} by rollbacks"),
                ("last step", last))
    safety = get("safety")
    gate, monitors = safety.get("gate"), safety.get("monitors")
    if safety:  # a snapshot of an earlier release has none
        section("safety", ("gate", "off" if not gate else f"{gate['prompts']} prompts, {gate['passed']} passed, "
                           f"{gate['rejected']} rejected, {gate['failures']} evaluations failed"),
                ("monitors", "off" if not monitors else f"{monitors['rollbacks']} rollbacks, {monitors['halts']} halts"
                 + ("; the version serving is clean" if monitors.get("clean") else "")
                 + "".join(f"\n  {'':<20}alarm: {a}" for a in monitors.get("alarms") or [])),
                ("versions", _counts(safety.get("versions"))))
    privacy = snapshot.get("privacy")
    if privacy:  # a snapshot of an earlier release has none
        pii, ret = privacy["pii"], privacy.get("retention") or {}
        section("privacy", ("PII", f"in {pii['turns_with_pii']} of {pii['turns_scanned']} turns ({_counts(pii['found'])}); "
                                   f"{pii['redacted_records']} records redacted"),
                ("not trained", _counts(privacy.get("not_trained"))),
                ("retention", f"{ret.get('days', '?')} days; last sweep {ago(ret.get('last'))}, removed "
                              f"{_counts(ret.get('removed'))}, {ret.get('failures', 0)} failures"))
    engines = snapshot.get("engines") or {}
    section("engines", *[(role, f"{e.get('state', '?')}, pid {e.get('pid') or '-'}, {e.get('restarts', 0)} restarts")
                         for role, e in sorted(engines.items())] or [("state", "off")])
    section("replicas", *[(f"policy-{r.get('index', '?')}", f"{r.get('state', '?')}, {'in' if r.get('in_rotation') else 'out of'} "
                           f"rotation, v{r.get('weight_version', '?')}, {r.get('in_flight', 0)} in flight, "
                           f"{r.get('sessions', 0)} sessions, {r.get('failures', 0)} failures, "
                           f"{r.get('retried_away', 0)} retried away, {r.get('swap_failures', 0)} failed swaps")
                          for r in snapshot.get("replicas") or []] or [("replicas", "none")])
    trainer = snapshot.get("trainer")
    section("trainer", ("state", "off") if not trainer else
            ("state", f"{'alive' if trainer.get('alive') else 'down'}, pid {trainer.get('pid') or '-'}, "
                      f"step {_num(trainer.get('step', '-'))}, {trainer.get('world_size', 1)} rank(s), "
                      f"{trainer.get('restarts', 0)} restarts"))
    j = get("journal")
    section("journal", ("size", human_bytes(j.get("size_bytes", 0))),
            ("records", f"{j.get('live', '?')} live in {j.get('segments', '?')} segment(s)"))
    return "\n".join(lines) + "\n"
