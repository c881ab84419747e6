"""Fan-out streams (``/v1/streams``): one generation, any number of resumable readers on any replica.

Routes only: the stream's lifecycle (start, pump, cancel) is :mod:`gateway.core.delivery`, the log and the
slow-reader policy :mod:`gateway.core.streams`, the frames :mod:`gateway.core.framing`, cross-replica mirrors
:mod:`gateway.scaleout.broker`.

Endings, per transport:
  finished   SSE ``data: [DONE]``                         WS ``{"type":"done"}``, close 1000
  cancelled  SSE ``event: end`` {"reason":"cancelled"} + [DONE]   WS ``{"type":"done","reason":"cancelled"}``
  failed     SSE ``event: error`` {"error":{...}}          WS ``{"type":"error","error":{...}}``, close 1011
  too slow   SSE ``event: error`` code slow_consumer       WS close 1013
A resume point at the end of a finished stream answers 204, which also tells a browser ``EventSource`` to stop
reconnecting; one past its end is a reader of events the log does not hold (``stream_rolled_back``).

Resume, the same on every reader route and transport (SSE over HTTP/1.1, HTTP/2, HTTP/3 and WebTransport, and the
WebSocket route): the ``Last-Event-ID`` header (what ``EventSource`` sends by itself on reconnect) or the query
parameter ``after=<seq>``; ``last_event_id=<seq>`` is accepted as another spelling of ``after``
(:func:`resume_after`). The stream URLs may already carry ``?token=…``, so a client adds ``after`` as one more
query parameter (``URL.searchParams.set``), never by appending ``"?after=…"``.

Each client may hold ``--max-subscriptions-per-client`` subscriptions open (:mod:`gateway.http.clients`); one
more is refused with 429 ``client_subscription_limit`` (SSE: the HTTP status; WS: an ``error`` message
and close 4429), as is one more than ``--max-subscribers`` on one stream (``too_many_subscribers``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.api.chat_request import parse_request
from gateway.api.edge import gateway_of, read_body, refuse
from gateway.api.generations import find_stream, start_generation
from gateway.api.openai.framing import FANOUT_SSE, FANOUT_WS
from gateway.core import sse
from gateway.core.bare import defer, detach_ws, run_detached
from gateway.core.conn import PEER_GONE, WsConn
from gateway.core.delivery import (
    SseResponse,
    read,
    release,
    resume_point,
    stop,
    until_disconnect,
)
from gateway.core.streams import Stream
from gateway.errors import APIError, ClientError, Refusal, conflicting_resume_points
from gateway.state import Gateway

log = logging.getLogger(__name__)


async def create_stream(request: Request) -> Response:
    gw: Gateway = gateway_of(request)
    body = await read_body(request, gw.config.max_body_bytes)
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ClientError(400, f"Request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(obj, dict):
        raise ClientError(400, "Request body must be a JSON object.", code="invalid_value")
    endpoint = obj.pop("endpoint", "chat.completions")
    if endpoint not in ("chat.completions", "completions"):
        raise ClientError(400, '`endpoint` must be "chat.completions" or "completions".', param="endpoint",
                       code="invalid_value")
    obj["stream"] = True
    parsed = parse_request(endpoint, obj, gw.config.limits)
    stream = await start_generation(gw, parsed, request.scope, listed=True)
    gw.metrics.requests.labels("/v1/streams", "201").inc()
    base = str(request.base_url).rstrip("/")
    ws_base = "ws" + base[4:] if base.startswith("http") else base
    auth = request.app.state.auth
    query = f"?token={auth.sign(stream.id)}" if auth.enabled else ""
    return JSONResponse({
        "id": stream.id, "object": "tokenfan.stream", "model": stream.model, "endpoint": endpoint,
        "events_url": f"{base}/v1/streams/{stream.id}/events{query}",
        "ws_url": f"{ws_base}/v1/streams/{stream.id}/ws{query}",
        "durable_url": f"{base}/v1/streams/{stream.id}/durable{query}",  # gateway.api.durable
    }, status_code=201, headers={"Location": f"/v1/streams/{stream.id}"})


async def stream_status(request: Request) -> Response:
    gw: Gateway = gateway_of(request)
    s = await find_stream(gw, request.path_params["id"])
    return JSONResponse({"id": s.id, "object": "tokenfan.stream", "state": s.state, "events": len(s.events),
                         "subscribers": s.subscriber_count(), "bytes": s.size})


async def delete_stream(request: Request) -> Response:
    gw: Gateway = gateway_of(request)
    s = await find_stream(gw, request.path_params["id"])
    deleted = await stop(gw.delivery, s)
    return JSONResponse({"id": s.id, "object": "tokenfan.stream", "state": s.state, "deleted": deleted})


async def _subscribe_check(gw: Gateway, stream_id: str) -> Stream:
    stream = await find_stream(gw, stream_id)
    if stream.subscriber_count() >= gw.hub.retention.max_subscribers:
        raise gw.refused(Refusal(429, f"Stream {stream_id} has {stream.subscriber_count()} subscribers; the limit is "
                            f"{gw.hub.retention.max_subscribers}.", type="rate_limit_error",
                       code="too_many_subscribers", retry_after=1.0))
    return stream


def _subscribe(gw: Gateway, scope: Any) -> str:
    """Count one more fan-out subscription of this scope's client; APIError 429 over its limit."""
    client: str = scope.get("state", {}).get("client") or "internal"
    try:
        gw.clients.acquire("subscriptions", client, gw.config.max_subscriptions_per_client)
    except APIError as err:
        raise gw.refused(err) from None
    return client


RESUME_QUERY = ("after", "last_event_id")  # ?after= is the documented form; last_event_id its other spelling


def resume_after(headers: Mapping[str, str], query: Mapping[str, str]) -> int:
    """The ``seq`` a fan-out reader resumes after, from any of the forms the docs name: the ``Last-Event-ID``
    header, ``?after=`` or ``?last_event_id=``; -1 (from the start) when none is given. Forms that name
    different events are a 400: which one the client meant cannot be guessed."""
    given = {name: query[name] for name in RESUME_QUERY if query.get(name, "") != ""}
    if headers.get("last-event-id", "") != "":
        given["Last-Event-ID"] = headers["last-event-id"]
    points = {name: resume_point(raw, name) for name, raw in given.items()}
    if len(set(points.values())) > 1:
        raise conflicting_resume_points(given)
    return next(iter(points.values()), -1)


async def _stream_events(request: Request) -> Any:
    gw: Gateway = gateway_of(request)
    after = resume_after(request.headers, request.query_params)
    stream = await _subscribe_check(gw, request.path_params["id"])
    if stream.over and after == len(stream.events) - 1 and stream.state == "done":
        return Response(status_code=204)
    preamble = sse.comment("tokenfan stream " + stream.id) + sse.retry(gw.config.sse_retry_ms)
    return _Subscriber(SseResponse(gw.delivery, stream, FANOUT_SSE, after, preamble=preamble, detachable=True), gw)


class _Subscriber:
    """Counts a fan-out SSE subscriber in ``tokenfan_subscribers`` and against its client's
    ``--max-subscriptions-per-client`` while its response runs (checked here, where it is also released:
    when the response ends, in its ASGI call or detached from it)."""

    __slots__ = ("gw", "inner")

    def __init__(self, inner: SseResponse, gw: Gateway) -> None:
        self.inner, self.gw = inner, gw

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            client = _subscribe(self.gw, scope)
        except APIError as err:
            await refuse(scope, receive, send, err)
            return
        gauge = self.gw.metrics.subscribers.labels("sse")
        gauge.inc()
        clients = self.gw.clients

        def done() -> None:
            gauge.dec()
            clients.release("subscriptions", client)

        try:
            await self.inner(scope, receive, send)
        finally:
            defer(scope, done)


async def _stream_ws(ws: WebSocket) -> None:
    gw: Gateway = gateway_of(ws)
    await ws.accept()
    try:
        after = resume_after(ws.headers, ws.query_params)
        stream = await _subscribe_check(gw, ws.path_params["id"])
        client = _subscribe(gw, ws.scope)
    except APIError as exc:
        with contextlib.suppress(WebSocketDisconnect, *PEER_GONE):  # the client left first: nobody to tell
            await ws.send_text(orjson.dumps({"type": "error", "error": exc.body()["error"]}).decode())
            await ws.close(4000 + exc.status if exc.status < 1000 else 1008, exc.code or "error")
        return
    bare = detach_ws(ws.scope, None, gw.policy.linger) if gw.delivery.detach else None
    conn = bare or WsConn.of(ws, gw.policy.linger)
    gauge = gw.metrics.subscribers.labels("ws")
    gauge.inc()
    receive = ws.receive if bare is None else None  # a detached reader keeps nothing of the ASGI call

    async def follow() -> None:
        outcome = None
        try:
            work = read(gw.delivery, stream, FANOUT_WS, after, conn)
            outcome = await (work if receive is None else until_disconnect(work, receive))
        except WebSocketDisconnect:
            pass
        finally:
            gauge.dec()
            gw.clients.release("subscriptions", client)
            release(stream, cut=bool(outcome and outcome.cut))
        if outcome is None:
            return
        end = outcome.ending
        text = end.frame if isinstance(end.frame, str) else None
        if outcome.cut:
            await conn.cut(end.close_code, end.reason, text)
        else:
            await conn.end(text, end.close_code, end.reason)

    if bare is not None:  # the socket is the gateway's now: the reader goes on after this call returns
        run_detached(gw.delivery.detached, bare, ws.scope, follow)
        return
    await follow()


class _Bare:
    """A subscriber route's endpoint as a plain ASGI app (Starlette serves an endpoint that is not a function
    as one): without the per-request wrappers of a function endpoint (``request_response`` or
    ``websocket_session`` and their exception wrapper, with the Request they hold), which would stay alive
    with each of thousands of subscribers for as long as it reads (about 2 KB each, tracemalloc). An error
    raised before the response starts reaches the app's exception middleware as from any route. Each call
    first takes a turn of the gateway's :class:`gateway.core.turns.Turnstile`."""

    def __init__(self, endpoint: Any, kind: type[Request | WebSocket]) -> None:
        self.endpoint, self.kind = endpoint, kind

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # A subscription's first step (the checks, the response head or the accept, detaching) takes a turn of
        # the loop's bounded share for subscribers: a crowd arriving at once does not hold the loop.
        await scope["app"].state.gateway.delivery.turnstile.turn()
        if self.kind is WebSocket:
            await self.endpoint(WebSocket(scope, receive, send))
            return
        response = await self.endpoint(Request(scope, receive, send))
        await response(scope, receive, send)


stream_events = _Bare(_stream_events, Request)  # GET /v1/streams/{id}/events
stream_ws = _Bare(_stream_ws, WebSocket)  # WS /v1/streams/{id}/ws
