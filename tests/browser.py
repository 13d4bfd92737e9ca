"""Headless Debian chromium for page tests: the DOM after the page's scripts ran, a screenshot, and
the little HTML and PNG reading their assertions need (stdlib; Pillow for colours when present).

`--virtual-time-budget` runs the page's clock forward until the budget is spent, waiting while
fetches are pending, so the DOM dumped is the one drawn from the page's first data fetch.
Without /usr/bin/chromium the tests skip, except under CI=true, where they fail: CI must run them
(`make test` installs chromium when it runs as root).
"""
from __future__ import annotations

import asyncio
import os
import signal
import struct
import tempfile
import zlib
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
         "--disable-extensions", "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


def require_chromium() -> Path:
    if CHROMIUM.exists():
        return CHROMIUM
    message = (f"{CHROMIUM} is missing: apt-get install -y --no-install-recommends chromium "
               "(make test does it as root)")
    if os.environ.get("CI") == "true":
        pytest.fail(message + "; CI runs the browser tests")
    pytest.skip(reason=message)


async def chromium(url: str, *args: str, timeout: float = 30.0) -> str:
    """Runs chromium on `url` with `args`, in a fresh profile; its stdout."""
    with tempfile.TemporaryDirectory(prefix="clawd-chromium-", ignore_cleanup_errors=True) as profile:
        proc = await asyncio.create_subprocess_exec(
            str(require_chromium()), *FLAGS, f"--user-data-dir={profile}", *args, url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            async with asyncio.timeout(timeout):
                out, err = await proc.communicate()
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the renderer and GPU children too
            await proc.wait()
            raise AssertionError(f"chromium did not finish {url} within {timeout:g}s") from None
    if proc.returncode != 0:
        raise AssertionError(f"chromium exited {proc.returncode}: {err.decode(errors='replace')[-2000:]}")
    return out.decode()


async def render(url: str, screenshot: Path | None = None, size: tuple[int, int] = (1280, 1600),
                 budget_ms: int = 2000) -> str:
    """The DOM once the page's clock ran `budget_ms` (virtual); with `screenshot`, also a PNG of the
    window at `size`, from the same run (one chromium start: they take seconds each)."""
    shot = (f"--window-size={size[0]},{size[1]}", f"--screenshot={screenshot}") if screenshot else ()
    return await chromium(url, f"--virtual-time-budget={budget_ms}", "--dump-dom", *shot)


# ---- the dumped DOM as a tree ------------------------------------------------------------------

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list = field(default_factory=list)  # Elements and strings

    @property
    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text for c in self.children)

    def all(self, tag: str | None = None, **attrs: str) -> list[Element]:
        """Descendants with this tag (any when None) whose attributes have these values (data_x: data-x, class_: class)."""
        want = {k.rstrip("_").replace("_", "-"): v for k, v in attrs.items()}
        found = []
        for child in self.children:
            if isinstance(child, Element):
                if (tag is None or child.tag == tag) and all(child.attrs.get(k) == v for k, v in want.items()):
                    found.append(child)
                found.extend(child.all(tag, **attrs))
        return found

    def one(self, tag: str | None = None, **attrs: str) -> Element:
        found = self.all(tag, **attrs)
        assert len(found) == 1, f"{len(found)} <{tag} {attrs}> elements"
        return found[0]


class _Builder(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag, attrs):
        node = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs):
        self.stack[-1].children.append(Element(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, 0, -1):  # tolerant: closes up to the matching open tag
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def parse_dom(html: str) -> Element:
    builder = _Builder()
    builder.feed(html)
    builder.close()
    return builder.root


# ---- a PNG, looked at -----------------------------------------------------------------------------

def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR; AssertionError when `data` is no PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13, "a PNG starts with its IHDR"
    return struct.unpack(">II", data[16:24])


def png_colours(path: Path) -> int | None:
    """Distinct colours of the image (Pillow, when installed; None without it)."""
    try:
        from PIL import Image
    except ImportError:
        return None
    with Image.open(path) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    return len(colours) if colours is not None else 1 << 20


def png_idat_bytes(data: bytes) -> int:
    """The decompressed size of a PNG's pixel data: checks the zlib stream is whole."""
    pos, idat = 8, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    return len(zlib.decompress(idat))
