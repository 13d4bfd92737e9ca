"""`bin/clawd --plan`: every process a configuration starts, its GPUs, command and environment, and no secret;
`--check-config` refuses placements that would collide on a GPU, naming the key."""
from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from clawd.config.loading import config_from_dict, ConfigError
from clawd.config.train import overlay
from clawd.tools.tomlfile import to_toml
from clawd.engine.launch import write_keys_file

ROOT = Path(__file__).resolve().parent.parent
SECRETS = ("sk-engine-0123456789", "sk-admin-0123456789", "sk-judge-0123456789", "sk-alice-0123456789")


def _model(tmp_path, dtype="bfloat16") -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "dtype": dtype}))
    return model


def _gpu_config(tmp_path) -> dict:
    return {"model": {"path": str(_model(tmp_path))}, "state": {"dir": str(tmp_path / "state")},
            "auth": {"keys": [{"name": "alice", "key_env": "CLAWD_TEST_ALICE"}]},
            "engine": {"launch": "sglang", "gpus": "0,1", "reference_gpus": "2", "api_key": SECRETS[0],
                       "admin_api_key_env": "CLAWD_TEST_ADMIN", "sglang_args": ["--tp-size", "2"],
                       "reference_sglang_args": ["--mem-fraction-static", "0.5"]},
            "judge": {"api_key_file": str(tmp_path / "judge-key")},
            "train": {"world": {"gpus": "3"}}}


def _plan(tmp_path, raw: dict, *args: str) -> subprocess.CompletedProcess:
    path = tmp_path / "clawd.toml"
    path.write_text(to_toml(raw))
    (tmp_path / "judge-key").write_text(SECRETS[2] + "\n")
    env = {**os.environ, "CLAWD_TEST_ADMIN": SECRETS[1], "CLAWD_TEST_ALICE": SECRETS[3]}
    return subprocess.run([str(ROOT / "bin/clawd"), "--config", str(path), *args],
                          capture_output=True, text=True, env=env, timeout=60)


def test_plan_places_each_role_on_its_own_gpus_with_the_dtype_and_no_secret(tmp_path):
    done = _plan(tmp_path, _gpu_config(tmp_path), "--plan", "--json")
    assert done.returncode == 0, done.stderr
    processes = {p["role"]: p for p in json.loads(done.stdout)["processes"]}
    assert list(processes) == ["policy", "reference", "trainer"]  # the order they start in
    assert {role: p["devices"] for role, p in processes.items()} == {"policy": [0, 1], "reference": [2],
                                                                     "trainer": [3]}
    assert {role: p["env"].get("CUDA_VISIBLE_DEVICES") for role, p in processes.items()} == {
        "policy": "0,1", "reference": "2", "trainer": "3"}
    for role in ("policy", "reference"):
        argv = processes[role]["argv"]
        assert argv[0].endswith("/sglang") and argv[1] == "serve"
        assert argv[argv.index("--dtype") + 1] == "bfloat16"
        assert argv[argv.index("--port") + 1] == str(processes[role]["port"])
        assert "--incremental-streaming-output" in argv
        assert processes[role]["startup_timeout"] >= 1200
        # The keys travel in a file named on the command line; the variables they came from are removed.
        keys = argv[argv.index("--config") + 1]
        assert keys.endswith(f"{role}-engine-keys.yaml") and not Path(keys).exists()  # a plan writes nothing
        assert processes[role]["env"]["CLAWD_TEST_ADMIN"] is None
        assert processes[role]["env"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] is None if (
            "SGLANG_RETURN_ORIGINAL_LOGPROB" in os.environ) else "SGLANG_RETURN_ORIGINAL_LOGPROB" not in processes[role]["env"]
    assert processes["policy"]["argv"][-2:] == ["--tp-size", "2"]
    assert processes["reference"]["argv"][-2:] == ["--mem-fraction-static", "0.5"]
    text = _plan(tmp_path, _gpu_config(tmp_path), "--plan")
    assert text.returncode == 0 and "policy: GPUs 0,1, port 30000, ready within 1800s" in text.stdout
    for secret in SECRETS:
        assert secret not in done.stdout + done.stderr + text.stdout + text.stderr


def test_the_child_environment_scrubs_log_prob_switches(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    done = _plan(tmp_path, _gpu_config(tmp_path), "--plan", "--json")
    for process in json.loads(done.stdout)["processes"]:
        assert process["env"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] is None


@pytest.mark.parametrize("change, key", [
    ({"engine": {"reference_gpus": "1"}}, "engine.gpus: GPU 1 is shared by the policy engine"),
    ({"train": {"world": {"gpus": "2"}}},
     "train.world.gpus: GPU 2 is shared by the reference engine (engine.reference_gpus) and "
                               "the trainer (train.world.gpus): every role on a shared GPU must set its memory share "
                               "(train.world.memory_fraction for the trainer)"),
    ({"train": {"world": {"gpus": "2", "memory_fraction": 0.6}}},
     "train.world.gpus: GPU 2 is shared by the reference engine "
                                                        "(engine.reference_gpus) and the trainer (train.world.gpus), "
                                                        "whose memory shares add up to 1.10"),
    ({"engine": {"reference_gpus": ""}}, "engine.reference_gpus: must name the GPUs of the reference engine"),
    ({"engine": {"gpus": "0"}}, "engine.gpus: names 1 GPU(s), but the SGLang arguments of the policy engine use 2"),
    ({"train": {"world": {"gpus": ""}}, "learner": {}}, None),  # no trainer GPUs: the trainer runs on the CPU
])
def test_check_config_refuses_overlapping_gpus_naming_the_key(tmp_path, change, key):
    raw = _gpu_config(tmp_path)
    for section, values in change.items():
        raw[section] = overlay(raw[section], values) if section == "train" else {**raw.get(section, {}), **values}
    done = _plan(tmp_path, raw, "--check-config")
    if key is None:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode == 2 and key in done.stderr, done.stderr


def test_a_shared_gpu_is_accepted_when_every_role_on_it_sets_its_share(tmp_path):
    raw = _gpu_config(tmp_path)
    raw["engine"] |= {"gpus": "0", "reference_gpus": "0", "sglang_args": ["--mem-fraction-static", "0.4"],
                      "reference_sglang_args": ["--mem-fraction-static=0.25"]}
    raw["train"] = overlay(raw["train"], {"world": {"gpus": "0", "memory_fraction": 0.3}})
    done = _plan(tmp_path, raw, "--plan", "--json")
    assert done.returncode == 0, done.stderr
    assert {p["role"]: p["devices"] for p in json.loads(done.stdout)["processes"]} == {
        "policy": [0], "reference": [0], "trainer": [0]}


def test_train_gpus_make_the_trainer_run_on_cuda_unless_told_otherwise():
    assert config_from_dict({"train": {"world": {"gpus": "3"}}}).train.world.device == "cuda"
    with pytest.raises(ConfigError, match='train.world.device: must be "cuda" when gpus is set'):
        config_from_dict({"train": {"world": {"gpus": "3", "device": "cpu"}}})


def test_keys_file_is_private_and_holds_sglang_config_keys(tmp_path):
    path = write_keys_file(tmp_path / "run" / "policy-engine-keys.yaml", "sk-a", "sk-b")
    assert json.loads(path.read_text()) == {"api-key": "sk-a", "admin-api-key": "sk-b"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_plan_shows_the_trainer_worlds_torchrun_lines_for_every_host(tmp_path):
    raw = _gpu_config(tmp_path)
    raw["learner"] = {"enabled": True}
    raw["train"] = {"gpus": "3,4", "nnodes": 2, "rdzv_endpoint": "10.0.0.5:29500", "collective_timeout": 120.0}
    done = _plan(tmp_path, raw, "--plan", "--json")
    assert done.returncode == 0, done.stderr
    processes = {p["role"]: p for p in json.loads(done.stdout)["processes"]}
    assert list(processes)[-3:] == ["trainer", "trainer-ranks", "trainer-ranks on host 1 (clawd-trainer@1)"]
    here, there = processes["trainer-ranks"], processes["trainer-ranks on host 1 (clawd-trainer@1)"]
    assert here["devices"] == there["devices"] == [3, 4] and here["env"]["CUDA_VISIBLE_DEVICES"] == "3,4"
    for node, p in enumerate((here, there)):
        argv = p["argv"]
        assert argv[1:3] == ["-m", "torch.distributed.run"] and argv[-4:] == ["-m", "clawd.trainer.worker.rank",
                                                                             "--collective-timeout", "120.0"]
        flags = dict(zip(argv[3:-4:2], argv[4:-4:2]))
        assert flags == {"--nnodes": "2", "--nproc-per-node": "2", "--node-rank": str(node), "--rdzv-backend": "static",
                         "--master-addr": "10.0.0.5", "--master-port": "29500", "--max-restarts": "0",
                         "--monitor-interval": "0.5"}
    for secret in SECRETS:
        assert secret not in done.stdout + done.stderr


def test_plan_in_lora_mode_serves_adapters_on_the_policy_engine_and_starts_no_reference(tmp_path):
    raw = _gpu_config(tmp_path)
    raw["engine"].pop("reference_gpus")
    raw["engine"].pop("reference_sglang_args")
    raw["train"] = overlay(raw["train"], {"lora": {"rank": 16, "target_modules": ["q_proj", "v_proj"]}})
    done = _plan(tmp_path, raw, "--plan", "--json")
    assert done.returncode == 0, done.stderr
    processes = {p["role"]: p for p in json.loads(done.stdout)["processes"]}
    assert list(processes) == ["policy", "trainer"]  # the judge and the teacher use the policy's base
    argv = processes["policy"]["argv"]
    lora = argv[argv.index("--enable-lora"):argv.index("--max-loras-per-batch") + 3]
    assert lora == ["--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj",
                    "--max-loras-per-batch", "4", "--lora-strict-loading"]
    assert argv[argv.index("--model-path") + 1] == raw["model"]["path"]  # the base, adapters beside it
    raw["engine"]["sglang_args"] = ["--max-lora-rank", "8"]
    refused = _plan(tmp_path, raw, "--check-config")
    assert refused.returncode != 0 and "must not hold --max-lora-rank" in refused.stderr


def test_lora_refuses_data_parallel_replicas_and_modules_sglang_does_not_serve_adapters_on():
    """SGLang 0.5.23 asserts dp_size == 1 when it loads an adapter (an HTTP 500 at every publish) and its
    argparse refuses a target module outside its list (the engine never starts): both are refused at start."""
    with pytest.raises(ConfigError, match="--dp-size above 1 with train.lora.rank > 0.*replicas = N"):
        config_from_dict({"train": {"lora": {"rank": 8}}, "engine": {"sglang_args": ["--dp-size=2"]}})
    config_from_dict({"train": {"lora": {"rank": 8}}, "engine": {"sglang_args": ["--tp-size", "2"]}})
    config_from_dict({"engine": {"sglang_args": ["--dp-size", "2"]}})  # a full fine-tune publishes from disk
    with pytest.raises(ConfigError, match="train.lora.target_modules: attn: not a module SGLang serves"):
        config_from_dict({"train": {"lora": {"rank": 8, "target_modules": ["q_proj", "attn"]}}})
    with pytest.raises(ConfigError, match="all: not a module"):  # the trainer needs the names
        config_from_dict({"train": {"lora": {"rank": 8, "target_modules": ["all"]}}})


@pytest.mark.parametrize("rollouts, setting, flagged", [(True, "auto", True), (False, "auto", False),
                                                        (False, "on", True), (True, "off", False)])
def test_the_policy_engine_schedules_by_priority_while_rollouts_run(tmp_path, rollouts, setting, flagged):
    """Active rollouts' calls yield to live ones at the engine: auto turns it on with them, on the policy
    engine only; an operator's copy of the flag is refused (clawd sets it)."""
    raw = _gpu_config(tmp_path)
    raw["engine"]["priority_scheduling"] = setting
    raw["learner"] = {"enabled": True}
    if rollouts:
        raw["rollouts"] = {"enabled": True, "environments": ["clawd.rollouts.envs.calculator:Calculator"]}
    done = _plan(tmp_path, raw, "--plan", "--json")
    assert done.returncode == 0, done.stderr
    processes = {p["role"]: p for p in json.loads(done.stdout)["processes"]}
    assert ("--enable-priority-scheduling" in processes["policy"]["argv"]) == flagged
    assert "--enable-priority-scheduling" not in processes["reference"]["argv"]
    local = {**raw, "engine": {"launch": "local", "priority_scheduling": setting}}
    local_argv = json.loads(_plan(tmp_path, local, "--plan", "--json").stdout)["processes"][0]["argv"]
    assert ("--enable-priority-scheduling" in local_argv) == flagged
    raw["engine"]["sglang_args"] = ["--enable-priority-scheduling"]
    refused = _plan(tmp_path, raw, "--check-config")
    assert refused.returncode != 0 and "must not hold --enable-priority-scheduling" in refused.stderr
