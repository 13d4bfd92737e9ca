"""An engine's output reaches clawd's log with its secrets taken out, and a log that falls behind never
blocks the engine (clawd.engine.output). SGLang 0.5.23 logs `server_args=...` with api_key and
admin_api_key in clear as it starts; the child processes here print the same."""
from __future__ import annotations

import io
import re
import subprocess
import sys
import threading
import time

import pytest

from clawd import credentials
from clawd.config import config_from_dict
from clawd.credentials import REDACTED
from clawd.engine.output import EngineOutput

KEY, ADMIN = "sk-engine-0123456789abcdef", "adm-0123456789abcdef"


@pytest.fixture(autouse=True, scope="module")
def engine_keys():
    """The keys as clawd knows them once its configuration is loaded (`credentials.remember`)."""
    credentials.remember(config_from_dict({"engine": {"api_key": KEY, "admin_api_key": ADMIN}}))


def spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_both_streams_reach_the_sink_without_the_keys():
    child = spawn("import sys\n"
                  f"print(\"server_args=ServerArgs(api_key='{KEY}', admin_api_key='{ADMIN}', port=30000)\")\n"
                  f"sys.stderr.write('[2026] INFO admin key {ADMIN} loaded\\n')\n"
                  "sys.stdout.write('no newline at the end')")
    sink = io.StringIO()
    out = EngineOutput(sink=sink).start(child.stdout)
    assert child.wait(30) == 0
    out.join()
    text = sink.getvalue()
    assert KEY not in text and ADMIN not in text and KEY[:12] not in text
    assert f"api_key='{REDACTED}', admin_api_key='{REDACTED}', port=30000" in text
    assert f"admin key {REDACTED} loaded" in text and text.endswith("no newline at the end\n")
    assert out.dropped == 0


class Stuck(io.StringIO):
    """A sink that blocks every write until released (a full journald)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def write(self, s: str) -> int:
        self.release.wait()
        return super().write(s)


def test_a_sink_that_blocks_never_blocks_the_engine_lines_are_dropped_and_counted():
    child = spawn("import sys\nfor i in range(20000): sys.stdout.write(f'line {i} ' + 'x' * 200 + '\\n')")
    sink = Stuck()
    out = EngineOutput(sink=sink, max_lines=100).start(child.stdout)
    started = time.monotonic()
    assert child.wait(30) == 0  # 4 MB through the pipe: far more than it holds, with nothing written out
    print(f"\nthe child wrote 20,000 lines and exited in {time.monotonic() - started:.2f}s; dropped {out.dropped}")
    assert out.dropped >= 20000 - 101
    sink.release.set()
    out.join()
    text = sink.getvalue()
    notices = re.findall(r"\[clawd: (\d+) line\(s\) of the engine's output dropped", text)
    assert notices and sum(map(int, notices)) == out.dropped  # the log says how many it lost
    assert text.count("\n") == 20000 - out.dropped + len(notices)
