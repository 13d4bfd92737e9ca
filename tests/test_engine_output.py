"""An engine's output reaches clawd's log with its secrets taken out, read by the daemon's loop with no
thread, and a loop that stalls does not block the engine (clawd.engine.output). SGLang 0.5.23 logs
`server_args=...` with api_key and admin_api_key in clear as it starts; the child processes here print the same."""
from __future__ import annotations

import asyncio
import io
import subprocess
import sys
import time

import pytest

from clawd import credentials
from clawd.config.loading import config_from_dict
from clawd.credentials import REDACTED
from clawd.engine.output import EngineOutput

KEY, ADMIN = "sk-engine-0123456789abcdef", "adm-0123456789abcdef"


@pytest.fixture(autouse=True, scope="module")
def engine_keys():
    """The keys as clawd knows them once its configuration is loaded (`credentials.remember`)."""
    credentials.remember(config_from_dict({"engine": {"api_key": KEY, "admin_api_key": ADMIN}}))


def spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


async def test_both_streams_reach_the_sink_without_the_keys():
    child = spawn("import sys\n"
                  f"print(\"server_args=ServerArgs(api_key='{KEY}', admin_api_key='{ADMIN}', port=30000)\")\n"
                  f"sys.stderr.write('[2026] INFO admin key {ADMIN} loaded\\n')\n"
                  "sys.stdout.write('no newline at the end')")
    sink = io.StringIO()
    out = EngineOutput(sink=sink).start(child.stdout)
    await asyncio.wait_for(out.done.wait(), 30)
    assert child.wait(30) == 0
    text = sink.getvalue()
    assert KEY not in text and ADMIN not in text and KEY[:12] not in text
    assert f"api_key='{REDACTED}', admin_api_key='{REDACTED}', port=30000" in text
    assert f"admin key {REDACTED} loaded" in text and text.endswith("no newline at the end\n")
    assert out.dropped == 0  # and no thread: the daemon tests hold it to one (test_e2e, test_metrics)


async def test_a_stalled_loop_does_not_block_the_engine():
    """The loop blocked for up to 10 s: the child still writes 300 KB (far over a default 64 KiB pipe) and
    exits, and every line arrives once the loop runs again."""
    child = spawn("import sys\nfor i in range(1500): sys.stdout.write(f'line {i} ' + 'x' * 200 + '\\n')")
    sink = io.StringIO()
    out = EngineOutput(sink=sink).start(child.stdout)
    started = time.monotonic()
    while child.poll() is None and time.monotonic() - started < 10:
        time.sleep(0.05)  # the loop stalls: nothing reads the pipe meanwhile
    assert child.poll() == 0, "the engine waited on its pipe"
    await asyncio.wait_for(out.done.wait(), 30)
    assert sink.getvalue().count("\n") == 1500 and out.dropped == 0
