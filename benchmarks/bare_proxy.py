"""The floor under a Python gateway: a pass-through proxy on duetime's own HTTP stack and
nothing else — uvicorn with httptools in front, a bare ASGI app, aiohttp's client to one
upstream, each request's body forwarded and the response's chunks streamed back as they come.
No parsing, routing, state, metrics or logs.

``benchmarks/gateway_overhead.py`` runs it as its ``floor`` path: its CPU per request is
what the stack costs before duetime does anything, so duetime's own share is the difference.

    python benchmarks/bare_proxy.py --upstream http://127.0.0.1:8001 --port 8100
"""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
import uvicorn


def make_app(upstream: str) -> Any:
    """The ASGI app forwarding every request to ``upstream`` (one client session, kept)."""
    session: aiohttp.ClientSession | None = None

    async def app(scope: dict, receive: Any, send: Any) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    session = aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    if session is not None:
                        await session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        assert session is not None
        async with session.request(scope["method"], upstream + scope["path"], data=body,
                                   headers={"content-type": "application/json"}) as r:
            await send({"type": "http.response.start", "status": r.status,
                        "headers": [(b"content-type",
                                     r.headers.get("content-type", "").encode())]})
            async for chunk in r.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="the upstream's base URL")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args()
    uvicorn.run(make_app(args.upstream.rstrip("/")), host="127.0.0.1", port=args.port,
                http="httptools", log_level="warning", access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
