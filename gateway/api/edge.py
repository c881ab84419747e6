"""Helpers at the HTTP edge shared by every route module: the gateway state, a bounded body read, and the
one place an :class:`gateway.errors.APIError` becomes an HTTP response (:func:`error_response`)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket

from gateway.errors import APIError, ClientError


def error_response(err: APIError) -> Response:
    """``err`` as an HTTP response: its status, the OpenAI error body, and ``Retry-After`` when it has one."""
    headers = {"Retry-After": str(max(1, round(err.retry_after)))} if err.retry_after else None
    return Response(err.to_bytes(), status_code=err.status, media_type="application/json", headers=headers)


def gateway_of(holder: Request | WebSocket) -> Any:
    """The :class:`gateway.state.Gateway` the lifespan put on the app."""
    return holder.app.state.gateway


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or APIError 413 as soon as it is known to exceed ``limit`` bytes, or 408 if it
    has not fully arrived within ``--http-body-timeout`` (slowloris; both servers then close the connection)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ClientError(413, f"Request body is {declared} bytes; the limit is {limit}.", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    timeout = gateway_of(request).config.http_body_timeout
    try:
        async with asyncio.timeout(timeout or None):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ClientError(413, f"Request body exceeds the limit of {limit} bytes.",
                                   code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise ClientError(408, f"The request body did not arrive within {timeout:g} s.",
                       code="request_timeout") from None
    return b"".join(chunks)


async def refuse(scope: Scope, receive: Receive, send: Send, err: APIError) -> None:
    """Answer a scope with ``err`` before the route runs: HTTP status + OpenAI body, or for a WebSocket an
    accept, one error message (the ``/v1/ws`` and Responses shapes at once) and close 4000 + status
    (a browser cannot read a refused handshake's status, but it can read this)."""
    if scope["type"] == "http":
        return await error_response(err)(scope, receive, send)
    message: dict[str, Any] = {"type": "error", "id": None, "status": err.status, "error": err.body()["error"]}
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": orjson.dumps(message).decode()})
    await send({"type": "websocket.close", "code": 4000 + err.status, "reason": err.code or "refused"})
