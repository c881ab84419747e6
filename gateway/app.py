"""The Starlette application: routes, lifespan, and the OpenAI-compatible endpoints.

Transports stay thin: they move the chunk objects :mod:`gateway.generation` produces, framed by
:mod:`gateway.sse` or as WebSocket JSON messages.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib.util
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from engine_worker import protocol as p
from gateway import fanout, sse
from gateway.access_log import AccessLogMiddleware
from gateway.auth import Auth, AuthMiddleware
from gateway.config import GatewayConfig
from gateway.edge import gateway_of, read_body
from gateway.engine_client import RequestHandle
from gateway.engine_pool import EnginePool
from gateway.errors import APIError, engine_unavailable, error_class
from gateway.generation import chunk_events
from gateway.metrics import ChunkMeter, Metrics
from gateway.openai_api import ChunkBuilder, Endpoint, ParsedRequest, dumps, new_id, parse_request
from gateway.streams import SlowConsumerPolicy, StreamHub, Watchdog

log = logging.getLogger(__name__)



def _web_dir() -> Path | None:
    """The pages: ``web/`` ships in the wheel as the ``tokenfan_web`` package (see pyproject.toml)."""
    spec = importlib.util.find_spec("tokenfan_web")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(loc) / "index.html").is_file():
            return Path(loc)
    return None


WEB_DIR = _web_dir()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Gateway:
    """Everything the routes share: config, engine link, metrics (owned by the lifespan)."""

    config: GatewayConfig
    engine: EnginePool
    metrics: Metrics = field(default_factory=Metrics)
    hub: StreamHub = field(init=False)
    policy: SlowConsumerPolicy = field(init=False)
    watchdog: Watchdog = field(init=False)
    broker: Any = None  # gateway.broker.Broker with --broker
    draining: bool = False
    active: collections.Counter[str | None] = field(default_factory=collections.Counter)

    def __post_init__(self) -> None:
        self.hub = StreamHub(self.config.retention)
        self.policy = self.config.policy
        self.watchdog = Watchdog(self.policy.send_timeout, self.config.keepalive_interval)

    def cancel_local_stream(self, stream_id: str) -> bool:
        """Cancel a generation this gateway runs (a broker-forwarded DELETE); False if not ours."""
        s = self.hub.streams.get(stream_id)
        if s is None or s.mirrored or s.finished or s.task is None:
            return False
        s.task.cancel()
        return True

    def in_flight(self) -> int:
        """Generations this gateway is still waiting on the engine for."""
        return sum(c.in_flight for c in self.engine.clients)

    def end_all_streams(self) -> None:
        """Shutdown deadline: fail every in-flight generation with an explicit error."""
        err = APIError(503, "The server is shutting down; retry on another instance.", type="server_error",
                       code="server_shutdown", retry_after=1.0)
        n = self.engine.fail_all(err)
        if n:
            log.warning("shutdown grace period over: ended %d in-flight generations with server_shutdown", n)

    @property
    def model_id(self) -> str | None:
        return self.config.served_model_name or self.engine.model

    def check_model(self, requested: str | None) -> str:
        if self.draining:
            raise APIError(503, "The server is shutting down.", type="server_error", code="server_shutdown",
                           retry_after=1.0)
        served = self.model_id
        if served is None or not self.engine.healthy:
            raise engine_unavailable()
        if requested is not None and requested != served:
            raise APIError(404, f"The model `{requested}` does not exist. This server serves `{served}`.",
                           param="model", code="model_not_found")
        return served

    def _admit(self, key: str | None) -> None:
        total = sum(self.active.values())
        if total >= self.config.max_concurrent:
            raise APIError(429, f"Too many concurrent generations ({total}); the limit is "
                                f"{self.config.max_concurrent}.", type="rate_limit_error",
                           code="too_many_requests", retry_after=1.0)
        per_key = self.config.max_concurrent_per_key
        if per_key and key is not None and self.active[key] >= per_key:
            raise APIError(429, f"This API key has {self.active[key]} generations in flight; the limit is "
                                f"{per_key}.", type="rate_limit_error", code="too_many_requests", retry_after=1.0)

    def _release(self, key: str | None) -> None:
        self.active[key] -= 1
        if self.active[key] <= 0:
            del self.active[key]

    async def open(self, parsed: ParsedRequest, scope: Any = None) -> tuple[RequestHandle, ChunkBuilder]:
        """Submit to the engine and wait until it accepted (prompt validated); raises APIError.

        ``scope`` (of the HTTP request or WebSocket) supplies the API key for per-key limits and the
        request id the engine logs as ``trace``; the generation id is recorded for the access log."""
        state = scope.setdefault("state", {}) if scope is not None else {}
        key = state.get("api_key")
        model = self.check_model(parsed.model)
        self._admit(key)
        rid = new_id(parsed.endpoint)
        handle = self.engine.submit(parsed.to_submit(rid, trace_id=state.get("request_id", rid)))
        state["generation_id"] = rid
        self.active[key] += 1
        handle.on_close.append(lambda: self._release(key))
        try:
            prompt_tokens = await handle.wait_accepted(self.config.accept_timeout)
            limit = self.config.max_prompt_tokens
            if limit and prompt_tokens > limit:
                raise APIError(400, f"The prompt has {prompt_tokens} tokens; this server accepts at most {limit}.",
                               param="messages" if parsed.endpoint == "chat.completions" else "prompt",
                               code="prompt_too_long")
        except BaseException:
            handle.close()
            raise
        return handle, ChunkBuilder(parsed.endpoint, rid, model, parsed.include_usage)


# -- OpenAI HTTP endpoints --------------------------------------------------------------------


def completions_route(endpoint: Endpoint):  # type: ignore[no-untyped-def]
    async def handler(request: Request) -> Response:
        gw = gateway_of(request)
        name = "/v1/" + endpoint.replace(".", "/")
        try:
            body = await read_body(request, gw.config.max_body_bytes)
            parsed = parse_request(endpoint, body, gw.config.limits)
            handle, builder = await gw.open(parsed, request.scope)
        except APIError as exc:
            gw.metrics.requests.labels(name, str(exc.status)).inc()
            gw.metrics.errors.labels(error_class(exc)).inc()
            return exc.response()
        except ClientDisconnect:
            return Response(status_code=499)
        gw.metrics.requests.labels(name, "200").inc()
        if parsed.stream:
            return TimedStreamingResponse(sse_body(gw, handle, builder, time.monotonic()), gw.policy.send_timeout,
                                          media_type="text/event-stream", headers=SSE_HEADERS)
        return await full_response(gw, handle, builder)

    return handler


class TimedStreamingResponse(StreamingResponse):
    """A StreamingResponse whose every write must finish within ``send_timeout`` seconds: a client
    that stopped reading (dead peer, full buffers) ends the response, which aborts its generation."""

    def __init__(self, content: AsyncIterator[bytes], send_timeout: float, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.send_timeout = send_timeout

    async def stream_response(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            async with asyncio.timeout(self.send_timeout):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def sse_body(gw: Gateway, handle: RequestHandle, builder: ChunkBuilder, t0: float) -> AsyncIterator[bytes]:
    """The POST streaming body; aborts the engine request if the client leaves (task cancelled)."""
    m = gw.metrics
    m.active_streams.labels("sse").inc()
    meter = ChunkMeter(m, "sse", t0)
    try:
        async for ev in chunk_events(handle, builder, idle=gw.config.keepalive_interval):
            if ev is None:
                yield sse.comment("keep-alive")
                continue
            meter.observe(ev.text, ev.tokens, ev.emit_ns)
            yield b"data: " + dumps(ev.chunk) + b"\n\n"
        yield sse.DONE
    except APIError as exc:
        m.errors.labels(error_class(exc)).inc()
        yield sse.event(exc.to_bytes(), event="error")
    finally:
        m.active_streams.labels("sse").dec()
        if not handle.done:
            m.aborted.inc()
            log.info("client left: aborting %s", handle.request_id)
        handle.close()


async def full_response(gw: Gateway, handle: RequestHandle, builder: ChunkBuilder) -> Response:
    texts: list[str] = []
    finish: str | None = None
    usage: p.Usage | None = None
    try:
        async for ev in chunk_events(handle, builder):
            assert ev is not None
            texts.append(ev.text)
            if ev.finish_reason is not None:
                finish, usage = ev.finish_reason, ev.usage
    except APIError as exc:
        return exc.response()
    finally:
        handle.close()
    assert usage is not None
    return Response(dumps(builder.full_response("".join(texts), finish, usage)), media_type="application/json")


# -- WebSocket /v1/ws -------------------------------------------------------------------------


class WsSession:
    """One ``/v1/ws`` connection: many generations multiplexed by client-chosen ids.

    A single writer task owns the socket's send side; generations put encoded messages on this
    connection's own bounded queue. A client that lets the queue fill is closed with 1013.
    """

    def __init__(self, gw: Gateway, ws: WebSocket) -> None:
        self.gw = gw
        self.ws = ws
        self.out: asyncio.Queue[str] = asyncio.Queue(gw.config.ws_send_queue)
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.closing: tuple[int, str] | None = None

    def send(self, msg: dict[str, Any]) -> None:
        try:
            self.out.put_nowait(orjson.dumps(msg).decode())
        except asyncio.QueueFull:
            self.closing = (1013, "client too slow: send queue full")

    async def writer(self) -> None:
        while self.closing is None:
            await self.ws.send_text(await self.out.get())
        await self.ws.close(*self.closing)

    async def run(self) -> None:
        writer = asyncio.create_task(self.writer())
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                raw = msg.get("text") or msg.get("bytes") or b""
                self.on_message(raw.encode() if isinstance(raw, str) else raw)
                if writer.done():
                    break
        finally:
            for t in self.tasks.values():
                t.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer

    def on_message(self, raw: bytes) -> None:
        try:
            msg = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self.send_error(None, APIError(400, "WebSocket message is not valid JSON.", code="invalid_json"))
            return
        if not isinstance(msg, dict):
            self.send_error(None, APIError(400, "WebSocket message must be a JSON object.", code="invalid_value"))
            return
        cid = msg.get("id")
        kind = msg.get("type")
        if not isinstance(cid, str) or not cid or len(cid) > 256:
            self.send_error(None, APIError(400, "`id` must be a non-empty string (max 256 chars).", param="id"))
            return
        if kind == "cancel":
            task = self.tasks.get(cid)
            if task is None:
                self.send_error(cid, APIError(404, f"No active request with id {cid!r}.", param="id",
                                              code="not_found"))
            else:
                task.cancel()
            return
        if kind != "request":
            self.send_error(cid, APIError(400, "`type` must be \"request\" or \"cancel\".", param="type"))
            return
        endpoint = msg.get("endpoint", "chat.completions")
        if endpoint not in ("chat.completions", "completions"):
            self.send_error(cid, APIError(400, "`endpoint` must be \"chat.completions\" or \"completions\".",
                                          param="endpoint"))
            return
        if cid in self.tasks:
            self.send_error(cid, APIError(400, f"Request id {cid!r} is already active.", param="id"))
            return
        body = msg.get("body")
        if not isinstance(body, dict):
            self.send_error(cid, APIError(400, "`body` must be an OpenAI request object.", param="body"))
            return
        self.tasks[cid] = asyncio.create_task(self.generate(cid, endpoint, body))

    def send_error(self, cid: str | None, err: APIError) -> None:
        self.gw.metrics.errors.labels(error_class(err)).inc()
        self.send({"type": "error", "id": cid, "error": err.body()["error"]})

    async def generate(self, cid: str, endpoint: Endpoint, body: dict[str, Any]) -> None:
        gw = self.gw
        handle: RequestHandle | None = None
        gw.metrics.active_streams.labels("ws").inc()
        meter = ChunkMeter(gw.metrics, "ws", time.monotonic())
        try:
            parsed = parse_request(endpoint, orjson.dumps(body), gw.config.limits)
            handle, builder = await gw.open(parsed, self.ws.scope)
            async for ev in chunk_events(handle, builder):
                assert ev is not None
                meter.observe(ev.text, ev.tokens, ev.emit_ns)
                self.send({"type": "chunk", "id": cid, "data": ev.chunk})
            self.send({"type": "done", "id": cid})
        except APIError as exc:
            self.send_error(cid, exc)
        except asyncio.CancelledError:
            if handle is not None and not handle.done:
                gw.metrics.aborted.inc()
            self.send({"type": "done", "id": cid, "cancelled": True})
            raise
        finally:
            gw.metrics.active_streams.labels("ws").dec()
            if handle is not None:
                handle.close()
            self.tasks.pop(cid, None)


async def ws_endpoint(ws: WebSocket) -> None:
    gw = gateway_of(ws)
    await ws.accept()
    gw.metrics.requests.labels("/v1/ws", "101").inc()
    await WsSession(gw, ws).run()


# -- service endpoints ------------------------------------------------------------------------


async def models(request: Request) -> Response:
    gw = gateway_of(request)
    hb = gw.engine.last_heartbeat
    if hb is None or gw.model_id is None:
        return engine_unavailable().response()
    entry: dict[str, Any] = {"id": gw.model_id, "object": "model", "created": 0, "owned_by": "tokenfan",
                             "root": hb.model, "max_model_len": hb.max_model_len, "backend": hb.backend}
    if hb.backend == "synthetic":
        entry["description"] = "synthetic token source for transport tests and benchmarks: NOT a model"
    return JSONResponse({"object": "list", "data": [entry]})


async def health(request: Request) -> Response:
    gw = gateway_of(request)
    hb = gw.engine.last_heartbeat
    engines = gw.engine.status()
    if gw.engine.healthy and hb is not None:
        running, waiting = gw.engine.load()
        return JSONResponse({"status": "ok", "engine": {"id": hb.engine_id, "backend": hb.backend,
                                                        "model": hb.model, "running": running,
                                                        "waiting": waiting}, "engines": engines})
    return JSONResponse({"status": "unavailable", "engine": None, "engines": engines}, status_code=503,
                        headers={"Retry-After": "1"})


async def metrics(request: Request) -> Response:
    gw = gateway_of(request)
    m = gw.metrics
    m.engine_up.set(1 if gw.engine.healthy else 0)
    running, waiting = gw.engine.load()
    m.engine_running.set(running)
    m.engine_queue.set(waiting)
    m.bad_frames.set(gw.engine.bad_frames)
    if gw.engine.last_heartbeat is not None:
        m.engine_bad_frames.set(gw.engine.last_heartbeat.bad_frames)
    return Response(m.render(), media_type=m.content_type)


async def server_time(request: Request) -> Response:
    """The gateway's clock, for NTP-style offset estimation by browser pages."""
    return Response(b'{"time_ns":%d}' % p.now_ns(), media_type="application/json",
                    headers={"Cache-Control": "no-store"})


async def not_found(request: Request, exc: Exception) -> Response:
    return APIError(404, f"No route for {request.method} {request.url.path}.", code="not_found").response()


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    return APIError(405, f"Method {request.method} not allowed on {request.url.path}.",
                    code="method_not_allowed").response()


async def server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, "Internal server error.", type="server_error", code="internal_error").response()


class RawSend:
    """Outermost ASGI wrapper: keeps uvicorn's own ``send`` in the scope as ``tokenfan.raw_send``.

    Starlette wraps ``send`` in three layers (server-error, exception and access-log bookkeeping)
    that matter until the response has started; after that, the per-event writes of fan-out
    subscribers take the raw ``send`` and skip them (~10% of the gateway's CPU under load).
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state = app.state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            scope["tokenfan.raw_send"] = send
        await self.app(scope, receive, send)


class IsolationHeaders:
    """Cross-origin isolation for the pages (COOP + COEP): browsers then give ``performance.now()``
    ~5 µs resolution instead of 100 µs, which the A/B page's latency measurements need."""

    HEADERS = [(b"cross-origin-opener-policy", b"same-origin"), (b"cross-origin-embedder-policy", b"require-corp")]

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


def create_app(config: GatewayConfig, *, extra_lifespan: Any = None) -> Starlette:
    """Build the app; the lifespan attaches to the engine at ``config.engine_address``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine = EnginePool([a.strip() for a in config.engine_address.split(",") if a.strip()],
                            heartbeat_interval=config.heartbeat_interval, heartbeat_timeout=config.heartbeat_timeout,
                            curve_dir=config.curve_dir)
        await engine.start()
        gw = Gateway(config=config, engine=engine)
        app.state.gateway = gw
        if config.broker_url:
            from gateway.broker import Broker

            gw.broker = Broker(config.broker_url, gw.hub, idle_timeout=config.broker_idle_timeout)
            gw.broker.local_cancel = gw.cancel_local_stream
            await gw.broker.start()
        for transport, delay in config.inject_delay.items():
            log.warning("DIAGNOSTIC --inject-delay: every %s write is delayed by %.3f ms (benchmark calibration "
                        "only; never in production)", transport, delay * 1000)
        try:
            if extra_lifespan is not None:
                async with extra_lifespan(gw):
                    yield
            else:
                yield
        finally:
            gw.watchdog.stop()
            if gw.broker is not None:
                await gw.broker.close()
            await engine.close()

    routes: list[Any] = [
        Route("/v1/chat/completions", completions_route("chat.completions"), methods=["POST"]),
        Route("/v1/completions", completions_route("completions"), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        WebSocketRoute("/v1/ws", ws_endpoint),
        Route("/v1/time", server_time, methods=["GET"]),
        Route("/v1/streams", fanout.create_stream, methods=["POST"]),
        Route("/v1/streams/{id}", fanout.stream_status, methods=["GET"]),
        Route("/v1/streams/{id}", fanout.delete_stream, methods=["DELETE"]),
        Route("/v1/streams/{id}/events", fanout.stream_events, methods=["GET"]),
        WebSocketRoute("/v1/streams/{id}/ws", fanout.stream_ws),
    ]
    if WEB_DIR is not None:
        routes.append(Route("/", lambda r: FileResponse(WEB_DIR / "index.html"), methods=["GET"]))
        routes.append(Route("/ab", lambda r: FileResponse(WEB_DIR / "ab.html"), methods=["GET"]))
        routes.append(Mount("/web", StaticFiles(directory=WEB_DIR), name="web"))
    auth = Auth(api_keys=frozenset(config.api_keys), token_ttl=config.stream_token_ttl,
                allowed_origins=config.allowed_origins,
                **({"secret": config.token_secret.encode()} if config.token_secret else {}))
    middleware = [Middleware(AccessLogMiddleware), Middleware(IsolationHeaders), Middleware(AuthMiddleware, auth=auth)]
    if config.cors_origins:
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                                        allow_methods=["GET", "POST", "DELETE"],
                                        allow_headers=["Authorization", "Content-Type", "Last-Event-ID"]))
    app = Starlette(
        routes=routes, lifespan=lifespan, middleware=middleware,
        exception_handlers={404: not_found, 405: method_not_allowed, 500: server_error},
    )
    app.state.auth = auth
    return app
