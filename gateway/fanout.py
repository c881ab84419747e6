"""HTTP and WebSocket routes of fan-out streams (``/v1/streams``): thin adapters over
:mod:`gateway.streams`.

Endings, per transport:
  finished   SSE ``data: [DONE]``                         WS ``{"type":"done"}``, close 1000
  cancelled  SSE ``event: end`` {"reason":"cancelled"} + [DONE]   WS ``{"type":"done","reason":"cancelled"}``
  failed     SSE ``event: error`` {"error":{...}}          WS ``{"type":"error","error":{...}}``, close 1011
  too slow   SSE ``event: error`` code slow_consumer       WS close 1013
A resume point at or past the end of a finished stream answers 204, which also tells a browser
``EventSource`` to stop reconnecting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway import sse
from gateway.edge import gateway_of, read_body
from gateway.errors import APIError, error_class
from gateway.generation import chunk_events
from gateway.openai_api import parse_request
from gateway.streams import Event, SlowConsumer, Stream, follow

log = logging.getLogger(__name__)

END_CANCELLED = sse.event(b'{"reason":"cancelled"}', event="end") + sse.DONE



async def _pump(gw: Any, stream: Stream, handle: Any, builder: Any) -> None:
    """Engine deltas -> stream events, until the generation ends, fails or is cancelled."""
    broker = gw.broker
    try:
        async for ev in chunk_events(handle, builder):
            assert ev is not None
            event = stream.publish(ev)
            if broker is not None:
                broker.published(stream, event)
            gw.metrics.tokens.inc(ev.tokens)
        stream.finish("done")
    except APIError as exc:
        gw.metrics.errors.labels(error_class(exc)).inc()
        stream.finish("error", exc)
    except asyncio.CancelledError:
        gw.metrics.aborted.inc()
        stream.finish("cancelled")
        raise
    finally:
        handle.close()
        if broker is not None:
            broker.ended(stream)
        gw.hub.mark_finished(stream)
        gw.metrics.retained.set(gw.hub.total_bytes)


async def create_stream(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        body = await read_body(request, gw.config.max_body_bytes)
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise APIError(400, f"Request body is not valid JSON: {exc}", code="invalid_json") from exc
        if not isinstance(obj, dict):
            raise APIError(400, "Request body must be a JSON object.", code="invalid_value")
        endpoint = obj.pop("endpoint", "chat.completions")
        if endpoint not in ("chat.completions", "completions"):
            raise APIError(400, '`endpoint` must be "chat.completions" or "completions".', param="endpoint")
        obj["stream"] = True
        parsed = parse_request(endpoint, orjson.dumps(obj), gw.config.limits)
        gw.hub.check_capacity()
        handle, builder = await gw.open(parsed, request.scope)
    except APIError as exc:
        gw.metrics.requests.labels("/v1/streams", str(exc.status)).inc()
        gw.metrics.errors.labels(error_class(exc)).inc()
        return exc.response()
    stream = gw.hub.create(endpoint, builder._base["model"], stream_id=handle.request_id)
    if gw.broker is not None:
        # Announce before the id is handed out (and before any event): every replica finds it at once.
        await gw.broker.created(stream)
    stream.task = asyncio.create_task(_pump(gw, stream, handle, builder), name=f"pump-{stream.id}")
    gw.metrics.requests.labels("/v1/streams", "201").inc()
    base = str(request.base_url).rstrip("/")
    ws_base = "ws" + base[4:] if base.startswith("http") else base
    auth = request.app.state.auth
    query = f"?token={auth.sign(stream.id)}" if auth.enabled else ""
    return JSONResponse({
        "id": stream.id, "object": "tokenfan.stream", "model": stream.model, "endpoint": endpoint,
        "events_url": f"{base}/v1/streams/{stream.id}/events{query}",
        "ws_url": f"{ws_base}/v1/streams/{stream.id}/ws{query}",
    }, status_code=201, headers={"Location": f"/v1/streams/{stream.id}"})


async def find_stream(gw: Any, stream_id: str) -> Stream:
    """The local stream, else (with a broker) a mirror of another replica's; APIError 404 / 410."""
    try:
        return gw.hub.get(stream_id)  # type: ignore[no-any-return]
    except APIError:
        if gw.broker is None:
            raise
        return await gw.broker.mirror(stream_id)  # type: ignore[no-any-return]


async def stream_status(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        s = await find_stream(gw, request.path_params["id"])
    except APIError as exc:
        return exc.response()
    return JSONResponse({"id": s.id, "object": "tokenfan.stream", "state": s.state, "events": len(s.events),
                         "subscribers": s.subscriber_count(), "bytes": s.size})


async def delete_stream(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        s = await find_stream(gw, request.path_params["id"])
    except APIError as exc:
        return exc.response()
    if s.mirrored and not s.finished:
        # Another replica runs it: ask the owner, then wait for its end to arrive through the broker.
        await gw.broker.cancel_remote(s.id)
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(s.task), 5.0)
    elif s.task is not None and not s.finished:
        s.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await s.task
    return JSONResponse({"id": s.id, "object": "tokenfan.stream", "state": s.state, "deleted": True})


def _after(raw: str | None, what: str) -> int:
    try:
        value = sse.parse_last_event_id(raw)
    except ValueError as exc:
        raise APIError(400, f"{what} must be a non-negative integer event id, got {raw!r}.", param=what,
                       code="invalid_value") from exc
    return -1 if value is None else value


async def _subscribe_check(gw: Any, stream_id: str, after: int) -> Stream:
    stream = await find_stream(gw, stream_id)
    if stream.subscriber_count() >= gw.hub.retention.max_subscribers:
        raise APIError(429, f"Stream {stream_id} has {stream.subscriber_count()} subscribers; the limit is "
                            f"{gw.hub.retention.max_subscribers}.", type="rate_limit_error",
                       code="too_many_subscribers", retry_after=1.0)
    return stream


async def stream_events(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        after = _after(request.headers.get("last-event-id") or request.query_params.get("last_event_id"),
                       "last_event_id")
        stream = await _subscribe_check(gw, request.path_params["id"], after)
    except APIError as exc:
        return exc.response()
    if stream.finished and after >= len(stream.events) - 1 and stream.state == "done":
        return Response(status_code=204)
    return EventStreamResponse(gw, stream, after)


class EventStreamResponse(Response):
    """SSE subscriber: writes pre-encoded events straight to the ASGI ``send`` (with the policy's
    timeout), and stops when the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, gw: Any, stream: Stream, after: int) -> None:
        super().__init__(headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                         media_type=self.media_type)
        # A stream has no length: drop the Content-Length: 0 that Response adds for an empty body.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.gw, self.stream, self.after = gw, stream, after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw, stream = self.gw, self.stream
        delay = gw.config.inject_delay.get("sse", 0.0)
        chunks = gw.metrics.chunks.labels("sse")
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        raw_send = scope.get("tokenfan.raw_send", send)  # the response has started: skip the wrappers

        async def body(data: bytes) -> None:
            await raw_send({"type": "http.response.body", "body": data, "more_body": True})

        async def write(batch: list[Event]) -> None:
            if delay:
                await asyncio.sleep(delay)
            if len(batch) == 1:
                await raw_send(batch[0].sse_message)
            else:
                await body(b"".join(e.sse for e in batch))
            chunks.inc(len(batch))

        async def idle() -> None:
            await body(sse.comment("keep-alive"))

        async def serve() -> bytes:
            await body(sse.comment("tokenfan stream " + stream.id) + b"retry: %d\n\n" % gw.config.sse_retry_ms)
            try:
                await follow(stream, "sse", self.after, write, gw.policy, gw.watchdog, idle=idle)
            except SlowConsumer as exc:
                gw.metrics.errors.labels("network").inc()
                return sse.event(_slow_error(stream, exc).to_bytes(), event="error")
            return _sse_ending(stream)

        gw.metrics.subscribers.labels("sse").inc()
        try:
            ending = await _until_disconnect(serve(), receive)
            if ending is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await send({"type": "http.response.body", "body": ending, "more_body": False})
        finally:
            gw.metrics.subscribers.labels("sse").dec()


def _sse_ending(stream: Stream) -> bytes:
    if stream.state == "cancelled":
        return END_CANCELLED
    if stream.state == "error" and stream.error is not None:
        return sse.event(stream.error.to_bytes(), event="error")
    return sse.DONE


def _slow_error(stream: Stream, exc: SlowConsumer) -> APIError:
    return APIError(503, f"Subscriber too slow ({exc}); resume with Last-Event-ID to continue.",
                    type="server_error", code="slow_consumer")


async def _until_disconnect(work: Any, receive: Receive) -> Any:
    """Run ``work`` until it finishes or the client disconnects (then cancel it, return None)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            msg = await receive()
            if msg["type"] in ("http.disconnect", "websocket.disconnect"):
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


async def stream_ws(ws: WebSocket) -> None:
    gw = gateway_of(ws)
    await ws.accept()
    try:
        after = _after(ws.query_params.get("after"), "after")
        stream = await _subscribe_check(gw, ws.path_params["id"], after)
    except APIError as exc:
        await ws.send_text(orjson.dumps({"type": "error", "error": exc.body()["error"]}).decode())
        await ws.close(4000 + exc.status if exc.status < 1000 else 1008, exc.code or "error")
        return
    delay = gw.config.inject_delay.get("ws", 0.0)
    chunks = gw.metrics.chunks.labels("ws")
    asgi_send = ws.scope.get("tokenfan.raw_send", ws._send)  # accepted already: skip the wrappers

    async def write(batch: list[Event]) -> None:
        if delay:
            await asyncio.sleep(delay)
        for e in batch:
            await asgi_send(e.ws_message)  # the prebuilt message; Starlette's state checks add nothing here
        chunks.inc(len(batch))

    async def serve() -> tuple[int, str, str | None]:
        try:
            await follow(stream, "ws", after, write, gw.policy, gw.watchdog)
        except SlowConsumer:
            gw.metrics.errors.labels("network").inc()
            return 1013, "slow consumer: resume with ?after=<last seq>", None
        if stream.state == "cancelled":
            return 1000, "cancelled", '{"type":"done","reason":"cancelled"}'
        if stream.state == "error" and stream.error is not None:
            return 1011, "generation failed", orjson.dumps({"type": "error", "error": stream.error.body()["error"]}).decode()
        return 1000, "done", '{"type":"done"}'

    gw.metrics.subscribers.labels("ws").inc()
    try:
        result = await _until_disconnect(serve(), ws.receive)
        if result is not None:
            code, reason, last = result
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    if last is not None:
                        await ws.send_text(last)
                    await ws.close(code, reason)
    except WebSocketDisconnect:
        pass
    finally:
        gw.metrics.subscribers.labels("ws").dec()
