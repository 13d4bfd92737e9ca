"""Which GPUs each process clawd starts may use, and whether the roles fit beside each other.

Pure functions over the configuration's plain values (no torch, no CUDA): `clawd.config` calls
`placement_problem` when a file is loaded, so `--check-config` refuses a placement that would
run out of memory at start, naming the key. A device set is a `CUDA_VISIBLE_DEVICES` string such
as "0,1" (docs/ARCHITECTURE.md §10).
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

# SGLang flags clawd writes itself on every launch (clawd.engine.launch): an operator's copy in
# sglang_args would contradict them or, for the keys, put a secret on the command line.
CLAWD_FLAGS = frozenset({"--model-path", "--model", "--host", "--port", "--weight-version", "--dtype",
                         "--context-length", "--api-key", "--admin-api-key", "--incremental-streaming-output",
                         # LoRA serving follows [train.lora] (LoraConfig.flags)
                         "--enable-lora", "--max-lora-rank", "--lora-target-modules", "--max-loras-per-batch",
                         "--lora-paths",
                         # every adapter clawd serves stays loaded (an eviction would leave a principal's own to
                         # SGLang's silent reload from a path clawd may have deleted): SGLang's default, no limit
                         "--max-loaded-loras",
                         "--enable-priority-scheduling"})  # follows [engine] priority_scheduling
_SET = re.compile(r"\d+(,\d+)*")


def device_set(text: str) -> tuple[int, ...]:
    """"0,1" → (0, 1); "" → ()."""
    return tuple(int(x) for x in text.split(",")) if text else ()


def set_problem(text: str) -> str | None:
    if not text:
        return None
    if not _SET.fullmatch(text):
        return 'must be GPU indices separated by commas, e.g. "0" or "0,1"'
    ids = device_set(text)
    if len(set(ids)) != len(ids):
        return "names a GPU twice"
    return None


def flag_value(args: tuple[str, ...], *names: str) -> str | None:
    """The value of the last of `names` in an argv (`--flag value` or `--flag=value`), or None."""
    found = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in names:
            found = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    return found


def gpus_needed(args: tuple[str, ...]) -> int:
    """GPUs one SGLang server uses: tensor × pipeline × data parallel sizes."""
    n = 1
    for names in (("--tp-size", "--tensor-parallel-size", "--tp"), ("--pp-size", "--pipeline-parallel-size"),
                  ("--dp-size", "--data-parallel-size", "--dp")):
        value = flag_value(args, *names)
        n *= int(value) if value and value.isdigit() else 1
    return n


def nameserver_problem(text: str) -> str | None:
    try:
        parse_nameserver(text)
    except ValueError:
        return 'must be an IP address, optionally with a port: "10.0.0.2", "127.0.0.1:5353", "[::1]:53"'
    return None


def parse_nameserver(text: str) -> tuple[str, int] | None:
    """"" → None (the system's resolv.conf); "IP", "IP:port", "[IPv6]:port" → (ip, port)."""
    if not text:
        return None
    host, port = text, 53
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(text)
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        port = int(port_text)
    ipaddress.ip_address(host)
    if not 0 < port < 65536:
        raise ValueError(text)
    return host, port


@dataclass(frozen=True)
class Role:
    """One process on GPUs: its device-set key, its devices and its memory share (0: not set)."""
    name: str
    key: str
    share_key: str
    devices: tuple[int, ...]
    share: float


def roles(cfg) -> list[Role]:
    """The GPU processes a configuration starts: SGLang engines clawd launches, a CUDA trainer."""
    eng, found = cfg.engine, []
    if eng.launch == "sglang":
        found.append(Role("the policy engine", "engine.gpus", "--mem-fraction-static in engine.sglang_args",
                          device_set(eng.gpus), _share(eng.sglang_args)))
        if cfg.reference_engine_needed:
            args = eng.reference_sglang_args
            found.append(Role("the reference engine", "engine.reference_gpus",
                              "--mem-fraction-static in engine.reference_sglang_args",
                              device_set(eng.reference_gpus), _share(args)))
    if cfg.learner.enabled and cfg.train.world.device.startswith("cuda"):
        found.append(Role("the trainer", "train.world.gpus", "train.world.memory_fraction",
                          device_set(cfg.train.world.gpus),
                          cfg.train.world.memory_fraction))
    return found


def _share(args: tuple[str, ...]) -> float:
    value = flag_value(args, "--mem-fraction-static")
    try:
        return float(value) if value else 0.0
    except ValueError:
        return 0.0


def placement_problem(cfg) -> tuple[str, str] | None:
    """(key, problem) when the roles' GPUs are unset where clawd cannot guess them, do not match an
    engine's parallel sizes, or overlap without every role on a shared GPU setting its memory share."""
    eng = cfg.engine
    found = roles(cfg)
    if eng.launch == "sglang":
        for role, args, copies in zip(found, (eng.sglang_args, eng.reference_sglang_args), (eng.replicas, 1)):
            if role.name == "the trainer":
                break
            if not role.devices:
                return role.key, f'must name the GPUs of {role.name} when clawd launches SGLang, e.g. "0"'
            if len(role.devices) != gpus_needed(args) * copies:  # each policy replica gets its own slice
                each = f" for each of its {copies} replicas" if copies > 1 else ""
                return role.key, (f"names {len(role.devices)} GPU(s), but the SGLang arguments of {role.name} "
                                  f"use {gpus_needed(args)} (tp × pp × dp){each}")
        trainer = next((r for r in found if r.name == "the trainer"), None)
        if trainer is not None and not trainer.devices:
            return "train.world.gpus", ("must be set when clawd launches SGLang and trains on CUDA (else both take "
                                        "GPU 0)")
    for gpu in sorted({d for r in found for d in r.devices}):
        sharing = [r for r in found if gpu in r.devices]
        if len(sharing) < 2:
            continue
        names = " and ".join(f"{r.name} ({r.key})" for r in sharing)
        for role in sharing:
            if role.share <= 0:
                return role.key, (f"GPU {gpu} is shared by {names}: every role on a shared GPU must set its "
                                  f"memory share ({role.share_key} for {role.name})")
        if sum(r.share for r in sharing) > 1.0 + 1e-9:
            return sharing[-1].key, (f"GPU {gpu} is shared by {names}, whose memory shares add up to "
                                     f"{sum(r.share for r in sharing):.2f}, more than the whole GPU")
    return None


# --- what a child process gets ---------------------------------------------------------------

# Variables that change what an engine's log-probs or sampling mean, removed from every child's environment:
# SGLang 0.5.23 returns temperature-1 log-probs under SGLANG_RETURN_ORIGINAL_LOGPROB=1, which the trainer's
# ratios would silently compare against temperature-T ones (docs/ARCHITECTURE.md §10).
SCRUBBED_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB",)


@dataclass(frozen=True)
class Launch:
    """One process clawd starts, as `bin/clawd --plan` prints it. `env` holds only what clawd changes in
    its own environment for the child: a value is set, None is removed. Never a secret: keys reach the
    engines through a file only clawd can read, named on the command line."""
    role: str
    argv: tuple[str, ...]
    env: dict[str, str | None]
    port: int | None
    devices: tuple[int, ...]
    startup_timeout: float

    def environ(self, base: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in base.items() if self.env.get(k, v) is not None}
        env.update({k: v for k, v in self.env.items() if v is not None})
        return env

    def as_json(self) -> dict:
        return {"role": self.role, "argv": list(self.argv), "env": dict(self.env), "port": self.port,
                "devices": list(self.devices), "startup_timeout": self.startup_timeout}


def child_env(cfg, gpus: str | None, base: dict[str, str], unbuffered: bool = True) -> dict[str, str | None]:
    """The changes to clawd's environment for a child: unbuffered output (for a child clawd execs), its
    GPUs (when it has a set), the scrubbed variables and those clawd read secrets from removed (when set)."""
    env: dict[str, str | None] = {"PYTHONUNBUFFERED": "1"} if unbuffered else {}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    secret_vars = [cfg.engine.api_key_env, cfg.engine.admin_api_key_env, cfg.judge.api_key_env,
                   *(k.key_env for k in cfg.auth.keys)]
    for name in (*SCRUBBED_ENV, *secret_vars):
        if name and name in base:
            env[name] = None
    return env
