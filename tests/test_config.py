"""Configuration: the documented default file loads; every kind of mistake names the key and the file."""
import re
import tomllib
from pathlib import Path

import pytest

from clawd.config.loading import ConfigError, load_config
from clawd.config.schema import Config
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
    text = (ROOT / "etc/clawd.toml").read_text().replace("# startup_timeout = 0.0", "startup_timeout = 0.0")
    written = tomllib.loads(text)  # startup_timeout ships commented out

    def documented(obj, table: dict, where: str) -> None:  # each key in its own table, groups included
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value) and f.name in table:
                documented(value, table[f.name], f"{where}.{f.name}")
            elif not (isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0])):  # [auth] keys
                assert f.name in table, f"[{where}] {f.name} is not documented in etc/clawd.toml"
    for section in dataclasses.fields(Config):
        if section.name != "source":
            documented(getattr(Config(), section.name), written.get(section.name, {}), section.name)


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
    ("[train.loss]\ntis_cap = 0.5\n", "train.loss.tis_cap: must be a finite number >= 1"),
    ("[train.loss]\nopd_clip = -1.0\n", "train.loss.opd_clip: must be a finite number >= 0"),
    ("[train.optimizer]\ngrad_clip = nan\n", "train.optimizer.grad_clip: must be a finite number"),
    ("[train.optimizer]\nbetas = [0.9]\n", "train.optimizer.betas: must be two numbers in [0, 1)"),
    ("[train.optimizer]\nbetas = [0.9, \"x\"]\n", "train.optimizer.betas[1]: must be float"),
    ("[train.loss]\naggregation = \"mean\"\n", "train.loss.aggregation: must be one of"),
    ("[train.world]\ndevice = \"tpu\"\n", "train.world.device"),
    ("[train.lora]\nrank = -1\n", "train.lora.rank: must be an integer in 0..1024"),
    ("[train]\nseed = -1\n", "train.seed"),
    ("[train]\nmomentum = 0.9\n", "train.momentum: unknown key"),
    ("[train.optimizer]\nmomentum = 0.9\n", "train.optimizer.momentum: unknown key"),
    ("[train]\noptimizer = 3\n", "train.optimizer: must be a table"),
    ("[train]\nlr = 1e-4\n[train.optimizer]\nlr = 1e-3\n", "train.lr: given twice, also as train.optimizer.lr"),
    ("[train]\ntis_cap = 0.5\n", "train.loss.tis_cap: must be a finite number >= 1"),  # a flat key: its new name
    ("[auth]\nkeys = [{name = \"@rollouts/set\", key = \"12345678\"}]\n", "auth.keys[0].name: must not start with"),
    ("[rollouts]\nenabled = true\n", "rollouts.enabled: needs a set or at least one environment"),
    ("[rollouts]\nenvironments = [\"calculator\"]\n", "rollouts.environments: each must name a class"),
    ("[rollouts]\nsamples_per_prompt = 1\n", "rollouts.samples_per_prompt: must be an integer, at least 2"),
    ("[rollouts]\ndiscount = 0.0\n", "rollouts.discount: must be a finite number in (0, 1]"),
    ("[rollouts]\nscale = \"max\"\n", "rollouts.scale: must be one of"),
    ("[scoring]\nmode = \"opd\"\n[rollouts]\nenabled = true\nenvironments = [\"a.b:C\"]\n",
     "rollouts.enabled: rollouts train the RL term"),
    ("[learner]\nenabled = false\n[rollouts]\nenabled = true\nenvironments = [\"a.b:C\"]\n",
     "rollouts.enabled: rollouts only feed the learner"),
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
    from clawd.config.loading import config_from_dict
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
    from clawd.config.loading import config_from_dict
    monkeypatch.setenv("CLAWD_TEST_SHORT", "short")
    monkeypatch.delenv("CLAWD_TEST_UNSET_VARIABLE", raising=False)
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict(raw)


def test_a_train_table_from_before_its_groups_reads_as_the_grouped_one(tmp_path, caplog):
    """Every flat [train] key a file may still hold lands in its group, and the log names each key's new place."""
    from clawd.config.train import REGROUPED, TrainConfig, regroup
    flat = tmp_path / "flat.toml"
    flat.write_text('[train]\nlr = 2e-5\nkl_loss_coef = 0.1\nlora_rank = 8\nlora_lr = 3e-4\ngpus = "0"\n'
                    'checkpoint_every = 2\n')
    grouped = tmp_path / "grouped.toml"
    grouped.write_text('[train]\ncheckpoint_every = 2\n[train.optimizer]\nlr = 2e-5\n[train.loss]\nkl_coef = 0.1\n'
                       '[train.lora]\nrank = 8\nlr = 3e-4\n[train.world]\ngpus = "0"\n')
    with caplog.at_level("WARNING", logger="clawd.config"):
        old = load_config(flat).train
    assert old == load_config(grouped).train
    assert (old.optimizer.lr, old.loss.kl_coef, old.lora.rank, old.lora.lr, old.world.device) == \
        (2e-5, 0.1, 8, 3e-4, "cuda")  # gpus written: device "cuda", as before
    assert "kl_loss_coef -> train.loss.kl_coef" in caplog.text and "lora_rank -> train.lora.rank" in caplog.text
    # the table is exact: every field of every group has exactly one flat name, and nothing else moves
    names = {f"{g}.{k}" for g, k in REGROUPED.values()}
    groups = {"optimizer": TrainConfig().optimizer, "loss": TrainConfig().loss, "world": TrainConfig().world,
              "lora": TrainConfig().lora}
    import dataclasses
    assert names == {f"{g}.{f.name}" for g, obj in groups.items() for f in dataclasses.fields(obj)}
    assert len(names) == len(REGROUPED)
    assert regroup({"seed": 1, "optimizer": {"eps": 1e-6}, "lr": 0.1}) == \
        ({"seed": 1, "optimizer": {"eps": 1e-6, "lr": 0.1}}, [("lr", "optimizer.lr")], [])


def test_every_field_of_every_section_has_its_line_of_documentation():
    """Each field in clawd/config/ carries a comment on its line or the line above: the schema reads as its
    documentation. A control: a field without one is found."""
    import ast

    def undocumented(text: str) -> list[str]:
        lines, found = text.splitlines(), []
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign):
                        after = lines[item.lineno - 1][item.end_col_offset:]
                        if "#" not in after and not lines[item.lineno - 2].strip().startswith("#"):
                            found.append(item.target.id)
        return found

    assert undocumented("class A:\n    x: int = 1  # documented\n    # so is\n    y: int = 2\n    z: int = 3\n") == ["z"]
    missing = {p.name: names for p in sorted((ROOT / "clawd/config").glob("*.py"))
               if (names := undocumented(p.read_text()))}
    assert missing == {}
