"""The dashboard's ASGI app: its routes, the security headers every answer carries, the gate in front
of every page when an access token is set.

Pages are rendered on the server (Jinja2, autoescaped: every string a provider sent is untrusted
text); htmx, served from this package, refreshes parts of them. No script runs inline and none
comes from elsewhere: the Content-Security-Policy says so to the browser.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobtrail.domain.errors import StorageError, require_extra
from jobtrail.domain.redact import Secret
from jobtrail.interfaces.dashboard.security import Access, host_allowed

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from jobtrail.ledger.store import Store

_HERE = Path(__file__).parent

#: what a page may load: only this server's own files; no inline script or style, no frames, forms only here
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    # a same-origin Referer still goes along (the CSRF check reads it when Origin is missing)
    (b"referrer-policy", b"same-origin"),
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class SecurityHeaders:
    """Adds :data:`CSP` and its companions to every HTTP answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


class HostCheck:
    """Refuses a request whose ``Host`` is not a name this dashboard is reached by (:func:`host_allowed`)."""

    def __init__(self, app: ASGIApp, public_origin: str | None = None) -> None:
        self.app = app
        self.public_origin = public_origin

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or host_allowed(scope, self.public_origin):
            await self.app(scope, receive, send)
            return
        host, port = scope.get("server") or ("127.0.0.1", 0)
        shown = f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
        why = (
            f"this dashboard answers only to the address it is reached at ({shown}"
            + (", or localhost" if host in ("127.0.0.1", "::1") else "")
            + (f", or {self.public_origin}" if self.public_origin else "")
            + "); a request naming another host (a site renaming itself to this address, or a proxy) is refused. "
            "Open it by that address, or start it with --origin naming the one people use\n"
        )
        await send(
            {
                "type": "http.response.start",
                "status": 421,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), *_HEADERS],
            }
        )
        await send({"type": "http.response.body", "body": why.encode()})


def dashboard_app(
    store: Store,
    *,
    token: Secret | None = None,
    provider_files: Sequence[str] = (),
    anchor_path: str | None = None,
    anchor_key: Secret | None = None,
    public_origin: str | None = None,
) -> Starlette:
    """The dashboard over ``store``: read-only unless ``token`` is given (then it asks for it first).

    ``provider_files`` are shown with their guarantees; ``anchor_path`` (and its HMAC key) is the
    anchor the audit page checks the ledger against; ``public_origin`` (``https://host[:port]``) is the
    origin people reach the dashboard by when a TLS proxy in front of it forwards plain HTTP.
    """
    require_extra("dashboard", "the dashboard", "starlette", "jinja2", "python_multipart")
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import ClientDisconnect
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    from jobtrail.interfaces.dashboard.pages import Pages

    pages = Pages(
        store,
        Access(token),
        templates_dir=_HERE / "templates",
        provider_files=provider_files,
        anchor_path=anchor_path,
        anchor_key=anchor_key,
        public_origin=public_origin,
    )
    routes = [
        Route("/", pages.operations, methods=["GET"]),
        Route("/ops/{operation_id}", pages.operation, methods=["GET"]),
        Route("/ops/{operation_id}/resolve", pages.resolve, methods=["POST"]),
        Route("/queue", pages.queue, methods=["GET"]),
        Route("/workers", pages.workers, methods=["GET"]),
        Route("/providers", pages.providers, methods=["GET"]),
        Route("/audit", pages.audit, methods=["GET"]),
        Route("/audit", pages.run_audit, methods=["POST"]),
        Route("/login", pages.login_form, methods=["GET"]),
        Route("/login", pages.login, methods=["POST"]),
        Route("/logout", pages.logout, methods=["POST"]),
        Route("/healthz", pages.healthz, methods=["GET"]),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(HostCheck, public_origin=public_origin), Middleware(SecurityHeaders)],
        # a client gone before its form arrived whole (or cut off by the server's deadline): nothing to answer, and
        # no traceback in the log for anyone who can open a connection
        # the database locked, unreachable, or its file deleted or replaced under this process: a page naming the
        # cause, not a 500 with a traceback (and never a page or a write on a file nobody else reads)
        exception_handlers={ClientDisconnect: _gone, StorageError: pages.unavailable},
    )


async def _gone(request: Any, exc: Exception) -> Any:
    from starlette.responses import Response

    return Response(status_code=400)
