"""The floors bench/serve.py measures clawd against: the least an aiohttp process in front of the engine can do.

One program, one route: `POST /generate` is forwarded to the engine's `/generate` as it came (the same
body the direct path sends) and the answer is relayed back. A whole answer is read and written once (the
bare proxy hop); a streamed one is relayed piece by piece as the engine's bytes arrive (the bare SSE relay:
no parsing, no re-framing). Whatever clawd does on top (render, encode, sessions, decode, parse, capture,
records) is what its CPU per request beyond this floor pays for.

    .venv/bin/python bench/floors.py --engine http://127.0.0.1:PORT --port 0   # prints "PORT n" when listening
"""
from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp
from aiohttp import web

ENGINE = web.AppKey("engine", str)
HTTP = web.AppKey("http", aiohttp.ClientSession)


async def generate(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    http = request.app[HTTP]
    async with http.post(request.app[ENGINE] + "/generate", data=body,
                         headers={"Content-Type": "application/json"}) as upstream:
        if not upstream.content_type == "text/event-stream":
            return web.Response(body=await upstream.read(), status=upstream.status,
                                content_type=upstream.content_type)
        resp = web.StreamResponse(status=upstream.status, headers={"Content-Type": "text/event-stream",
                                                                   "Cache-Control": "no-cache"})
        await resp.prepare(request)
        async for piece in upstream.content.iter_any():
            await resp.write(piece)
        await resp.write_eof()
        return resp


async def client(app: web.Application):
    app[HTTP] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                      timeout=aiohttp.ClientTimeout(total=600))
    yield
    await app[HTTP].close()


async def serve(engine: str, port: int) -> None:
    app = web.Application()
    app[ENGINE] = engine.rstrip("/")
    app.cleanup_ctx.append(client)
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    print(f"PORT {runner.addresses[0][1]}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", required=True, help="the engine's base URL")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        asyncio.run(serve(args.engine, args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
