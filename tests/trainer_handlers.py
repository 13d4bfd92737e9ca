"""A scripted trainer handler for tests/test_trainer_link.py and tests/test_learner.py.

`build` is the factory they give the link (`TrainerLink(options, factory=build)`): it travels
to the spawned child pickled by reference and runs there. `build(options)` makes a handler
scripted per train call: `options["script"]` maps the call number (counted across restarts in
`dir/calls.jsonl`) to "exit" (os._exit(3)), "hang", "raise", "retryable", "oom" or "oom_fatal" (the
trainer's OutOfMemory, after which the child carries on or exits). Its step and
version come back from `dir/checkpoint.json`, as a real trainer resumes from its checkpoint.
It logs one info and one debug line as it is built, for the child's logging set-up.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from clawd.samples import Sample
from clawd.trainer.catalogue import Trained
from clawd.trainer.child import RetryableError


def calls(directory) -> list[dict]:
    path = Path(directory) / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def make_sample(i: int, response_length: int = 4) -> Sample:
    n = response_length
    return Sample(sample_id=f"s{i}", mode="rl", session_id="sess", turn_index=i, principal="alice",
                  tokens=list(range(100, 103 + n)), response_length=n, loss_mask=[1] * n,
                  rollout_logprobs=[-0.123456789012345] * n, temperature=1.0, reward=1.0,
                  teacher_logprobs=None, has_hint=False, policy_version=0, created=1.5, scored=2.5)


class Scripted:
    def __init__(self, options: dict):
        self.dir = Path(options["dir"])
        self.script = options.get("script", {})
        self.echo = options.get("echo", False)
        ckpt = self.dir / "checkpoint.json"
        state = json.loads(ckpt.read_text()) if ckpt.exists() else {"step": 0, "version": 0}
        self.step, self.version = state["step"], state["version"]
        self.weights_version = self.version  # every train call "publishes"
        self.writing = None  # a deferred train's version until `written` (script "written": "exit" dies there once)
        if names := options.get("report_env"):  # what the child's environment held as its handler was built
            (self.dir / "env.json").write_text(json.dumps({k: os.environ.get(k) for k in names}))

    def train(self, batch_id: str, version: int, samples: list[Sample], deferred: bool = False) -> Trained:
        call = len(calls(self.dir)) + 1
        with open(self.dir / "calls.jsonl", "a") as f:
            f.write(json.dumps({"call": call, "batch_id": batch_id, "pid": os.getpid(), "n": len(samples),
                                "version": version, "deferred": deferred, "ids": [x.sample_id for x in samples],
                                "rewards": [x.reward for x in samples], "hints": [x.has_hint for x in samples],
                                "t": time.time()}) + "\n")
        action = self.script.get(str(call))
        if action == "exit":
            os._exit(3)
        if action == "hang":
            time.sleep(3600)
        if action == "slow":  # a step long enough for something to happen meanwhile
            time.sleep(1.5)
        if action == "raise":
            raise ValueError("scripted failure")
        if action in ("oom", "oom_fatal"):  # the trainer's own exception (torch imported only here)
            from clawd.trainer.worker.failures import OutOfMemory
            raise OutOfMemory(f"scripted out of memory on {len(samples)} sample(s)", fatal=action == "oom_fatal")
        if action == "retryable":
            raise RetryableError("scripted transient failure")
        self.step += 1
        self.version = self.weights_version = version
        self.writing = version if deferred else None
        return Trained(batch_id, version, str(self.dir / f"v{version}"),
                       {"step": self.step, "pid": os.getpid(), "call": call, "n": len(samples)},
                       [json.loads(s.to_json()) for s in samples] if self.echo else [])

    def publish(self, version: int) -> str:
        self.version = self.weights_version = version
        self.checkpoint()
        return str(self.dir / f"v{version}")

    def written(self, version: int) -> str:
        """The deferred directory, made to look published; dies first, once, with script {"written": "exit"}."""
        if self.script.get("written") == "exit" and not (self.dir / "died_writing").exists():
            (self.dir / "died_writing").touch()
            os._exit(3)
        path = self.dir / f"v{version}"
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text("{}")
        self.writing = None
        return str(path)

    def restore(self, version: int) -> int:
        """A rollback: the step that made `version` (its calls.jsonl line) becomes the current one."""
        self.step = next((c["call"] for c in calls(self.dir) if c.get("version") == version), 0)
        self.version = self.weights_version = version
        return self.step

    def checkpoint(self) -> tuple[str, int]:
        path = self.dir / "checkpoint.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": self.step, "version": self.version}))
        os.replace(tmp, path)
        return str(path), self.step


log = logging.getLogger("tests.trainer_handlers")


def build(options: dict) -> Scripted:
    log.info("scripted handler built in %d", os.getpid())
    log.debug("scripted handler options %s", options)
    if options.get("fail_build"):
        raise RuntimeError("no model here")
    return Scripted(options)
