"""The package layout cannot rot: the import graph, read with `ast`, follows the data path
(docs/ARCHITECTURE.md §1).

- The floor (top-level modules other than the entry points: config, the currencies passed between
  stages, the state-dir layout, the tokenizer, the records) imports no stage.
- The stages, in the order data flows: serving → scoring → learning → safety → trainer → engine, and
  privacy below them all (a policy any of them may ask). A stage
  imports only the floor and the stages downstream of it (the one it hands data to and the services
  it calls); it never imports one upstream.
- ops reads the stages and owns none; tools are programs beside the daemon; the entry points
  (cli, daemon, __main__) wire everything.
- No import cycle between modules or packages, no re-exports from `__init__.py`, modules small.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "clawd"
# upstream to downstream; privacy (PII, consent, file modes, retention) is the policy any stage may call
STAGES = ["serving", "scoring", "learning", "safety", "trainer", "engine", "privacy"]
ENTRY = {"clawd.cli", "clawd.daemon", "clawd.__main__"}
MAX_LINES, REASONED_MAX_LINES = 500, 600


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def resolve(name: str) -> str | None:
    """The clawd module an import names (a package's name resolves to its __init__)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(path: Path) -> set[str]:
    """Every clawd module `path` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (absolute imports only)"
            base = node.module or ""
            # `from clawd.x import y` names the module clawd.x.y when there is one, else a name in clawd.x.
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found |= {m for m in map(resolve, (n for n in names if n.split(".")[0] == "clawd")) if m}
    return found - {module_name(path)}


GRAPH = {name: imports_of(path) for name, path in MODULES.items()}


def layer(module: str) -> str:
    """'entry', 'floor', 'root' (the clawd package itself), or the first package under clawd."""
    if module in ENTRY:
        return "entry"
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    return parts[1] if len(parts) > 2 or (PACKAGE / parts[1]).is_dir() else "floor"


def allowed(src: str, dst: str) -> bool:
    a, b = layer(src), layer(dst)
    if a == "entry" or a == b or b == "root":
        return True
    if b == "entry":
        return False
    if a == "floor":
        return False  # b is a stage, ops or tools
    if a in STAGES:
        return b == "floor" or (b in STAGES and STAGES.index(b) > STAGES.index(a))
    if a == "ops":
        return b == "floor" or b in STAGES
    if a == "tools":
        return b in ("floor", "ops") or b in STAGES
    return False


def test_every_module_is_placed():
    layers = {layer(m) for m in MODULES}
    assert layers <= {"entry", "floor", "root", "ops", "tools", *STAGES}, layers
    assert set(STAGES) <= layers


def test_imports_follow_the_data_path():
    wrong = sorted(f"{src} imports {dst} ({layer(src)} -> {layer(dst)})"
                   for src, targets in GRAPH.items() for dst in targets if not allowed(src, dst))
    assert wrong == []


def test_no_import_cycles_between_modules():
    cycles, state = [], {}  # state: 1 on the DFS stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_no_import_cycles_between_packages():
    packages = {}
    for src, targets in GRAPH.items():
        packages.setdefault(layer(src), set()).update(layer(dst) for dst in targets if layer(dst) != layer(src))
    order = ["entry", "tools", "ops", *STAGES, "floor", "root"]
    for a, targets in packages.items():
        for b in targets:
            assert order.index(a) < order.index(b), f"{a} imports {b}"


def test_the_rules_catch_what_they_forbid():
    # A negative control for the checker itself: upstream imports, the floor reaching up, ops owning.
    assert not allowed("clawd.engine.client", "clawd.serving.completion")
    assert not allowed("clawd.trainer.step", "clawd.learning.store")
    assert not allowed("clawd.learning.learner", "clawd.scoring.scorer")
    assert not allowed("clawd.config", "clawd.serving.api")
    assert not allowed("clawd.serving.api", "clawd.ops.metrics")
    assert not allowed("clawd.ops.status", "clawd.daemon")
    assert allowed("clawd.scoring.scorer", "clawd.learning.store") and allowed("clawd.daemon", "clawd.ops.status")
    assert resolve("clawd.serving.api.make_app") == "clawd.serving.api"


def test_package_init_files_are_empty():
    """No re-exports: a name is imported from the module that defines it (a docstring may say what the
    package holds)."""
    def statements(path: Path) -> list[ast.stmt]:
        body = ast.parse(path.read_text()).body
        docstring = body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        return body[1:] if docstring else body

    assert [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("__init__.py") if statements(p)] == []


def test_modules_stay_small():
    """Over 500 lines a module says in its first lines why it must be one file; none passes 600."""
    too_long = []
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        head = "\n".join(lines[:12]).lower()
        if len(lines) > REASONED_MAX_LINES or (len(lines) > MAX_LINES and "one file" not in head):
            too_long.append(f"{name}: {len(lines)} lines")
    assert too_long == []


def test_no_one_letter_module_aliases():
    """`import x as X` hides what a name is; modules are imported under their own names."""
    found = []
    for path in [*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "bench").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {alias.name} as {alias.asname}"
                          for alias in node.names if alias.asname and len(alias.asname) == 1]
    assert found == []
