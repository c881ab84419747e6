"""The fast client's HTTP/2 arms: SSE over HTTP/2 (``sse-h2``) and WebSocket over HTTP/2 (``ws-h2``,
RFC 8441 extended CONNECT), on :class:`~tokenfan_bench.wire.http2.H2Client`.

``https``/``wss`` targets negotiate ``h2`` by ALPN; ``http``/``ws`` targets speak HTTP/2 with prior
knowledge (h2c). Receive times follow the fast client's discipline (one stamp per read, parsing
deferred through the :class:`~tokenfan_bench.clients.fast.ReadBatch`): every frame in one read, of any
stream, carries that read's stamp. :class:`H2Pool` puts up to ``streams_per_connection``
subscribers on one connection (default 1: one connection per subscriber, like the HTTP/1.1 arms).
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from typing import Any

from tokenfan_bench.clients.fast import PARSE_ERRORS, ReadBatch, Sink, SseSubscription, connect
from tokenfan_bench.clients.recorder import Recorder, on_ws_message
from tokenfan_bench.wire.events import OP_CLOSE, OP_PING, OP_PONG, OP_TEXT, WsDecoder, ws_frame
from tokenfan_bench.wire.http1 import ResponseHead
from tokenfan_bench.wire.http2 import (
    ENABLE_CONNECT_PROTOCOL,
    EV_DATA,
    EV_GOAWAY,
    EV_HEADERS,
    EV_RESET,
    EV_SETTINGS,
    MAX_CONCURRENT_STREAMS,
    H2Client,
    H2Error,
)

time_ns = time.time_ns


class H2Connection(asyncio.Protocol):
    def __init__(self, batch: ReadBatch) -> None:
        self.batch = batch
        self.h2 = H2Client()
        self.transport: asyncio.Transport | None = None
        self.sinks: dict[int, Sink] = {}
        self.heads: set[int] = set()  # streams whose response head arrived (later HEADERS are trailers)
        self.reserved = 0  # streams the pool promised to a subscriber that has not opened it yet
        self.ready: asyncio.Future[dict[int, int]] = asyncio.get_running_loop().create_future()
        self.closed = False
        self._consume = self._on_data
        self._lost = self._on_lost

    # -- asyncio ----------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.h2.data_to_send())  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.batch.add(self._consume, time_ns(), data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.batch.add(self._lost, 0, exc)

    # -- requests ---------------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        return not self.closed and self.h2.goaway is None and self.transport is not None \
            and not self.transport.is_closing()

    def open(self, headers: list[tuple[str, str]], end_stream: bool, sink: Sink) -> int:
        assert self.transport is not None
        self.reserved = max(0, self.reserved - 1)
        sid = self.h2.open(headers, end_stream)
        self.sinks[sid] = sink
        self.transport.write(self.h2.data_to_send())
        return sid

    def send(self, sid: int, data: bytes, end_stream: bool = False) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.h2.send_data(sid, data, end_stream)
            self.transport.write(self.h2.data_to_send())

    def cancel(self, sid: int) -> None:
        """Abandon a stream (timeout, cancellation): RST_STREAM, and its sink hears nothing more."""
        if self.sinks.pop(sid, None) is not None and self.transport is not None and not self.transport.is_closing():
            self.h2.reset(sid)
            self.transport.write(self.h2.data_to_send())

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # -- events -----------------------------------------------------------------------------------

    def _on_data(self, t: int, data: bytes) -> None:
        try:
            events = self.h2.receive(data)
        except H2Error as exc:
            self._fail_all(exc)
            self.close()
            return
        sinks = self.sinks
        for kind, sid, value, end in events:
            if kind == EV_DATA:
                sink = sinks.get(sid)
                if sink is not None:
                    sink.body(t, value)  # type: ignore[arg-type]
            elif kind == EV_HEADERS:
                sink = sinks.get(sid)
                if sink is not None and sid not in self.heads:
                    self.heads.add(sid)
                    headers = dict(value)  # type: ignore[call-overload]
                    sink.head(t, ResponseHead(int(headers.get(":status", 0)), headers))
            elif kind == EV_RESET:
                self._end(sid, H2Error(f"RST_STREAM code {value}"))
                continue
            elif kind == EV_GOAWAY:
                for s in [s for s in sinks if s > sid]:
                    self._end(s, H2Error(f"GOAWAY code {value}"))
                continue
            elif kind == EV_SETTINGS and not self.ready.done():
                self.ready.set_result(value)  # type: ignore[arg-type]
            if end:
                self._end(sid, None)
        out = self.h2.data_to_send()
        if out and self.transport is not None:
            self.transport.write(out)

    def _end(self, sid: int, error: BaseException | None) -> None:
        self.heads.discard(sid)
        sink = self.sinks.pop(sid, None)
        if sink is not None:
            sink.end(error)

    def _fail_all(self, error: BaseException) -> None:
        for sid in list(self.sinks):
            self._end(sid, error)

    def _on_lost(self, _t: int, exc: Exception | None) -> None:
        self.closed = True
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"closed before the server's SETTINGS ({exc})"))
        self._fail_all(ConnectionError(f"connection closed{f' ({exc})' if exc else ''}"))


class WsOverH2(Sink):
    """A fan-out WebSocket on an RFC 8441 stream, recorded into ``rec``."""

    def __init__(self, rec: Recorder, fut: asyncio.Future[None], conn: H2Connection) -> None:
        self.rec, self.fut, self.conn = rec, fut, conn
        self.sid = 0
        self.dec = WsDecoder()
        self.ended = False

    def head(self, t: int, head: ResponseHead) -> None:
        self.rec.connected_ns = t
        if head.status != 200:
            self.rec.fail(f"WS over HTTP/2: status {head.status}")

    def body(self, t: int, data: bytes) -> None:
        rec = self.rec
        try:
            for f in self.dec.feed(data):
                if f.opcode == OP_TEXT and rec.error is None:
                    on_ws_message(rec, t, f.payload)
                elif f.opcode == OP_CLOSE:
                    # Answer after the rest of this read: when the server ended the stream along with its
                    # close frame, say nothing (Hypercorn drops the connection on DATA for a stream it forgot).
                    asyncio.get_running_loop().call_soon(self._answer_close, f.payload[:2])
                    code = int.from_bytes(f.payload[:2], "big") if len(f.payload) >= 2 else 1005
                    if code != 1000:
                        rec.fail(f"WS close {code} {f.payload[2:102]!r}")
                elif f.opcode == OP_PING:
                    self.conn.send(self.sid, ws_frame(OP_PONG, f.payload, os.urandom(4)))
        except PARSE_ERRORS as exc:
            rec.fail(f"ws-h2: {type(exc).__name__}: {exc}"[:300])

    def _answer_close(self, code: bytes) -> None:
        if not self.ended:
            self.conn.send(self.sid, ws_frame(OP_CLOSE, code, os.urandom(4)), end_stream=True)

    def end(self, error: BaseException | None) -> None:
        self.ended = True
        if error is not None:
            self.rec.fail(f"ws-h2: {type(error).__name__}: {error}"[:300])
        elif not self.rec.done:
            self.rec.fail("WS closed before done")
        if not self.fut.done():
            self.fut.set_result(None)


class H2Pool:
    """HTTP/2 connections to one origin, each carrying at most ``streams_per_connection`` streams."""

    def __init__(self, batch: ReadBatch, scheme: str, host: str, port: int, ssl_ctx: ssl.SSLContext | None,
                 streams_per_connection: int = 1) -> None:
        self.batch, self.host, self.port, self.ssl_ctx = batch, host, port, ssl_ctx
        self.scheme = "https" if ssl_ctx is not None else "http"
        self.authority = f"{host}:{port}"
        self.per_conn = max(1, streams_per_connection)
        self.conns: list[H2Connection] = []
        self._lock = asyncio.Lock()  # with several streams per connection: open one connection at a time

    async def _connect(self) -> H2Connection:
        transport, conn = await connect(lambda: H2Connection(self.batch), self.host, self.port, self.ssl_ctx)
        if self.ssl_ctx is not None:
            obj = transport.get_extra_info("ssl_object")
            alpn = getattr(obj, "selected_alpn_protocol", lambda: "h2")()
            if alpn != "h2":
                transport.close()
                raise H2Error(f"the server did not choose h2 by ALPN (got {alpn!r})")
        async with asyncio.timeout(30):  # not wait_for: Python 3.11's drops a cancel that lands as ready does
            await conn.ready
        return conn  # type: ignore[no-any-return]

    async def _acquire(self) -> H2Connection:
        if self.per_conn == 1:
            return await self._acquire_unlocked()
        async with self._lock:
            return await self._acquire_unlocked()

    async def _acquire_unlocked(self) -> H2Connection:
        self.conns = [c for c in self.conns if c.usable or c.sinks or c.reserved]
        for c in self.conns:
            limit = min(self.per_conn, c.h2.peer.get(MAX_CONCURRENT_STREAMS, 100))
            if c.usable and len(c.sinks) + c.reserved < limit:
                c.reserved += 1  # until the stream opens: another subscriber may look meanwhile
                return c
        conn = await self._connect()
        conn.reserved += 1
        self.conns.append(conn)
        return conn

    async def _run(self, conn: H2Connection, headers: list[tuple[str, str]], end_stream: bool, sink: Any,
                   fut: asyncio.Future[None]) -> None:
        sid = conn.open(headers, end_stream, sink)
        sink.sid = sid
        try:
            await fut
        finally:
            conn.cancel(sid)  # no-op once the stream ended

    async def sse(self, target: str, rec: Recorder) -> None:
        conn = await self._acquire()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        headers = [(":method", "GET"), (":scheme", self.scheme), (":authority", self.authority), (":path", target),
                   ("accept", "text/event-stream")]
        await self._run(conn, headers, True, SseSubscription(rec, fut), fut)

    async def websocket(self, target: str, rec: Recorder) -> None:
        conn = await self._acquire()
        if conn.h2.peer.get(ENABLE_CONNECT_PROTOCOL) != 1:
            raise H2Error("the server does not offer WebSocket over HTTP/2 (no SETTINGS_ENABLE_CONNECT_PROTOCOL)")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        headers = [(":method", "CONNECT"), (":protocol", "websocket"), (":scheme", self.scheme),
                   (":authority", self.authority), (":path", target), ("sec-websocket-version", "13")]
        await self._run(conn, headers, False, WsOverH2(rec, fut, conn), fut)

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.conns.clear()
