"""The fast bench client (``--client fast``): asyncio protocols that spend a few µs of CPU per event.

- HTTP/1.1 (``POST /v1/streams`` and SSE): :class:`H1Connection`, an ``asyncio.Protocol`` over the
  pure :class:`~tokenfan_bench.wire.http1.ResponseParser` and :class:`~tokenfan_bench.wire.events.SseDecoder`,
  reused through :class:`H1Pool` (keep-alive, like httpx's pool).
- WebSocket: picows (Cython framing), :class:`WsSubscriber`.
- HTTP/2: :mod:`tokenfan_bench.clients.fast_h2`; both behind one backend: :mod:`tokenfan_bench.clients.fast_backend`.

Sockets come from aiofastnet when it is installed (picows' own transport layer; plain and TLS),
else from the event loop.

Timestamping, the same discipline as the python client: the receive time is taken first thing in
``data_received`` (once per read; picows delivers frames, so its stamp is taken at the first frame of
each read buffer and reused until ``WSFrame.last_in_buffer``), and the parsing of that read waits in a
:class:`ReadBatch` until every read of the same event-loop iteration has been stamped. So when several
subscribers' data arrive together, none is stamped late by another's parsing (the python client gets
this with an ``await asyncio.sleep(0)`` per read, at the price of a task switch).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import picows

from tokenfan_bench.clients.recorder import Recorder, on_sse_event, on_ws_message
from tokenfan_bench.wire.events import SseDecoder
from tokenfan_bench.wire.http1 import HttpError, ResponseHead, ResponseParser, request
from tokenfan_bench.wire.http2 import H2Error

try:
    import aiofastnet
except ImportError:  # optional: picows' dependency, but a plain loop transport works too
    aiofastnet = None  # type: ignore[assignment]

time_ns = time.time_ns
# What a failed subscription may raise (besides TimeoutError): recorded as the subscriber's error.
FAST_ERRORS: tuple[type[Exception], ...] = (OSError, HttpError, H2Error, picows.WSError, ssl.SSLError)
# What a malformed event raises while it is recorded (the subscriber fails, the run goes on).
PARSE_ERRORS = (ValueError, KeyError, TypeError)  # orjson.JSONDecodeError is a ValueError


class ReadBatch:
    """Defers the handling of stamped reads until every read of this loop iteration is stamped.

    ``add(handler, t, data)`` queues ``handler(t, data)``; the queue runs in the next loop
    iteration, after every I/O callback of this one (asyncio and uvloop both run ``call_soon``
    callbacks only after the I/O callbacks of the iteration that scheduled them). Order is kept, so
    a connection's end, queued the same way, comes after its last data.
    """

    __slots__ = ("_loop", "_queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: list[tuple[Callable[[int, Any], None], int, Any]] = []

    def add(self, handler: Callable[[int, Any], None], t: int, data: Any) -> None:
        if not self._queue:
            self._loop.call_soon(self._run)
        self._queue.append((handler, t, data))

    def _run(self) -> None:
        queue, self._queue = self._queue, []
        for handler, t, data in queue:
            try:
                handler(t, data)
            except Exception as exc:  # noqa: BLE001 - a bug in one handler must not lose the others' reads
                self._loop.call_exception_handler({"message": "bench read handler failed", "exception": exc})


def client_ssl_context(cafile: str | None, alpn: str = "http/1.1") -> ssl.SSLContext:
    """TLS for ``https``/``wss`` targets, offering one ALPN protocol: verified against ``cafile``,
    else not verified (the bench talks to a gateway you run, often with a self-signed certificate)."""
    if cafile:
        ctx = ssl.create_default_context(cafile=cafile)
    else:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols([alpn])
    return ctx


async def connect(factory: Callable[[], asyncio.Protocol], host: str, port: int,
                  ssl_ctx: ssl.SSLContext | None) -> tuple[asyncio.Transport, Any]:
    loop = asyncio.get_running_loop()
    if aiofastnet is not None:
        return await aiofastnet.create_connection(loop, factory, host, port, ssl=ssl_ctx,  # type: ignore[no-any-return]
                                                  server_hostname=host if ssl_ctx else None)
    return await loop.create_connection(factory, host, port, ssl=ssl_ctx)  # type: ignore[return-value]


# -- HTTP/1.1 ---------------------------------------------------------------------------------


class Sink:
    """Where one response goes: ``head`` once, ``body`` per decoded read, then ``end`` once."""

    def head(self, t: int, head: ResponseHead) -> None: ...

    def body(self, t: int, data: bytes) -> None: ...

    def end(self, error: BaseException | None) -> None: ...


class H1Connection(asyncio.Protocol):
    """One HTTP/1.1 connection, one request at a time."""

    def __init__(self, batch: ReadBatch, pool: H1Pool) -> None:
        self.batch, self.pool = batch, pool
        self.transport: asyncio.Transport | None = None
        self.parser = ResponseParser()
        self.sink: Sink | None = None
        self.reused = False  # carried an earlier response (may have been closed by the server meanwhile)
        self._consume = self._on_data  # bound once: data_received runs per read
        self._lost = self._on_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.batch.add(self._consume, time_ns(), data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.batch.add(self._lost, 0, exc)

    def send(self, req: bytes, sink: Sink) -> None:
        assert self.transport is not None and self.sink is None
        self.parser, self.sink = ResponseParser(), sink
        self.transport.write(req)

    @property
    def usable(self) -> bool:
        return self.transport is not None and not self.transport.is_closing() and self.sink is None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abandon(self, sink: Sink) -> None:
        """The waiter of ``sink`` gave up (timeout, cancellation): if its response is still running,
        the connection cannot be reused. (Once the response ended, the connection may already carry
        someone else's request: leave it alone.)"""
        if self.sink is sink:
            self.sink = None
            self.close()

    def _on_data(self, t: int, data: bytes) -> None:
        sink, p = self.sink, self.parser
        if sink is None:
            return  # nothing asked: late bytes of an abandoned response
        had_head = p.head is not None
        try:
            body = p.feed(data)
        except HttpError as exc:
            self._finish(exc)
            return
        if not had_head and p.head is not None:
            sink.head(t, p.head)
        if body:
            sink.body(t, body)
        if p.complete:
            self._finish(None)

    def _on_lost(self, _t: int, exc: Exception | None) -> None:
        if self.sink is None:
            return
        try:
            self.parser.eof()
        except HttpError as err:
            self._finish(ConnectionError(f"{err}" + (f" ({exc})" if exc else "")))
            return
        self._finish(None)

    def _finish(self, error: BaseException | None) -> None:
        sink, self.sink = self.sink, None
        head = self.parser.head
        if error is not None or head is None or head.headers.get("connection", "").lower() == "close" \
                or self.parser.leftover:
            self.close()
        else:
            self.reused = True
            self.pool.release(self)
        if sink is not None:
            sink.end(error)


class Buffered(Sink):
    """A whole small response (the POST that creates a stream)."""

    def __init__(self, fut: asyncio.Future[tuple[ResponseHead, bytes]]) -> None:
        self.fut = fut
        self._head: ResponseHead | None = None
        self._body: list[bytes] = []

    def head(self, t: int, head: ResponseHead) -> None:
        self._head = head

    def body(self, t: int, data: bytes) -> None:
        self._body.append(data)

    def end(self, error: BaseException | None) -> None:
        if self.fut.done():
            return
        if error is not None:
            self.fut.set_exception(error)
        elif self._head is None:
            self.fut.set_exception(ConnectionError("connection closed before a response"))
        else:
            self.fut.set_result((self._head, b"".join(self._body)))


class SseSubscription(Sink):
    """An SSE response recorded into ``rec``."""

    def __init__(self, rec: Recorder, fut: asyncio.Future[None]) -> None:
        self.rec, self.fut, self.dec = rec, fut, SseDecoder()
        self.refused: tuple[int, list[bytes]] | None = None  # a status other than 200, and its body

    def head(self, t: int, head: ResponseHead) -> None:
        self.rec.connected_ns = t
        if head.status != 200:
            self.refused = (head.status, [])

    def body(self, t: int, data: bytes) -> None:
        rec = self.rec
        if self.refused is not None:
            self.refused[1].append(data)
        elif rec.error is None:
            try:
                for ev in self.dec.feed(data):
                    on_sse_event(rec, t, ev)
            except PARSE_ERRORS as exc:
                rec.fail(f"sse: {type(exc).__name__}: {exc}"[:300])

    def end(self, error: BaseException | None) -> None:
        if self.refused is not None:  # the error body names the refusal's code (client_subscription_limit …)
            self.rec.fail(f"SSE HTTP {self.refused[0]} {b''.join(self.refused[1])[:240].decode(errors='replace')}")
        elif error is not None:
            self.rec.fail(f"sse: {type(error).__name__}: {error}"[:300])
        elif not self.rec.done:
            self.rec.fail("SSE closed before [DONE]")
        if not self.fut.done():
            self.fut.set_result(None)


class H1Pool:
    """Keep-alive HTTP/1.1 connections to one origin."""

    def __init__(self, batch: ReadBatch, host: str, port: int, ssl_ctx: ssl.SSLContext | None) -> None:
        self.batch, self.host, self.port, self.ssl_ctx = batch, host, port, ssl_ctx
        self.authority = f"{host}:{port}"
        self.idle: list[H1Connection] = []
        self.all: set[H1Connection] = set()

    async def _connect(self) -> H1Connection:
        _, conn = await connect(lambda: H1Connection(self.batch, self), self.host, self.port, self.ssl_ctx)
        self.all.add(conn)
        return conn  # type: ignore[no-any-return]

    async def acquire(self) -> H1Connection:
        while self.idle:
            conn = self.idle.pop()
            if conn.usable:
                return conn
            self.all.discard(conn)
        return await self._connect()

    def release(self, conn: H1Connection) -> None:
        self.idle.append(conn)

    async def fetch(self, method: str, target: str, headers: dict[str, str] | None = None,
                    body: bytes | None = None) -> tuple[ResponseHead, bytes]:
        """One request; retried once on a fresh connection when a reused one was closed by the
        server before it answered (an idle keep-alive connection may be closed at any time)."""
        req = request(method, target, self.authority, headers, body)
        for attempt in (0, 1):
            conn = await self.acquire()
            fut: asyncio.Future[tuple[ResponseHead, bytes]] = asyncio.get_running_loop().create_future()
            sink = Buffered(fut)
            conn.send(req, sink)
            try:
                return await fut
            except (ConnectionError, HttpError):
                if attempt or not conn.reused:
                    raise
            finally:
                conn.abandon(sink)
        raise AssertionError("unreachable")

    async def sse(self, target: str, rec: Recorder) -> None:
        conn = await self.acquire()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        sink = SseSubscription(rec, fut)
        conn.send(request("GET", target, self.authority, {"accept": "text/event-stream"}), sink)
        try:
            await fut
        finally:
            conn.abandon(sink)

    def close(self) -> None:
        for conn in self.all:
            conn.close()
        self.all.clear()
        self.idle.clear()


# -- WebSocket (picows) -----------------------------------------------------------------------


class BatchedWsListener(picows.WSListener):  # type: ignore[misc]
    """A picows listener that stamps each read buffer once and hands whole messages (``_on_message(t,
    payload)``) and the end (``_on_end(t, why)``) to the :class:`ReadBatch`. ``label`` starts its error
    texts; a clean close (1000) ends it quietly unless ``close_ok_is_end``."""

    label = "WS"
    close_ok_is_end = False

    def __init__(self, batch: ReadBatch) -> None:
        super().__init__()
        self.batch = batch
        self.transport: picows.WSTransport | None = None
        self._t = 0  # the stamp of the read buffer being delivered
        self._message = self._on_message
        self._end = self._on_end

    def _on_message(self, t: int, payload: bytes) -> None:
        raise NotImplementedError

    def _on_end(self, t: int, why: str | None) -> None:
        raise NotImplementedError

    def on_ws_connected(self, transport: picows.WSTransport) -> None:
        self.transport = transport

    def on_ws_frame(self, transport: picows.WSTransport, frame: picows.WSFrame) -> None:
        t = self._t or time_ns()
        self._t = 0 if frame.last_in_buffer else t
        mt = frame.msg_type
        if mt == picows.WSMsgType.TEXT or mt == picows.WSMsgType.BINARY:
            if not frame.fin:
                self.batch.add(self._end, t, f"{self.label} fragmented message (not sent by tokenfan)")
                transport.disconnect(False)
                return
            self.batch.add(self._message, t, frame.get_payload_as_bytes())
        elif mt == picows.WSMsgType.CLOSE:
            code = frame.get_close_code()
            transport.send_close(code)
            transport.disconnect()
            if self.close_ok_is_end or code != picows.WSCloseCode.OK:
                reason = frame.get_close_reason()[:100]
                self.batch.add(self._end, t, f"{self.label} close {int(code.value)} {reason}")


class WsSubscriber(BatchedWsListener):
    """Records the gateway's fan-out WebSocket messages into ``rec``."""

    def __init__(self, rec: Recorder, batch: ReadBatch, fut: asyncio.Future[None]) -> None:
        super().__init__(batch)
        self.rec, self.fut = rec, fut

    def on_ws_disconnected(self, transport: picows.WSTransport) -> None:
        self.batch.add(self._end, 0, None)

    def _on_message(self, t: int, payload: bytes) -> None:
        if self.rec.error is None:
            try:
                on_ws_message(self.rec, t, payload)
            except PARSE_ERRORS as exc:
                self.rec.fail(f"ws: {type(exc).__name__}: {exc}"[:300])

    def _on_end(self, _t: int, why: str | None) -> None:
        if why is not None:
            self.rec.fail(why)
        if why is None and not self.fut.done():
            if not self.rec.done:
                self.rec.fail("WS closed before done")
            self.fut.set_result(None)


async def subscribe_ws(url: str, rec: Recorder, batch: ReadBatch, ssl_ctx: ssl.SSLContext | None) -> None:
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    transport, _ = await picows.ws_connect(lambda: WsSubscriber(rec, batch, fut), url, ssl_context=ssl_ctx,
                                           websocket_handshake_timeout=30, enable_auto_pong=True,
                                           max_frame_size=1 << 30)
    rec.connected_ns = time_ns()
    try:
        await fut
    finally:
        if not transport.is_disconnected:
            transport.disconnect(False)


def target_of(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path?query) of an absolute URL."""
    u = urlsplit(url)
    default = 443 if u.scheme in ("https", "wss") else 80
    return u.scheme, u.hostname or "127.0.0.1", u.port or default, (u.path or "/") + (f"?{u.query}" if u.query else "")
