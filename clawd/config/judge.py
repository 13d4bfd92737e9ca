"""The [judge] section: the model that scores a turn from the user's next message, and the teacher's engine."""
from __future__ import annotations

import typing
from dataclasses import dataclass

from clawd import devices
from clawd.checks import ip_url_problem


@dataclass(frozen=True)
class JudgeConfig:
    # "sglang": an engine below; "openai": the chat API at url; "rules": phrase lists, no model
    backend: typing.Literal["sglang", "openai", "rules"] = "sglang"
    engine: typing.Literal["reference", "policy"] = "reference"  # the engine the sglang judge runs on
    teacher_engine: typing.Literal["reference", "policy"] = "reference"  # the engine scoring the teacher's log-probs
    hint_placement: typing.Literal["system", "user"] = "system"  # where the teacher reads the hint
    url: str = ""                        # backend "openai": the base URL, ending in /v1 (a host name may be used)
    api_key: str = ""                    # backend "openai": its bearer key
    api_key_env: str = ""                # or the environment variable holding it
    api_key_file: str = ""               # or a file holding it (see [auth])
    model: str = ""                      # backend "openai": the model name
    ca_file: str = ""                    # PEM file of the CA that signed the judge's certificate; "" = the system's
    nameserver: str = ""                 # the DNS server asked for url's host; "" = the system's
    temperature: float = 0.6             # the judge's sampling temperature, in [0, 2]
    max_new_tokens: int = 512            # tokens a judge answer may take (it reasons before its verdict)
    timeout: float = 120.0               # seconds per attempt of a judge or teacher call
    retries: int = 2                     # retries of a failed call, with exponential backoff
    backoff_initial: float = 0.5         # seconds before the first retry; doubles up to backoff_max
    backoff_max: float = 8.0             # the retry backoff's cap (seconds)
    concurrency: int = 8                 # judge and teacher calls in flight at once
    record_text_chars: int = 2000        # characters of each raw judge answer kept in the judge records

    def check(self) -> dict[str, str]:
        errors = {}
        if self.backend == "openai":
            if problem := ip_url_problem(self.url, names=True):
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
