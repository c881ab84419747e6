"""``GET`` / ``HEAD /v1/streams/{id}/durable``: any listed stream read by the Durable Streams protocol.

  request                           answer
  HEAD                              200, Stream-Next-Offset (the tail), Stream-Closed once closed; no-store
  GET ?offset=O                     200, the messages from O as a JSON array (at most 4096), Stream-Next-Offset,
                                    Stream-Up-To-Date at the tail, Stream-Closed at a closed stream's tail, ETag
                                    (If-None-Match: 304)
  GET ?offset=O&live=long-poll      as above once there is a message at O; 204 (Stream-Up-To-Date) after
                                    ``timeout`` seconds without one (default 20, at most 60), or at once with
                                    Stream-Closed at a closed stream's tail; Stream-Cursor
  GET ?offset=O&live=sse            text/event-stream: ``event: data`` + ``event: control`` per message, to the
                                    closing control (``streamClosed``), then the connection closes

The stream is found as every reader route finds it (:func:`gateway.api.generations.find_stream`: here, or a
mirror of the replica or worker that runs it) and read through the delivery core: an SSE reader is
:func:`gateway.core.delivery.read`'s, a long poll waits as a follower of the log (:class:`Subscription`), so what
a reader sees is what the stream's readers see on every path: committed events (``--broker``), adoption after its
owner died, a reader cut as too slow. A stream whose owner fenced itself or handed it over answers 503
``owner_fenced`` (Retry-After: the client reads it from another replica). Live reads count against
``--max-subscriptions-per-client`` and ``--max-subscribers``; access is that of ``events_url`` (an API key, or the
stream token ``POST /v1/streams`` signs). The write side (``PUT``, ``POST``, ``DELETE``) is the generation's, not a
client's: 405.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, ClassVar

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.durable import protocol
from gateway.api.durable.framing import DurableSse
from gateway.api.edge import error_response, gateway_of, refuse
from gateway.api.generations import find_stream
from gateway.core.delivery import SseResponse, until_disconnect
from gateway.core.follow import Subscription
from gateway.core.streams import Stream
from gateway.errors import APIError, ClientError, Refusal, owner_fenced
from gateway.state import Gateway

LIVE = ("long-poll", "sse")
LONG_POLL_TIMEOUT = 20.0  # seconds; ``?timeout=`` (5.7's extension) asks for less or more, up to MAX_TIMEOUT
MAX_TIMEOUT = 60.0


async def durable(request: Request) -> Any:
    """The route: every error in tokenfan's shape, with the protocol's status and its security headers."""
    try:
        return await _answer(request)
    except APIError as err:
        response = error_response(err)
        response.headers.update(protocol.SECURITY_HEADERS)
        return response


async def _answer(request: Request) -> Any:
    gw: Gateway = gateway_of(request)
    query = request.query_params
    live = query.get("live")
    if live is not None and live not in LIVE:
        raise ClientError(400, f"`live` must be long-poll or sse, not {live[:32]!r}.", param="live",
                          code="invalid_value")
    if len(query.getlist("offset")) > 1:
        raise ClientError(400, "Send one `offset`.", param="offset", code="invalid_value")
    raw = query.get("offset")
    if live is not None and raw is None:
        raise ClientError(400, f"live={live} needs an `offset` (-1 for the start).", param="offset",
                          code="invalid_value")
    timeout = _timeout(query.get("timeout")) if live == "long-poll" else LONG_POLL_TIMEOUT
    stream = await _readable(gw, request.path_params["id"])
    if request.method == "HEAD":
        return _head(stream)
    position = protocol.parse_offset(raw, stream)
    cursor = protocol.cursor(time.time(), query.get("cursor")) if live is not None else None
    if live == "sse":
        return _subscriber(gw, stream, DurableSseResponse(gw, stream, position, cursor or "", raw == "now"))
    if live == "long-poll" and position >= len(stream.events) and not protocol.closed(stream):
        client = _subscribe(gw, request.scope, stream)
        try:
            await until_disconnect(_wait_past(stream, position, timeout), request.receive)
        finally:
            gw.clients.release("subscriptions", client)
        stream = await _readable(gw, stream.id)  # it may have moved while we waited
        if raw != "now":
            protocol.parse_offset(raw, stream)  # it may have closed short of the offset: a 400 then
    return _read(request, stream, position, raw, cursor)


async def _readable(gw: Gateway, stream_id: str) -> Stream:
    stream = await find_stream(gw, stream_id)
    if stream.state == "moved" or stream.paused:
        raise owner_fenced(stream_id)
    return stream


def _head(stream: Stream) -> Response:
    headers = {**protocol.SECURITY_HEADERS, "content-type": protocol.CONTENT_TYPE, "cache-control": protocol.NO_STORE,
               "stream-next-offset": protocol.offset(protocol.tail(stream))}
    if protocol.closed(stream):
        headers["stream-closed"] = "true"
    return Response(status_code=200, headers=headers)


def _read(request: Request, stream: Stream, position: int, raw: str | None, cursor: str | None) -> Response:
    """A catch-up or long-poll answer: the messages there are from ``position``."""
    items, end = protocol.messages(stream, position)
    at_tail = end >= protocol.tail(stream)
    is_closed = at_tail and protocol.closed(stream)
    headers = {**protocol.SECURITY_HEADERS, "content-type": protocol.CONTENT_TYPE,
               "stream-next-offset": protocol.offset(end)}
    if at_tail:
        headers["stream-up-to-date"] = "true"
    if is_closed:
        headers["stream-closed"] = "true"
    elif cursor is not None:
        headers["stream-cursor"] = cursor
    if cursor is not None and not items:  # a long poll that found nothing: 204 (5.7)
        headers["cache-control"] = protocol.NO_STORE
        del headers["content-type"]
        return Response(status_code=204, headers=headers)
    if raw == "now" and cursor is None:  # 8: a catch-up read of the tail has no data, the tail, never cached, no ETag
        headers["cache-control"] = protocol.NO_STORE
        return Response(b"[]", status_code=200, headers=headers)
    # Messages never change at their offsets, and a closed stream's end is for good: cacheable. An open
    # stream's empty tail is not: a browser would keep answering "nothing yet" from its cache.
    headers["cache-control"] = protocol.CACHEABLE if items or is_closed else protocol.NO_STORE
    tag = protocol.etag(stream.id, protocol.offset(position), end, is_closed)
    headers["etag"] = tag
    if request.headers.get("if-none-match") == tag:
        return Response(status_code=304, headers={**protocol.SECURITY_HEADERS, "etag": tag})
    return Response(protocol.json_array(items), status_code=200, headers=headers)


def _timeout(raw: str | None) -> float:
    if raw is None:
        return LONG_POLL_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_TIMEOUT:
        raise ClientError(400, f"`timeout` must be seconds in (0, {MAX_TIMEOUT:g}].", param="timeout",
                          code="invalid_value")
    return value


async def _wait_past(stream: Stream, position: int, timeout: float) -> None:
    """Wait, as a follower of the log, until it holds a message at ``position``, ends, pauses, or ``timeout``."""
    sub = Subscription("sse", None, cursor=position)
    stream.add_follower(sub)
    try:
        async with asyncio.timeout(timeout):
            while len(stream.events) <= position and not (stream.over or stream.paused):
                sub.waiter.clear()
                await sub.waiter.wait()
    except TimeoutError:
        pass
    finally:
        stream.remove_follower(sub)


def _subscribe(gw: Gateway, scope: Any, stream: Stream) -> str:
    """Count one more live reader of ``stream`` for its client (429 over either limit); returns the client."""
    limit = gw.hub.retention.max_subscribers
    if stream.subscriber_count() >= limit:
        raise gw.refused(Refusal(429, f"Stream {stream.id} has {stream.subscriber_count()} subscribers; the limit "
                                      f"is {limit}.", type="rate_limit_error", code="too_many_subscribers",
                                 retry_after=1.0))
    client: str = scope.get("state", {}).get("client") or "internal"
    try:
        gw.clients.acquire("subscriptions", client, gw.config.max_subscriptions_per_client)
    except APIError as err:
        raise gw.refused(err) from None
    return client


class DurableSseResponse(SseResponse):
    """``?live=sse``: the core's SSE reader with this protocol's framing; a reader that starts caught up
    gets a control event at once (8: ``offset=now``'s first control says where the tail is)."""

    headers: ClassVar[list[tuple[bytes, bytes]]] = [
        (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
        *((k.encode(), v.encode()) for k, v in protocol.SECURITY_HEADERS.items())]

    def __init__(self, gw: Gateway, stream: Stream, position: int, cursor: str, now: bool) -> None:
        preamble = b""
        if (now or position >= len(stream.events)) and not protocol.closed(stream):
            preamble = protocol.sse_control(position, cursor, True)
        super().__init__(gw.delivery, stream, DurableSse(stream, position, cursor), position - 1, preamble=preamble)


def _subscriber(gw: Gateway, stream: Stream, inner: SseResponse) -> Any:
    """``inner`` counted as a live reader of its client while it runs (429 if it is one too many)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        try:
            client = _subscribe(gw, scope, stream)
        except APIError as err:
            await refuse(scope, receive, send, err)
            return
        try:
            await inner(scope, receive, send)
        finally:
            gw.clients.release("subscriptions", client)

    return app
