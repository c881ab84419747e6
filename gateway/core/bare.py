"""Fan-out subscribers that outlive their ASGI call: the socket taken over from uvicorn once the response started.

A subscriber of a listed stream holds its connection for minutes; thousands of them held, each, the server's
protocol and request cycle (uvicorn's, with their asyncio Events and Queues, the websockets library's
connection), every middleware's frame and the request's task, about 20 KB in all (docs/benchmarks.md, "A
smaller subscriber"). Once the response head is written (SSE) or the WebSocket accepted, nothing of that is
needed any more: :func:`detach_http` / :func:`detach_ws` give the transport a protocol of this module
(:class:`BareSse`, :class:`BareWs`), which is at once the connection the delivery core writes to (the same
``write`` / ``write_now`` / ``flush`` / ``end`` / ``cut`` as :mod:`gateway.core.conn`'s) and the socket's
protocol (flow control, the peer leaving, a WebSocket's control frames and keep-alive pings). uvicorn
forgets the connection; the ASGI call returns; the reader goes on in a task of its own
(:func:`run_detached`).

What the middlewares do at a request's end (the access log line, the client's connection count) waits for
the connection's real end: the endpoint puts a :class:`Detached` in the scope, and :func:`defer` runs a
middleware's finaliser now, or when that detached connection ends.

The socket is taken through the exchange's server port (:mod:`gateway.core.server_port`: uvicorn's httptools
HTTP/1.1 with chunked encoding and its sans-I/O WebSocket without compression, :mod:`gateway.http.uvicorn_shim`,
which makes uvicorn's objects forget it): without one (another server, HTTP/3, a uvicorn the shim does not
know), or with ``--detach-subscribers false``, subscribers stay in their ASGI call. The WebSocket frames a
client sends are parsed by the websockets library's own :meth:`Frame.parse`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine, Generator, MutableMapping
from typing import Any, ClassVar

from websockets.exceptions import PayloadTooBig, ProtocolError
from websockets.frames import Frame, Opcode
from websockets.streams import StreamReader

from gateway.core.conn import chunked, http_chunk, ws_close_frame, ws_ending, ws_frame, ws_text
from gateway.core.server_port import port_of
from gateway.core.step import Step

log = logging.getLogger(__name__)

DETACHED_KEY = "tokenfan.detached"
TRACE_HEADERS = (b"traceparent", b"tracestate")
WS_CLOSE_WAIT = 1.0  # after a normal close frame, how long the peer's own close is waited for


class Detached:
    """What a detached exchange still has to do when its connection really ends: the middlewares' finalisers
    (in the order they would have run), then nothing is left of the request."""

    __slots__ = ("_later",)

    def __init__(self) -> None:
        self._later: list[Callable[[], None]] | None = []

    def later(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the connection ends (at once if it already has)."""
        if self._later is None:
            fn()
        else:
            self._later.append(fn)

    def done(self) -> None:
        later, self._later = self._later or [], None
        for fn in later:
            try:
                fn()
            except Exception:  # one finaliser's bug must not keep the others from running
                log.exception("a detached connection's finaliser failed")


def defer(scope: MutableMapping[str, Any], fn: Callable[[], None]) -> None:
    """Run ``fn`` (a middleware's end-of-request work) now, or when the scope's detached connection ends."""
    detached: Detached | None = scope.get(DETACHED_KEY)
    if detached is None:
        fn()
    else:
        detached.later(fn)


class BareConn(asyncio.Protocol):
    """The socket's protocol and the delivery core's connection in one object (one per subscriber)."""

    __slots__ = ("_drain", "_out", "closed", "headers", "label", "linger", "lost", "paused", "task", "transport")
    ws: ClassVar[bool] = False  # a WebSocket: payloads become text frames as they are taken
    def __init__(self, transport: asyncio.Transport, label: str, headers: list[tuple[bytes, bytes]],
                 linger: float, paused: bool) -> None:
        self.transport = transport
        self.label = label
        self.headers = headers  # the request's trace-context headers only (its span's parent)
        self.linger = linger
        self.paused = paused
        self.closed = False  # an ending was written: nothing more goes out
        self.lost = False  # the socket is gone
        self.task: asyncio.Task[None] | None = None  # the reader's: cancelled when the peer leaves
        self._drain: asyncio.Future[None] | None = None
        self._out: list[bytes] = []

    # -- the protocol ------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = self.closed = True
        self._wake()
        task = self.task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()  # as until_disconnect does for a reader in its ASGI call

    def eof_received(self) -> bool | None:
        return None  # the peer stopped sending: close (a subscriber sends nothing that matters)

    def _wake(self) -> None:
        fut, self._drain = self._drain, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def _drained(self) -> None:
        """Wait while the transport's buffer is over its high-water mark (the Watchdog cuts a reader blocked
        here for longer than ``--send-timeout``)."""
        while self.paused and not self.lost:
            if self._drain is None:
                self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    def write_now(self, data: bytes, step: Step | None = None) -> bool:
        """Take one event's payload without awaiting while the socket is writable (False otherwise: the reader's
        own loop sends it); within a ``step`` it is written at the step's end, with the step's other frames."""
        if self.paused or self.closed or self.transport.is_closing():
            return False
        out = self._out
        out.append(ws_text(data) if self.ws else data)
        if step is None:
            self.flush()
        elif len(out) == 1:
            step.hold(self)
        return True

    def flush(self) -> None:
        """Write what ``write_now`` took, in one transport write (each subclass frames it)."""
        raise NotImplementedError

    def _finish(self, data: bytes, linger: float) -> None:
        """Write the last bytes, close (flushing them if the peer reads), reset after ``linger`` seconds."""
        self.closed = True
        transport = self.transport
        if transport.is_closing():
            return
        if data:
            transport.write(data)
        transport.close()
        asyncio.get_running_loop().call_later(linger, transport.abort)


class BareSse(BareConn):
    """A fan-out SSE response after its head: HTTP/1.1 chunks straight into the transport."""

    __slots__ = ()

    def data_received(self, data: bytes) -> None:
        pass  # a request pipelined after a subscription is not served: the response said Connection: close

    async def write(self, data: bytes) -> None:
        if self.closed:
            return  # the peer left (the reader's task is being cancelled) or the ending went out
        self.transport.write(chunked(data))
        await self._drained()


    def flush(self) -> None:
        out = self._out
        if out and not self.closed and not self.transport.is_closing():
            self.transport.write(http_chunk(out[0]) if len(out) == 1 else chunked(b"".join(out)))
        out.clear()

    async def end(self, data: bytes | None) -> None:
        """The response's last chunk and its end; the connection closes (its head said so)."""
        if not self.closed:
            self._finish(chunked(data or b"") + b"0\r\n\r\n", self.linger)

    async def cut(self, data: bytes | None) -> None:
        await self.end(data)


class BareWs(BareConn):
    """An accepted fan-out WebSocket: text frames out; the client's pings answered, its close echoed, a ping
    sent every ``ping_interval`` s and the connection failed (1011) without a pong in ``ping_timeout`` s."""

    __slots__ = ("_frames", "_parser", "_ping", "_reader", "_timer", "max_size", "ping_interval", "ping_timeout")
    ws = True
    def __init__(self, transport: asyncio.Transport, headers: list[tuple[bytes, bytes]], linger: float,
                 paused: bool, *, max_size: int | None, ping_interval: float | None,
                 ping_timeout: float | None) -> None:
        super().__init__(transport, "ws", headers, linger, paused)
        self.max_size = max_size
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self._reader: StreamReader | None = None  # made at the client's first bytes
        self._parser: Generator[None, None, None] | None = None
        self._frames: list[Frame] = []
        self._ping: bytes | None = None  # the payload of the ping awaiting its pong
        self._timer: asyncio.TimerHandle | None = None
        self._schedule_ping()

    # -- client frames (websockets' parser) ---------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._reader is None:
            if self.lost or self.transport.is_closing():
                return  # failed or closing: nothing more is read
            self._reader = StreamReader()
            self._parser = self._parse(self._reader)
            next(self._parser)
        parser = self._parser
        if parser is None:
            return
        self._reader.feed_data(data)
        try:
            next(parser)
        except StopIteration:
            pass
        except PayloadTooBig:
            self._fail(1009, "message too big")
        except ProtocolError as exc:
            self._fail(1002, str(exc)[:100])
        for frame in self._frames:
            self._on_frame(frame)
        self._frames.clear()

    def _parse(self, reader: StreamReader) -> Generator[None, None, None]:
        while True:
            self._frames.append((yield from Frame.parse(reader.read_exact, mask=True, max_size=self.max_size)))
            if not reader.buffer:
                yield

    def _on_frame(self, frame: Frame) -> None:
        if self.lost:
            return
        if frame.opcode is Opcode.CLOSE:
            if not self.closed:  # the client closes first: echo its status code (RFC 6455 §5.5.1), then close
                self.closed = True
                self.transport.write(ws_frame(0x8, bytes(frame.data[:2])))
            self._stop_timer()
            self.transport.close()  # connection_lost follows: the reader's task is cancelled
        elif frame.opcode is Opcode.PING:
            if not self.closed:
                self.transport.write(ws_frame(0xA, bytes(frame.data)))
        elif frame.opcode is Opcode.PONG and self._ping is not None and bytes(frame.data) == self._ping:
            self._ping = None
            self._stop_timer()
            self._schedule_ping()
        # text, binary, continuation: a subscriber's socket takes nothing from its client; skipped

    def _fail(self, code: int, reason: str) -> None:
        self._stop_timer()
        self._parser = None  # nothing more is parsed
        if not self.closed and not self.transport.is_closing():
            self.closed = True
            self.transport.write(ws_close_frame(code, reason))
        self.transport.close()

    # -- keep-alive pings (as uvicorn's own WebSocket protocol does them) -----------------------------

    def _schedule_ping(self) -> None:
        if self.ping_interval:
            self._timer = asyncio.get_running_loop().call_later(self.ping_interval, self._send_ping)

    def _send_ping(self) -> None:
        self._timer = None
        if self.closed or self.transport.is_closing():
            return
        self._ping = os.urandom(4)
        self.transport.write(ws_frame(0x9, self._ping))
        if self.ping_timeout:
            self._timer = asyncio.get_running_loop().call_later(self.ping_timeout, self._ping_timed_out)
        else:
            self._schedule_ping()

    def _ping_timed_out(self) -> None:
        self._timer = None
        log.info("closing a fan-out WebSocket: no pong within %g s", self.ping_timeout)
        self._fail(1011, "keepalive ping timeout")

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self._parser = self._reader = None
        super().connection_lost(exc)

    # -- the connection -----------------------------------------------------------------------------

    async def write(self, text: str) -> None:
        if self.closed:
            return
        self.transport.write(ws_frame(0x1, text.encode()))
        await self._drained()


    def flush(self) -> None:
        out = self._out
        if out and not self.closed and not self.transport.is_closing():
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
        out.clear()

    async def end(self, text: str | None, code: int = 1000, reason: str = "") -> None:
        """The last message and a close frame; the connection closes when the client echoes the close (or
        after :data:`WS_CLOSE_WAIT` s), and is reset if its buffer has not drained ``linger`` s later."""
        if self.closed:
            return
        self._stop_timer()
        out = ws_ending(text, code, reason)
        self.closed = True
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(out)
        loop = asyncio.get_running_loop()
        loop.call_later(WS_CLOSE_WAIT, transport.close)
        loop.call_later(WS_CLOSE_WAIT + self.linger, transport.abort)

    async def cut(self, code: int, reason: str, text: str | None = None) -> None:
        """Close with ``code`` now, without waiting for the stalled peer."""
        if self.closed:
            return
        self._stop_timer()
        self._finish(ws_ending(text, code, reason), self.linger)


def _trace_headers(scope: MutableMapping[str, Any]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in scope.get("headers") or () if k in TRACE_HEADERS]


def detachable_http(scope: MutableMapping[str, Any], send: Any) -> bool:
    """Whether an SSE response on this exchange can be detached once started (the server port's HTTP/1.1:
    chunked): asked before its head, which then says ``Connection: close``."""
    if scope.get("http_version") != "1.1" or "tokenfan.transport" in scope:
        return False
    port = port_of(scope)
    return port is not None and port.http_detachable(scope.get("tokenfan.raw_send", send))


def detach_http(scope: MutableMapping[str, Any], send: Any, linger: float) -> BareSse | None:
    """Take an SSE response's socket from the server once its head (and anything before) is written; None if it
    cannot be (no server port, not chunked, a pipelined request waiting, the client gone)."""
    port = port_of(scope)
    taken = port.take_http(scope.get("tokenfan.raw_send", send)) if port is not None else None
    if taken is None:
        return None
    bare = BareSse(taken.transport, "sse", _trace_headers(scope), linger, taken.paused)
    taken.transport.set_protocol(bare)
    taken.transport.resume_reading()  # the peer's leaving is seen at once
    return bare


def detach_ws(scope: MutableMapping[str, Any], send: Any, linger: float) -> BareWs | None:
    """Take an accepted WebSocket's socket from the server (no compression, nothing received and not yet
    handled, no close under way); None if it cannot be."""
    port = port_of(scope)
    taken = port.take_ws(scope.get("tokenfan.raw_send", send)) if port is not None else None
    if taken is None:
        return None
    bare = BareWs(taken.transport, _trace_headers(scope), linger, taken.paused, max_size=taken.max_size,
                  ping_interval=taken.ping_interval, ping_timeout=taken.ping_timeout)
    taken.transport.set_protocol(bare)
    return bare


def run_detached(registry: set[BareConn], conn: BareConn, scope: MutableMapping[str, Any],
                 body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a detached reader: ``body`` in a task of its own, cancelled when the peer leaves; the scope's
    middlewares' finalisers run when it ends, and the socket is closed on every path."""
    detached = scope[DETACHED_KEY] = Detached()

    async def run() -> None:
        try:
            await body()
        except asyncio.CancelledError:
            pass  # the peer left, or a shutdown ended it
        except Exception:
            log.exception("a detached reader failed")
        finally:
            registry.discard(conn)
            if not conn.lost and not conn.transport.is_closing() and not conn.closed:
                conn.transport.abort()  # a shutdown cancelled it before its ending
            detached.done()

    registry.add(conn)
    conn.task = asyncio.get_running_loop().create_task(run())


async def close_detached(registry: set[BareConn], wait: float) -> None:
    """At shutdown, after the streams ended: give detached readers ``wait`` s to write their endings, then
    cancel the rest (their sockets are reset)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while registry and loop.time() < deadline:
        await asyncio.sleep(0.05)
    tasks = [conn.task for conn in registry if conn.task is not None]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["BareSse", "BareWs", "Detached", "close_detached", "defer", "detach_http", "detach_ws",
           "detachable_http", "run_detached"]
