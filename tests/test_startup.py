"""clawd.startup: the collector off while a process loads, then on with what it loaded frozen; and off for a
one-off job, then back as it was. In a fresh interpreter each: the calls change the process's collector."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_loading_holds_the_collector_off_and_loaded_turns_it_on_with_everything_frozen():
    out = run("import gc\n"
              "from clawd import startup\n"
              "startup.loading()\n"
              "off = gc.isenabled()\n"
              "cycles = []\n"
              "for _ in range(10000):\n"
              "    a = []; a.append(a); cycles.append(a)\n"
              "counts = gc.get_count()[0]\n"
              "startup.loaded()\n"
              "print(off, counts >= 10000, gc.isenabled(), gc.get_freeze_count() >= 10000, gc.get_count()[0] < 10)")
    # off while loading (no collection: the young generation kept every allocation), then on, all frozen
    assert out == ["False", "True", "True", "True", "True"]


def test_collector_off_restores_the_state_it_found():
    out = run("import gc\n"
              "from clawd import startup\n"
              "with startup.collector_off():\n"
              "    inside = gc.isenabled()\n"
              "after = gc.isenabled()\n"
              "gc.disable()\n"
              "with startup.collector_off():\n"
              "    pass\n"
              "print(inside, after, gc.isenabled(), gc.get_freeze_count())")
    assert out == ["False", "True", "False", "0"]
