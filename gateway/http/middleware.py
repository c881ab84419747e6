"""ASGI wrappers and the error handlers shared by every route.

Order, outermost first (as :func:`gateway.http.app.create_app` builds it): :class:`RawSend`, Starlette's
server-error middleware, [CORS], ``AccessLogMiddleware``, :class:`IsolationHeaders`, ``AuthMiddleware``,
``ClientLimitMiddleware`` (:mod:`gateway.http.clients`), Starlette's exception middleware (the handlers below), the router.
"""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.edge import error_response
from gateway.core.server_port import SERVER_KEY, ServerPort
from gateway.errors import APIError, ClientError, TokenfanError, error_class, to_api_error

log = logging.getLogger(__name__)

_ID_SEGMENT = re.compile(r"/(?:str|chatcmpl|cmpl|resp)[-_][0-9a-zA-Z]+")


def route_label(path: str) -> str:
    """A low-cardinality metrics label for a path: stream and response ids become ``{id}``."""
    return _ID_SEGMENT.sub("/{id}", path)


async def api_error_handler(request: Request, exc: Exception) -> Response:
    """The one place a raised APIError / EngineError becomes an HTTP response (and is counted)."""
    err = to_api_error(exc) if isinstance(exc, TokenfanError) else APIError(500, str(exc))
    gw = getattr(request.app.state, "gateway", None)
    if gw is not None:
        gw.metrics.requests.labels(route_label(request.url.path), str(err.status)).inc()
        gw.metrics.errors.labels(error_class(err)).inc()
    return error_response(err)


async def not_found(request: Request, exc: Exception) -> Response:
    return error_response(ClientError(404, f"No route for {request.method} {request.url.path}.", code="not_found"))


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(ClientError(405, f"Method {request.method} not allowed on {request.url.path}.",
                                      code="method_not_allowed"))


async def server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(APIError(500, "Internal server error.", type="server_error", code="internal_error"))


class RawSend:
    """Outermost ASGI wrapper: keeps the server's own ``send`` in the scope as ``tokenfan.raw_send``, and the
    port to the server's objects beneath it as ``tokenfan.server`` (:mod:`gateway.core.server_port`; None: the
    plain ASGI path).

    Starlette wraps ``send`` in layers (server-error, exception and access-log bookkeeping) that matter
    until the response has started; after that, readers write through the raw ``send``
    (:mod:`gateway.core.conn`), and the port finds the server's transport from it (a cut, the one-pass write,
    a detached subscriber).
    """

    def __init__(self, app: Any, server: ServerPort | None = None) -> None:
        self.app = app
        self.state = app.state
        self.server = server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            scope["tokenfan.raw_send"] = send
            scope[SERVER_KEY] = self.server
        await self.app(scope, receive, send)


class IsolationHeaders:
    """Cross-origin isolation for the pages (COOP + COEP): browsers then give ``performance.now()``
    ~5 µs resolution instead of 100 µs, which the A/B page's latency measurements need."""

    HEADERS: ClassVar[list[tuple[bytes, bytes]]] = [(b"cross-origin-opener-policy", b"same-origin"), (b"cross-origin-embedder-policy", b"require-corp")]

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path in ("/", "/ab") or path.startswith("/web/")):
            return await self.app(scope, receive, send)

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.HEADERS]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
