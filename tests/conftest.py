import pytest

from clawd.models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny Qwen2 test model (DESIGN §10), built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2")
