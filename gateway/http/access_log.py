"""JSON access log: one line per HTTP request or WebSocket session, written when it ends.

Every request gets a request id (the client's ``X-Request-ID`` if it sent a sane one, else a new
one), echoed in the ``X-Request-ID`` response header and passed to the engine as the submission's
``trace_id``, so the engine's log lines for that generation carry the same id. ``trace_id`` and ``span_id``
(W3C, hex) join the line to a trace (docs/observability.md): the generation's span when the request ran one
with tracing on, else the request's own ``traceparent`` (its trace and its parent span), else null.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.core.bare import defer
from gateway.core.tracing import traceparent_ids

log = logging.getLogger("tokenfan.access")
_SANE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if _SANE.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        t0 = time.monotonic()
        status = 0
        sent = 0

        async def send_logged(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            elif message["type"] == "websocket.accept":
                status = 101
            elif message["type"] == "websocket.close" and status == 0:
                status = 403
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            if log.isEnabledFor(logging.INFO):
                client = scope.get("client")
                state = scope["state"]
                ids = (state["trace_id"], state["span_id"]) if "trace_id" in state else \
                    traceparent_ids(headers[b"traceparent"].decode("latin-1")) if b"traceparent" in headers else None
                line = {
                    "ts": 0.0, "request_id": rid, "type": scope["type"], "method": scope.get("method", "WS"),
                    "path": scope["path"], "status": status, "duration_ms": 0.0,
                    "bytes": sent, "client": f"{client[0]}:{client[1]}" if client else None,
                    "generation_id": state.get("generation_id"),
                    "trace_id": ids[0] if ids else None, "span_id": ids[1] if ids else None,
                }

                def write() -> None:
                    line["ts"], line["duration_ms"] = time.time(), round((time.monotonic() - t0) * 1000, 2)
                    log.info(orjson.dumps(line).decode(), extra={"trace": ""})  # its ids are fields of the line

                defer(scope, write)  # now, or when a detached subscriber's connection ends (gateway.core.bare)
