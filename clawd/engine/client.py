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


class EngineClient:
    def __init__(self, url: str, *, api_key: str = "", connect_timeout: float = 5.0,
                 request_timeout: float = 600.0, incremental_stream: bool = False):
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
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

    async def _post(self, path: str, payload: dict, timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        try:
            return await self.session.post(self.url + path, json=payload, headers=self._headers, timeout=timeout)
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
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    obj = json.loads(data)
                    if "error" in obj:
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
        except ValueError:
            raise EngineError("engine sent a stream chunk that is not JSON") from None
        except asyncio.TimeoutError:
            raise EngineError("engine timed out mid-stream") from None

    async def control(self, path: str, body: dict, timeout: float) -> None:
        """A control call (pause, update weights, continue): anything but 200 is an EngineError."""
        resp = await self._post(path, body, aiohttp.ClientTimeout(total=timeout))
        async with resp:
            if resp.status != 200:
                raise EngineError(f"{path} answered {resp.status}: {(await resp.text())[:300]}")

    async def abort(self, rid: str) -> None:
        resp = await self._post("/abort_request", {"rid": rid}, self._short)
        resp.release()

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
