"""HTTP client for SGLang's native API (and clawd's CPU engine, which speaks the same).

Token in, token out: `/generate` with `input_ids` and `return_logprob`, the ids and log-probs read from
`output_ids` and `meta_info.output_token_logprobs` (docs/ARCHITECTURE.md §3); streams cumulative or incremental.

No call waits forever. A streamed call must see its first body byte within `first_byte_timeout` of being
sent (queueing and prefill included: SGLang sends a stream's headers at once, so headers prove nothing),
then never wait more than `idle_timeout` for the next byte. A non-streamed /generate gets its whole answer
at once, so no first-byte deadline can tell a long answer from a hung engine: `request_timeout` bounds it,
and the supervisor ends it sooner by `abandon`ing the calls of an engine it declares hung. The deadlines
time only the waits for the engine (not a slow consumer between chunks), and a deadline that fires ends
the call with `EngineTimeout` (503, Retry-After) and drops its connection, so the engine frees the request.

The client also keeps the evidence the supervisor's hang detector reads (`stalls`, `quiet_for`, `publishing`,
`control_timed_out`): calls that timed out in a row with no byte from any call in between, how long calls
have waited on the engine with no byte from any of them, and whether a weight publish (pause to continue)
is under way, during which held calls prove nothing. `health_generate` asks the engine itself whether its
scheduler is making progress, for waits no byte of ours can judge (a non-streamed call's answer comes whole).
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import AsyncIterator

import aiohttp

from clawd import jsoncodec
from clawd.engine.chunks import Chunk, StreamChunks, error_text
from clawd.engine.deadlines import Call, Deadline, StreamDeadline
from clawd.engine.errors import (EngineDisconnected, EngineError, EngineRejected, EngineTimeout,  # noqa: F401
                                 EngineUnavailable, EngineUnresponsive)  # (their home: callers import them here too)
from clawd.engine.sse import LineSplitter, LineTooLong

log = logging.getLogger("clawd.engine")


# The neutral value of every /generate field that shapes the distribution besides the temperature (SGLang 0.5.23's
# defaults): a trainable turn sends them all, so --preferred-sampling-params cannot change what it samples (§10).
NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                    "repetition_penalty": 1.0, "min_new_tokens": 0}


class EngineClient:
    def __init__(self, url: str, *, api_key: str = "", admin_api_key: str = "", connect_timeout: float = 5.0,
                 request_timeout: float = 600.0, first_byte_timeout: float = 120.0, idle_timeout: float = 60.0,
                 incremental_stream: bool = False, priority: int | None = None):
        self.url = url.rstrip("/")
        self._priority = {} if priority is None else {"priority": priority}  # for a /generate that names none
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # SGLang started with --admin-api-key takes only that key on its control endpoints (pause, update,
        # continue, abort) and refuses the ordinary one there (docs/ARCHITECTURE.md §10).
        self._admin_headers = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else self._headers
        # A POST's body goes as the bytes jsoncodec writes (aiohttp's json= would take them as text, to encode again).
        self._post_headers = {**self._headers, "Content-Type": "application/json"}
        self._admin_post_headers = {**self._admin_headers, "Content-Type": "application/json"}
        self._timeout = aiohttp.ClientTimeout(total=request_timeout, sock_connect=connect_timeout)
        self._short = aiohttp.ClientTimeout(total=max(connect_timeout, 5.0), sock_connect=connect_timeout)
        self._request_timeout, self._first_byte, self._idle = request_timeout, first_byte_timeout, idle_timeout
        self._incremental = incremental_stream
        self._session: aiohttp.ClientSession | None = None
        self._refusing: str | None = None
        # What the supervisor's hang detector reads (module docstring).
        self.stalls = 0  # generation calls in a row that timed out, with no byte from any call in between
        self.last_stall: str | None = None
        self.control_timed_out: str | None = None  # a control call that ran past its own timeout, since cleared
        self._controls = 0  # control calls in flight
        self._control_epoch = 0  # moves at each control call's start and end
        self._paused = False  # a pause was sent and the continue after it has not finished
        self._abandon_epoch = 0
        self._abandoned = ""
        self._waits: set[asyncio.Timeout | StreamDeadline] = set()  # the deadlines of calls waiting on the engine now
        self._progress_at = 0.0  # loop time of the last byte from any call, or of a wait begun when none was

    async def start(self) -> None:
        # Engines are addressed by IP literal, so aiohttp never calls its threaded resolver.
        connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=False)
        self._session = aiohttp.ClientSession(connector=connector)

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

    # ---- hang evidence -------------------------------------------------------------------------

    @property
    def publishing(self) -> bool:
        """A control call is in flight or the engine was paused and not yet continued: calls held now prove
        nothing about its health."""
        return self._controls > 0 or self._paused

    def clear_evidence(self) -> None:
        """For an engine that just became ready: what its predecessor did says nothing of it."""
        self.stalls, self.last_stall, self.control_timed_out = 0, None, None

    def abandon(self, reason: str) -> None:
        """End every generation call in flight with EngineTimeout(reason): the engine is hung, and a non-streamed
        call would otherwise wait request_timeout. Calls made after this go on as usual."""
        self._abandon_epoch += 1
        self._abandoned = reason
        now = asyncio.get_running_loop().time()
        for deadline in self._waits:
            if not deadline.expired():  # one that already fired cannot be moved (and ends its call anyway)
                deadline.reschedule(now)

    def quiet_for(self) -> float:
        """Seconds that generation calls have waited on the engine with no byte from any of them; 0 when none
        waits. A busy engine that answers anything resets it."""
        if not self._waits:
            return 0.0
        return asyncio.get_running_loop().time() - self._progress_at

    def _begin(self) -> Call:
        return Call(self._abandon_epoch, self._control_epoch)

    def _deadline(self, call: Call, when: float, what: str) -> Deadline:
        """The body's waits end by loop time `when`, or at once when the call is abandoned: EngineTimeout."""
        return Deadline(self, call, when, what)

    def _answered(self) -> None:
        self.stalls = 0
        self._progress_at = asyncio.get_running_loop().time()

    def _stalled(self, call: Call, exc: EngineTimeout) -> None:
        """A timed-out call is evidence of a hang unless it was abandoned or a publish overlapped it."""
        if call.abandon_epoch != self._abandon_epoch or self.publishing or call.control_epoch != self._control_epoch:
            return
        self.stalls += 1
        self.last_stall = str(exc)

    # ---- calls -----------------------------------------------------------------------------------

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # not started yet, or closed: calls fail like a down engine
            raise EngineUnavailable("the engine client is closed")
        if self._refusing is not None:
            raise EngineUnavailable(self._refusing)
        return self._session

    async def _post(self, path: str, payload: dict, timeout: aiohttp.ClientTimeout,
                    admin: bool = False) -> aiohttp.ClientResponse:
        headers = self._admin_post_headers if admin else self._post_headers
        try:
            return await self.session.post(self.url + path, data=jsoncodec.dumps(payload), headers=headers,
                                           timeout=timeout)
        except aiohttp.ClientConnectorError as exc:
            raise EngineUnavailable(f"engine unreachable: {exc}") from None
        except asyncio.TimeoutError:  # before OSError: on 3.11 TimeoutError is one
            raise EngineTimeout("engine did not answer in time") from None
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            raise EngineDisconnected(f"engine connection failed: {exc}", retry_after=1) from None

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
            raise EngineRejected(error_text(body))
        if resp.status in (502, 503, 504):  # busy or starting: worth a retry, not "down"
            raise EngineError(f"engine answered {resp.status}: {error_text(body)}", status=503, retry_after=2)
        raise EngineError(f"engine answered {resp.status}: {error_text(body)}", retry_after=1)

    async def generate(self, payload: dict, timeout: float | None = None) -> dict:
        """One non-streamed /generate; returns SGLang's response object. Its answer comes whole, so only
        `timeout` (default request_timeout) or an `abandon` ends a wait on a hung engine."""
        call = self._begin()
        limit = self._request_timeout if timeout is None else timeout
        resp = None
        try:
            async with self._deadline(call, asyncio.get_running_loop().time() + limit, f"no answer in {limit:g}s"):
                resp = await self._post("/generate", {**self._priority, **payload, "stream": False}, self._timeout)
                self._answered()
                await self._check(resp)
                async with resp:
                    return jsoncodec.loads(await resp.read())
        except EngineTimeout as exc:
            if resp is not None:
                resp.close()  # half read: the connection cannot be reused, and the engine sees the hang-up
            self._stalled(call, exc)
            raise
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise EngineDisconnected(f"engine connection lost: {exc}") from None
        except ValueError:
            raise EngineError("engine sent a body that is not JSON") from None

    async def open_stream(self, payload: dict) -> tuple[AsyncIterator[Chunk], Chunk | None]:
        """(a streamed /generate, its first chunk or None); one that fails first is closed (a retry is clean)."""
        chunks = self.stream(payload)
        try:
            return chunks, await anext(chunks, None)
        except BaseException:
            await chunks.aclose()
            raise

    async def stream(self, payload: dict) -> AsyncIterator[Chunk]:
        """A streamed /generate as a series of `Chunk`s of new tokens: the first byte within first_byte_timeout,
        each later one within idle_timeout of the wait for it."""
        call = self._begin()
        loop = asyncio.get_running_loop()
        first_by = loop.time() + self._first_byte
        first_what, idle_what = f"no first byte in {self._first_byte:g}s", f"nothing for {self._idle:g}s mid-stream"
        resp = deadline = None
        try:
            async with self._deadline(call, first_by, first_what):
                resp = await self._post("/generate", {**self._priority, **payload, "stream": True}, self._timeout)
                if resp.status != 200:
                    self._answered()
                await self._check(resp)
            deadline = StreamDeadline(self, call)
            started = False

            async def read() -> bytes:
                nonlocal started
                if started:
                    data = await deadline.read(resp.content, loop.time() + self._idle, idle_what)
                else:
                    data = await deadline.read(resp.content, first_by, first_what)
                if data:
                    started = True
                    self._answered()
                return data

            lines, chunks = LineSplitter(), StreamChunks(self._incremental)
            async with resp:
                while True:
                    data = await read()
                    # The events of one read come out as one chunk (clawd.engine.chunks).
                    try:
                        for line in lines.feed(data) if data else lines.end():
                            if not line.startswith(b"data:"):
                                continue
                            event = line[5:].strip()
                            if event == b"[DONE]":
                                if (merged := chunks.take()) is not None:
                                    merged.more = True  # the stream's end came in the same read
                                    yield merged
                                return
                            chunks.add(jsoncodec.loads(event))
                    except (EngineError, ValueError):  # an error event or a bad line: what came before it first
                        if (merged := chunks.take()) is not None:
                            yield merged
                        raise
                    if (merged := chunks.take()) is not None:
                        yield merged
                    if not data:
                        return
        except EngineTimeout as exc:
            if resp is not None:
                resp.close()
            self._stalled(call, exc)
            raise
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise EngineDisconnected(f"engine connection lost mid-stream: {exc}") from None
        except LineTooLong as exc:
            raise EngineError(str(exc)) from None
        except ValueError:
            raise EngineError("engine sent a stream chunk that is not JSON") from None
        finally:
            if deadline is not None:
                deadline.close()

    async def probe(self, timeout: float) -> None:
        """A one-token generation, for an engine whose HTTP front end answers while its scheduler may not."""
        await self.generate({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                             "rid": f"clawd-probe-{uuid.uuid4().hex}"}, timeout=timeout)

    async def control(self, path: str, body: dict, timeout: float) -> dict | None:
        """A control call (pause, update weights, continue): anything but 200 is an EngineError; the answer's
        JSON object, or None. It keeps its own `timeout`; running past it is recorded as `control_timed_out`,
        the supervisor's evidence of a hang."""
        self._controls += 1
        self._control_epoch += 1
        if path == "/pause_generation":  # before sending: a pause that times out may still have happened
            self._paused = True
        try:
            resp = await self._post(path, body, aiohttp.ClientTimeout(total=timeout), admin=True)
            async with resp:
                if resp.status != 200:
                    raise EngineError(f"{path} answered {resp.status}: {(await resp.text())[:300]}")
                try:
                    answer = jsoncodec.loads(await resp.read())
                except ValueError:
                    return None
                return answer if isinstance(answer, dict) else None
        except (EngineTimeout, asyncio.TimeoutError):
            self.control_timed_out = f"{path} got no answer in {timeout:g}s"
            raise EngineTimeout(self.control_timed_out) from None
        finally:
            self._controls -= 1
            self._control_epoch += 1
            if path == "/continue_generation":  # the publish's window ends whatever the answer
                self._paused = False

    # ---- LoRA adapters (SGLang 0.5.23: --enable-lora; loading one leaves /model_info's weight_version) ----

    async def load_adapter(self, name: str, path: str, timeout: float) -> None:
        """Load the adapter directory `path` as `name`; confirmed by the answer's list of loaded adapters."""
        answer = await self.control("/load_lora_adapter", {"lora_name": name, "lora_path": path}, timeout) or {}
        if answer.get("success") is not True or name not in (answer.get("loaded_adapters") or {}):
            raise EngineError(f"/load_lora_adapter did not confirm {name}: {str(answer)[:300]}")

    async def unload_adapter(self, name: str, timeout: float) -> None:
        """Unload `name` (the engine first lets the requests using it end)."""
        answer = await self.control("/unload_lora_adapter", {"lora_name": name}, timeout) or {}
        if answer.get("success") is not True:
            raise EngineError(f"/unload_lora_adapter did not confirm {name}: {str(answer)[:300]}")

    async def loaded_adapters(self) -> set[str]:
        """The adapters the engine holds: /v1/models' cards that have a parent (the base model)."""
        try:
            async with self.session.get(self.url + "/v1/models", headers=self._headers,
                                        timeout=self._short) as resp:
                if resp.status != 200:
                    raise EngineError(f"/v1/models answered {resp.status}: {(await resp.text())[:300]}")
                cards = (jsoncodec.loads(await resp.read()) or {}).get("data") or []
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnavailable(f"/v1/models: {exc}") from None
        except asyncio.TimeoutError:
            raise EngineUnresponsive("engine did not answer /v1/models in time") from None
        return {c["id"] for c in cards if isinstance(c, dict) and c.get("parent") and isinstance(c.get("id"), str)}

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
            raise EngineUnresponsive("engine did not answer /server_info in time") from None
        except (aiohttp.ClientError, ConnectionError, OSError, ValueError) as exc:
            raise EngineUnavailable(f"engine unreachable: {exc}") from None
        return info if isinstance(info, dict) else None

    async def health_generate(self, timeout: float) -> bool:
        """Whether the engine's scheduler is making progress: SGLang's /health_generate answers 200 as soon
        as the scheduler puts out anything (a token of any request; idle, its own one-token request) and 503
        when nothing comes within its own wait (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s). False on 503 or when
        `timeout` passes; True also counts as progress for `quiet_for`."""
        try:
            async with self.session.get(self.url + "/health_generate", headers=self._headers,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                await resp.read()
                if resp.status == 200:
                    self._progress_at = asyncio.get_running_loop().time()
                    return True
                if resp.status == 503:
                    return False
                raise EngineUnavailable(f"/health_generate answered {resp.status}")
        except asyncio.TimeoutError:  # before OSError: on 3.11 TimeoutError is one
            return False
        except (aiohttp.ClientError, ConnectionError, OSError) as exc:
            raise EngineUnavailable(f"engine unreachable: {exc}") from None

    async def model_info(self, timeout: float | None = None) -> dict:
        """Liveness and what the engine serves; `timeout` for a caller that expects it busy (or a short poll)."""
        limit = self._short if timeout is None else aiohttp.ClientTimeout(total=timeout)
        try:
            async with self.session.get(self.url + "/model_info", headers=self._headers, timeout=limit) as resp:
                if resp.status != 200:
                    raise EngineUnavailable(f"/model_info answered {resp.status}")
                return await resp.json(content_type=None)
        except asyncio.TimeoutError:  # before OSError: on 3.11 TimeoutError is one
            raise EngineUnresponsive("engine did not answer /model_info in time") from None
        except (aiohttp.ClientError, ConnectionError, OSError, ValueError) as exc:
            raise EngineUnavailable(f"engine unreachable: {exc}") from None
