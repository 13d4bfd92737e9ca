"""Configuration: one TOML file loaded into frozen dataclasses (docs/ARCHITECTURE.md §9).

One file on purpose: it is the schema of etc/clawd.toml, section by section in the file's order,
so a key is found in one place and read beside its documentation. Every section is a frozen dataclass whose fields carry their type and default.
`load_config` rejects unknown keys, wrong types and impossible values with a
`ConfigError` naming the file and the dotted key, so a typo never starts a
daemon that silently ignores it.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from clawd import credentials, devices
from clawd.checks import below, is_group_name, not_positive
from clawd.privacy_config import PrivacyConfig
from clawd.safety_config import GateConfig, MonitorsConfig, VersionsConfig
from clawd.train_config import TrainConfig


class ConfigError(ValueError):
    """A configuration problem, already phrased for the operator."""


@dataclass(frozen=True)
class ApiKey:
    name: str
    key: str = ""
    key_env: str = ""   # secrets: see clawd.credentials (resolved into `key` when the file is loaded)
    key_file: str = ""
    train: bool = True  # false: this key's turns are served and never trained (consent; reason "consent")
    record: bool = True  # false: this key's turns leave no turn or judge record
    operator: bool = False  # true: this key opens /dashboard (and /metrics with require_metrics_key)

    def check(self) -> dict[str, str]:
        errors = {}
        if not self.name:
            errors["name"] = "must not be empty"
        if len(self.key) < 8:
            errors["key"] = "must be at least 8 characters"
        return errors


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8400
    max_concurrent_requests: int = 64
    max_body_bytes: int = 4 * 1024 * 1024
    max_messages: int = 2048
    max_message_chars: int = 1_000_000
    drain_timeout: float = 30.0
    served_model_name: str = ""
    debug_routes: bool = False
    # A client that stalls holds a connection, never a request slot (clawd.serving.connections).
    header_timeout: float = 10.0         # seconds from a connection's first byte (or its last request) to all headers
    body_timeout: float = 30.0           # seconds to receive a whole request body
    keepalive_timeout: float = 15.0      # an idle keep-alive connection is closed after this
    write_timeout: float = 60.0          # seconds a client may take no byte of its reply (aiohttp has no bound)
    max_connections: int = 8192          # open connections; when full, the longest-stalled one is closed
    peer_connection_share: float = 0.5   # of max_connections one peer address may hold (1: no share)
    principal_request_share: float = 0.25  # of max_concurrent_requests kept for others (2+ API keys; 1: no share)
    allowed_hosts: tuple[str, ...] = ()  # Host names served (empty: the loopback names on loopback, else any)
    allowed_origins: tuple[str, ...] = ()  # web pages (scheme://host[:port]) that may call the API (CORS)

    def check(self) -> dict[str, str]:
        errors = below(self, 1, "max_concurrent_requests", "max_body_bytes", "max_messages", "max_message_chars",
                        "max_connections")
        bad = [o for o in self.allowed_origins if urlsplit(o).scheme not in ("http", "https") or not urlsplit(o).netloc
               or o != f"{urlsplit(o).scheme}://{urlsplit(o).netloc}"]
        if bad:
            errors["allowed_origins"] = f"each must be scheme://host[:port], as browsers send it, not {bad[0]!r}"
        errors |= below(self, 0, "drain_timeout") | not_positive(self, "header_timeout", "body_timeout",
                                                                    "keepalive_timeout", "write_timeout")
        errors |= {k: "must be above 0 and at most 1" for k in ("peer_connection_share", "principal_request_share")
                   if not 0 < getattr(self, k) <= 1}
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            errors["host"] = "must be an IP literal (no name lookups in the daemon)"
        if not 0 <= self.port <= 65535:
            errors["port"] = "must be in 0..65535"
        return errors

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback


@dataclass(frozen=True)
class AuthConfig:
    keys: tuple[ApiKey, ...] = ()
    # With no keys every request is the one principal "anonymous", unless the operator trusts the
    # client-chosen `user` field (then a principal is that field, cut to max_user_chars).
    trust_user_field: bool = False
    max_user_chars: int = 64
    allow_open: bool = False             # serve with no keys on an address other than loopback
    require_metrics_key: bool = False    # /metrics needs an operator key (it is open, like /health, otherwise)

    def check(self) -> dict[str, str]:
        if self.max_user_chars < 1:
            return {"max_user_chars": "must be at least 1"}
        names = [k.name for k in self.keys]
        if len(set(names)) != len(names):
            return {"keys": "key names must be unique"}
        secrets = [k.key for k in self.keys]
        if len(set(secrets)) != len(secrets):
            return {"keys": "two entries share one key"}
        return {}


@dataclass(frozen=True)
class ModelConfig:
    path: str = "state/models/SmolLM2-135M-Instruct"
    context_length: int = 0
    max_tokens_cap: int = 1024
    tool_parser: str = "hermes"
    reasoning_parser: str = "think"
    dtype: typing.Literal["auto", "bfloat16", "float16", "float32"] = "auto"

    def check(self) -> dict[str, str]:
        errors = {}
        if not self.path:
            errors["path"] = "must name a Hugging Face model directory"
        if self.context_length < 0:
            errors["context_length"] = "must be 0 (from the model) or positive"
        if self.max_tokens_cap < 1:
            errors["max_tokens_cap"] = "must be at least 1"
        return errors


@dataclass(frozen=True)
class EngineConfig:
    launch: typing.Literal["local", "sglang", "none"] = "local"
    url: str = "http://127.0.0.1:30000"
    reference_url: str = "http://127.0.0.1:30001"
    api_key: str = ""
    api_key_env: str = ""
    api_key_file: str = ""
    admin_api_key: str = ""
    admin_api_key_env: str = ""
    admin_api_key_file: str = ""
    gpus: str = ""
    reference_gpus: str = ""
    sglang_args: tuple[str, ...] = ()
    reference_sglang_args: tuple[str, ...] = ()
    request_timeout: float = 600.0
    connect_timeout: float = 5.0
    startup_timeout: float = 0.0
    restart_backoff_initial: float = 1.0
    restart_backoff_max: float = 30.0
    health_interval: float = 5.0
    health_failures: int = 3             # failed polls in a row that make a hung engine restart
    first_byte_timeout: float = 120.0    # seconds an engine call may wait for its first byte (queueing, prefill)
    idle_timeout: float = 60.0           # seconds a stream may go without a byte once it started
    incremental_streaming_output: bool = False
    cpu_threads: int = 0
    max_batch_size: int = 8
    seed: int = 0
    replicas: int = 1                    # policy engines clawd launches (local or sglang), each on its own port and GPUs
    urls: tuple[str, ...] = ()           # launch = "none": the policy replicas' URLs (empty: url alone)
    weight_sync: typing.Literal["auto", "distributed", "disk"] = "auto"  # auto: distributed for SGLang clawd launches
    weight_sync_address: str = "127.0.0.1"  # where the engines reach trainer rank 0's rendezvous
    weight_sync_bucket_mb: int = 512     # the most one broadcast carries

    @property
    def policy_urls(self) -> tuple[str, ...]:
        """Every policy replica's URL: `urls` (launch "none"), else url and the next replicas − 1 ports."""
        if self.launch == "none":
            return self.urls or (self.url,)
        parts = urlsplit(self.url)
        port = parts.port or 80
        return tuple(parts._replace(netloc=f"{parts.hostname}:{port + i}").geturl() for i in range(self.replicas))

    def replica_gpus(self, i: int) -> str:
        """Replica i's slice of `gpus` (each replica gets len(gpus) / replicas of them)."""
        ids = devices.device_set(self.gpus)
        share = len(ids) // self.replicas
        return ",".join(map(str, ids[i * share:(i + 1) * share]))

    @property
    def streams_deltas(self) -> bool:
        """Engines clawd launches always stream deltas: cumulative chunks cost O(n²) to read."""
        return self.launch != "none" or self.incremental_streaming_output

    @property
    def startup_seconds(self) -> float:
        """startup_timeout, or its launch kind's default when 0: a cold SGLang start loads the weights,
        captures CUDA graphs and may JIT kernels first, which takes many minutes."""
        return self.startup_timeout or STARTUP_TIMEOUTS[self.launch]

    def check(self) -> dict[str, str]:
        errors = {}
        for name in ("url", "reference_url"):
            if problem := _ip_url_problem(getattr(self, name)):
                errors[name] = problem
        errors |= not_positive(self, "request_timeout", "connect_timeout", "restart_backoff_initial",
                                "restart_backoff_max", "health_interval", "first_byte_timeout", "idle_timeout")
        errors |= below(self, 1, "health_failures", "max_batch_size", "weight_sync_bucket_mb")
        if self.startup_timeout < 0:
            errors["startup_timeout"] = "must be 0 (the launch kind's default) or positive"
        for name in ("gpus", "reference_gpus"):
            if problem := devices.set_problem(getattr(self, name)):
                errors[name] = problem
            elif getattr(self, name) and self.launch != "sglang":
                errors[name] = 'applies to launch = "sglang" only (clawd starts no GPU engine otherwise)'
        for name in ("sglang_args", "reference_sglang_args"):
            if "--config" in getattr(self, name):
                errors[name] = "must not hold --config: clawd passes its own (the engine keys go in it)"
            elif flag := next((a for a in getattr(self, name) if a.split("=")[0] in devices.CLAWD_FLAGS), None):
                errors[name] = f"must not hold {flag.split('=')[0]}: clawd sets it (see docs/ARCHITECTURE.md §10)"
        if self.restart_backoff_max < self.restart_backoff_initial:
            errors["restart_backoff_max"] = "must be at least restart_backoff_initial"
        if self.cpu_threads < 0:
            errors["cpu_threads"] = "must be 0 (torch's default) or positive"
        errors |= _replica_problems(self)
        return errors


def _replica_problems(eng: EngineConfig) -> dict[str, str]:
    errors = below(eng, 1, "replicas")
    if eng.urls and eng.launch != "none":
        errors["urls"] = 'applies to launch = "none" only (launched replicas are replicas = N)'
    if eng.replicas > 1 and eng.launch == "none":
        errors["replicas"] = 'counts launched engines: with launch = "none" list them in urls'
    for i, url in enumerate(eng.urls):
        if problem := _ip_url_problem(url):
            errors[f"urls[{i}]"] = problem
    if len(set(eng.urls)) != len(eng.urls):
        errors["urls"] = "names a URL twice"
    if eng.replicas > 1 and eng.gpus and len(devices.device_set(eng.gpus)) % eng.replicas:
        errors["replicas"] = f"must divide the {len(devices.device_set(eng.gpus))} GPUs of gpus (a slice each)"
    return errors


# Seconds a starting engine may take to answer, per launch kind, when startup_timeout is 0.
STARTUP_TIMEOUTS = {"local": 300.0, "sglang": 1800.0, "none": 300.0}


def _ip_url_problem(url: str, names: bool = False) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http(s) URL"
    try:
        ipaddress.ip_address(parts.hostname)
    except ValueError:
        if not names:
            return "host must be an IP literal such as 127.0.0.1 (no name lookups in the daemon)"
    return None


@dataclass(frozen=True)
class ScoringConfig:
    mode: typing.Literal["rl", "opd", "combine"] = "combine"
    prm_m: int = 1
    at_least_one: bool = False
    max_pending: int = 10_000
    max_pending_bytes: int = 256 * 1024 * 1024  # turns waiting for their judge, by their messages' size
    fair_share: float = 0.25

    def check(self) -> dict[str, str]:
        errors = below(self, 1, "max_pending", "max_pending_bytes")
        if not 1 <= self.prm_m <= 16:
            errors["prm_m"] = "must be in 1..16"
        if self.at_least_one and self.mode != "rl":
            errors["at_least_one"] = "applies to mode \"rl\" only"
        if not 0 < self.fair_share <= 1:
            errors["fair_share"] = "must be in (0, 1]"
        return errors


@dataclass(frozen=True)
class JudgeConfig:
    backend: typing.Literal["sglang", "openai", "rules"] = "sglang"
    engine: typing.Literal["reference", "policy"] = "reference"
    teacher_engine: typing.Literal["reference", "policy"] = "reference"
    hint_placement: typing.Literal["system", "user"] = "system"  # where the teacher reads the hint
    url: str = ""
    api_key: str = ""
    api_key_env: str = ""
    api_key_file: str = ""
    model: str = ""
    ca_file: str = ""
    nameserver: str = ""
    temperature: float = 0.6
    max_new_tokens: int = 512
    timeout: float = 120.0
    retries: int = 2
    backoff_initial: float = 0.5
    backoff_max: float = 8.0
    concurrency: int = 8
    record_text_chars: int = 2000

    def check(self) -> dict[str, str]:
        errors = {}
        if self.backend == "openai":
            if problem := _ip_url_problem(self.url, names=True):
                errors["url"] = problem + ' (backend "openai" needs url, e.g. "https://judge.example.com/v1")'
            if not self.model:
                errors["model"] = 'backend "openai" needs a model name'
        if problem := devices.nameserver_problem(self.nameserver):
            errors["nameserver"] = problem
        if not 0 <= self.temperature <= 2:
            errors["temperature"] = "must be in [0, 2]"
        if self.max_new_tokens < 1:
            errors["max_new_tokens"] = "must be at least 1"
        if self.timeout <= 0 or self.backoff_initial <= 0 or self.backoff_max < self.backoff_initial:
            errors["timeout"] = "timeout and backoff_initial must be positive, backoff_max >= backoff_initial"
        if self.retries < 0:
            errors["retries"] = "must not be negative"
        if self.concurrency < 1:
            errors["concurrency"] = "must be at least 1"
        if self.record_text_chars < 0:
            errors["record_text_chars"] = "must not be negative"
        return errors


@dataclass(frozen=True)
class LearnerConfig:
    enabled: bool = True
    rollout_batch_size: int = 16
    backlog_batches: int = 4  # a backlog's step takes up to this many batches' worth of fresh samples
    min_batch_size: int = 4
    rollout_timeout: float = 0.0
    stall_warn_interval: float = 30.0
    max_staleness: int = 2
    train_timeout: float = 1800.0
    trainer_ready_timeout: float = 600.0
    publish_timeout: float = 600.0
    control: typing.Literal["none", "shuffle_rewards", "zero_rewards"] = "none"  # clawd.learning.controls
    max_sample_tokens: int = 0  # longer samples are never trained (clawd.learning.limits); 0: [train] micro_batch_tokens

    def check(self) -> dict[str, str]:
        errors = not_positive(self, "stall_warn_interval", "train_timeout", "trainer_ready_timeout",
                               "publish_timeout", "backlog_batches") | below(self, 0, "rollout_timeout", "max_staleness",
                                                                            "max_sample_tokens")
        if self.rollout_batch_size < 1:
            errors["rollout_batch_size"] = "must be at least 1"
        if not 1 <= self.min_batch_size <= self.rollout_batch_size:
            errors["min_batch_size"] = "must be in 1..rollout_batch_size"
        return errors


@dataclass(frozen=True)
class JournalConfig:
    fsync: typing.Literal["interval", "always"] = "interval"
    fsync_interval: float = 0.1
    segment_bytes: int = 64 * 1024 * 1024

    def check(self) -> dict[str, str]:
        return not_positive(self, "fsync_interval") | below(self, 4096, "segment_bytes")


@dataclass(frozen=True)
class SamplingConfig:
    default_temperature: float = 1.0
    min_train_temperature: float = 0.05
    override_sampling: bool = False
    train_temperature: float = 1.0

    def check(self) -> dict[str, str]:
        errors = {}
        if not 0 <= self.default_temperature <= 2:
            errors["default_temperature"] = "must be in [0, 2]"
        if not 0 < self.min_train_temperature <= 2:
            errors["min_train_temperature"] = "must be in (0, 2]"
        if not self.min_train_temperature <= self.train_temperature <= 2:
            errors["train_temperature"] = "must be in [min_train_temperature, 2]"
        return errors


@dataclass(frozen=True)
class SessionsConfig:
    default_turn_type: typing.Literal["main", "side"] = "main"
    session_idle_timeout: float = 900.0
    session_max_turns: int = 256
    max_sessions: int = 10_000
    max_bytes: int = 512 * 1024 * 1024   # live sessions' messages; the least recently used close first
    sweep_interval: float = 5.0

    def check(self) -> dict[str, str]:
        return (not_positive(self, "session_idle_timeout", "sweep_interval")
                | below(self, 1, "session_max_turns", "max_sessions", "max_bytes"))


@dataclass(frozen=True)
class RecordsConfig:
    retention_days: int = 30

    def check(self) -> dict[str, str]:
        return {"retention_days": "must be at least 1"} if self.retention_days < 1 else {}


@dataclass(frozen=True)
class StateConfig:
    dir: str = "state"
    # Learning pauses (reason "disk") before a journal, weights or checkpoint write would leave less than
    # this free on the state directory's filesystem; serving goes on. 0: only a failed write pauses it.
    min_free_bytes: int = 1024 * 1024 * 1024

    def check(self) -> dict[str, str]:
        return ({} if self.dir else {"dir": "must not be empty"}) | below(self, 0, "min_free_bytes")


@dataclass(frozen=True)
class AdminConfig:
    socket: str = ""
    group: str = ""
    start_paused: typing.Literal["last", True, False] = "last"

    def check(self) -> dict[str, str]:
        if self.group and not is_group_name(self.group):
            return {"group": "must be a group name"}
        return {}

    def socket_path(self, state_dir: Path) -> Path:
        """Explicit path; else the systemd runtime directory; else the state directory."""
        if self.socket:
            return Path(self.socket)
        runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
        return Path(runtime or state_dir) / "clawd.sock"


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # the daemon's lines and the trainer process's


@dataclass(frozen=True)
class LoggingConfig:
    level: typing.Literal["debug", "info", "warning", "error"] = "info"

    check = dict  # nothing to check beyond the type


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    monitors: MonitorsConfig = field(default_factory=MonitorsConfig)
    versions: VersionsConfig = field(default_factory=VersionsConfig)
    records: RecordsConfig = field(default_factory=RecordsConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    state: StateConfig = field(default_factory=StateConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    source: str = "<defaults>"

    @property
    def state_dir(self) -> Path:
        return Path(self.state.dir)

    @property
    def model_path(self) -> Path:
        return Path(self.model.path)

    @property
    def max_sample_tokens(self) -> int:
        """The longest sample trained: `[learner] max_sample_tokens`, else the trainer's micro-batch budget."""
        return self.learner.max_sample_tokens or self.train.micro_batch_tokens

    @property
    def reference_engine_needed(self) -> bool:
        """The frozen reference engine serves the judge and the teacher when they are set to it. Not in LoRA
        mode: there the reference is the policy engine's base model, asked without an adapter."""
        judge = self.judge.backend == "sglang" and self.judge.engine == "reference"
        teacher = self.scoring.mode != "rl" and self.judge.teacher_engine == "reference"
        kl = self.train.kl_loss_coef > 0  # the KL term's log-probs are scored there, not in the trainer
        return (judge or teacher or kl) and not self.train.lora


def load_config(path: str | Path) -> Config:
    """Read and check a TOML file; every problem names the file and the key."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc.reason} at byte {exc.start}") from None
    except OSError as exc:  # permissions (0640 and not in clawd's group), a directory, an I/O error
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return config_from_dict(raw, source=str(path))


def config_from_dict(raw: dict, source: str = "<dict>") -> Config:
    sections = {}
    hints = typing.get_type_hints(Config)
    for key, value in raw.items():
        if key == "source" or key not in hints:
            raise ConfigError(f"{source}: unknown section [{key}]")
        sections[key] = _build(hints[key], value, key, source)
    cfg = Config(**sections, source=source)
    if problem := devices.placement_problem(cfg):  # across sections: which role runs on which GPU
        key, text = problem
        raise ConfigError(f"{source}: {key}: {text}")
    dp = devices.flag_value(cfg.engine.sglang_args, "--dp-size", "--data-parallel-size", "--dp") or "1"
    if cfg.train.lora and dp.isdigit() and int(dp) > 1:
        raise ConfigError(f"{source}: engine.sglang_args: --dp-size above 1 with train.lora_rank > 0: SGLang loads "
                          "no adapter on data-parallel replicas; use [engine] replicas = N instead")
    if cfg.reference_engine_needed and cfg.engine.reference_url in cfg.engine.policy_urls:
        raise ConfigError(f"{source}: engine.reference_url: {cfg.engine.reference_url} is a policy replica's URL "
                          f"(replicas take url's port and the next ones)")
    if not cfg.auth.keys and not cfg.server.loopback and not cfg.auth.allow_open:
        raise ConfigError(f"{source}: auth.keys: none, and server.host {cfg.server.host} is not loopback: anyone "
                          "who reaches it could chat and train the model (set auth.allow_open = true to mean it)")
    return cfg


def _build(cls, value, where: str, source: str):
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {where}: must be a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, item in value.items():
        if key not in names:
            raise ConfigError(f"{source}: {where}.{key}: unknown key")
        kwargs[key] = _convert(hints[key], item, f"{where}.{key}", source)
    for key in credentials.SECRET_FIELDS & names:  # a secret may come from the environment or a file instead
        try:
            kwargs[key] = credentials.resolve(kwargs.get(key, ""), kwargs.get(f"{key}_env", ""),
                                          kwargs.get(f"{key}_file", ""))
        except credentials.SecretError as exc:
            raise ConfigError(f"{source}: {where}.{key}{exc.suffix}: {exc}") from None
    if cls is TrainConfig and kwargs.get("gpus") and "device" not in kwargs:
        kwargs["device"] = "cuda"
    obj = cls(**kwargs)
    for key, problem in obj.check().items():
        raise ConfigError(f"{source}: {where}.{key}: {problem}")
    return obj


def _convert(hint, value, where: str, source: str):
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{source}: {where}: must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if origin is tuple:
        item_hint = typing.get_args(hint)[0]
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {where}: must be a list")
        return tuple(_convert(item_hint, v, f"{where}[{i}]", source) for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where, source)
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    else:  # pragma: no cover - a field type this loader does not know is a programming error
        raise TypeError(f"unsupported config type {hint!r} at {where}")
    if not ok:
        shown = "" if where.rpartition(".")[2] in credentials.SECRET_FIELDS else f" {value!r}"  # never echo a secret
        raise ConfigError(f"{source}: {where}: must be {hint.__name__}, got {type(value).__name__}{shown}")
    return value
