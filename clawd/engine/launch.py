"""How an engine is started: its command line, environment, GPUs and start-up budget.

One function, `engine_launch`, for the supervisor that runs it and for `bin/clawd --plan` that
prints it, so what is printed is what runs. SGLang is started with `sglang serve` (0.5.23's
recommended entry point), on its own device set, with the served dtype named (its "auto" turns a
float32 config into float16), deltas for streams, and the engine keys in a `--config` file that
only clawd can read: never on the command line, where `ps` shows it (docs/ARCHITECTURE.md §10).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from clawd.devices import Launch, child_env, device_set
from clawd.weights import model_dtype

FD_PLACEHOLDER = "<the listening socket clawd holds>"  # --plan: the local engine's socket exists only at run time


def engine_launch(cfg, role: str, weights: str, weight_version: str, *, fd: int | None = None,
                  keys_file: Path | None = None, base_env: dict[str, str] | None = None, replica: int = 0) -> Launch:
    """The `role` ("policy" or "reference") engine's launch on `weights`. `fd`: the local engine's
    listening socket; `keys_file`: where `write_keys_file` put the engine keys (None: no keys); `replica`:
    which policy replica (SGLang: url's port + replica, its slice of `gpus`; the local engine listens on
    the socket clawd made for it)."""
    eng, model = cfg.engine, cfg.model
    base_env = os.environ if base_env is None else base_env
    name = replica_name(cfg, role, replica)
    if eng.launch == "local":
        argv = [sys.executable, "-m", "clawd.engine.local", "--model", weights,
                "--fd", FD_PLACEHOLDER if fd is None else str(fd), "--seed", str(eng.seed),
                "--max-batch-size", str(eng.max_batch_size), "--weight-version", weight_version]
        if eng.cpu_threads:
            argv += ["--threads", str(eng.cpu_threads)]
        if model.context_length:
            argv += ["--context-length", str(model.context_length)]
        argv.append("--incremental-streaming-output")  # see EngineConfig.streams_deltas
        if keys_file is not None:
            argv += ["--config", str(keys_file)]
        if role == "policy":
            argv += policy_flags(cfg)
        return Launch(name, tuple(argv), child_env(cfg, None, base_env), None, (), eng.startup_seconds)
    if eng.launch != "sglang":
        raise ValueError(f'engine.launch = "{eng.launch}": clawd launches no engine')
    url = eng.policy_urls[replica] if role == "policy" else eng.reference_url
    port = urlsplit(url).port or 80
    gpus = (eng.replica_gpus(replica) if eng.replicas > 1 else eng.gpus) if role == "policy" else eng.reference_gpus
    argv = [str(Path(sys.executable).with_name("sglang")), "serve", "--model-path", weights,
            "--host", urlsplit(url).hostname, "--port", str(port), "--weight-version", weight_version,
            "--dtype", model_dtype(Path(model.path), model.dtype), "--incremental-streaming-output"]
    if model.context_length:
        argv += ["--context-length", str(model.context_length)]
    if keys_file is not None:
        argv += ["--config", str(keys_file)]
    if role == "policy":  # LoRA mode: the base, with the trainer's adapters loaded beside it at run time
        argv += policy_flags(cfg)
    argv += eng.sglang_args if role == "policy" else eng.reference_sglang_args
    return Launch(name, tuple(argv), child_env(cfg, gpus, base_env), port, device_set(gpus), eng.startup_seconds)


def policy_flags(cfg) -> list[str]:
    """The policy engines' own flags, the same for SGLang and the CPU engine: LoRA serving as [train.lora] says,
    and priority scheduling while active rollouts run (Config.priority_scheduling)."""
    return [*cfg.train.lora_flags(), *(["--enable-priority-scheduling"] if cfg.priority_scheduling else [])]


def replica_name(cfg, role: str, replica: int) -> str:
    """"policy-<i>" for a policy replica when there are several, else the role."""
    return f"{role}-{replica}" if role == "policy" and len(cfg.engine.policy_urls) > 1 else role


def keys_file_path(cfg, role: str) -> Path | None:
    """Where the `role` engine's keys file goes, or None when no engine key is configured. systemd's
    runtime directory (a tmpfs, gone at stop) when there is one, else `run/` in the state directory."""
    if not (cfg.engine.api_key or cfg.engine.admin_api_key):
        return None
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return Path(runtime or cfg.state_dir / "run") / f"{role}-engine-keys.yaml"


def write_keys_file(path: Path, api_key: str, admin_api_key: str) -> Path:
    """The engine keys as SGLang's `--config` YAML (JSON is YAML), mode 0600 in a 0700 directory, replaced
    atomically so an engine never reads half a file."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    keys = {k: v for k, v in (("api-key", api_key), ("admin-api-key", admin_api_key)) if v}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp creates it 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(keys, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
