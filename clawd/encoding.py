"""Long prompts encoded in a worker process, so that no prompt holds the daemon's one thread.

The tokenizer encodes ~0.7-1.8 µs a character (SmolLM2, 2 cores): a 600,000-character prompt, which
SmolLM2's context admits (80 spaces fit one token), held the event loop for ~1 s, and every request and
health poll waited. `ChatTokenizer.encode_steps` hands each uncached piece longer than `INLINE_CHARS`
to its caller; `encode_prompt` sends it here, to a worker that loads the same tokenizer.json with the same
library, so the ids are the ones the daemon would compute (tests/test_encoder.py checks them equal). The
judge's and the teacher's prompts, which quote the turn, go the same way (`encode_quoted`).
Shorter pieces are encoded in the daemon, yielding the loop every `INLINE_CHARS` characters.

The worker is started on first use (~0.5 s: most prompts never need it) with multiprocessing's `spawn`
(fork+exec, no helper thread) and talks over a socket pair in multiprocessing's own framing (a 4-byte
big-endian length, then the bytes): UTF-8 text one way, the ids as 32-bit unsigned integers back. One
piece at a time (a lock): the worker has one thread too. A worker that dies, or takes longer than
`timeout`, is killed; that piece is encoded in the daemon after all (counted in `fallbacks`: the loop
stalls once, the request is served) and the next long piece starts a new worker.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import socket
import struct
from array import array
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Generator

from clawd.lifetime import die_with_spawner
from clawd.tokenizer import FULL, PLAIN, ChatTokenizer, plain_tokenizer

log = logging.getLogger("clawd.encoder")

INLINE_CHARS = 8192  # encoded in the daemon between two yields: ~5-15 ms
_KINDS = {FULL: b"F", PLAIN: b"P"}  # a request's first byte: the tokenizer to encode it with


@dataclass
class EncoderStats:
    pieces: int = 0      # pieces the worker encoded
    chars: int = 0       # their characters
    fallbacks: int = 0   # pieces encoded in the daemon after the worker failed
    starts: int = 0      # workers started


class Encoder:
    def __init__(self, model_dir: str | Path, timeout: float = 60.0):
        self.tokenizer_path = str(Path(model_dir) / "tokenizer.json")
        self.timeout = timeout
        self.stats = EncoderStats()
        self._lock = asyncio.Lock()
        self._process = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def encode(self, kind: str, piece: str) -> list[int] | None:
        """The piece's ids by the tokenizer `kind` names (clawd.tokenizer FULL or PLAIN) from the worker; None
        when the worker failed (the caller encodes it itself)."""
        async with self._lock:
            try:
                if self._writer is None:
                    await self._start()
                data = _KINDS[kind] + piece.encode("utf-8", errors="surrogatepass")
                self._writer.write(struct.pack("!i", len(data)) + data)
                ids = await asyncio.wait_for(self._reply(), self.timeout)
            except (OSError, EOFError, asyncio.IncompleteReadError, TimeoutError) as exc:
                log.error("the encoder worker failed (%s: %s); encoding a %d-character piece here", type(exc).__name__,
                          exc, len(piece))
                self.stats.fallbacks += 1
                self._kill()
                return None
            self.stats.pieces += 1
            self.stats.chars += len(piece)
            return ids

    async def _reply(self) -> list[int]:
        await self._writer.drain()
        (n,) = struct.unpack("!i", await self._reader.readexactly(4))
        if n < 0:
            raise EOFError(f"bad frame length {n}")
        ids = array("I")
        ids.frombytes(await self._reader.readexactly(n))
        return ids.tolist()

    async def _start(self) -> None:
        ours, theirs = socket.socketpair()
        child = Connection(theirs.detach())
        process = multiprocessing.get_context("spawn").Process(
            target=main, args=(child, self.tokenizer_path), name="clawd-encoder", daemon=True)
        try:
            process.start()
        finally:
            child.close()  # only the worker holds its end: its death ends our stream
        self._process = process
        self.stats.starts += 1
        self._reader, self._writer = await asyncio.open_unix_connection(sock=ours, limit=1 << 20)
        log.info("encoder worker %d started for prompts over %d characters", process.pid, INLINE_CHARS)

    def _kill(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
        if self._process is not None and self._process.exitcode is None:
            os.kill(self._process.pid, signal.SIGKILL)
        if self._process is not None:
            self._process.join(timeout=5)  # reaped: it was killed, this is immediate
        self._process = None

    async def close(self) -> None:
        async with self._lock:
            self._kill()


async def encode_prompt(tok: ChatTokenizer, text: str, encoder: Encoder | None
                        ) -> tuple[list[int], dict[str, array]]:
    """`tok.encode_held(text)` with long pieces sent to `encoder` and the loop yielded between the rest."""
    return await drive(tok, tok.encode_steps(text, INLINE_CHARS), encoder)


async def encode_quoted(tok: ChatTokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        quotes: dict[str, str], encoder: Encoder | None) -> list[int]:
    """`tok.encode_chat_quoted` (a judge's or a teacher's prompt) the same way."""
    return await drive(tok, tok.quoted_steps(messages, tools, quotes, INLINE_CHARS), encoder)


async def drive(tok: ChatTokenizer, steps: Generator, encoder: Encoder | None) -> Any:
    """Runs the tokenizer's steps: a None is a moment to yield the loop; a (kind, piece) is encoded by the
    worker, or here when there is none or it failed."""
    try:
        request = next(steps)
        while True:
            if request is None:
                await asyncio.sleep(0)
                request = steps.send(None)
                continue
            ids = None if encoder is None else await encoder.encode(*request)
            request = steps.send(ids if ids is not None else tok.encode_as(*request))
    except StopIteration as done:
        return done.value


def main(conn: Connection, tokenizer_path: str) -> None:
    """The worker: encode each text it is sent, until the daemon closes the socket."""
    die_with_spawner()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the daemon, which stops us
    from tokenizers import Tokenizer

    full = Tokenizer.from_file(tokenizer_path)
    tokenizers = {_KINDS[FULL]: full, _KINDS[PLAIN]: plain_tokenizer(full)}
    while True:
        try:
            data = conn.recv_bytes()
        except EOFError:
            return
        text = data[1:].decode("utf-8", errors="surrogatepass")
        ids = tokenizers[data[:1]].encode(text, add_special_tokens=False).ids
        conn.send_bytes(array("I", ids).tobytes())  # native order: the daemon is on this host
