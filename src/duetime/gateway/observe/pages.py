"""The gateway's pages: ``/dashboard``, ``/playground`` (and ``/demo`` where ``duetime serve``
adds the simulator's routes), plain HTML with their scripts and the vendored uPlot under
``/static`` (no build step, no CDN: they work with no internet). ``/`` leads to the dashboard.

The pages hold no data: they read the API (``/duetime/dashboard/events``, ``/duetime/route``,
the completion routes), so they answer to the same keys as the API does (a page asks for a key
when a route answers 401)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).with_name("static")
PAGES = {"/dashboard": "dashboard.html", "/playground": "playground.html"}


def page(filename: str):
    """An endpoint answering one of the static folder's HTML files (its route is left out of
    the OpenAPI document: a page, not an API)."""
    path = STATIC / filename

    async def endpoint(request: Request) -> Response:
        return FileResponse(path, media_type="text/html; charset=utf-8",
                            headers={"cache-control": "no-cache"})

    return endpoint


def page_routes() -> list[BaseRoute]:
    async def root(request: Request) -> Response:
        return RedirectResponse("/dashboard", status_code=307)

    return [
        *(Route(p, page(f), methods=["GET"], include_in_schema=False) for p, f in PAGES.items()),
        Route("/", root, methods=["GET"], include_in_schema=False),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
