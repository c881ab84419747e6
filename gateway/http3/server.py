"""The QUIC listener (``--http3-port``): started and stopped with the app's lifespan, in the same event loop
as the TCP server (uvicorn or Granian), so HTTP/3 and WebTransport readers share its delivery core.

The listener serves ALPN ``h3`` only. Browsers find HTTP/3 through ``Alt-Svc`` or, for WebTransport, are
pointed at it (``new WebTransport("https://host:PORT/v1/wt")``); nothing here advertises it on the TCP port.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from aioquic.asyncio import serve
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration

from gateway.http3.bridge import H3Protocol

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

log = logging.getLogger("tokenfan.http3")

MAX_DATAGRAM_FRAME = 65536  # WebTransport needs datagram support negotiated, though no datagram is sent


def quic_configuration(config: GatewayConfig) -> QuicConfiguration:
    """The server's QUIC settings from the gateway's: certificate (``--http3-certfile``, else
    ``--ssl-certfile``) and idle timeout (a little over two keep-alive intervals)."""
    cert = config.http3_certfile or config.ssl_certfile
    key = config.http3_keyfile or config.ssl_keyfile
    if not (cert and key):
        raise SystemExit("--http3-port needs a certificate: --http3-certfile/--http3-keyfile or "
                         "--ssl-certfile/--ssl-keyfile (QUIC always uses TLS; `tokenfan certs DIR` makes one)")
    qc = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN, max_datagram_frame_size=MAX_DATAGRAM_FRAME,
                           idle_timeout=max(30.0, 3 * config.keepalive_interval))
    qc.load_cert_chain(str(cert), str(key))
    return qc


def http3_lifespan(app_of: Callable[[], Any], config: GatewayConfig, inner: Any = None) -> Any:
    """An ``extra_lifespan`` for :func:`gateway.http.app.create_app` that serves ``app_of()`` over QUIC on
    ``--http3-port`` while the app runs (``inner``: another extra lifespan, entered inside)."""
    if config.workers > 1:
        raise SystemExit("--http3-port serves one process: QUIC connections cannot share a UDP port "
                         "between --workers without connection-id routing")
    qc = quic_configuration(config)

    @contextlib.asynccontextmanager
    async def lifespan(gw: Any) -> AsyncIterator[None]:
        open_: set[H3Protocol] = set()

        def create(*args: Any, **kwargs: Any) -> H3Protocol:
            proto = H3Protocol(*args, **kwargs)
            proto.app = app_of()
            proto.on_close = open_.discard
            open_.add(proto)
            return proto

        server = await serve(config.host, config.http3_port, configuration=qc, create_protocol=create)
        log.info("serving HTTP/3 and WebTransport on udp://%s:%d", config.host, config.http3_port)
        try:
            if inner is not None:
                async with inner(gw):
                    yield
            else:
                yield
        finally:
            for proto in list(open_):
                proto.close_all()
            server.close()

    return lifespan
