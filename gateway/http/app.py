"""The Starlette application: routes, middleware and the lifespan that owns the :class:`Gateway`.

Route modules: :mod:`gateway.api.openai.routes` (chat/completions/models), :mod:`gateway.api.openai.ws_mux`
(``/v1/ws``), :mod:`gateway.api.openai.fanout` (``/v1/streams``), :mod:`gateway.api.responses` (``/v1/responses``),
:mod:`gateway.api.ui_chat` (``/api/chat``), :mod:`gateway.api.durable` (``/v1/streams/{id}/durable``),
:mod:`gateway.http.service` (health, metrics, time, pages). Every streamed token goes through
:mod:`gateway.core.delivery`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from gateway.api import durable, ui_chat
from gateway.api.adoption import Adopter
from gateway.api.durable.protocol import EXPOSED
from gateway.api.openai import fanout, ws_mux
from gateway.api.openai import routes as routes_openai
from gateway.api.responses import routes as routes_responses
from gateway.api.responses import ws_route as responses_ws_route
from gateway.config import GatewayConfig, TrustedProxies
from gateway.core.engine_pool import EnginePool
from gateway.core.metrics import MigrationCollector
from gateway.core.server_port import ServerPort
from gateway.errors import APIError, EngineError
from gateway.http import internal, service
from gateway.http.access_log import AccessLogMiddleware
from gateway.http.auth import AuthMiddleware
from gateway.http.clients import ClientLimitMiddleware
from gateway.http.heap import HeapFreezer
from gateway.http.middleware import (
    IsolationHeaders,
    RawSend,
    api_error_handler,
    method_not_allowed,
    not_found,
    server_error,
)
from gateway.http.reload import Reloader, add_auth_parts, auth_from
from gateway.scaleout import workers
from gateway.state import Gateway
from tokenfan_settings import traces_endpoint

log = logging.getLogger(__name__)


async def _client_left(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)


def freeze_startup_heap() -> int:
    """Collect, then move every object alive now (the app, its modules, the engine links, the broker's clients)
    to the permanent generation, which no collection scans; returns how many. The engine worker and ``vllm
    serve``'s API server do the same once they started: a full collection while streams are live then scans
    only what serving made (docs/vs-vllm.md, GC)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def create_app(config: GatewayConfig, *, extra_lifespan: Any = None, server: ServerPort | None = None) -> RawSend:
    """Build the ASGI app; its lifespan attaches to the engine(s) at ``config.engine_address``. ``server``: the
    port to the ASGI server's own objects (:mod:`gateway.http.uvicorn_shim`), None for the plain ASGI path."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine = EnginePool([a.strip() for a in config.engine_address.split(",") if a.strip()],
                            heartbeat_interval=config.heartbeat_interval, heartbeat_timeout=config.heartbeat_timeout,
                            curve_dir=config.curve_dir, migration=config.migration)
        await engine.start()
        # Accept connections once the engine answers (bounded: an engine that starts later is fine too),
        # so a fresh gateway or worker does not answer its first requests with 503.
        for _ in range(int(2.0 / 0.02)):
            if engine.healthy:
                break
            await asyncio.sleep(0.02)
        gw = Gateway(config=config, engine=engine)
        gw.metrics.registry.register(MigrationCollector(engine.migrations))
        traces = traces_endpoint(config.otlp_traces_endpoint)
        if traces is not None:
            from gateway.telemetry import OtelTracer

            gw.tracer = tracer = OtelTracer.otlp(traces, attributes={"tokenfan.worker": str(workers.worker_index())})
            log.info("tracing: spans of every generation to %s (OTLP/HTTP)", traces)
        reloader.counter = gw.metrics.reloads
        gc.set_threshold(config.gc_gen0_threshold, *gc.get_threshold()[1:])
        app.state.gateway = gw
        gw.loop.start()
        if config.broker_url:
            from gateway.scaleout.broker import Broker
            from gateway.scaleout.redis_clients import Credentials

            redis = Broker(config.broker_url, gw.hub, idle_timeout=config.broker_idle_timeout,
                           local_cancel=gw.cancel_local_stream, timings=config.broker,
                           on_fenced=lambda _, reason: gw.metrics.given_up.labels(reason).inc(),
                           credentials=Credentials(config.broker_password, config.broker_sentinel_password))
            await redis.start()
            gw.remote = gw.publisher = redis
            redis.mirrors.adopt = Adopter(gw, redis)
        if config.workers > 1:
            from gateway.scaleout.peers import Peers

            gw.peers = Peers(gw.hub, port=config.port, workers=config.workers, me=workers.worker_index(),
                             idle_timeout=config.broker_idle_timeout, recheck=config.broker.lease_interval,
                             standby_timeout=config.standby_timeout)
            if gw.remote is None:  # the workers mirror, hold standbys of and adopt each other's streams
                gw.remote = gw.publisher = gw.peers
                gw.peers.mirrors.adopt = Adopter(gw, gw.peers, refuse=gw.peers.refusal)
            # with --broker, Redis mirrors (and adoption) across workers too
        others = [b for b in dict.fromkeys((gw.remote, gw.peers)) if b is not None]
        for transport, delay in config.inject_delay.items():
            log.warning("DIAGNOSTIC --inject-delay: every %s write is delayed by %.3f ms (benchmark calibration "
                        "only; never in production)", transport, delay * 1000)
        log.info("froze the start-up heap: %d objects", freeze_startup_heap())
        freezer = HeapFreezer(lambda: len(gw.watchdog.subs))  # every reader, on every path
        freezer.start()
        app.state.heap = freezer  # /health's "gc"
        try:
            if extra_lifespan is not None:
                async with extra_lifespan(gw):
                    yield
            else:
                yield
        finally:
            freezer.stop()
            gc.unfreeze()  # what the shutdown drops is collectable again
            gw.watchdog.stop()
            gw.loop.stop()
            for other in others:
                await other.close()
            await engine.close()
            if traces is not None:
                await asyncio.to_thread(tracer.shutdown)  # the spans still queued are exported

    routes: list[Any] = [
        Route("/v1/chat/completions", routes_openai.completions_route("chat.completions"), methods=["POST"]),
        Route("/v1/completions", routes_openai.completions_route("completions"), methods=["POST"]),
        Route("/v1/models", routes_openai.models, methods=["GET"]),
        WebSocketRoute("/v1/ws", ws_mux.ws_endpoint),
        Route("/v1/streams", fanout.create_stream, methods=["POST"]),
        Route("/v1/streams/{id}", fanout.stream_status, methods=["GET"]),
        Route("/v1/streams/{id}", fanout.delete_stream, methods=["DELETE"]),
        Route("/v1/streams/{id}/events", fanout.stream_events, methods=["GET"]),
        WebSocketRoute("/v1/streams/{id}/ws", fanout.stream_ws),
        *durable.mount(),  # the Durable Streams protocol's read side of every listed stream
        Route("/v1/responses", routes_responses.create_response, methods=["POST"]),
        Route("/v1/responses/{id}", routes_responses.retrieve_response, methods=["GET"]),
        Route("/v1/responses/{id}", routes_responses.delete_response, methods=["DELETE"]),
        Route("/v1/responses/{id}/cancel", routes_responses.cancel_response, methods=["POST"]),
        WebSocketRoute("/v1/responses", responses_ws_route.responses_ws_endpoint),
        *ui_chat.mount(),  # the AI SDK's useChat: POST /api/chat, GET / DELETE /api/chat/{id}/stream
        Route("/livez", service.livez, methods=["GET"]),
        Route("/readyz", service.readyz, methods=["GET"]),
        Route("/health", service.health, methods=["GET"]),
        Route("/metrics", service.metrics, methods=["GET"]),
        Route("/v1/time", service.server_time, methods=["GET"]),
        *service.page_routes(),
    ]
    if config.workers > 1:  # served only over each worker's private Unix socket (gateway.scaleout.workers)
        routes += [Route("/internal/streams/{id}", internal.internal_stream, methods=["GET", "POST"]),
                   Route("/internal/streams/{id}", internal.internal_cancel, methods=["DELETE"]),
                   Route("/internal/transcripts/{id}", internal.internal_transcript, methods=["GET"]),
                   Route("/internal/metrics", internal.internal_metrics, methods=["GET"]),
                   Route("/internal/ready", internal.internal_ready, methods=["GET"]),
                   Route("/internal/standby/{id}", internal.internal_standby, methods=["POST"])]
    auth = auth_from(config)
    reloader = Reloader()  # SIGHUP (the server registers the handler and adds its TLS parts)
    add_auth_parts(reloader, auth, config)
    middleware = [Middleware(AccessLogMiddleware), Middleware(IsolationHeaders), Middleware(AuthMiddleware, auth=auth),
                  Middleware(ClientLimitMiddleware, trusted=TrustedProxies(config.trusted_proxies))]
    if config.cors_origins:
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(config.cors_origins),
                                        allow_methods=["GET", "HEAD", "POST", "DELETE"],
                                        allow_headers=["Authorization", "Content-Type", "Last-Event-ID",
                                                       "If-None-Match"],
                                        expose_headers=list(EXPOSED)))
    app = Starlette(
        routes=routes, lifespan=lifespan, middleware=middleware,
        exception_handlers={APIError: api_error_handler, EngineError: api_error_handler,
                            ClientDisconnect: _client_left, 404: not_found, 405: method_not_allowed,
                            500: server_error},
    )
    app.state.auth = auth
    app.state.reloader = reloader
    return RawSend(app, server)
