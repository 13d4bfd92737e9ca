"""No secret of the configuration ever leaves clawd: not in a log line, a file of the state directory,
an HTTP reply (errors included), `clawctl status`, `--plan`, nor an engine's command line or environment.

One real daemon (tests/harness.py) runs with a distinctive value for every secret: two API keys inline,
the engine's api_key and admin_api_key inline, the judge's api_key through `api_key_env` (an OpenAI-
compatible fake judge, tests/fake_judge.py, that refuses any other key). It is driven with the official
`openai` client and raw requests (a right, a wrong, a missing and a malformed key; errors that echo their
input), reloaded with SIGHUP (a rotated key, then files that fail to load), its engine and then itself
SIGKILLed, and restarted on the same state. Everything it said or wrote is collected and searched for
each secret, and for its first 12 characters (a partial echo), and for the keys clients presented. The
one place the engine keys may be is the engine's keys file (0600 in a 0700 directory), by design.
The learner is off there (a trainer start would double the time); the trainer's environment is checked
on its own below.
"""
from __future__ import annotations

import asyncio
import base64
import http.client
import io
import json
import logging
import os
import secrets
import signal
import stat
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import openai
import pytest

from clawd import credentials
from clawd.config.loading import config_from_dict, ConfigError
from clawd.tools.tomlfile import to_toml

from .fake_judge import FakeJudge, Reply
from .harness import ROOT, Daemon

JUDGE_ENV = "CLAWD_LEAKCHECK_JUDGE_KEY"
PARTIAL = 12  # characters of a secret that count as a leak on their own


def secret(label: str) -> str:
    """A distinctive value whose first PARTIAL characters are random too (so a partial echo is found)."""
    return f"sk-{secrets.token_hex(4)}-LEAKCHECK-{label}-{secrets.token_hex(12)}"


# ---- what is collected, and the search -------------------------------------------------------------

class Evidence:
    """Everything clawd said or wrote, each piece with where it came from."""

    def __init__(self):
        self.items: list[tuple[str, bytes]] = []

    def add(self, where: str, data) -> None:
        if isinstance(data, (dict, list)):
            data = json.dumps(data)
        if isinstance(data, str):
            data = data.encode("utf-8", "surrogateescape")
        self.items.append((where, bytes(data)))

    def leaks(self, needles: dict[str, str]) -> list[str]:
        found = []
        for label, value in needles.items():
            for form, text in (("whole", value), (f"first {PARTIAL} chars", value[:PARTIAL])):
                raw = text.encode()
                for where, data in self.items:
                    at = data.find(raw)
                    if at >= 0:
                        context = data[max(0, at - 80):at + len(raw) + 40].decode("utf-8", "replace")
                        found.append(f"{label} ({form}) in {where}: ...{context}...")
        return found


def raw_request(url: str, method: str, path: str, headers: dict[str, str], body: bytes = b""):
    """A request with headers the openai client would never send (status, headers, body)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value.encode("latin-1", "replace"))
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def debug(daemon: Daemon, evidence: Evidence) -> dict:
    status, snap = daemon.get("/debug/process")
    assert status == 200, snap
    evidence.add("GET /debug/process", snap)
    return snap


def proc_view(pid: int, what: str, evidence: Evidence) -> list[str]:
    """A child's command line and environment as every local user (cmdline) or its owner (environ) sees them."""
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    evidence.add(f"/proc/{pid}/cmdline ({what})", b" ".join(cmdline))
    evidence.add(f"/proc/{pid}/environ ({what})", Path(f"/proc/{pid}/environ").read_bytes())
    return [a.decode() for a in cmdline]


def check_keys_file(argv: list[str], expected: dict[str, str]) -> Path:
    """The engine gets its keys in a file named by --config: clawd's alone (0600, directory 0700)."""
    path = Path(argv[argv.index("--config") + 1])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert json.loads(path.read_text()) == expected
    return path.resolve()


def run_tool(args: list[str], cwd: Path, evidence: Evidence, where: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=60, cwd=cwd)
    evidence.add(f"{where} stdout", done.stdout)
    evidence.add(f"{where} stderr", done.stderr)
    return done


def clawctl(daemon: Daemon, evidence: Evidence, *args: str) -> subprocess.CompletedProcess:
    done = run_tool([str(ROOT / "bin/clawctl"), "--config", str(daemon.config_path), *args], daemon.tmp, evidence,
                    "clawctl " + " ".join(args))
    assert done.returncode == 0, done.stderr
    return done


def settle(daemon: Daemon, evidence: Evidence, turns: int, timeout: float = 60) -> dict:
    """Every submitted turn judged (the fake judge answered or refused)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = debug(daemon, evidence)
        if snap["scoring"]["turns"] >= turns and snap["scoring"]["pending"] == 0:
            return snap
        assert time.monotonic() < deadline, snap["scoring"]
        time.sleep(0.1)


def conversation(client: openai.OpenAI, text: str, evidence: Evidence) -> None:
    """Two turns, the second streamed and ending the session: the judge votes on the first."""
    messages = [{"role": "user", "content": text}]
    reply = client.chat.completions.create(model="m", messages=messages)
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "Thanks, that's perfect."}]
    stream = client.chat.completions.create(model="m", messages=messages, stream=True,
                                            extra_headers={"X-Session-Done": "1"})
    evidence.add(f"chat replies ({text})", reply.model_dump_json() + "".join(c.model_dump_json() for c in stream))


class JudgeThread:
    """tests/fake_judge.py on its own event loop, for a synchronous test."""

    def __init__(self, api_key: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.fake = FakeJudge(api_key=api_key)
        asyncio.run_coroutine_threadsafe(self.fake.start(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.fake.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def hup(daemon: Daemon, config: dict | str, pattern: str) -> None:
    """Write the file, SIGHUP, and wait for one more log line matching `pattern` than there was."""
    before = sum(1 for line in daemon.lines if pattern in line)
    daemon.config_path.write_text(config if isinstance(config, str) else to_toml(config))
    daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while sum(1 for line in daemon.lines if pattern in line) == before:
        assert time.monotonic() < deadline and daemon.proc.poll() is None, "".join(daemon.lines[-20:])
        time.sleep(0.05)


# ---- the test ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_no_secret_leaves_clawd(tiny_model, tmp_path, monkeypatch):
    keys = {name: secret(name) for name in ("alice", "bob", "bob2", "engine", "engine2", "admin", "judge")}
    presented = {"wrong key": secret("wrong"), "malformed header": secret("malformed"),
                 "query key": secret("query")}  # a client's keys: not clawd's to echo either
    monkeypatch.setenv(JUDGE_ENV, keys["judge"])
    judge = JudgeThread(keys["judge"])
    evidence = Evidence()
    lives: list[Daemon] = []
    clients: list[openai.OpenAI] = []

    def client(url: str, key: str, **options) -> openai.OpenAI:
        clients.append(openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60, **options))
        return clients[-1]

    sections = {"model": {"path": str(tiny_model), "max_tokens_cap": 4},
                "engine": {"launch": "local", "restart_backoff_initial": 0.2,
                           "api_key": keys["engine"], "admin_api_key": keys["admin"]},
                "auth": {"keys": [{"name": "alice", "key": keys["alice"], "operator": True},  # she opens the dashboard
                                  {"name": "bob", "key": keys["bob"]}]},
                "judge": {"backend": "openai", "url": judge.fake.url, "model": "judge-m", "api_key_env": JUDGE_ENV,
                          "retries": 0, "timeout": 20.0}}
    try:
        daemon = Daemon(tmp_path, sections)
        lives.append(daemon)
        base = daemon.url
        engine_pid = debug(daemon, evidence)["engines"]["policy"]["pid"]
        argv = proc_view(engine_pid, "engine", evidence)
        keys_file = check_keys_file(argv, {"api-key": keys["engine"], "admin-api-key": keys["admin"]})
        # The daemon's own environ holds the judge key (it was given it so); its command line must not.
        evidence.add(f"/proc/{daemon.proc.pid}/cmdline (daemon)", Path(f"/proc/{daemon.proc.pid}/cmdline").read_bytes())

        # Traffic with the official client: right keys (a session the judge scores), a wrong one, an empty one.
        alice = client(base, keys["alice"])
        conversation(alice, "Say something short.", evidence)
        bob = client(base, keys["bob"])
        evidence.add("GET /v1/models (bob)", bob.models.list().model_dump_json())
        for label, refused in (("wrong key", client(base, presented["wrong key"])),
                               ("missing key", client(base, "unused", default_headers={"Authorization": ""}))):
            with pytest.raises(openai.AuthenticationError) as exc:
                refused.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            evidence.add(f"openai error ({label})", str(exc.value))
            evidence.add(f"openai error body ({label})", exc.value.response.content)
        # Errors that echo what they were sent, with a right key on the request.
        for label, body in (("bad json", b"{not json"), ("bad role", b'{"model": "m", "messages": [{"role": '
                                                                   b'"wizard", "content": "x"}]}'),
                            ("bad temperature", b'{"model": "m", "temperature": 9, "messages": []}')):
            status, headers, data = raw_request(base, "POST", "/v1/chat/completions",
                                                {"Authorization": f"Bearer {keys['alice']}",
                                                 "Content-Type": "application/json"}, body)
            assert 400 <= status < 500, (label, status, data)
            evidence.add(f"POST error ({label})", json.dumps(headers).encode() + data)
        with pytest.raises(openai.BadRequestError) as exc:  # a role that does not exist, named back
            alice.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
        evidence.add("openai error (bad role)", str(exc.value))
        # Malformed and misplaced credentials, raw (no client would send these).
        basic = base64.b64encode(f"alice:{keys['alice']}".encode()).decode()
        attempts = {"no header": {}, "scheme only": {"Authorization": "Bearer"},
                    "wrong scheme, real key": {"Authorization": f"Token {keys['alice']}"},
                    "basic on the API": {"Authorization": f"Basic {basic}"},
                    "key plus junk": {"Authorization": f"Bearer {keys['alice']} {presented['malformed header']}"},
                    "malformed": {"Authorization": f"Bearer\t{presented['malformed header']}\xff"},
                    "x-api-key": {"x-api-key": keys["bob"]}}
        for label, headers in attempts.items():
            dashboard = () if label == "basic on the API" else (("GET", "/dashboard/data"),)  # Basic opens it
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), *dashboard):
                status, got, data = raw_request(base, method, path, {**headers, "Content-Type": "application/json"},
                                                b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}')
                assert status == 401, (label, path, status, data)
                evidence.add(f"{method} {path} ({label})", json.dumps(got).encode() + data)
        status, got, data = raw_request(base, "GET", f"/v1/models?api_key={presented['query key']}", {})
        assert status == 401
        evidence.add("GET /v1/models?api_key=", json.dumps(got).encode() + data)
        for path in ("/dashboard", "/dashboard/data"):
            status, got, data = raw_request(base, "GET", path, {"Authorization": f"Basic {basic}"})
            assert status == 200, (path, status)
            evidence.add(f"GET {path}", json.dumps(got).encode() + data)
        for path in ("/metrics", "/health", "/ready", "/no/such/route", "/dashboard"):  # bob's is a user's key
            status, got, data = raw_request(base, "GET", path, {"Authorization": f"Bearer {keys['bob']}"})
            evidence.add(f"GET {path}", json.dumps(got).encode() + data)

        # The judge: the first call is refused with the key echoed back (as some servers do), the next scored.
        assert settle(daemon, evidence, turns=2)["scoring"]["votes"] == {"+1": 1}
        assert [h.get("Authorization") for h, _ in judge.fake.requests] == [f"Bearer {keys['judge']}"]
        judge.fake.script(Reply(status=401, body={"error": {"message": f"Incorrect API key provided: "
                                                            f"{keys['judge']}", "type": "invalid_request_error",
                                                            "code": "invalid_api_key"}}))
        conversation(alice, "Another one.", evidence)
        settle(daemon, evidence, turns=4)
        assert len(judge.fake.requests) == 2
        evidence.add("clawctl status", clawctl(daemon, evidence, "status").stdout)
        clawctl(daemon, evidence, "status", "--json")

        # SIGHUP: bob's key rotated (live), the engine key changed (at the next start).
        full = tomllib.loads(daemon.config_path.read_text())
        full["auth"]["keys"][1]["key"] = keys["bob2"]
        full["engine"]["api_key"] = keys["engine2"]
        hup(daemon, full, "reloaded auth.keys")
        assert raw_request(base, "GET", "/v1/models", {"Authorization": f"Bearer {keys['bob']}"})[0] == 401
        assert raw_request(base, "GET", "/v1/models", {"Authorization": f"Bearer {keys['bob2']}"})[0] == 200
        # Files that do not load: a key shared by two entries, a short key, a key pasted where a variable's name
        # goes, a file that is not TOML around a key.
        duplicate = json.loads(json.dumps(full))
        duplicate["auth"]["keys"].append({"name": "carol", "key": keys["alice"]})
        short = json.loads(json.dumps(full))
        short["auth"]["keys"][0]["key"] = keys["alice"][:7]
        pasted = json.loads(json.dumps(full))
        pasted["auth"]["keys"][0] = {"name": "alice", "key_env": keys["alice"]}
        unquoted = to_toml(full).replace(f'"{keys["alice"]}"', keys["alice"], 1)
        assert unquoted != to_toml(full)
        for broken in (duplicate, short, pasted, unquoted):
            hup(daemon, broken, "reload failed")
        daemon.config_path.write_text(to_toml(full))
        assert raw_request(base, "GET", "/v1/models", {"Authorization": f"Bearer {keys['alice']}"})[0] == 200

        # A crash of the engine (restarted by clawd, its keys file written again), then of clawd itself.
        os.kill(engine_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (snap := debug(daemon, evidence))["engines"]["policy"]["restarts"] < 1 or daemon.get("/ready")[0] != 200:
            assert time.monotonic() < deadline, snap["engines"]
            time.sleep(0.1)
        argv = proc_view(snap["engines"]["policy"]["pid"], "restarted engine", evidence)
        assert check_keys_file(argv, {"api-key": keys["engine"], "admin-api-key": keys["admin"]}) == keys_file
        alice.chat.completions.create(model="m", messages=[{"role": "user", "content": "after"}])
        daemon.proc.kill()
        daemon.proc.wait(30)
        daemon.stop()

        # The next life, on the same state, with the reloaded file: the new engine key in force.
        again = Daemon(tmp_path, full)
        lives.append(again)
        argv = proc_view(debug(again, evidence)["engines"]["policy"]["pid"], "engine, second life", evidence)
        check_keys_file(argv, {"api-key": keys["engine2"], "admin-api-key": keys["admin"]})
        bob2 = client(again.url, keys["bob2"])
        conversation(bob2, "Back again.", evidence)
        settle(again, evidence, turns=2)
        evidence.add("clawctl status (second life)", clawctl(again, evidence, "status").stdout)
        clawctl(again, evidence, "status", "--json")
        evidence.add("GET /metrics (second life)", raw_request(again.url, "GET", "/metrics", {})[2])
        for args in (["--plan"], ["--plan", "--json"], ["--check-config"]):
            done = run_tool(["-m", "clawd", "--config", str(again.config_path), *args], tmp_path, evidence,
                            "clawd " + " ".join(args))
            assert done.returncode == 0, done.stderr
        assert again.stop() == 0
    finally:
        for opened in clients:
            opened.close()
        for life in lives:
            life.stop()
        judge.close()

    for n, life in enumerate(lives):
        evidence.add(f"daemon stderr (life {n + 1})", "".join(life.lines))
    assert sum("reload failed" in line for line in lives[0].lines) == 4
    # The judge's refusal echoed its key: logged, with the key redacted by the log handler's filter.
    assert any("http_401: Incorrect API key provided: <redacted>" in line for line in lives[0].lines)
    evidence.add("requests the judge received (bodies)", json.dumps([b for _, b in judge.fake.requests]))
    assert not keys_file.exists()  # the engines' keys file goes with a clean stop: no copy of the state has it
    for path in sorted(p for p in (tmp_path / "state").rglob("*") if p.is_file()):
        evidence.add(str(path.relative_to(tmp_path)), path.read_bytes())
    assert len(evidence.items) > 60
    leaks = evidence.leaks({**{f"secret {k}": v for k, v in keys.items()}, **presented})
    assert not leaks, "secrets found:\n" + "\n".join(leaks)


# ---- configuration errors (no daemon) ----------------------------------------------------------------

SECRET = secret("config")


def test_a_secret_pasted_where_a_variable_name_goes_is_not_echoed():
    """An operator who puts the key itself in key_env gets an error naming the TOML key, not showing the
    value: the error goes to the journal, which more people read than the secret's own file."""
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"auth": {"keys": [{"name": "a", "key_env": SECRET}]}})
    assert str(exc.value).startswith("<dict>: auth.keys[0].key_env: not the name of an environment variable")
    assert SECRET[:PARTIAL] not in str(exc.value)


def test_a_variable_name_is_still_shown(monkeypatch):
    monkeypatch.delenv("CLAWD_NO_SUCH_VARIABLE", raising=False)
    with pytest.raises(ConfigError, match="CLAWD_NO_SUCH_VARIABLE is not set"):
        config_from_dict({"engine": {"api_key_env": "CLAWD_NO_SUCH_VARIABLE"}})


@pytest.mark.parametrize("value", [[SECRET], {"value": SECRET}, 123456789012345678])
def test_a_secret_of_the_wrong_type_is_not_echoed(value):
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"engine": {"api_key": value}})
    assert "engine.api_key: must be str" in str(exc.value)
    assert SECRET[:PARTIAL] not in str(exc.value) and "123456789012" not in str(exc.value)


def test_the_log_filter_redacts_every_remembered_secret(monkeypatch):
    """Message, arguments and traceback; a rotated key once its file loaded; short values left alone."""
    monkeypatch.setattr(credentials, "_known", set())
    first, rotated = secret("first"), secret("rotated")
    credentials.remember(config_from_dict({"auth": {"keys": [{"name": "a", "key": first}]},
                                           "engine": {"api_key": "short"}}))
    credentials.remember(config_from_dict({"judge": {"api_key": rotated}}))
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(credentials.RedactingFilter())
    log = logging.getLogger("clawd.test_secrets")
    monkeypatch.setattr(log, "propagate", False)  # pytest's own capture handler raises on a format bug
    log.addHandler(handler)
    try:
        log.warning("upstream said: %s (%s)", f"bad key {rotated}", "short")
        try:
            raise RuntimeError(f"refused {first}")
        except RuntimeError:
            log.exception("failed with %d", 1)
        handler.handleError = lambda record: out.write("(logging error)\n")  # logging's own report, kept
        log.warning("two %s %s", "one")  # a format bug in a log call stays logging's, never raises here
    finally:
        log.removeHandler(handler)
    text = out.getvalue()
    assert text.startswith("upstream said: bad key <redacted> (short)\nfailed with 1\nTraceback")
    assert text.endswith("RuntimeError: refused <redacted>\n(logging error)\n")
    assert "RuntimeError: refused <redacted>" in text and first[:PARTIAL] not in text and rotated[:PARTIAL] not in text


async def test_the_trainer_is_not_started_with_a_secret_variable(tmp_path, monkeypatch):
    """A secret read from the environment (judge.api_key_env) stays out of the trainer process's environment
    as the kernel keeps it (/proc/<pid>/environ: what it was exec'd with, whatever it unsets later)."""
    from clawd.trainer.link import TrainerLink

    from .trainer_handlers import build
    value = secret("trainer-env")
    monkeypatch.setenv(JUDGE_ENV, value)
    link = TrainerLink({"dir": str(tmp_path), "env": {JUDGE_ENV: None}}, factory=build)
    await link.start()
    try:
        environ = Path(f"/proc/{link.pid}/environ").read_bytes()
    finally:
        assert await link.stop(10) == 0
    assert value[:PARTIAL].encode() not in environ
