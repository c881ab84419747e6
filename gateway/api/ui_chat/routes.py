"""The AI SDK chat API over HTTP: ``POST /api/chat``, ``GET /api/chat/{id}/stream``, ``DELETE /api/chat/{id}/stream``.

An answer is a listed, detached stream of the delivery core (like a background response): its parts are
the stream's log, so a reader that comes back (``resume: true`` after a reload, on any replica with
``--broker``) replays the answer from its first part, which the SDK's ``DefaultChatTransport`` expects
(``resumeStreamIsReplay``, default true), then follows it live. The generation outlives its readers:
in resume mode the SDK's ``stop()`` only disconnects, so ``DELETE /api/chat/{id}/stream`` cancels it. A new
``POST`` for a chat whose previous answer still runs on this gateway cancels that one first.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.api.chat_request import parse_request
from gateway.api.edge import gateway_of, read_body
from gateway.api.generations import find_stream, start_generation
from gateway.api.ui_chat.chats import ChatIndex
from gateway.api.ui_chat.convert import chat_id_of, chat_turn
from gateway.api.ui_chat.framing import HEADER, UI_MESSAGE_SSE
from gateway.api.ui_chat.render import UiMessageRenderer
from gateway.api.validation import decode_json_object
from gateway.core.delivery import SseResponse, cancel, stop
from gateway.core.streams import Stream
from gateway.errors import APIError
from gateway.state import Gateway

ENDPOINT = "ui_chat"


class UiMessageResponse(SseResponse):
    """An SSE reader of a chat's stream, with the protocol's header."""

    headers: ClassVar[list[tuple[bytes, bytes]]] = [*SseResponse.headers, HEADER]


class UiChatRoutes:
    """The three endpoints and the :class:`ChatIndex` they share (one per app)."""

    def __init__(self) -> None:
        self.chats = ChatIndex()

    async def post(self, request: Request) -> Any:
        t0 = time.monotonic()
        gw: Gateway = gateway_of(request)
        obj = decode_json_object(await read_body(request, gw.config.max_body_bytes), gw.config.limits.max_json_depth)
        turn = chat_turn(obj)
        parsed = parse_request("chat.completions", turn.body, gw.config.limits)
        previous = self.chats.running.get(turn.chat_id)
        if previous is not None and (s := gw.hub.streams.get(previous)) is not None:
            cancel(s)  # the chat moved on (e.g. stop() in resume mode only disconnected)
        stream = await start_generation(
            gw, parsed, request.scope, listed=True, detached=True, endpoint=ENDPOINT,
            source=lambda handle, _builder: UiMessageRenderer(turn.message_id, handle.openai))
        stream.meta["chat_id"] = turn.chat_id
        self.chats.started(gw, turn.chat_id, stream)
        gw.metrics.requests.labels("/api/chat", "200").inc()
        return UiMessageResponse(gw.delivery, stream, UI_MESSAGE_SSE, -1, t0=t0)

    async def resume(self, request: Request) -> Any:
        """The chat's running answer from its first part, then live; 204 when none runs."""
        gw: Gateway = gateway_of(request)
        stream = await self._running(gw, chat_id_of(request.path_params["id"], "id"))
        label = "200" if stream is not None else "204"
        gw.metrics.requests.labels("/api/chat/{id}/stream", label).inc()
        if stream is None:
            return Response(status_code=204)
        return UiMessageResponse(gw.delivery, stream, UI_MESSAGE_SSE, -1)

    async def cancel(self, request: Request) -> Response:
        """Cancel the chat's running answer wherever it runs; its readers get ``abort``, then ``[DONE]``."""
        gw: Gateway = gateway_of(request)
        chat_id = chat_id_of(request.path_params["id"], "id")
        stream = await self._running(gw, chat_id)
        cancelled = stream is not None and await stop(gw.delivery, stream)
        gw.metrics.requests.labels("/api/chat/{id}/stream", "200").inc()
        return JSONResponse({"id": chat_id, "object": "tokenfan.ui_chat.stream", "cancelled": cancelled,
                             "stream_id": stream.id if stream is not None else None})

    async def _running(self, gw: Gateway, chat_id: str) -> Stream | None:
        stream_id = await self.chats.lookup(gw, chat_id)
        if stream_id is None:
            return None
        try:
            stream = await find_stream(gw, stream_id)
        except APIError as exc:
            if exc.status in (404, 410):  # ended and no longer retained
                return None
            raise
        if stream.endpoint != ENDPOINT or stream.finished:
            return None
        return stream
