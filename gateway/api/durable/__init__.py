"""The Durable Streams protocol's read side (docs/durable-streams.md): every listed stream (a fan-out stream, a
background response, a useChat answer) also read by offset, catch-up, long-poll or SSE, with the protocol's
clients (``@durable-streams/client``, ``durable-streams``). An API peer of the others, on the delivery core:

  protocol.py  offsets, messages and the trailer, ETag, cursor, the SSE data and control events (pure)
  framing.py   the SSE reader's frames on the core (``Framing``)
  routes.py    ``GET`` / ``HEAD /v1/streams/{id}/durable``
"""

from __future__ import annotations

from typing import Any

from starlette.routing import Route

from gateway.api.durable.routes import durable


def mount(path: str = "/v1/streams/{id}/durable") -> list[Any]:
    """The one route (Starlette answers HEAD with it; a write method is a 405)."""
    return [Route(path, durable, methods=["GET", "HEAD"])]
