"""The admin socket (clawd/ops/admin.py) and its client, bin/clawctl (clawd/ops/ctl.py)."""
from __future__ import annotations

import asyncio
import grp
import json
import logging
import os
import shutil
import socket
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from clawd.ops import admin
from clawd.ops.admin import AdminError, AdminServer, AdminSocketError
from clawd.ops.ctl import find_socket, format_pause, format_status, human_age, human_bytes

ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534


async def status_cmd(request):
    # The server adds who asked (SO_PEERCRED): the audit lines of export and forget name it.
    request = dict(request)
    peer = request.pop("peer")
    assert isinstance(peer["uid"], int) and peer["pid"] > 0 and "user" in peer
    return {"mode": "rl", "echo": request}


async def pause_cmd(request):
    serving = admin.argument(request, "serving", bool, False)
    return {"learning": True, "serving": serving, "reasons": [
        {"reason": "operator", "since": 1700000000.0, "detail": admin.argument(request, "reason", str) or "",
         "serving": serving, "lifted_by": "clawctl resume"}]}


async def refuse_cmd(request):
    raise AdminError(admin.BAD_ARGUMENT, "serving must be a bool")


async def broken_cmd(request):
    raise RuntimeError("the handler broke")


COMMANDS = {"status": status_cmd, "pause": pause_cmd, "refuse": refuse_cmd, "broken": broken_cmd}


@pytest.fixture
async def server(tmp_path):
    srv = AdminServer(tmp_path / "run" / "clawd.sock", COMMANDS)
    await srv.start()
    yield srv
    await srv.close()


async def ask(path: Path, raw: bytes, *, eof: bool = False) -> dict:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(raw)
    if eof:
        writer.write_eof()
    await writer.drain()
    line = await reader.readline()
    writer.close()
    return json.loads(line)


# --- pure parts ---------------------------------------------------------------------------

def test_parse_request():
    assert admin.parse_request(b'{"cmd": "pause", "serving": true}\n') == {"cmd": "pause", "serving": True}
    for line, message in [(b"nope", "request is not JSON (Expecting value: line 1 column 1 (char 0))"),
                          (b"[1]", "request must be a JSON object, not list"),
                          (b'{"cmd": 3}', 'request has no "cmd" string'),
                          (b"{}", 'request has no "cmd" string')]:
        with pytest.raises(AdminError) as err:
            admin.parse_request(line)
        assert (err.value.code, err.value.message) == (admin.MALFORMED, message)
    with pytest.raises(AdminError) as err:
        admin.parse_request(b"[" * 60000)
    assert err.value.code == admin.MALFORMED


def test_reply_encoding():
    assert admin.encode_result({"a": 1}) == b'{"ok": true, "result": {"a": 1}}\n'
    assert admin.encode_error(2, "no") == b'{"ok": false, "error": {"code": 2, "message": "no"}}\n'
    assert admin.decode_reply(admin.encode_result({"a": 1})) == {"a": 1}
    with pytest.raises(AdminError) as err:
        admin.decode_reply(admin.encode_error(4, "go away"))
    assert (err.value.code, err.value.message) == (4, "go away")
    for bad in (b"", b"[]", b'{"ok": true}', b'{"ok": false, "error": "x"}'):
        with pytest.raises(ValueError):
            admin.decode_reply(bad)


def test_argument():
    assert admin.argument({"serving": True}, "serving", bool, False) is True
    assert admin.argument({}, "serving", bool, False) is False
    assert admin.argument({"n": 3}, "n", int) == 3
    for request, kind in [({"serving": "yes"}, bool), ({"n": True}, int)]:
        with pytest.raises(AdminError) as err:
            admin.argument(request, next(iter(request)), kind)
        assert err.value.code == admin.BAD_ARGUMENT


def test_peer_allowed():
    group = grp.struct_group(("ops", "x", 4321, ["nobody"]))
    other = grp.struct_group(("ops", "x", 4321, []))
    assert admin.peer_allowed(0, 0, own_uid=1000, group=None)
    assert admin.peer_allowed(1000, 1000, own_uid=1000, group=None)
    assert not admin.peer_allowed(NOBODY, NOBODY, own_uid=1000, group=None)
    assert admin.peer_allowed(NOBODY, 4321, own_uid=1000, group=other)  # by the peer's gid
    assert not admin.peer_allowed(NOBODY, NOBODY, own_uid=1000, group=other)
    assert admin.peer_allowed(NOBODY, NOBODY, own_uid=1000, group=group)  # by membership (nobody's name)
    assert not admin.peer_allowed(987654, 987654, own_uid=1000, group=group)  # no passwd entry


# --- the server ---------------------------------------------------------------------------

async def test_round_trips_and_errors_keep_serving(server, caplog):
    ok = {"ok": True, "result": {"mode": "rl", "echo": {"cmd": "status"}}}
    assert await ask(server.path, b'{"cmd": "status"}\n') == ok
    assert await ask(server.path, b'{"cmd": "pause", "serving": true}\n') == {
        "ok": True, "result": {"learning": True, "serving": True, "reasons": [
            {"reason": "operator", "since": 1700000000.0, "detail": "", "serving": True, "lifted_by": "clawctl resume"}]}}
    assert await ask(server.path, b'{"cmd": "status"}', eof=True) == ok  # EOF instead of a newline is accepted
    cases = [(b"not json\n", admin.MALFORMED), (b"[1, 2]\n", admin.MALFORMED),
             (b'{"cmd": "reboot"}\n', admin.UNKNOWN), (b"x" * (admin.MAX_LINE + 10) + b"\n", admin.MALFORMED),
             (b'{"cmd": "pause", "serving": 1}\n', admin.BAD_ARGUMENT),
             (b'{"cmd": "refuse"}\n', admin.BAD_ARGUMENT), (b'{"cmd": "broken"}\n', admin.INTERNAL)]
    for raw, code in cases:
        reply = await ask(server.path, raw)
        assert reply["ok"] is False and reply["error"]["code"] == code, (raw[:40], reply)
        assert await ask(server.path, b'{"cmd": "status"}\n') == ok
    assert (await ask(server.path, b'{"cmd": "reboot"}\n'))["error"]["message"] == \
        "unknown command 'reboot' (known: broken, pause, refuse, status)"
    assert (await ask(server.path, b'{"cmd": "refuse"}\n'))["error"]["message"] == "serving must be a bool"
    broken = [r for r in caplog.records if r.name == "clawd.admin" and r.levelno == logging.ERROR]
    assert broken and broken[0].exc_info[0] is RuntimeError  # logged with its traceback


async def test_silent_client_times_out(server):
    server.read_timeout = 0.2
    reader, writer = await asyncio.open_unix_connection(str(server.path))
    reply = json.loads(await asyncio.wait_for(reader.readline(), 5))
    writer.close()
    assert reply == {"ok": False, "error": {"code": admin.MALFORMED, "message": "no request line within 0.2s"}}


async def test_socket_file_and_close(tmp_path):
    srv = AdminServer(tmp_path / "a" / "b" / "clawd.sock", COMMANDS)
    await srv.start()  # the parent directories are created
    assert stat.S_IMODE(os.stat(srv.path).st_mode) == 0o660 and stat.S_ISSOCK(os.stat(srv.path).st_mode)
    _, idle = await asyncio.open_unix_connection(str(srv.path))  # connected, says nothing
    await asyncio.sleep(0.05)
    assert len(srv._conns) == 1
    await asyncio.wait_for(srv.close(), 2)  # the idle connection is cancelled, not waited out
    assert not srv._conns and not srv.path.exists()
    idle.close()


async def test_close_leaves_a_socket_that_is_no_longer_ours(tmp_path):
    srv = AdminServer(tmp_path / "clawd.sock", COMMANDS)
    await srv.start()
    srv.path.unlink()
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(str(srv.path))
        await srv.close()
        assert srv.path.exists()


async def test_stale_socket_is_replaced_live_one_is_not(tmp_path):
    path = tmp_path / "clawd.sock"
    with socket.socket(socket.AF_UNIX) as dead:  # what a SIGKILLed clawd leaves: a file nobody listens on
        dead.bind(str(path))
    srv = AdminServer(path, COMMANDS)
    await srv.start()
    assert (await ask(path, b'{"cmd": "status"}\n'))["ok"]
    with pytest.raises(AdminSocketError, match=f"{path}: another clawd is answering on it"):
        await AdminServer(path, COMMANDS).start()
    assert (await ask(path, b'{"cmd": "status"}\n'))["ok"]  # the first one is undisturbed
    await srv.close()


async def test_start_refuses_what_it_cannot_use(tmp_path):
    regular = tmp_path / "clawd.sock"
    regular.write_text("not a socket")
    with pytest.raises(AdminSocketError, match="exists and is not a socket"):
        await AdminServer(regular, COMMANDS).start()
    assert regular.read_text() == "not a socket"
    with pytest.raises(AdminSocketError, match="no group named 'no-such-group-here'"):
        await AdminServer(tmp_path / "other.sock", COMMANDS, group="no-such-group-here").start()
    assert not (tmp_path / "other.sock").exists()


# --- the peer check, with a child that changes uid -------------------------------------------

@pytest.fixture
def open_dir():
    """A directory another uid can reach (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="clawd-admin-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


async def ask_as(path: Path, uid: int, gid: int) -> dict:
    """A forked child becomes uid/gid, asks for status, and pipes back the reply."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: blocking calls only, never the parent's event loop
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(5)
                sock.connect(str(path))
                sock.sendall(b'{"cmd": "status"}\n')
                os.write(w, sock.makefile("rb").readline())
            code = 0
        except BaseException as exc:
            os.write(w, repr(exc).encode())
        finally:
            os._exit(code)
    os.close(w)
    os.set_blocking(r, False)
    data = b""
    async with asyncio.timeout(10):
        while True:
            try:
                chunk = os.read(r, 65536)
            except BlockingIOError:
                await asyncio.sleep(0.01)
                continue
            if not chunk:
                break
            data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, data
    return json.loads(data)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="changing uid in a child needs root")


@needs_root
async def test_peer_check_refuses_another_uid_the_file_mode_would_let_in(open_dir, caplog):
    srv = AdminServer(open_dir / "clawd.sock", COMMANDS)
    await srv.start()
    try:
        os.chmod(srv.path, 0o666)  # the file mode is no obstacle: only the check stands in the way
        reply = await ask_as(srv.path, NOBODY, NOBODY)
        assert reply["ok"] is False and reply["error"]["code"] == admin.DENIED, reply
        assert reply["error"]["message"].startswith(f"uid {NOBODY} may not use this socket")
        refused = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(f"refused uid {NOBODY} (pid " in m for m in refused), refused
        assert (await ask(srv.path, b'{"cmd": "status"}\n'))["ok"]  # root still gets in
    finally:
        await srv.close()


@needs_root
async def test_peer_check_lets_in_the_configured_group(open_dir):
    try:
        group = grp.getgrgid(NOBODY).gr_name
    except KeyError:
        pytest.skip(reason=f"no group with gid {NOBODY} on this host")
    srv = AdminServer(open_dir / "clawd.sock", COMMANDS, group=group)
    await srv.start()
    try:
        st = os.stat(srv.path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, NOBODY)
        assert (await ask_as(srv.path, NOBODY, NOBODY))["ok"] is True
    finally:
        await srv.close()


# --- clawctl --------------------------------------------------------------------------------

async def clawctl(*args: str, env: dict | None = None, cwd: Path | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "bin" / "clawctl"), *args, cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    return proc.returncode, out.decode(), err.decode()


async def test_clawctl_not_running(tmp_path):
    code, out, err = await clawctl("--socket", str(tmp_path / "missing.sock"), "status")
    assert (code, out) == (3, "")
    assert err == f"clawctl: clawd is not running ({tmp_path / 'missing.sock'}: No such file or directory)\n"
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(tmp_path / "stale.sock"))
    code, _, err = await clawctl("status", "--socket", str(tmp_path / "stale.sock"))
    assert code == 3 and "Connection refused" in err


async def test_clawctl_against_a_server(server, tmp_path):
    code, out, err = await clawctl("--socket", str(server.path), "--json", "status")
    assert (code, err) == (0, "")
    assert json.loads(out) == {"mode": "rl", "echo": {"cmd": "status"}}
    code, out, _ = await clawctl("pause", "--serving", "--reason", "maintenance", "--socket", str(server.path))
    assert (code, out) == (0, "paused learning and serving (maintenance): new chat requests get 503 "
                              "until `clawctl resume`\n")
    code, out, _ = await clawctl("status", "--json", env={"CLAWD_SOCKET": str(server.path)}, cwd=tmp_path)
    assert code == 0 and json.loads(out)["mode"] == "rl"


async def test_clawctl_error_reply_and_bad_usage(tmp_path):
    srv = AdminServer(tmp_path / "clawd.sock", {"pause": refuse_cmd})
    await srv.start()
    try:
        code, out, err = await clawctl("--socket", str(srv.path), "pause")
        assert (code, out, err) == (1, "", "clawctl: pause: serving must be a bool (error 3)\n")
        code, _, err = await clawctl("--socket", str(srv.path), "status")
        assert code == 1 and err.startswith("clawctl: status: unknown command 'status'")
    finally:
        await srv.close()
    code, _, err = await clawctl("reboot")
    assert code == 1 and "invalid choice: 'reboot'" in err


def test_find_socket(tmp_path):
    config = tmp_path / "clawd.toml"
    config.write_text(f'[state]\ndir = "{tmp_path / "state"}"\n')
    run = tmp_path / "run.sock"
    assert find_socket("/x.sock", str(config), {"CLAWD_SOCKET": "/y.sock"}, run) == Path("/x.sock")
    assert find_socket(None, str(config), {"CLAWD_SOCKET": "/y.sock"}, run) == Path("/y.sock")
    assert find_socket(None, str(config), {}, run) == tmp_path / "state" / "clawd.sock"
    assert find_socket(None, None, {"CLAWD_CONFIG": str(config)}, run) == tmp_path / "state" / "clawd.sock"
    run.touch()  # systemd's /run/clawd/clawd.sock wins over the state directory
    assert find_socket(None, str(config), {}, run) == run
    config.write_text(f'[admin]\nsocket = "{tmp_path / "elsewhere.sock"}"\n')
    assert find_socket(None, str(config), {}, run) == tmp_path / "elsewhere.sock"


# --- what clawctl prints ----------------------------------------------------------------------

NOW = 1_700_000_000.0
SNAPSHOT = {
    "pid": 4242, "uptime_s": 3723.4, "mode": "rl", "judge": "rules",
    "paused": {"learning": True, "serving": False, "reasons": [
        {"reason": "operator", "since": NOW - 300, "detail": "maintenance", "serving": False,
         "lifted_by": "clawctl resume"},
        {"reason": "disk", "since": NOW - 60, "detail": "812 MiB free, 1 GiB wanted", "serving": False,
         "lifted_by": "free space (by itself)"}]},
    "policy": {"version": 3, "weight_version": "3", "published_at": NOW - 252, "weights": "state/weights/v3"},
    "queue": {"waiting": 12, "in_flight": 2, "effective": 8, "batch_size": 16, "journal_live": 20, "collected": 120},
    "sessions": {"live": 5},
    "rates": {"requests_per_min": 12.0, "turns_per_min": 3.5},
    "scoring": {"turns": 40, "samples": 30, "pending": 1, "votes": {"+1": 20, "-1": 4, "0": 6},
                "excluded": {"paused": 3}, "hints_offered": 5, "hints_accepted": 2, "not_learned_while_paused": 3},
    "learner": {"steps": 7, "skipped_steps": 1, "failed_steps": 0, "publishes": 3, "failed_publishes": 0,
                "stale_dropped": 2, "samples_trained": 112, "last_publish_seconds": 1.234,
                "last_intake_held_seconds": 0.01, "waiting_since": None,
                "last_metrics": {"loss": 0.0123456, "loss_policy": -0.01, "loss_kl": 0.002, "grad_norm": 0.5,
                                 "tokens": 812.0, "step": 7, "skipped": False, "skip_reason": None}},
    "engines": {"policy": {"state": "ready", "pid": 4300, "restarts": 1, "url": "http://127.0.0.1:30000"}},
    "replicas": [{"index": 0, "url": "http://127.0.0.1:30000", "state": "ready", "in_rotation": True,
                  "weight_version": "3", "in_flight": 2, "sessions": 3, "failures": 0, "retried_away": 0,
                  "swap_failures": 0},
                 {"index": 1, "url": "http://127.0.0.1:30001", "state": "ready", "in_rotation": False,
                  "weight_version": "2", "in_flight": 0, "sessions": 2, "failures": 1, "retried_away": 1,
                  "swap_failures": 1}],
    "trainer": {"alive": True, "pid": 4301, "restarts": 0, "step": 7, "version": 3, "world_size": 2},
    "journal": {"bytes": 1, "records": 2, "fsyncs": 3, "truncations": 0, "live": 20, "segments": 2,
                "size_bytes": 3 * 1024 * 1024},
}


def test_format_status():
    assert format_status(SNAPSHOT, now=NOW) == """\
clawd
  pid                 4242
  up                  1h 2m
  mode                rl (judge rules)
  paused              learning paused, serving
                      operator since 5m 0s ago: maintenance (lifted by clawctl resume)
                      disk since 1m 0s ago: 812 MiB free, 1 GiB wanted (lifted by free space (by itself))
policy
  version             3 (weights 3)
  published           4m 12s ago
  weights             state/weights/v3
queue
  waiting             12 (2 in flight)
  effective           8 / 16 toward the next batch
  in journal          20
traffic
  sessions            5 live
  requests            12.0/min
  turns               3.5/min
scoring
  turns               40 (1 pending)
  samples             30
  votes               +1 20, -1 4, 0 6
  excluded            paused 3
  hints               2 accepted of 5 offered
  paused, unlearned   3
learner
  steps               7 (1 skipped, 0 failed)
  publishes           3 (0 failed, last took 1.23s)
  samples             120 collected, 112 trained, 2 dropped as stale, 0 by rollbacks
  last step           loss 0.01235, loss_policy -0.01, loss_kl 0.002, grad_norm 0.5, tokens 812
engines
  policy              ready, pid 4300, 1 restarts
replicas
  policy-0            ready, in rotation, v3, 2 in flight, 3 sessions, 0 failures, 0 retried away, 0 failed swaps
  policy-1            ready, out of rotation, v2, 0 in flight, 2 sessions, 1 failures, 1 retried away, 1 failed swaps
trainer
  state               alive, pid 4301, step 7, 2 rank(s), 0 restarts
journal
  size                3.0 MiB
  records             20 live in 2 segment(s)
"""


def test_format_status_with_parts_off_or_missing():
    text = format_status({**SNAPSHOT, "learner": None, "trainer": None, "engines": {},
                          "paused": {"learning": False, "serving": False, "reasons": []}}, now=NOW)
    assert "learner\n  state               off\n" in text
    assert "trainer\n  state               off\n" in text
    assert "engines\n  state               off\n" in text
    assert "  paused              no\n" in text
    assert format_status({}, now=NOW).count("state               off") == 3  # an empty snapshot still renders
    no_loss = {**SNAPSHOT["learner"], "last_metrics": {"loss": None, "tokens": 0.0}}  # NaN arrives as null
    assert "  last step           loss n/a, tokens 0\n" in format_status({**SNAPSHOT, "learner": no_loss}, now=NOW)


def test_small_formatters():
    assert [human_age(s) for s in (0, 59.9, 61, 3600, 90061)] == ["0s", "59s", "1m 1s", "1h 0m", "1d 1h"]
    assert [human_bytes(n) for n in (0, 1023, 1024, 5 * 1024 ** 3)] == ["0 B", "1023 B", "1.0 KiB", "5.0 GiB"]
    operator = {"reason": "operator", "since": NOW, "detail": "", "serving": False, "lifted_by": "clawctl resume"}
    disk = {"reason": "disk", "since": NOW, "detail": "full", "serving": False, "lifted_by": "free space (by itself)"}
    assert format_pause({"learning": True, "serving": False, "reasons": [operator]}) == \
        "paused learning: chat is still served, no turn becomes a sample"
    assert format_pause({"learning": False, "serving": False, "reasons": []}) == "resumed: learning and serving"
    assert format_pause({"learning": True, "serving": False, "reasons": [disk]}) == \
        "resumed serving; learning still paused by disk (full), lifted by free space (by itself)"
    assert format_pause({"learning": True, "serving": False, "reasons": [operator, disk]}) == \
        "paused learning: chat is still served, no turn becomes a sample; still paused by disk (full), " \
        "lifted by free space (by itself)"
