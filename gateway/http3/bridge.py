"""HTTP/3 and WebTransport in front of the same ASGI app: a thin adapter over aioquic.

Each HTTP/3 request stream and each WebTransport stream becomes one ASGI ``http`` exchange of the gateway's
own app, so routes, authentication, per-client limits, resume (``Last-Event-ID``), slow-reader cuts and
metrics are those of every other transport. The delivery core sees an ASGI ``send`` like Granian's (no
uvicorn transport behind it), so its readers write through their own loop, and the connection's label
(``scope["tokenfan.transport"]``: ``sse-h3`` or ``wt``) names their metrics.

- **HTTP/3** (:class:`H3Protocol`, ALPN ``h3``): request streams as in RFC 9114; a streamed response is
  SSE over HTTP/3 (DATA frames, the same bytes).
- **WebTransport** (draft-02, what Chromium speaks): an extended CONNECT to :data:`WT_PATH` opens a
  session (a browser's ``Origin`` is checked as for a WebSocket: the gateway's own host or
  ``--allowed-origins``, else 403); each bidirectional stream the client opens on it carries one exchange, framed as in
  :mod:`gateway.http3.wire` (a JSON head line each way, then the body: for a stream, the SSE bytes).

Back-pressure: aioquic buffers whatever it is given, so ``send`` waits while a stream holds more than
:data:`HIGH_WATER` unacknowledged bytes (woken by every datagram the peer sends, its ACKs among them). A
stalled client therefore blocks the write as a full TCP socket does, and ``--send-timeout`` cuts it. A
stream reset, STOP_SENDING, a closed session or connection is an ``http.disconnect``; a response the app
did not finish is reset, never ended as if complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived, WebTransportStreamDataReceived
from aioquic.quic.events import (
    ConnectionTerminated,
    ProtocolNegotiated,
    QuicEvent,
    StopSendingReceived,
    StreamReset,
)

from gateway.errors import APIError
from gateway.http3.wire import HeadError, RequestHead, response_head, split_head

log = logging.getLogger(__name__)

WT_PATH = "/v1/wt"
HIGH_WATER = 256 * 1024  # unacknowledged bytes a stream may hold before ``send`` waits
H3_REQUEST_CANCELLED = 0x10C
WT_APP_ERROR_0 = 0x52E4A40FA8DB  # WebTransport application error 0, as an HTTP/3 error code
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"proxy-connection"})


class PeerGone(ConnectionError):
    """The stream or connection went away while a response was being written."""


class Exchange:
    """One request and its response, run through the ASGI app as an ``http`` scope."""

    def __init__(self, proto: H3Protocol, stream_id: int, scope: dict[str, Any], *, wt: bool) -> None:
        self.proto, self.stream_id, self.scope, self.wt = proto, stream_id, scope, wt
        self.body: list[bytes] = []
        self.body_done = False
        self.gone = False
        self.finished = False  # the response ended (FIN sent)
        self.started = False
        self._end_given = False  # receive() returned the body's last part
        self._arrived = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    # -- from the network
    def feed(self, data: bytes, ended: bool) -> None:
        if data:
            self.body.append(data)
        self.body_done = self.body_done or ended
        self._arrived.set()

    def disconnect(self) -> None:
        if not self.gone:
            self.gone = True
            self._arrived.set()

    def start(self, app: Any) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run(app), name=f"h3-{self.stream_id}")

    async def _run(self, app: Any) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except PeerGone:
            pass
        except Exception:
            log.exception("HTTP/3 exchange on stream %d failed", self.stream_id)
            if not self.started and not self.gone:
                with contextlib.suppress(PeerGone):
                    err = APIError(500, "Internal server error.", type="server_error", code="internal_error")
                    await self.send({"type": "http.response.start", "status": 500,
                                     "headers": [(b"content-type", b"application/json")]})
                    await self.send({"type": "http.response.body", "body": err.to_bytes()})
        finally:
            if not self.finished and not self.gone:
                self.proto.reset(self.stream_id, WT_APP_ERROR_0 if self.wt else H3_REQUEST_CANCELLED)
            self.proto.forget(self)

    # -- ASGI
    async def receive(self) -> dict[str, Any]:
        while True:
            if self.body or (self.body_done and not self._end_given):
                data = b"".join(self.body)
                self.body.clear()
                self._end_given = self.body_done
                return {"type": "http.request", "body": data, "more_body": not self.body_done}
            if self.gone:
                return {"type": "http.disconnect"}
            self._arrived.clear()
            await self._arrived.wait()

    async def send(self, message: dict[str, Any]) -> None:
        if self.gone:
            raise PeerGone("the client went away")
        kind = message["type"]
        if kind == "http.response.start":
            self.started = True
            headers = [(k.lower(), v) for k, v in message.get("headers", []) if k.lower() not in HOP_BY_HOP]
            self.proto.send_head(self, int(message["status"]), headers)
        elif kind == "http.response.body":
            more = bool(message.get("more_body", False))
            self.proto.send_body(self, message.get("body", b""), end=not more)
            self.finished = not more
            await self.proto.drained(self)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} on an HTTP/3 exchange")


def _scope(proto: H3Protocol, method: str, target: str, headers: list[tuple[bytes, bytes]],
           transport: str, scheme: str = "https") -> dict[str, Any]:
    path, _, query = target.partition("?")
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "3",
        "method": method, "scheme": scheme, "path": unquote(path), "raw_path": path.encode(),
        "query_string": query.encode(), "root_path": "", "headers": headers,
        "client": proto.peer, "server": proto.local, "tokenfan.transport": transport,
    }


class H3Protocol(QuicConnectionProtocol):
    """One QUIC connection: HTTP/3 requests and WebTransport sessions, each exchange through ``app``."""

    app: Any = None  # set by the server (gateway.http3.server)
    on_close: Callable[[H3Protocol], None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3: H3Connection | None = None
        self.exchanges: dict[int, Exchange] = {}
        self.sessions: dict[int, set[int]] = {}  # WebTransport session id -> its exchanges' stream ids
        self.session_authority: dict[int, bytes] = {}
        self.pending: dict[int, bytearray] = {}  # WebTransport streams whose head line is incomplete
        self._progress = asyncio.Event()
        self._flush_soon: asyncio.Handle | None = None
        self.peer: tuple[str, int] | None = None
        self.local: tuple[str, int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        local = transport.get_extra_info("sockname")
        self.local = (local[0], local[1]) if local else None

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        if self.peer is None:
            self.peer = (addr[0], addr[1])
        super().datagram_received(data, addr)
        self._progress.set()  # ACKs may have freed stream buffers: waiting writers look again

    # -- events
    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated):
            self.h3 = H3Connection(self._quic, enable_webtransport=True)
        if isinstance(event, ConnectionTerminated):
            for ex in list(self.exchanges.values()):
                ex.disconnect()
            self._progress.set()
            if self.on_close is not None:
                self.on_close(self)
            return
        if isinstance(event, StreamReset | StopSendingReceived):
            self._stream_gone(event.stream_id)
        if self.h3 is None:
            return
        for h3_event in self.h3.handle_event(event):
            self._h3_event(h3_event)

    def _h3_event(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            self._headers(event)
        elif isinstance(event, DataReceived):
            ex = self.exchanges.get(event.stream_id)
            if ex is not None:
                ex.feed(event.data, event.stream_ended)
            elif event.stream_ended and event.stream_id in self.sessions:
                self._session_gone(event.stream_id)
        elif isinstance(event, WebTransportStreamDataReceived):
            self._wt_data(event)

    def _headers(self, event: HeadersReceived) -> None:
        pseudo: dict[bytes, bytes] = {}
        headers: list[tuple[bytes, bytes]] = []
        for k, v in event.headers:
            if k.startswith(b":"):
                pseudo[k] = v
            else:
                headers.append((k, v))
        method, target = pseudo.get(b":method", b"GET").decode(), pseudo.get(b":path", b"/").decode()
        authority = pseudo.get(b":authority", b"")
        if method == "CONNECT" and pseudo.get(b":protocol") == b"webtransport":
            self._open_session(event.stream_id, target, authority, headers)
            return
        if authority and not any(k == b"host" for k, _ in headers):
            headers.append((b"host", authority))
        ex = Exchange(self, event.stream_id, _scope(self, method, target, headers, "sse-h3",
                                                    pseudo.get(b":scheme", b"https").decode()), wt=False)
        self.exchanges[event.stream_id] = ex
        ex.feed(b"", event.stream_ended)
        ex.start(self.app)

    def _open_session(self, stream_id: int, target: str, authority: bytes,
                      headers: list[tuple[bytes, bytes]]) -> None:
        assert self.h3 is not None
        origin = next((v.decode("latin-1") for k, v in headers if k == b"origin"), None)
        status = b"200" if target.partition("?")[0] == WT_PATH else b"404"
        if status == b"200" and not self._origin_allowed(origin, authority.decode("latin-1")):
            log.info("WebTransport session refused: Origin %s is not allowed", origin)
            status = b"403"
        self.h3.send_headers(stream_id, [(b":status", status), (b"sec-webtransport-http3-draft", b"draft02")],
                             end_stream=status != b"200")
        if status == b"200":
            self.sessions[stream_id] = set()
            self.session_authority[stream_id] = authority
        self.transmit()

    def _origin_allowed(self, origin: str | None, authority: str) -> bool:
        """The WebSocket rule (``--allowed-origins``, :class:`gateway.http.auth.Auth`) for a session: a page of
        the gateway's own host passes whatever its port (the page comes from the TCP port, the session goes
        to the UDP one), as does a client that sends no Origin (not a browser)."""
        auth = getattr(getattr(self.app, "state", None), "auth", None)
        if auth is None or origin is None:
            return True
        own = urlsplit(origin).hostname == urlsplit("//" + authority).hostname
        return bool(auth.origin_ok(origin, urlsplit(origin).netloc if own else authority))

    def _wt_data(self, event: WebTransportStreamDataReceived) -> None:
        ex = self.exchanges.get(event.stream_id)
        if ex is not None:
            ex.feed(event.data, event.stream_ended)
            return
        if event.session_id not in self.sessions or event.stream_id % 4 != 0:  # client-initiated bidi only
            return
        buf = self.pending.setdefault(event.stream_id, bytearray())
        buf += event.data
        try:
            parsed = split_head(buf)
        except HeadError as exc:
            self.pending.pop(event.stream_id, None)
            err = APIError(400, f"Bad WebTransport request head: {exc}", code="invalid_request")
            self._quic.send_stream_data(event.stream_id, response_head(400, [(b"content-type", b"application/json")])
                                        + err.to_bytes(), end_stream=True)
            self.transmit()
            return
        if parsed is None:
            if event.stream_ended:
                self.pending.pop(event.stream_id, None)
            return
        del self.pending[event.stream_id]
        head, rest = parsed
        ex = self._wt_exchange(event.stream_id, event.session_id, head)
        ex.feed(rest, event.stream_ended)
        ex.start(self.app)

    def _wt_exchange(self, stream_id: int, session_id: int, head: RequestHead) -> Exchange:
        headers = head.asgi_headers()
        if not any(k == b"host" for k, _ in headers):
            headers.append((b"host", self.session_authority.get(session_id, b"")))
        ex = Exchange(self, stream_id, _scope(self, head.method, head.path, headers, "wt"), wt=True)
        self.exchanges[stream_id] = ex
        self.sessions[session_id].add(stream_id)
        return ex

    def _stream_gone(self, stream_id: int) -> None:
        ex = self.exchanges.get(stream_id)
        if ex is not None:
            ex.disconnect()
        if stream_id in self.sessions:
            self._session_gone(stream_id)
        self._progress.set()

    def _session_gone(self, session_id: int) -> None:
        for sid in self.sessions.pop(session_id, set()):
            ex = self.exchanges.get(sid)
            if ex is not None:
                ex.disconnect()
        self.session_authority.pop(session_id, None)

    # -- writes
    def send_head(self, ex: Exchange, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if ex.wt:
            self._quic.send_stream_data(ex.stream_id, response_head(status, headers))
        else:
            assert self.h3 is not None
            self.h3.send_headers(ex.stream_id, [(b":status", str(status).encode()), *headers])
        self._flush()

    def send_body(self, ex: Exchange, data: bytes, end: bool) -> None:
        if ex.wt:
            self._quic.send_stream_data(ex.stream_id, data, end_stream=end)
        else:
            assert self.h3 is not None
            self.h3.send_data(ex.stream_id, data, end_stream=end)
        self._flush()

    def reset(self, stream_id: int, code: int) -> None:
        with contextlib.suppress(Exception):  # the stream may be gone already (aioquic asserts)
            self._quic.reset_stream(stream_id, code)
            self._flush()

    def unacked(self, stream_id: int) -> int:
        stream = self._quic._streams.get(stream_id)  # aioquic has no public accessor for this  # noqa: SLF001
        return 0 if stream is None else len(stream.sender._buffer)  # noqa: SLF001  (aioquic: no public accessor)

    async def drained(self, ex: Exchange) -> None:
        """Wait while ``ex``'s stream holds more than :data:`HIGH_WATER` unacknowledged bytes."""
        while self.unacked(ex.stream_id) > HIGH_WATER:
            if ex.gone:
                raise PeerGone("the client went away")
            self._progress.clear()
            await self._progress.wait()
        if ex.gone:
            raise PeerGone("the client went away")

    def _flush(self) -> None:
        """Send at the end of this loop turn: every stream written in the same turn shares the packets."""
        if self._flush_soon is None:
            self._flush_soon = self._loop.call_soon(self._flush_now)

    def _flush_now(self) -> None:
        self._flush_soon = None
        self.transmit()

    def forget(self, ex: Exchange) -> None:
        self.exchanges.pop(ex.stream_id, None)
        for members in self.sessions.values():
            members.discard(ex.stream_id)

    def close_all(self) -> None:
        for ex in list(self.exchanges.values()):
            ex.disconnect()
        self._quic.close(error_code=0x100, reason_phrase="server shutdown")  # H3_NO_ERROR
        self.transmit()
