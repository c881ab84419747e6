"""The bench's QUIC clients (aioquic): SSE over HTTP/3 (``sse-h3``) and WebTransport (``wt``).

A :class:`QuicClient` is one QUIC connection to the gateway's ``--http3-port``; every subscription of a
worker to that origin shares it, as a page's streams share one HTTP/3 connection (and as ``sse-h2`` shares
one HTTP/2 connection): under loss QUIC holds back only the stream that lost a packet. ``wt`` opens one
WebTransport session on it (``/v1/wt``) and one bidirectional stream per generation, carrying the same
request and the same SSE bytes (:mod:`gateway.http3.wire`).

Receive times are taken first thing in ``datagram_received`` (once per datagram) and passed along with
the bytes it carried, so parsing never delays another subscriber's stamp.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived, WebTransportStreamDataReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamDataReceived, StreamReset

from gateway.http3.wire import RequestHead, parse_response_head
from tokenfan_bench.clients.recorder import Recorder, on_sse_event
from tokenfan_bench.wire.events import SseDecoder

time_ns = time.time_ns
PARSE_ERRORS = (ValueError, KeyError, TypeError)
WT_PATH = "/v1/wt"


class QuicGone(ConnectionError):
    """The QUIC connection, the WebTransport session or the stream ended before the response did."""


QUIC_ERRORS: tuple[type[Exception], ...] = (OSError, QuicGone, ssl.SSLError)


def _retrieved(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


class Response:
    """One response being read: its head, its body pieces (each with its receive time) and its end."""

    def __init__(self, on_body: Callable[[int, bytes], None] | None = None) -> None:
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.head_ns = 0
        self.chunks: list[bytes] = []
        self.on_body = on_body
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.done.add_done_callback(_retrieved)  # a response nobody awaits any more may fail quietly
        self._head_buf = bytearray()  # WebTransport: the JSON head line, until complete

    def body(self, t: int, data: bytes) -> None:
        if self.on_body is not None:
            self.on_body(t, data)
        else:
            self.chunks.append(data)

    def wt_data(self, t: int, data: bytes) -> None:
        if self.status is None:
            self._head_buf += data
            parsed = parse_response_head(self._head_buf)
            if parsed is None:
                return
            self.status, self.headers, data = parsed
            self.head_ns = t
        if data:
            self.body(t, data)

    def end(self, error: BaseException | None = None) -> None:
        if not self.done.done():
            if error is not None:
                self.done.set_exception(error)
            elif self.status is None:
                self.done.set_exception(QuicGone("stream ended before a response head"))
            else:
                self.done.set_result(None)


class QuicClient(QuicConnectionProtocol):
    """One QUIC connection speaking HTTP/3, with WebTransport enabled."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic, enable_webtransport=True)
        self.responses: dict[int, Response] = {}
        self.session: int | None = None  # the WebTransport session's stream id, once accepted
        self._session_ready: asyncio.Future[None] | None = None
        self.wt_streams: set[int] = set()  # WebTransport streams this client opened
        self._t = 0

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self._t = time_ns()
        super().datagram_received(data, addr)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            err = QuicGone(f"QUIC connection closed: {event.reason_phrase or event.error_code}")
            for resp in self.responses.values():
                resp.end(err)
            self.responses.clear()
            if self._session_ready is not None and not self._session_ready.done():
                self._session_ready.set_exception(err)
            return
        if isinstance(event, StreamReset):
            self.wt_streams.discard(event.stream_id)
            reset = self.responses.pop(event.stream_id, None)
            if reset is not None:
                reset.end(QuicGone(f"stream reset by the server (code {event.error_code:#x})"))
        if isinstance(event, StreamDataReceived) and event.stream_id in self.wt_streams:
            # aioquic's H3Connection parses the answer on a stream the client opened as HTTP/3 frames:
            # a WebTransport stream's bytes are read here instead
            self._h3_event(WebTransportStreamDataReceived(event.data, event.stream_id, event.end_stream,
                                                          self.session or 0))
            if event.end_stream:
                self.wt_streams.discard(event.stream_id)
            return
        for h3_event in self.h3.handle_event(event):
            self._h3_event(h3_event)

    def _h3_event(self, event: H3Event) -> None:
        t = self._t or time_ns()
        if isinstance(event, HeadersReceived):
            if event.stream_id == self.session and self._session_ready is not None:
                status = dict(event.headers).get(b":status", b"")
                if not self._session_ready.done():
                    if status == b"200":
                        self._session_ready.set_result(None)
                    else:
                        self._session_ready.set_exception(QuicGone(f"WebTransport CONNECT: HTTP {status.decode()}"))
                return
            resp = self.responses.get(event.stream_id)
            if resp is not None:
                resp.status = int(dict(event.headers)[b":status"])
                resp.headers = {k.decode(): v.decode() for k, v in event.headers if not k.startswith(b":")}
                resp.head_ns = t
                if event.stream_ended:
                    self.responses.pop(event.stream_id).end()
        elif isinstance(event, DataReceived):
            resp = self.responses.get(event.stream_id)
            if resp is not None:
                resp.body(t, event.data)
                if event.stream_ended:
                    self.responses.pop(event.stream_id).end()
        elif isinstance(event, WebTransportStreamDataReceived):
            resp = self.responses.get(event.stream_id)
            if resp is not None:
                resp.wt_data(t, event.data)
                if event.stream_ended:
                    self.responses.pop(event.stream_id).end()

    # -- HTTP/3
    def request(self, method: str, authority: str, target: str, headers: dict[str, str] | None = None,
                body: bytes = b"", on_body: Callable[[int, bytes], None] | None = None) -> tuple[int, Response]:
        sid = self._quic.get_next_available_stream_id()
        resp = self.responses[sid] = Response(on_body)
        self.h3.send_headers(sid, [(b":method", method.encode()), (b":scheme", b"https"),
                                   (b":authority", authority.encode()), (b":path", target.encode()),
                                   *((k.encode(), v.encode()) for k, v in (headers or {}).items())],
                             end_stream=not body)
        if body:
            self.h3.send_data(sid, body, end_stream=True)
        self.transmit()
        return sid, resp

    # -- WebTransport
    async def open_session(self, authority: str, path: str = WT_PATH, origin: str | None = None) -> int:
        if self.session is not None:
            assert self._session_ready is not None
            await self._session_ready
            return self.session
        sid = self.session = self._quic.get_next_available_stream_id()
        self._session_ready = asyncio.get_running_loop().create_future()
        self.h3.send_headers(sid, [(b":method", b"CONNECT"), (b":protocol", b"webtransport"), (b":scheme", b"https"),
                                   (b":authority", authority.encode()), (b":path", path.encode()),
                                   (b"origin", (origin or f"https://{authority}").encode())])
        self.transmit()
        await self._session_ready
        return sid

    def open_wt_stream(self) -> int:
        assert self.session is not None
        sid = self.h3.create_webtransport_stream(self.session)
        self.wt_streams.add(sid)
        return sid

    def wt_request(self, head: RequestHead, body: bytes = b"",
                   on_body: Callable[[int, bytes], None] | None = None) -> tuple[int, Response]:
        assert self.session is not None
        sid = self.open_wt_stream()
        resp = self.responses[sid] = Response(on_body)
        self._quic.send_stream_data(sid, head.encode() + body, end_stream=True)
        self.transmit()
        return sid, resp

    def cancel(self, sid: int) -> None:
        """Give up on a response: reset our side and ask the server to stop sending."""
        resp = self.responses.pop(sid, None)
        if resp is not None:
            resp.end(QuicGone("cancelled"))
        try:
            self._quic.stop_stream(sid, 0x10C)
        except (AssertionError, ValueError):  # already finished on our side
            pass
        self.transmit()


def free_udp_port(host: str = "127.0.0.1") -> int:
    """A UDP port free on ``host`` now (for a gateway's ``--http3-port``)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def h3_gateway_args(cert_dir: Path, host: str = "127.0.0.1", port: int | None = None) -> tuple[list[str], str]:
    """Gateway flags for an HTTP/3 listener with a fresh self-signed certificate in ``cert_dir`` (valid 13
    days: browsers take it by hash for WebTransport), and the URL the QUIC arms connect to."""
    from gateway.http.certs import generate

    cert, key = (cert_dir / "cert.pem", cert_dir / "key.pem")
    if not cert.exists():
        cert, key = generate(cert_dir, days=13)
    port = port or free_udp_port(host)
    return ([f"--http3-port={port}", f"--http3-certfile={cert}", f"--http3-keyfile={key}"],
            f"https://{host}:{port}")


def client_configuration(cafile: str | None) -> QuicConfiguration:
    qc = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, max_datagram_frame_size=65536)
    if cafile:
        qc.load_verify_locations(cafile)
    else:
        qc.verify_mode = ssl.CERT_NONE
    return qc


class QuicOrigin:
    """One shared :class:`QuicClient` per origin (``host:port``), opened on first use, reopened if it closed."""

    def __init__(self, host: str, port: int, cafile: str | None) -> None:
        self.host, self.port, self.authority = host, port, f"{host}:{port}"
        self.configuration = client_configuration(cafile)
        self._client: QuicClient | None = None
        self._cm: Any = None
        self._opening: asyncio.Lock = asyncio.Lock()

    async def client(self) -> QuicClient:
        async with self._opening:
            if self._client is not None and not self._client._closed.is_set():  # noqa: SLF001  (aioquic)
                return self._client
            await self.close()
            self._cm = connect(self.host, self.port, configuration=self.configuration, create_protocol=QuicClient,
                               wait_connected=True)
            self._client = await self._cm.__aenter__()
            return self._client

    async def close(self) -> None:
        cm, self._cm, self._client = self._cm, None, None
        if cm is not None:
            try:
                await asyncio.wait_for(cm.__aexit__(None, None, None), 2.0)
            except (TimeoutError, OSError, ssl.SSLError):  # QuicGone is an OSError
                pass


def sse_sink(rec: Recorder) -> Callable[[int, bytes], None]:
    dec = SseDecoder()

    def on_body(t: int, data: bytes) -> None:
        if rec.error is None:
            try:
                for ev in dec.feed(data):
                    on_sse_event(rec, t, ev)
            except PARSE_ERRORS as exc:
                rec.fail(f"sse: {type(exc).__name__}: {exc}"[:300])

    return on_body


async def read_events(client: QuicClient, transport: str, authority: str, target: str, rec: Recorder,
                      last_event_id: int | None = None) -> None:
    """Subscribe ``rec`` to ``target`` (a ``/v1/streams/{id}/events`` path) over ``transport``
    (``sse-h3`` or ``wt``) until the stream's end; ``last_event_id`` resumes after that event."""
    headers = {"accept": "text/event-stream"}
    if last_event_id is not None:
        headers["last-event-id"] = str(last_event_id)
    if transport == "wt":
        await client.open_session(authority)
        sid, resp = client.wt_request(RequestHead("GET", target, headers), on_body=sse_sink(rec))
    else:
        sid, resp = client.request("GET", authority, target, headers, on_body=sse_sink(rec))
    try:
        await resp.done
    except BaseException:
        client.cancel(sid)
        raise
    rec.connected_ns = rec.connected_ns or resp.head_ns
    if resp.status != 200:
        rec.fail(f"{transport} HTTP {resp.status}")
    elif not rec.done:
        rec.fail(f"{transport}: stream ended before [DONE]")


class QuicBackend:
    """The ``sse-h3`` and ``wt`` arms of the fast client: per gateway address, QUIC connections that carry
    up to ``k`` subscriptions each (``--h2-streams-per-connection``, as the HTTP/2 arms share theirs)."""

    transports = ("sse-h3", "wt")
    errors = QUIC_ERRORS

    def __init__(self, cafile: str | None, k: int = 1) -> None:
        self.cafile, self.k = cafile, max(1, k)
        self.pools: dict[tuple[str, int, str], list[tuple[QuicOrigin, list[int]]]] = {}

    async def _acquire(self, transport: str, url: str) -> tuple[QuicOrigin, list[int], str]:
        u = urlsplit(url)
        host, port = u.hostname or "127.0.0.1", u.port or 443
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        pool = self.pools.setdefault((host, port, transport), [])
        for origin, active in pool:
            if active[0] < self.k:
                break
        else:
            origin, active = QuicOrigin(host, port, self.cafile), [0]
            pool.append((origin, active))
        active[0] += 1
        return origin, active, target

    async def subscribe(self, transport: str, info: dict[str, Any], rec: Recorder) -> None:
        # events_url is rebased on the arm's https://host:<--http3-port> (Plan.arm_urls)
        origin, active, target = await self._acquire(transport, info["events_url"])
        try:
            client = await origin.client()
            await read_events(client, transport, origin.authority, target, rec)
        finally:
            active[0] -= 1

    async def aclose(self) -> None:
        for pool in self.pools.values():
            for origin, _ in pool:
                await origin.close()
