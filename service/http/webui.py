"""The chat page at `/`: one static page (service/http/webui/: HTML, CSS and JS, no build
step) that streams replies through this server's own /v1/chat/completions, renders
markdown and code blocks, folds a reasoning model's thinking, stops a reply on request
(the client going away cancels it in the engine), takes a system prompt and the usual
sampling settings, shows tokens per second after each reply, and keeps the conversation
in the browser (localStorage).

Nothing is fetched from outside the server, and the Content-Security-Policy says so to the
browser: scripts, styles and requests from this origin only (the machine may be offline,
and a page that talks to a local model should not talk to anyone else). The page is
package data, so the wheel carries it (pyproject.toml). `eagerlm serve --no-webui`
(`ServerConfig.webui`) leaves the routes out: `/` is then a 404 like any unknown route.

The page and its assets are open (no API key): the key, when the server has one, is typed
into the page's settings and sent with each API request.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import Response

from eagerlm.service.http.server_context import ServerContext

_ASSETS = {"index.html": "text/html; charset=utf-8", "chat.js": "text/javascript; charset=utf-8",
           "chat.css": "text/css; charset=utf-8"}
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def asset(name: str) -> bytes:
    """One of the page's files, from the installed package."""
    return files("eagerlm.service.http").joinpath("webui", name).read_bytes()


def add_webui_routes(app: FastAPI, ctx: ServerContext) -> None:
    """`GET /` and `GET /webui/{chat.js, chat.css}`, unless the server runs without the
    page."""
    if not ctx.config.webui:
        return
    pages = {name: asset(name) for name in _ASSETS}  # read once: they do not change

    def serve(name: str) -> Response:
        return Response(pages[name], media_type=_ASSETS[name], headers=_HEADERS)

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return serve("index.html")

    @app.get("/webui/chat.js", include_in_schema=False)
    async def script() -> Response:
        return serve("chat.js")

    @app.get("/webui/chat.css", include_in_schema=False)
    async def style() -> Response:
        return serve("chat.css")


__all__ = ["add_webui_routes", "asset"]
