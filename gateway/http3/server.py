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
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

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


def reload_certificate(qc: QuicConfiguration, config: GatewayConfig) -> str:
    """Load the certificate files again into ``qc``, the listener's live configuration: connections made
    from now on handshake with it; open ones keep theirs. Raises ValueError (``qc`` untouched) on a file
    that does not load or a key that is not the certificate's. Returns what the log says."""
    cert = config.http3_certfile or config.ssl_certfile
    key = config.http3_keyfile or config.ssl_keyfile
    fresh = QuicConfiguration(is_client=False)
    try:
        fresh.load_cert_chain(str(cert), str(key))
    except (OSError, ValueError, IndexError, TypeError) as exc:  # IndexError: no certificate in the file
        raise ValueError(f"{cert} / {key}: {exc.__class__.__name__}: {exc}") from exc
    assert fresh.certificate is not None and fresh.private_key is not None
    if _spki(fresh.certificate.public_key()) != _spki(fresh.private_key.public_key()):
        raise ValueError(f"{key} is not the key of {cert}")
    if fresh.certificate == qc.certificate:
        return "certificate unchanged"
    qc.certificate, qc.certificate_chain, qc.private_key = fresh.certificate, fresh.certificate_chain, fresh.private_key
    not_after = fresh.certificate.not_valid_after_utc
    return (f"new certificate for new connections (serial {fresh.certificate.serial_number:x}, valid until "
            f"{not_after:%Y-%m-%d %H:%M} UTC); open ones keep theirs")


def _spki(public_key: Any) -> bytes:
    return bytes(public_key.public_bytes(Encoding.DER, PublicFormat.SubjectPublicKeyInfo))


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

        async def reload_part() -> str:  # SIGHUP (gateway.http.reload)
            return reload_certificate(qc, config)

        server = await serve(config.host, config.http3_port, configuration=qc, create_protocol=create)
        app_of().state.reloader.add("http3 tls", reload_part)
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
