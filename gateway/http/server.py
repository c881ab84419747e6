"""The ASGI server under the gateway: which one, its timeouts, and the SIGTERM drain.

- Cleartext HTTP/1.1 (the default, and the upstream side of a reverse proxy): uvicorn with httptools
  and uvloop. It has the lowest CPU per delivered event on the fan-out hot path here.
- TLS (``--ssl-certfile``/``--ssl-keyfile``): Granian (Rust, hyper). It negotiates HTTP/2 by ALPN and
  still offers HTTP/1.1 on the same port, where WebSockets upgrade (it does not speak RFC 8441);
  uvicorn has no HTTP/2 at all and Hypercorn costs more CPU per event. The measurements behind this
  choice are in docs/tls.md ("Choosing the ASGI server", ``tools/asgi_servers.py``). What Granian lacks
  is added here (:class:`WsMessageLimit`) or documented (no WebSocket pings).

Both close slowloris connections: a request head must arrive within ``--http-header-timeout`` seconds
(uvicorn: :class:`HeaderTimeoutProtocol`; Granian: its HTTP/1 header read timeout) and a body within
``--http-body-timeout`` (uvicorn: the same protocol answers 408 and closes; Granian: ``read_body``).

Both drain the same way on SIGTERM/SIGINT (:func:`drain`) and then return normally, so ``tokenfan
serve``/``gateway`` exit 0 after a clean drain (uvicorn on its own re-raises the signal: exit -15).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.core.bare import close_detached
from gateway.errors import ClientError

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

log = logging.getLogger("tokenfan.server")
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def run_gateway(config: GatewayConfig, extra_lifespan: Any = None) -> None:
    """Serve the gateway app until SIGTERM/SIGINT, drain, return (the caller exits 0)."""
    from gateway.http.app import create_app

    if config.http3_port:  # QUIC beside the TCP server, in its event loop, through the same app
        from gateway.http3.server import http3_lifespan

        extra_lifespan = http3_lifespan(lambda: app, config, extra_lifespan)
    app = create_app(config, extra_lifespan=extra_lifespan)  # RawSend is part of the app
    if config.ssl_certfile or config.ssl_keyfile:
        if not (config.ssl_certfile and config.ssl_keyfile):
            raise SystemExit("--ssl-certfile and --ssl-keyfile go together")
        if config.workers > 1:
            raise SystemExit("--workers > 1 serves cleartext HTTP/1.1 (uvicorn); put TLS in front (deploy/nginx)")
        run_granian(app, config)
        return
    run_uvicorn(app, config)


async def drain(app: Any, grace: float) -> None:
    """New generations get 503; listed streams are handed over if another gateway serves (``--handover``);
    in-flight streams get ``grace`` seconds to finish; the rest end with an explicit ``server_shutdown``
    error (never a silent cut, never a hang)."""
    gw = getattr(app.state, "gateway", None)
    if gw is None:
        return
    gw.draining = True
    loop = asyncio.get_running_loop()
    if gw.config.handover and gw.publisher is not None and await gw.publisher.successor():
        await hand_over(gw)
    deadline = loop.time() + grace
    while gw.in_flight() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if gw.end_all_streams():
        await asyncio.sleep(0.2)  # let the error events reach the clients
    await close_detached(gw.delivery.detached, 1.0)  # subscribers out of their ASGI call: uvicorn does not wait


async def hand_over(gw: Any) -> None:
    """Listed streams go to the other replicas (``--handover``): each ends here ``moved`` (its readers
    disconnected without an end, its engine request aborted), every event reaches Redis, and this gateway's
    lease is released, so a replica mirroring them adopts each at once (:mod:`gateway.api.adoption`)."""
    pumps = gw.hand_over()
    if pumps:  # each pump ends its stream and queues nothing more for Redis (at most 1 s)
        await asyncio.wait(pumps, timeout=1.0)
    await gw.publisher.hand_over()
    log.warning("shutdown: handed %d listed streams over to the other replicas", len(pumps))


# ---------------------------------------------------------------------------------------------- uvicorn

class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with read deadlines (slowloris):

    - the request head must be complete ``header_timeout`` seconds after the connection is made or
      after the request's first byte, else the connection is closed;
    - a request body must be complete ``body_timeout`` seconds after its head, else the client gets
      408 (OpenAI error shape, ``Connection: close``) if no response has started, and the connection
      is closed either way; the app sees a disconnect.

    The deadlines are two timer handles per connection, armed and cancelled at parser callbacks: no
    cost per response write. Configured by subclassing (:func:`protocol_class`).
    """

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # a keep-alive connection's next request
            self._arm(self.header_timeout, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self.disarm()
        super().on_headers_complete()
        if not self.parser.should_upgrade() and not self._private():
            self._arm(self.body_timeout, self._body_timed_out)  # cancelled at once if there is no body

    def _private(self) -> bool:
        """A peer worker's request on this worker's private Unix socket (--workers): its body is a standby's
        acknowledgements for as long as its relay runs (gateway.scaleout.peers), so it has no deadline."""
        sock = self.transport.get_extra_info("socket")
        return sock is not None and sock.family == socket.AF_UNIX

    def on_message_complete(self) -> None:
        self.disarm()
        super().on_message_complete()

    def _arm(self, delay: float, callback: Any) -> None:
        self.disarm()
        if delay > 0:
            self._deadline = self.loop.call_later(delay, callback)

    def disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_timed_out(self) -> None:
        self._deadline = None
        log.info("closing %s: request head not complete after %.1f s", self.client, self.header_timeout)
        self.transport.close()

    def _body_timed_out(self) -> None:
        self._deadline = None
        log.info("closing %s: request body not complete after %.1f s", self.client, self.body_timeout)
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and not self.transport.is_closing():
            body = ClientError(408, f"The request body did not arrive within {self.body_timeout:g} s.",
                            code="request_timeout").to_bytes()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()


def protocol_class(header_timeout: float, body_timeout: float) -> type[HeaderTimeoutProtocol]:
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout})


def run_uvicorn(app: Any, config: GatewayConfig) -> None:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """Drains before uvicorn's own shutdown, and handles the signals without re-raising them."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            loop = asyncio.get_running_loop()
            for sig in SIGNALS:
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            try:
                yield
            finally:
                for sig in SIGNALS:
                    loop.remove_signal_handler(sig)

        gate: asyncio.Task[None] | None = None

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            """With ``--workers``: serve the private socket at once, the shared port once the engine link is up."""
            if public is None:
                return await super().startup(sockets)
            await super().startup(sockets)
            config = self.config

            def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
                return config.http_protocol_class(  # type: ignore[call-arg]  # as uvicorn's own startup does
                    config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=_loop)

            loop = asyncio.get_running_loop()
            server = await loop.create_server(create_protocol, sock=public, backlog=config.backlog,
                                              start_serving=False)
            self.servers.append(server)
            self.gate = loop.create_task(listen_when_ready(app, server), name="listen-when-ready")

        async def shutdown(self, sockets: Any = None) -> None:
            if self.gate is not None:
                self.gate.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self.gate
            for server in self.servers:
                server.close()  # stop accepting; open connections (SSE and WS) carry on
            await drain(app, config.shutdown_grace)
            await super().shutdown(sockets)

    sockets: list[socket.socket] | None = None
    public: socket.socket | None = None
    if config.workers > 1:
        from gateway.scaleout.workers import bind_sockets

        public, private = bind_sockets(config)
        sockets = [private]
    GracefulServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level.lower(),
        http=protocol_class(config.http_header_timeout, config.http_body_timeout),
        ws_max_size=config.ws_max_message_bytes, ws_per_message_deflate=config.ws_per_message_deflate,
        ws_ping_interval=config.keepalive_interval, ws_ping_timeout=config.keepalive_interval * 2,
        timeout_graceful_shutdown=math.ceil(config.shutdown_grace + 2.0),
        access_log=False,  # tokenfan.access writes one JSON line per request instead
    )).run(sockets=sockets)


async def listen_when_ready(app: Any, server: asyncio.Server, poll: float = 0.02) -> None:
    """Start listening on the shared port (``--workers``) once this worker's engine link is up: until then
    the kernel gives this worker none of the port's connections, so none gets 503 ``engine_unavailable``."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    gw = app.state.gateway
    while not gw.engine.healthy:
        await asyncio.sleep(poll)
    await server.start_serving()
    gw.listening = True
    log.info("listening on the shared port: engine link up after %.2f s", loop.time() - t0)


# ---------------------------------------------------------------------------------------------- Granian

class WsMessageLimit:
    """Granian has no WebSocket message size setting: an incoming message above ``limit`` bytes closes the
    socket with 1009, as uvicorn's ``ws_max_size`` does (``--ws-max-message-bytes``). Wraps ``receive`` only,
    so the per-event writes are untouched."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit, self.state = app, limit, app.state

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)
        limit = self.limit

        async def limited() -> Any:
            message = await receive()
            if message["type"] == "websocket.receive":
                text, data = message.get("text"), message.get("bytes")
                size = len(data) if data is not None else len(text or "")
                if size > limit // 4 and text is not None:
                    size = len(text.encode())
                if size > limit:
                    await send({"type": "websocket.close", "code": 1009, "reason": "message too big"})
                    return {"type": "websocket.disconnect", "code": 1009}
            return message

        return await self.app(scope, limited, send)


def run_granian(app: Any, config: GatewayConfig) -> None:
    import uvloop
    from granian.constants import HTTPModes, Interfaces, SSLProtocols
    from granian.http import HTTP1Settings
    from granian.server.embed import Server

    app = WsMessageLimit(app, config.ws_max_message_bytes)
    server = Server(
        app, address=config.host, port=config.port, interface=Interfaces.ASGI, http=HTTPModes.auto,
        websockets=True, backlog=2048,  # uvicorn's default (Granian's embedded server has 128)
        ssl_cert=Path(config.ssl_certfile or ""), ssl_key=Path(config.ssl_keyfile or ""),
        ssl_protocol_min=SSLProtocols.tls12,
        http1_settings=HTTP1Settings(header_read_timeout=max(1, int(config.http_header_timeout * 1000))),
        log_enabled=False,  # tokenfan logs through `logging`; tokenfan.access has the requests
    )

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Task[None]] = []

        async def stop() -> None:
            try:
                await drain(app, config.shutdown_grace)
            finally:
                server.stop()  # even if the drain failed: serve() must return

        def on_signal() -> None:
            if not stopping:
                log.info("draining for up to %.1f s", config.shutdown_grace)
                stopping.append(loop.create_task(stop()))

        for sig in SIGNALS:
            loop.add_signal_handler(sig, on_signal)
        log.info("serving https://%s:%d (HTTP/2 and HTTP/1.1 by ALPN)", config.host, config.port)
        await server.serve()
        for task in stopping:  # the drain that stopped the server: wait for its end, raise its error
            await task

    uvloop.run(serve())
