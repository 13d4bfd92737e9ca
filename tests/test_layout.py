"""The package layout cannot rot: the import graph, read with `ast`, follows the data path
(docs/ARCHITECTURE.md §1).

- The floor (top-level modules other than the entry points: config, the currencies passed between
  stages, the state-dir layout, the tokenizer, the records) imports no stage.
- The stages, in the order data flows: rollouts (prompt sets and environments: a synthetic user that reads
  replies with serving's parsers) → serving → scoring → learning → safety → trainer → engine, and
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
STAGES = ["rollouts", "serving", "scoring", "learning", "safety", "trainer", "engine", "privacy"]
ENTRY = {"clawd.cli", "clawd.daemon", "clawd.__main__"}
FLOOR_PACKAGES = {"config"}  # a package of the floor: the configuration, one module per section of the file
MAX_LINES = 500


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
    if parts[1] in FLOOR_PACKAGES:
        return "floor"
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
    assert not allowed("clawd.trainer.worker.step", "clawd.learning.store")
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
    """No module over MAX_LINES: one that grows past it is split by what its parts own (there is no
    escape clause; the last module that needed one, the configuration, is a package now)."""
    too_long = [f"{name}: {n} lines" for name, path in MODULES.items()
                if (n := len(path.read_text().splitlines())) > MAX_LINES]
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


# Top-level names that two modules may both define, each with why it is not one thing defined twice.
SAME_NAME_ALLOWED = {
    "log": "each module's own logger", "main": "each program's entry point",
    "add_flags": "the CPU engine's flag groups (LoRA serving, priority scheduling), each beside what reads them",
    "run": "daemon.run and the simulations' runs: different programs", "parse_args": "each program's arguments",
    "ACTIONS": "fault actions vs the monitors' verdicts", "CHAT": "an aiohttp app key vs a persona's style",
    "FACTS": "the question bank vs a persona's facts (tools/sim)", "KINDS": "question kinds vs persona kinds",
    "STYLES": "the styles users ask for vs the ones evaluation grades (tools/sim)",
    "FORMAT_VERSION": "the sample's JSON format vs the journal frame's", "MARGIN": "disk headroom vs memory plan",
    "Progress": "the CPU engine's progress counter vs a model build's progress callback",
    "ROLES": "roles a gate prompt may have vs roles the chat API accepts",
    "Scan": "a PII scanner's output vs the journal's frame scan",
    "_RETRY_INITIAL": "the learner's backoff vs the adapter unloader's", "_RETRY_MAX": "the same two backoffs",
    "_SENTENCE_END": "two regexes for two jobs (phone context, persona text)", "_TOKEN": "two regexes for two jobs",
    "_TYPES": "DNS record types vs OpenAI error types", "_body": "two servers' request bodies",
    "_counts": "a status line vs a forget report", "_mean": "a share at RATIO_DIGITS vs a mean at MEAN_DIGITS",
    "_resolve": "overlapping PII findings vs a monitor's rule", "_share": "a GPU memory fraction vs a ratio",
    "_versions": "version lists printed by two programs", "apply": "layer recompute vs a learning control",
    "by_version": "two groupings of replies", "canonical": "a session's messages vs a sample's limits",
    "compare": "paired statistics vs a grading comparison", "decide": "the gate's verdict vs a judge's",
    "describe": "a pause, a memory plan, a paired interval", "entropy": "a distribution's vs a string's",
    "grad_norm": "one process's vs a trainer world's", "join": "a trainer world vs a weight-update group",
    "load": "the trainer's model vs the gate's prompt set", "models": "two servers' /v1/models routes",
    "normalise": "Unicode look-alikes folded vs answers tokenised for grading", "pack": "samples vs weights",
    "redact": "secrets in config text vs PII spans", "split": "questions into sets vs batches by tokens",
    "verdict": "a paired interval's vs the gate set's",
}


def test_top_level_names_are_defined_once_or_say_why():
    """A helper copied into a second module drifts from the first (three `_die_with_parent`s did)."""
    where: dict[str, list[str]] = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text(), str(path)).body:
            targets = ([node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else
                       [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else [])
            for target in targets:
                if not target.startswith("__"):
                    where.setdefault(target, []).append(name)
    twice = {n: sorted(set(m)) for n, m in where.items() if len(set(m)) > 1}
    assert sorted(set(twice) - set(SAME_NAME_ALLOWED)) == [], {n: twice[n] for n in set(twice) - set(SAME_NAME_ALLOWED)}
    assert sorted(set(SAME_NAME_ALLOWED) - set(twice)) == []  # no stale exception


def module_level_imports(path: Path) -> set[str]:
    """The clawd modules `path` imports when it is imported (statements run at import, not inside functions)."""
    found, todo = set(), list(ast.parse(path.read_text(), str(path)).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.If, ast.Try)):  # run at import too
            todo += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *(h for handler in getattr(node, "handlers", []) for h in handler.body)]
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
    return found


def test_the_daemon_process_imports_no_module_that_starts_threads():
    # The daemon is one process, one event loop, no threads: no module it imports uses `threading` (asyncio
    # imports it; that is not a module of ours starting one). Threads live in the processes it starts: the CPU
    # engine's compute thread, the trainer's deferred directory write.
    seen, todo = set(), ["clawd.daemon", "clawd.cli"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [m for m in map(resolve, (n for n in module_level_imports(MODULES[name]) if n.startswith("clawd")))
                 if m and m not in seen]
    threaded = sorted(m for m in seen if {"threading", "concurrent.futures"} & module_level_imports(MODULES[m]))
    assert threaded == [], threaded
    # The trainer process's own code (torch, its writer thread) is a package the daemon never reaches.
    assert sorted(m for m in seen if m.startswith("clawd.trainer.worker")) == []
    outside = {m for m, path in MODULES.items() if "threading" in module_level_imports(path)}
    # the rule can see them:
    assert outside == {"clawd.engine.local.compute", "clawd.trainer.worker.publishing"}, outside
