"""Configuration: the documented default file loads; every kind of mistake names the key and the file."""
import re
from pathlib import Path

import pytest

from clawd.config import Config, ConfigError, load_config
from clawd.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_documented_default_file_equals_the_defaults():
    cfg = load_config(ROOT / "etc/clawd.toml")
    assert cfg.server == Config().server
    assert cfg.engine == Config().engine
    assert cfg.sessions == Config().sessions
    assert cfg.sampling == Config().sampling
    assert cfg.train == Config().train
    assert cfg.privacy == Config().privacy
    assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 8400)
    assert cfg.state.dir == "state"


def test_every_option_is_in_the_default_file_under_a_comment():
    import dataclasses
    lines = (ROOT / "etc/clawd.toml").read_text().splitlines()
    is_option = [("=" in ln and not ln.lstrip().startswith("#")) for ln in lines]
    for i, line in enumerate(lines):
        if is_option[i]:
            j = i - 1
            while is_option[j]:  # a comment may cover a group of related options
                j -= 1
            assert lines[j].lstrip().startswith("#"), f"option without a comment: {line}"
    present = {ln.split("=")[0].strip() for ln, opt in zip(lines, is_option) if opt}
    present |= {"startup_timeout"} if "# startup_timeout = 0.0" in lines else set()  # shipped commented out
    for section in dataclasses.fields(Config):
        if section.name != "source":
            for f in dataclasses.fields(section.type if isinstance(section.type, type) else
                                        type(getattr(Config(), section.name))):
                assert f.name in present, f"[{section.name}] {f.name} is not documented in etc/clawd.toml"


@pytest.mark.parametrize("text, message", [
    ("[server]\nprot = 1\n", "server.prot: unknown key"),
    ("[servr]\n", "unknown section [servr]"),
    ("[server]\nport = \"80\"\n", "server.port: must be int"),
    ("[server]\nport = 70000\n", "server.port: must be in 0..65535"),
    ("[server]\nhost = \"localhost\"\n", "server.host: must be an IP literal"),
    ("[server]\ndebug_routes = 1\n", "server.debug_routes: must be bool"),
    ("[engine]\nlaunch = \"docker\"\n", "engine.launch: must be one of"),
    ("[engine]\nurl = \"http://example.com:3000\"\n", "engine.url: host must be an IP literal"),
    ("[engine]\nrestart_backoff_max = 0.5\n", "engine.restart_backoff_max"),
    ("[engine]\nsglang_args = [1, 2]\n", "engine.sglang_args[0]: must be str"),
    ("[sampling]\nmin_train_temperature = 0\n", "sampling.min_train_temperature: must be in (0, 2]"),
    ("[sessions]\ndefault_turn_type = \"both\"\n", "sessions.default_turn_type"),
    ("[sessions]\nsession_max_turns = 0\n", "sessions.session_max_turns: must be at least 1"),
    ("[auth]\nkeys = [{name = \"a\", key = \"short\"}]\n", "auth.keys[0].key: must be at least 8"),
    ("[auth]\nkeys = [{name = \"a\", key = \"12345678\", role = \"x\"}]\n", "auth.keys[0].role: unknown key"),
    ("[auth]\nkeys = [{name = \"a\", key = \"12345678\"}, {name = \"a\", key = \"87654321\"}]\n",
     "auth.keys: key names must be unique"),
    ("[records]\nretention_days = -1\n", "records.retention_days"),
    ("[train]\ntis_cap = 0.5\n", "train.tis_cap: must be a finite number >= 1"),
    ("[train]\nopd_clip = -1.0\n", "train.opd_clip: must be a finite number >= 0"),
    ("[train]\ngrad_clip = nan\n", "train.grad_clip: must be a finite number"),
    ("[train]\nbetas = [0.9]\n", "train.betas: must be two numbers in [0, 1)"),
    ("[train]\nbetas = [0.9, \"x\"]\n", "train.betas[1]: must be float"),
    ("[train]\naggregation = \"mean\"\n", "train.aggregation: must be one of"),
    ("[train]\ndevice = \"tpu\"\n", "train.device"),
    ("[train]\nseed = -1\n", "train.seed"),
    ("[train]\nmomentum = 0.9\n", "train.momentum: unknown key"),
    ("[server\n", "not valid TOML"),
    ("server = 3\n", "server: must be a table"),
])
def test_mistakes_name_the_key_and_the_file(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_config_is_frozen(tmp_path):
    cfg = load_config(ROOT / "etc/clawd.toml")
    with pytest.raises(AttributeError):
        cfg.server.port = 1


def test_ints_are_accepted_for_floats(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[server]\ndrain_timeout = 5\n")
    assert load_config(path).server.drain_timeout == 5.0


def test_check_config_cli(tmp_path, capsys):
    assert main(["--config", str(ROOT / "etc/clawd.toml"), "--check-config"]) == 0
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nlaunch = 3\n")
    assert main(["--config", str(bad), "--check-config"]) == 2
    assert "engine.launch" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.toml")]) == 2


def test_secrets_come_inline_from_the_environment_or_from_a_file(tmp_path, monkeypatch):
    from clawd.config import config_from_dict
    monkeypatch.setenv("CLAWD_TEST_ENGINE_KEY", "sk-from-env-1234")
    (tmp_path / "judge-key").write_text("sk-from-file-1234\n")
    (tmp_path / "creds").mkdir()
    (tmp_path / "creds" / "alice").write_text("sk-alice-credential")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path / "creds"))  # systemd's LoadCredential=
    cfg = config_from_dict({"engine": {"api_key_env": "CLAWD_TEST_ENGINE_KEY", "admin_api_key": "sk-inline"},
                            "judge": {"api_key_file": str(tmp_path / "judge-key")},
                            "auth": {"keys": [{"name": "alice", "key_file": "alice"}]}})
    assert (cfg.engine.api_key, cfg.engine.admin_api_key) == ("sk-from-env-1234", "sk-inline")
    assert cfg.judge.api_key == "sk-from-file-1234"  # the file's trailing newline is not part of the key
    assert cfg.auth.keys[0].key == "sk-alice-credential"


@pytest.mark.parametrize("raw, message", [
    ({"engine": {"api_key": "x", "api_key_env": "HOME"}}, "engine.api_key_env: give the secret one way only"),
    ({"engine": {"admin_api_key_env": "CLAWD_TEST_UNSET_VARIABLE"}},
     "engine.admin_api_key_env: the environment variable CLAWD_TEST_UNSET_VARIABLE is not set"),
    ({"judge": {"api_key_file": "/nonexistent/key"}}, "judge.api_key_file: cannot read /nonexistent/key"),
    ({"auth": {"keys": [{"name": "a", "key_env": "CLAWD_TEST_SHORT"}]}}, "auth.keys[0].key: must be at least 8"),
])
def test_a_secret_that_cannot_be_read_names_its_key(raw, message, monkeypatch):
    from clawd.config import config_from_dict
    monkeypatch.setenv("CLAWD_TEST_SHORT", "short")
    monkeypatch.delenv("CLAWD_TEST_UNSET_VARIABLE", raising=False)
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict(raw)
