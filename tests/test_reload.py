"""SIGHUP reload: which changes apply live, which need a restart, and a bad file changes nothing."""
from __future__ import annotations

import dataclasses
import signal
import tomllib

import pytest

from clawd.config.auth import ApiKey
from clawd.config.loading import config_from_dict
from clawd.config.schema import Config
from clawd.config.train import OptimizerConfig
from clawd.tools.tomlfile import to_toml
from clawd.ops.reload import (RELOADABLE, ReloadPlan, ReloadTargets, apply_reload, changed_keys, in_effect,
                          load_for_reload, plan_reload, reload)

from .harness import Daemon

BASE = config_from_dict({"judge": {"backend": "rules"}, "state": {"dir": "/var/lib/clawd"}}, source="a.toml")


def changed(**sections) -> Config:
    """BASE with some fields of some sections replaced."""
    return dataclasses.replace(BASE, **{name: dataclasses.replace(getattr(BASE, name), **values)
                                        for name, values in sections.items()})


class Recorder:
    """The daemon's setters, recording what they were given."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []
        self.targets = ReloadTargets(set_log_level=lambda level: self.calls.append(("log_level", level)),
                                     set_api_keys=lambda keys: self.calls.append(("api_keys", keys)),
                                     set_judge=lambda judge: self.calls.append(("judge", judge)))


def test_nothing_changed():
    assert plan_reload(BASE, BASE) == ReloadPlan((), ())
    # Where the file was read from is not a setting.
    assert plan_reload(BASE, dataclasses.replace(BASE, source="b.toml")) == ReloadPlan((), ())


def test_live_changes_apply():
    keys = (ApiKey("alice", "sk-alice-123456"),)
    new = changed(logging={"level": "debug"}, auth={"keys": keys})
    assert plan_reload(BASE, new) == ReloadPlan(apply=("auth.keys", "logging.level"), refused=())


def test_judge_call_settings_apply_and_the_backend_does_not():
    new = changed(judge={"timeout": 30.0, "retries": 5, "backoff_initial": 1.0, "backoff_max": 4.0,
                         "temperature": 0.2, "max_new_tokens": 64, "record_text_chars": 100,
                         "backend": "openai", "url": "http://10.0.0.5:8000/v1", "model": "m", "concurrency": 2})
    assert plan_reload(BASE, new) == ReloadPlan(
        apply=("judge.temperature", "judge.max_new_tokens", "judge.timeout", "judge.retries",
               "judge.backoff_initial", "judge.backoff_max", "judge.record_text_chars"),
        refused=("judge.backend", "judge.url", "judge.model", "judge.concurrency"))


def test_everything_else_needs_a_restart():
    new = changed(engine={"url": "http://127.0.0.1:31000", "launch": "none"}, server={"port": 9000},
                  state={"dir": "/srv/clawd"}, train={"optimizer": OptimizerConfig(lr=2e-5)},
                  logging={"level": "warning"})
    assert plan_reload(BASE, new) == ReloadPlan(
        apply=("logging.level",),
        refused=("server.port", "engine.launch", "engine.url", "train.optimizer.lr", "state.dir"))


def test_the_reloadable_keys_exist():
    assert RELOADABLE <= {f"{s.name}.{f.name}" for s in dataclasses.fields(Config) if s.name != "source"
                          for f in dataclasses.fields(s.default_factory())}


def test_changed_keys_in_declaration_order():
    new = changed(logging={"level": "error"}, server={"debug_routes": True, "host": "0.0.0.0"})
    assert list(changed_keys(BASE, new)) == ["server.host", "server.debug_routes", "logging.level"]


def test_apply_calls_only_the_setters_whose_keys_changed():
    keys = (ApiKey("bob", "sk-bob-1234567"),)
    rec = Recorder()
    new = changed(auth={"keys": keys}, engine={"url": "http://127.0.0.1:31000"})
    line = apply_reload(plan_reload(BASE, new), new, rec.targets)
    assert rec.calls == [("api_keys", keys)]
    assert line == "reloaded auth.keys; needs a restart: engine.url"

    rec = Recorder()
    new = changed(logging={"level": "debug"}, judge={"timeout": 9.0})
    line = apply_reload(plan_reload(BASE, new), new, rec.targets)
    assert rec.calls == [("log_level", "debug"), ("judge", new.judge)]
    assert line == "reloaded judge.timeout, logging.level"

    rec = Recorder()
    new = changed(judge={"concurrency": 1})  # a judge key, but not a live one
    line = apply_reload(plan_reload(BASE, new), new, rec.targets)
    assert rec.calls == []
    assert line == "needs a restart: judge.concurrency"

    rec = Recorder()
    assert apply_reload(plan_reload(BASE, BASE), BASE, rec.targets) == "no changes"
    assert rec.calls == []


def test_the_summary_line_of_the_example():
    keys = (ApiKey("alice", "sk-alice-123456"),)
    new = changed(logging={"level": "debug"}, auth={"keys": keys}, engine={"url": "http://127.0.0.1:31000"})
    plan = plan_reload(BASE, new)
    assert apply_reload(plan, new, Recorder().targets) == \
        "reloaded auth.keys, logging.level; needs a restart: engine.url"


def test_in_effect_keeps_refused_changes_pending():
    new = changed(logging={"level": "debug"}, judge={"timeout": 9.0, "backend": "sglang"},
                  engine={"url": "http://127.0.0.1:31000"})
    running = in_effect(BASE, new, plan_reload(BASE, new))
    assert running.logging.level == "debug" and running.judge.timeout == 9.0
    assert running.judge.backend == "rules" and running.engine.url == BASE.engine.url
    # A second SIGHUP with the same file: the live keys are done, the refused ones are said again.
    assert plan_reload(running, new) == ReloadPlan(apply=(), refused=("engine.url", "judge.backend"))


def test_a_config_error_is_returned_as_text(tmp_path):
    path = tmp_path / "clawd.toml"
    path.write_text('[logging]\nlevel = "loud"\n')
    assert load_for_reload(path) == (f"{path}: logging.level: must be one of 'debug', 'info', 'warning', "
                                     "'error', got 'loud'")
    path.write_text("[server\n")
    assert load_for_reload(path).startswith(f"{path}: not valid TOML: ")
    assert load_for_reload(tmp_path / "gone.toml") == f"{tmp_path / 'gone.toml'}: no such file"
    assert load_for_reload(tmp_path) == f"{tmp_path}: cannot read: Is a directory"
    path.write_bytes(b"[logging]\nlevel = \"\xff\"\n")
    assert load_for_reload(path) == f"{path}: not UTF-8 text: invalid start byte at byte 19"


def test_a_good_file_loads(tmp_path):
    path = tmp_path / "clawd.toml"
    path.write_text(to_toml({"logging": {"level": "debug"}}))
    cfg = load_for_reload(path)
    assert isinstance(cfg, Config) and cfg.logging.level == "debug"


def test_reload_from_a_file(tmp_path):
    path = tmp_path / "clawd.toml"
    path.write_text(to_toml({"judge": {"backend": "rules", "retries": 4}, "state": {"dir": "/var/lib/clawd"},
                             "server": {"port": 9000}}))
    rec = Recorder()
    running, line = reload(path, BASE, rec.targets)
    assert line == "reloaded judge.retries; needs a restart: server.port"
    assert [name for name, _ in rec.calls] == ["judge"]
    assert running.judge.retries == 4 and running.server.port == BASE.server.port

    path.write_text("[judge]\nretries = -1\n")
    rec = Recorder()
    again, line = reload(path, running, rec.targets)
    assert again is running and rec.calls == []
    assert line == f"reload failed, keeping the running configuration: {path}: judge.retries: must not be negative"


def test_a_setter_that_raises_propagates():
    def broken(_):
        raise RuntimeError("bug in the daemon")
    targets = ReloadTargets(set_log_level=broken, set_api_keys=broken, set_judge=broken)
    new = changed(logging={"level": "debug"})
    with pytest.raises(RuntimeError):
        apply_reload(plan_reload(BASE, new), new, targets)


# --- the real daemon (needs the SIGHUP wiring in clawd/daemon.py) ----------------------------

@pytest.mark.slow
def test_sighup_reloads_the_live_settings_and_names_the_rest(tmp_path, tiny_model):
    sections = {"model": {"path": str(tiny_model)}, "engine": {"launch": "local"}}
    daemon = Daemon(tmp_path, sections)
    try:
        status, _ = daemon.get("/v1/models")
        assert status == 200  # no keys yet: the API is open
        full = tomllib.loads(daemon.config_path.read_text())
        full["auth"] = {"keys": [{"name": "alice", "key": "sk-alice-123456"}]}
        full["logging"] = {"level": "debug"}
        full["engine"] = {**full["engine"], "url": "http://127.0.0.1:31999"}
        daemon.config_path.write_text(to_toml(full))
        daemon.proc.send_signal(signal.SIGHUP)
        daemon.wait_for(r"reloaded auth\.keys, logging\.level; needs a restart: engine\.url", 30)
        assert daemon.get("/v1/models")[0] == 401  # the new key table is in force

        daemon.config_path.write_text("[logging]\nlevel = \"loud\"\n")
        daemon.proc.send_signal(signal.SIGHUP)
        daemon.wait_for(r"reload failed, keeping the running configuration: .*logging\.level", 30)
        assert daemon.proc.poll() is None
        assert daemon.get("/v1/models")[0] == 401
        assert daemon.stop() == 0
    finally:
        daemon.stop()



def test_a_rotated_key_file_is_read_again_on_reload(tmp_path):
    """Secrets from files are read when the configuration loads: a SIGHUP after the file changed applies the
    new API key at once, and names (never shows) an engine key that changed as needing a restart."""
    (tmp_path / "alice").write_text("sk-alice-first-1234\n")
    (tmp_path / "engine").write_text("sk-engine-first-1234\n")
    path = tmp_path / "clawd.toml"
    path.write_text(to_toml({"auth": {"keys": [{"name": "alice", "key_file": str(tmp_path / "alice")}]},
                             "engine": {"api_key_file": str(tmp_path / "engine")}}))
    running = load_for_reload(path)
    assert running.auth.keys[0].key == "sk-alice-first-1234"
    (tmp_path / "alice").write_text("sk-alice-second-1234\n")
    (tmp_path / "engine").write_text("sk-engine-second-1234\n")
    rec = Recorder()
    running, line = reload(path, running, rec.targets)
    assert rec.calls == [("api_keys", (ApiKey(name="alice", key="sk-alice-second-1234",
                                              key_file=str(tmp_path / "alice")),))]
    assert line == "reloaded auth.keys; needs a restart: engine.api_key" and "sk-" not in line
