"""Helpers at the HTTP edge shared by every route module: the gateway state and a bounded body read."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.websockets import WebSocket

from gateway.errors import APIError


def gateway_of(holder: Request | WebSocket) -> Any:
    """The :class:`gateway.app.Gateway` the lifespan put on the app."""
    return holder.app.state.gateway


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or APIError 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"Request body is {declared} bytes; the limit is {limit}.", code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"Request body exceeds the limit of {limit} bytes.", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)
