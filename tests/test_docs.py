"""The docs cannot drift from the tree: every repository path a Markdown file cites exists, every relative link
resolves, and docs/ARCHITECTURE.md §1's package table names exactly the packages the layout test knows."""
from __future__ import annotations

import re

from .test_layout import PACKAGE, ROOT, STAGES

DOCS = sorted(p for p in ROOT.rglob("*.md") if not any(part.startswith(".") or part in ("state", "node_modules")
                                                        for part in p.relative_to(ROOT).parts))
# Where a cited path may start: what the repository holds (state/ is made at run time, not cited as a file).
TOP = ("clawd/", "tests/", "bench/", "docs/", "etc/", "systemd/", "bin/", "constraints/", ".ci/")
CITED = re.compile(r"`((?:" + "|".join(re.escape(t) for t in TOP) + r")[\w./-]*[\w/])`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _exists(path: str) -> bool:
    if path.startswith("bench/results/"):
        return True  # what the benches write when they run
    # a module may be cited without .py (clawd/serving/api), a directory with a trailing /
    target = ROOT / path
    return target.exists() or target.with_suffix(".py").exists()


def test_every_cited_repository_path_exists():
    missing = [f"{doc.relative_to(ROOT)}: {path}" for doc in DOCS
               for path in CITED.findall(doc.read_text(encoding="utf-8")) if not _exists(path)]
    assert missing == []


def test_every_relative_link_resolves():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_package_table_of_section_1_is_the_layout():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text[text.index("## §1 Shape"):text.index("## §2 ")]
    named = set(re.findall(r"^\| `clawd/(\w+)/`", section, re.M))
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert named == packages
    assert set(STAGES) <= named


def test_the_checks_catch_what_they_forbid():
    assert CITED.findall("see `clawd/nowhere.py` and `clawd/serving/api.py`") == ["clawd/nowhere.py",
                                                                                   "clawd/serving/api.py"]
    assert not _exists("clawd/nowhere.py") and _exists("clawd/serving/api.py") and _exists("clawd/serving/api")
    assert LINK.findall("[a](docs/OPERATING.md#metrics) [b](https://x.org)") == ["docs/OPERATING.md", "https://x.org"]
