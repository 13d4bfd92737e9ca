"""The [engine] section: the policy engines (the CPU engine or SGLang), their replicas, timeouts and weight sync."""
from __future__ import annotations

import typing
from dataclasses import dataclass
from urllib.parse import urlsplit

from clawd import devices
from clawd.checks import below, ip_url_problem, not_positive


@dataclass(frozen=True)
class EngineConfig:
    # "local": clawd's CPU engine; "sglang": clawd starts SGLang; "none": the engine at url
    launch: typing.Literal["local", "sglang", "none"] = "local"
    url: str = "http://127.0.0.1:30000"  # the policy engine's address (an IP literal) with launch "sglang" or "none"
    # The frozen reference engine (the initial weights): launched on this URL's port, or used as is
    reference_url: str = "http://127.0.0.1:30001"
    api_key: str = ""                    # bearer key for the engines; "" = none
    api_key_env: str = ""                # or the environment variable holding it
    api_key_file: str = ""               # or a file holding it (see [auth])
    admin_api_key: str = ""              # SGLang's --admin-api-key for its control endpoints; "" = api_key
    admin_api_key_env: str = ""          # or the environment variable holding it
    admin_api_key_file: str = ""         # or a file holding it
    gpus: str = ""                       # launch "sglang": the policy engine's CUDA_VISIBLE_DEVICES, e.g. "0,1"
    reference_gpus: str = ""             # launch "sglang": the reference engine's CUDA_VISIBLE_DEVICES
    sglang_args: tuple[str, ...] = ()    # extra arguments to the policy engine's SGLang (never a flag clawd sets)
    reference_sglang_args: tuple[str, ...] = ()  # extra arguments to the reference engine's SGLang
    request_timeout: float = 600.0       # seconds a generation may take
    connect_timeout: float = 5.0         # seconds to open a connection to an engine
    startup_timeout: float = 0.0         # seconds a starting engine has to answer; 0 = 1800 for SGLang, 300 otherwise
    restart_backoff_initial: float = 1.0  # seconds before restarting a dead engine; doubles up to restart_backoff_max
    restart_backoff_max: float = 30.0    # the restart backoff's cap (seconds), at least restart_backoff_initial
    health_interval: float = 5.0         # seconds between liveness checks (/model_info) of every engine
    health_failures: int = 3             # failed polls in a row that make a hung engine restart
    first_byte_timeout: float = 120.0    # seconds an engine call may wait for its first byte (queueing, prefill)
    idle_timeout: float = 60.0           # seconds a stream may go without a byte once it started
    incremental_streaming_output: bool = False  # launch "none": the engine streams deltas, not cumulative chunks
    cpu_threads: int = 0                 # CPU engine: torch threads; 0 = torch's default
    max_batch_size: int = 8              # CPU engine: requests it runs at once (at least 1)
    seed: int = 0                        # CPU engine: the sampling seed
    replicas: int = 1                    # policy engines clawd launches (local or sglang), each on its port and GPUs
    urls: tuple[str, ...] = ()           # launch = "none": the policy replicas' URLs (empty: url alone)
    weight_sync: typing.Literal["auto", "distributed", "disk"] = "auto"  # auto: distributed for SGLang clawd launches
    weight_sync_address: str = "127.0.0.1"  # where the engines reach trainer rank 0's rendezvous
    weight_sync_bucket_mb: int = 512     # the most one broadcast carries
    # Engine-side priority: auto = on while [rollouts] run. On: clawd starts its engines with
    # --enable-priority-scheduling and every policy call names a priority (LIVE_PRIORITY, ROLLOUT_PRIORITY), so
    # rollout rows yield to live ones; launch "none" needs the flag on that engine (without it they are ignored).
    priority_scheduling: typing.Literal["auto", "on", "off"] = "auto"

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
            if problem := ip_url_problem(getattr(self, name)):
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
        if problem := ip_url_problem(url):
            errors[f"urls[{i}]"] = problem
    if len(set(eng.urls)) != len(eng.urls):
        errors["urls"] = "names a URL twice"
    if eng.replicas > 1 and eng.gpus and len(devices.device_set(eng.gpus)) % eng.replicas:
        errors["replicas"] = f"must divide the {len(devices.device_set(eng.gpus))} GPUs of gpus (a slice each)"
    return errors

# Seconds a starting engine may take to answer, per launch kind, when startup_timeout is 0.
# The priorities clawd's policy calls carry when scheduling by priority (SGLang's default order: larger first). Live
# chat, its side turns and scoring run at LIVE; active rollouts at ROLLOUT, far more than SGLang's default preemption
# threshold (10) below it, so a live request preempts a rollout's row and never waits behind one.
LIVE_PRIORITY = 0
ROLLOUT_PRIORITY = -100

STARTUP_TIMEOUTS = {"local": 300.0, "sglang": 1800.0, "none": 300.0}
