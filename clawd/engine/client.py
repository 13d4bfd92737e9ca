"""HTTP client for SGLang's native API (and clawd's CPU engine, which speaks the same).

Token in, token out: `/generate` with `input_ids` and `return_logprob`, the
output ids and their log-probs read from `output_ids` and
`meta_info.output_token_logprobs` (docs/ARCHITECTURE.md §3). Streams are read in either of
SGLang's modes: cumulative (the default) or incremental.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator

import aiohttp

log = logging.getLogger("clawd.engine")


class EngineError(Exception):
    """The engine could not serve a request. `status` is what the client sees."""

    def __init__(self, message: str, status: int = 502, retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class EngineUnavailable(EngineError):
    """The engine cannot be reached at all (refused, timed out connecting)."""

    def __init__(self, message: str, retry_after: int = 2):
        super().__init__(message, status=503, retry_after=retry_after)


class EngineRejected(EngineError):
    """The engine answered 400: the request itself is at fault."""

    def __init__(self, message: str):
        super().__init__(message, status=400)


@dataclass(frozen=True)
class Chunk:
    """New output since the previous chunk; `finish` is set on the last one."""

    ids: list[int]
    logprobs: list[float | None]
    logprob_ids: list[int]
    finish: dict[str, Any] | None
    meta: dict[str, Any]


def _error_text(body: Any) -> str:
    """SGLang's error bodies come in several shapes (SGLang 0.5.23: docs/ARCHITECTURE.md §10)."""
    if isinstance(body, dict):
        err = body.get("error", body.get("message"))
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return str(body)[:500]


# The neutral value of every /generate sampling field that shapes the distribution besides the temperature
# (SGLang 0.5.23's defaults). A trainable turn sends them all, so an engine's --preferred-sampling-params,
# merged into the fields a request leaves out, cannot change what it samples (docs/ARCHITECTURE.md §10).
NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                    "repetition_penalty": 1.0, "min_new_tokens": 0}

# One SSE line may hold a whole reply: SGLang's default (cumulative) chunks repeat everything so far with
# its log-probs, about 30 bytes a token. aiohttp's line reader raises LineTooLong past 512 KiB (3.14);
# clawd splits lines itself, up to this bound.
MAX_SSE_LINE = 64 * 1024 * 1024


class _LineTooLong(ValueError):
    pass


async def _sse_lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The stripped lines of a response body, read in chunks of any size (a long line is joined once)."""
    parts: list[bytes] = []  # the current line's pieces, so far without a newline
    size = 0
    async for chunk in content.iter_any():
        if b"\n" not in chunk:
            parts.append(chunk)
            size += len(chunk)
            if size > MAX_SSE_LINE:
                raise _LineTooLong(f"engine sent a stream line over {MAX_SSE_LINE} bytes")
            continue
        first, *lines, rest = chunk.split(b"\n")
        yield b"".join([*parts, first]).strip()
        for line in lines:
            yield line.strip()
        parts, size = [rest], len(rest)
    if size:
        yield b"".join(parts).strip()


class EngineClient:
    def __init__(self, url: str, *, api_key: str = "", admin_api_key: str = "", connect_timeout: float = 5.0,
                 request_timeout: float = 600.0, incremental_stream: bool = False):
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # SGLang started with --admin-api-key takes only that key on its control endpoints (pause, update,
        # continue, abort) and refuses the ordinary one there (docs/ARCHITECTURE.md §10).
        self._admin_headers = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else self._headers
        self._timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=connect_timeout)
        self._short = aiohttp.ClientTimeout(total=max(connect_timeout, 5.0), sock_connect=connect_timeout)
        self._incremental = incremental_stream
        self._session: aiohttp.ClientSession | None = None
        self._refusing: str | None = None

    async def start(self) -> None:
        # Engines are addressed by IP literal, so aiohttp never calls its threaded resolver.
        connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=False)
        self._session = aiohttp.ClientSession(connector=connector, json_serialize=json.dumps)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def refuse(self, reason: str) -> None:
        """New calls fail at once; calls in flight go on until the engine answers or drops them. (Closing the
        session would not end them: aiohttp detaches a closed connection's payload, so its reader waits forever.)"""
        self._refusing = reason

    def set_url(self, url: str) -> None:
        self.url = url.rstrip("/")

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # not started yet, or closed: calls fail like a down engine
            raise EngineUnavailable("the engine client is closed")
        if self._refusing is not None:
            raise EngineUnavailable(self._refusing)
        return self._session

    async def _post(self, path: str, payload: dict, timeout: aiohttp.ClientTimeout,
                    admin: bool = False) -> aiohttp.ClientResponse:
        headers = self._admin_headers if admin else self._headers
        try:
            return await self.session.post(self.url + path, json=payload, headers=headers, timeout=timeout)
        except aiohttp.ClientConnectorError as exc:
            raise EngineUnavailable(f"engine unreachable: {exc}") from None
        except asyncio.TimeoutError:  # before OSError: on 3.11 TimeoutError is one
            raise EngineError("engine did not answer in time", status=503, retry_after=2) from None
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            raise EngineError(f"engine connection failed: {exc}", retry_after=1) from None

    async def _check(self, resp: aiohttp.ClientResponse) -> None:
        if resp.status == 200:
            return
        try:
            body = await resp.json(content_type=None)
        except (ValueError, aiohttp.ClientError):
            body = await resp.text()
        finally:
            resp.release()
        if resp.status == 400:
            raise EngineRejected(_error_text(body))
        if resp.status in (502, 503, 504):  # busy or starting: worth a retry, not "down"
            raise EngineError(f"engine answered {resp.status}: {_error_text(body)}", status=503, retry_after=2)
        raise EngineError(f"engine answered {resp.status}: {_error_text(body)}", retry_after=1)

    async def generate(self, payload: dict) -> dict:
        """One non-streamed /generate; returns SGLang's response object."""
        resp = await self._post("/generate", {**payload, "stream": False}, self._timeout)
        await self._check(resp)
        try:
            async with resp:
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise EngineError(f"engine connection lost: {exc}") from None
        except ValueError:
            raise EngineError("engine sent a body that is not JSON") from None
        except asyncio.TimeoutError:
            raise EngineError("engine timed out mid-response") from None

    async def stream(self, payload: dict) -> AsyncIterator[Chunk]:
        """A streamed /generate as a series of `Chunk`s of new tokens."""
        resp = await self._post("/generate", {**payload, "stream": True}, self._timeout)
        await self._check(resp)
        seen = 0
        try:
            async with resp:
                async for line in _sse_lines(resp.content):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    obj = json.loads(data)
                    if "error" in obj:  # SGLang's ValueErrors inside a started stream carry their 400
                        err = obj["error"]
                        if isinstance(err, dict) and err.get("code") == 400:
                            raise EngineRejected(_error_text(obj))
                        raise EngineError(f"engine stream error: {_error_text(obj)}")
                    ids = obj.get("output_ids") or []
                    meta = obj.get("meta_info") or {}
                    lps = meta.get("output_token_logprobs") or []
                    if not self._incremental:  # cumulative chunks: keep only what is new
                        ids, lps = ids[seen:], lps[seen:]
                    seen += len(ids)
                    yield Chunk(ids=ids, logprobs=[e[0] for e in lps], logprob_ids=[e[1] for e in lps],
                                finish=meta.get("finish_reason"), meta=meta)
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise EngineError(f"engine connection lost mid-stream: {exc}") from None
        except _LineTooLong as exc:
            raise EngineError(str(exc)) from None
        except ValueError:
            raise EngineError("engine sent a stream chunk that is not JSON") from None
        except asyncio.TimeoutError:
            raise EngineError("engine timed out mid-stream") from None

    async def control(self, path: str, body: dict, timeout: float) -> None:
        """A control call (pause, update weights, continue): anything but 200 is an EngineError."""
        resp = await self._post(path, body, aiohttp.ClientTimeout(total=timeout), admin=True)
        async with resp:
            if resp.status != 200:
                raise EngineError(f"{path} answered {resp.status}: {(await resp.text())[:300]}")

    async def abort(self, rid: str) -> None:
        resp = await self._post("/abort_request", {"rid": rid}, self._short, admin=True)
        resp.release()

    async def server_info(self) -> dict | None:
        """SGLang's /server_info (its input limit, `max_req_input_len`, among the server's arguments);
        None from an engine without the route (404)."""
        try:
            async with self.session.get(self.url + "/server_info", headers=self._headers, timeout=self._short) as resp:
                if resp.status == 404:
                    return None
                if resp.status != 200:
                    raise EngineError(f"/server_info answered {resp.status}")
                info = await resp.json(content_type=None)
        except asyncio.TimeoutError:
            raise EngineUnavailable("engine did not answer /server_info in time") from None
        except (aiohttp.ClientError, ConnectionError, OSError, ValueError) as exc:
            raise EngineUnavailable(f"engine unreachable: {exc}") from None
        return info if isinstance(info, dict) else None

    async def model_info(self, timeout: float | None = None) -> dict:
        """Liveness and what the engine serves; `timeout` for a caller that expects it busy."""
        limit = self._short if timeout is None else aiohttp.ClientTimeout(total=timeout)
        try:
            async with self.session.get(self.url + "/model_info", headers=self._headers, timeout=limit) as resp:
                if resp.status != 200:
                    raise EngineUnavailable(f"/model_info answered {resp.status}")
                return await resp.json(content_type=None)
        except asyncio.TimeoutError:  # before OSError: on 3.11 TimeoutError is one
            raise EngineUnavailable("engine did not answer /model_info in time") from None
        except (aiohttp.ClientError, ConnectionError, OSError, ValueError) as exc:
            raise EngineUnavailable(f"engine unreachable: {exc}") from None
