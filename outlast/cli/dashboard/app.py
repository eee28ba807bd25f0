"""The dashboard's HTTP side: a Starlette app of pages and JSON, read-only.

Pages are one shell (`static/page.html`) that `static/app.js` and `run.js` fill from the JSON
routes, so the same documents serve the browser and scripts. What can be reached: the static assets shipped in
the package, the runs listed under the storage paths given, and the output files their histories
name; no route takes a path from the request.
"""

from __future__ import annotations

import html
import logging
import re
import secrets
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from outlast.cli.dashboard.sources import Sources, Unavailable
from outlast.storage.metric_values import stored

STATIC = Path(__file__).parent / "static"
TOKEN_COOKIE = "outlast_dashboard_token"
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "::1", "[::1]"]
# Everything the pages load comes from this server: no CDN, nothing inline to inject into.
CSP = "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'"

log = logging.getLogger("outlast.dashboard")


def _shell(kind: str, title: str, main: str, status: int = 200, **data: str) -> HTMLResponse:
    shell = (STATIC / "page.html").read_text()
    attrs = " ".join(f'data-{k}="{html.escape(v)}"' for k, v in data.items())
    return HTMLResponse(shell.replace("{title}", html.escape(title)).replace("{page}", kind)
                        .replace("{attrs}", attrs).replace("{main}", main), status_code=status)


def _page(kind: str, title: str, **data: str) -> HTMLResponse:
    return _shell(kind, title, '<p class="muted">loading…</p>', **data)


class Document(JSONResponse):
    """An API answer: a metric that is NaN or infinite goes by name, as on storage (docs/json.md), since
    JSON has no such numbers and the browser's parser refuses them."""

    def render(self, content: Any) -> bytes:
        return super().render(stored(content))


def error_page(status: int, message: str, json: bool) -> Response:
    if json:
        return JSONResponse({"error": message}, status_code=status)
    # The message is in the page itself: it reads the same where the page's script does not run.
    return _shell("error", "outlast: error", f'<div class="error-box" id="error">{html.escape(message)}</div>',
                  status, error=message)


def locked_page(request: Request, message: str, json: bool) -> Response:
    """The answer without the token: plain HTML, nothing to load (without the token this server
    serves no script, style or icon either), saying what is wrong and how to get in."""
    if json:
        return JSONResponse({"error": f"{message}; send the token printed at start (?token=..., or "
                                      "Authorization: Bearer TOKEN)"}, status_code=401)
    url = html.escape(f"{request.url.scheme}://{request.url.netloc}{request.url.path}")
    return HTMLResponse((STATIC / "locked.html").read_text().replace("{message}", html.escape(message))
                        .replace("{url}", url), status_code=401)


def _wants_json(request: Request) -> bool:
    return request.url.path.startswith("/api/")


def _number(raw: str) -> int | None:
    """A whole number as a URL writes one: ASCII digits only, at most 9 (int() would take " 1", "1_0",
    "١" and thousands of digits)."""
    return int(raw) if re.fullmatch(r"[0-9]{1,9}", raw) else None


def _int(request: Request, name: str, default: int | None) -> int | None:
    raw = request.query_params.get(name)
    if raw in (None, ""):
        return default
    value = _number(raw)
    if value is None:
        raise Unavailable(f"{name} must be a whole number, got {raw[:100]!r}", status=400)
    return value


def _index(request: Request) -> int:
    raw = request.path_params["storage"]
    value = _number(raw)
    if value is None:
        raise Unavailable(f"{raw[:100]!r} is not a storage path's number", status=404)
    return value


def build_app(sources: Sources, token: str | None, loopback: bool) -> Starlette:
    async def root(request: Request) -> Response:
        return RedirectResponse("/runs", status_code=302)

    async def runs_page(request: Request) -> Response:
        return _page("runs", "outlast: runs")

    async def cluster_page(request: Request) -> Response:
        return _page("cluster", "outlast: cluster")

    async def run_page(request: Request) -> Response:
        i, name = _index(request), request.path_params["name"]
        return _page("run", f"outlast: {name}", storage=str(i), name=name)

    def api_runs(request: Request) -> Response:
        out: list[dict[str, Any]] = []
        for i, path in enumerate(sources.paths):
            try:
                out.append({"index": i, "path": path, "runs": sources.runs(i)})
            except Unavailable as e:
                out.append({"index": i, "path": path, "error": str(e)})
        return Document({"paths": out})

    def api_cluster(request: Request) -> Response:
        return Document(sources.cluster())

    def api_run(request: Request) -> Response:
        return Document(sources.run(_index(request), request.path_params["name"]))

    def api_checkpoint(request: Request) -> Response:
        return Document(sources.checkpoint(_index(request), request.path_params["name"],
                                               request.path_params["checkpoint"],
                                               check=request.query_params.get("check") == "1"))

    def api_logs(request: Request) -> Response:
        lines = _int(request, "lines", 200)
        if not 1 <= lines <= 100_000:
            raise Unavailable(f"lines must be between 1 and 100000, got {lines}", status=400)
        rank = _number(request.path_params["rank"])
        if rank is None:
            raise Unavailable(f"{request.path_params['rank'][:100]!r} is not a rank's number", status=404)
        return Document(sources.logs(_index(request), request.path_params["name"], rank,
                                     _int(request, "attempt", None), lines))

    async def unavailable(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Unavailable)
        return error_page(exc.status, str(exc), _wants_json(request))

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = ("there is no such page here: the dashboard has /runs, /runs/N/NAME and /cluster"
                   if exc.status_code == 404 else str(exc.detail))
        return error_page(exc.status_code, message, _wants_json(request))

    async def crashed(request: Request, exc: Exception) -> Response:
        log.exception("the dashboard failed on %s", request.url.path)
        return error_page(500, f"the dashboard could not build this page ({type(exc).__name__}: {exc}); "
                          "its log on the terminal that started it has the details", _wants_json(request))

    async def favicon(request: Request) -> Response:
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    routes = [
        Route("/", root),
        Route("/favicon.ico", favicon),  # what a browser asks for on a page that names no icon (the JSON routes)
        Route("/runs", runs_page),
        Route("/cluster", cluster_page),
        Route("/runs/{storage}/{name}", run_page),
        Route("/api/runs", api_runs),
        Route("/api/cluster", api_cluster),
        Route("/api/runs/{storage}/{name}", api_run),
        Route("/api/runs/{storage}/{name}/checkpoints/{checkpoint}", api_checkpoint),
        Route("/api/runs/{storage}/{name}/logs/{rank}", api_logs),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    # Outermost first: every answer, refusals included, carries the security headers.
    middleware = [Middleware(SecurityHeaders), Middleware(TargetLimit)]
    if loopback:
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=LOOPBACK_HOSTS))
    if token is not None:
        middleware.append(Middleware(TokenGate, token=token))
    return Starlette(routes=routes, middleware=middleware,
                     exception_handlers={Unavailable: unavailable, HTTPException: http_error, Exception: crashed})


def new_token() -> str:
    return secrets.token_urlsafe(24)


class TokenGate:
    """Off loopback, every request carries the token printed at start: once in the URL (`?token=`),
    after that in a cookie the first answer sets."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        given = request.query_params.get("token")
        bearer = request.headers.get("authorization", "")
        # As bytes: compare_digest refuses a str that is not ASCII, and a request may carry any.
        ok = any(secrets.compare_digest(c.encode("utf-8", "surrogateescape"), self.token.encode()) for c in (
            given or "", request.cookies.get(TOKEN_COOKIE, ""), bearer.removeprefix("Bearer ")) if c)
        if not ok:
            message = ("the token in this address is not this dashboard's (a new one is made each time it starts)"
                       if given or request.cookies.get(TOKEN_COOKIE) or bearer else
                       "this dashboard listens beyond its own machine, so every request needs the token it printed "
                       "when it started, and this one has none")
            response = locked_page(request, message, _wants_json(request))
            await response(scope, receive, send)
            return
        if given:
            async def send_with_cookie(message) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", []), (
                        b"set-cookie", f"{TOKEN_COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/".encode())]
                await send(message)
            await self.app(scope, receive, send_with_cookie)
            return
        await self.app(scope, receive, send)


MAX_TARGET_BYTES = 8192  # a request's path and query: the longest the pages make is well under 1 KiB


class TargetLimit:
    """A request whose path and query pass `MAX_TARGET_BYTES` is refused before any route sees it:
    nothing the dashboard serves needs one, and an answer must not echo it (a redirect's Location)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or scope["path"].encode()) + len(scope.get("query_string", b""))
            if size > MAX_TARGET_BYTES:
                message = (f"this address is {size} bytes long, more than the dashboard takes "
                           f"({MAX_TARGET_BYTES}); its pages are /runs, /runs/N/NAME and /cluster")
                await error_page(414, message, scope["path"].startswith("/api/"))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"content-security-policy", CSP.encode()),
                                       (b"x-content-type-options", b"nosniff"),
                                       (b"referrer-policy", b"no-referrer"),
                                       (b"cache-control", b"no-store")]
            await send(message)
        await self.app(scope, receive, with_headers)
