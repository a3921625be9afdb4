"""The dashboard: a static page (HTML, CSS, a small vanilla script) at ``/``.

No build step: the files live in ``static/`` beside this module, package data of the wheel.
The page signs in with a pasted token, submits analyses, cancels queued ones, and updates from
``GET /v1/events`` only: it never polls.
"""

from __future__ import annotations

import functools
from pathlib import Path

from aiohttp import web

from analysis_queue import errors

STATIC_DIR = Path(__file__).resolve().parent / "static"
CONTENT_TYPES = {
    "index.html": "text/html",
    "app.js": "text/javascript",
    "app.css": "text/css",
    "favicon.svg": "image/svg+xml",
}
# The page loads nothing but its own files and talks to nothing but this service; no inline
# script or style, so an injected string cannot run.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

routes = web.RouteTableDef()


@functools.cache
def _read(name: str) -> bytes:
    return (STATIC_DIR / name).read_bytes()


def _file(name: str) -> web.Response:
    if name not in CONTENT_TYPES:
        raise errors.NotFound("No such file.")
    return web.Response(
        body=_read(name),
        content_type=CONTENT_TYPES[name],
        charset="utf-8",
        headers=SECURITY_HEADERS,
    )


@routes.get("/")
async def index(_request: web.Request) -> web.Response:
    return _file("index.html")


@routes.get("/static/{name}")
async def static_file(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name == "index.html":  # the page lives at /
        raise errors.NotFound("No such file.")
    return _file(name)
