"""The write side of one client connection, as the delivery core needs it.

Three operations: ``write`` (await until the server took the frame; a stalled client makes it block,
which the :class:`gateway.core.follow.Watchdog` turns into a cut), ``write_now`` (the publisher's one pass:
take a frame without awaiting while the transport is writable, else refuse it and let the reader's loop
send it) and ``cut`` (end the connection with a final frame *without waiting on the stalled peer*).

``write_now`` inside an engine step only collects the frame: the :class:`gateway.core.step.Step` flushes every connection
it touched once, at the end of the step, so a connection that carries several generations (``/v1/ws``,
Responses WebSocket lanes) or several events of one step gets one transport write per step.

``write_now`` and ``cut`` need what ASGI does not give: the server's flow control, and (after a blocked write
the server's ``send`` is stuck waiting for the peer to drain, so a final frame sent through it would wait as
well) its transport. Both come from the exchange's server port (:mod:`gateway.core.server_port`, under uvicorn
:mod:`gateway.http.uvicorn_shim`, the one module that knows its objects): the ending is appended to the
transport buffer directly (chunk-framed for HTTP, a WebSocket close frame for WS), the transport is closed (it
flushes what it holds if the peer reads again) and aborted after ``linger`` seconds if it never does. Without
a port (another server, HTTP/3, a uvicorn the shim does not know) ``write_now`` refuses and the ending is sent
through ASGI with a short timeout, the connection left to the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable, MutableMapping
from typing import Any

from gateway.core.server_port import Writer, port_of
from gateway.core.step import Step

log = logging.getLogger(__name__)

ENDING_TIMEOUT = 1.0  # the ASGI fallback's wait for a final frame

# What a send to a peer that is gone or stalled raises, so an ending that cannot be delivered is dropped and
# anything else (a bug) still propagates: OSError covers TimeoutError (our bounded wait) and uvicorn's
# ClientDisconnected (ASGI 2.4); RuntimeError is what uvicorn raises for a message after the response or
# close was already sent (a cut got there first) and what Granian raises on a closed transport
# ("ASGI flow error: Transport closed").
PEER_GONE: tuple[type[Exception], ...] = (OSError, RuntimeError)


def ws_head(opcode: int, n: int) -> bytes:
    """The head of an unmasked (server-to-client) WebSocket frame with FIN set (RFC 6455 §5.2)."""
    if n < 126:
        return struct.pack("!BB", 0x80 | opcode, n)
    if n < 1 << 16:
        return struct.pack("!BBH", 0x80 | opcode, 126, n)
    return struct.pack("!BBQ", 0x80 | opcode, 127, n)


def ws_frame(opcode: int, payload: bytes) -> bytes:
    return ws_head(opcode, len(payload)) + payload


def ws_close_frame(code: int, reason: str) -> bytes:
    return ws_frame(0x8, struct.pack("!H", code) + reason.encode()[:123])


def ws_ending(text: str | None, code: int, reason: str) -> bytes:
    """A WebSocket's last message (if any) and its close frame, as one write."""
    return (ws_frame(0x1, text.encode()) if text is not None else b"") + ws_close_frame(code, reason)


def chunked(data: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%b\r\n" % (len(data), data) if data else b""


class LastFrame:
    """The wire form of the last payload asked for, by identity: in one pass over thousands of readers
    each writes the same event's bytes object, so its HTTP chunk or WebSocket frame is built once and the
    same bytes go to every connection (the payload is held, so its identity cannot be reused meanwhile)."""

    __slots__ = ("_build", "_payload", "_wire")

    def __init__(self, build: Callable[[bytes], bytes]) -> None:
        self._build = build
        self._payload: bytes | None = None
        self._wire = b""

    def __call__(self, payload: bytes) -> bytes:
        if payload is not self._payload:
            self._payload, self._wire = payload, self._build(payload)
        return self._wire


http_chunk = LastFrame(chunked)
ws_text = LastFrame(lambda payload: ws_head(0x1, len(payload)) + payload)


def _linger_then_abort(transport: asyncio.Transport, linger: float) -> None:
    transport.close()  # flushes what is buffered if the peer reads again, then closes
    asyncio.get_running_loop().call_later(linger, transport.abort)


class HttpConn:
    """The body of one streaming HTTP response (SSE)."""

    transport = "sse"
    __slots__ = ("_checked", "_out", "_port", "_safe_send", "_writer", "closed", "headers", "label", "linger",
                 "send")

    def __init__(self, scope: MutableMapping[str, Any], send: Any, linger: float) -> None:
        self.send = scope.get("tokenfan.raw_send", send)  # the response has started: skip the wrappers
        self._safe_send = send
        # what the metrics call this connection: "sse", or the label a server adapter put in the scope
        self.label: str = scope.get("tokenfan.transport", self.transport)
        self.headers: list[tuple[bytes, bytes]] = scope.get("headers") or []  # the request's (its traceparent)
        self.linger = linger
        self.closed = False
        self._port = port_of(scope)
        self._writer: Writer | None = None  # the server's transport, once write_now found it can write into it
        self._checked = False
        self._out: list[bytes] = []  # frames taken by write_now, written at flush (one HTTP chunk)

    async def write(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes | None) -> None:
        """The normal last write (the response completes)."""
        with contextlib.suppress(*PEER_GONE):
            async with asyncio.timeout(ENDING_TIMEOUT):
                await self.send({"type": "http.response.body", "body": data or b"", "more_body": False})
        self.closed = True

    def write_now(self, data: bytes, step: Step | None = None) -> bool:
        """Take ``data`` without awaiting (a server port's chunked HTTP/1.1 only) while the server's flow control
        says the transport is writable; False otherwise (no port, a full buffer, a closing socket): the reader's
        own loop sends it. Within a ``step`` the frame is written at the step's flush."""
        writer = self._writer
        if writer is None:
            if self._checked:
                return False
            self._checked = True  # asked once the response started, when its encoding is known
            writer = self._writer = self._port.http_writer(self.send) if self._port is not None else None
            if writer is None:
                return False
        if writer.blocked():
            return False
        self._out.append(data)
        if step is None:
            self.flush()
        elif len(self._out) == 1:
            step.hold(self)
        return True

    def flush(self) -> None:
        """Write what ``write_now`` took as one HTTP chunk (one buffer: one send)."""
        out = self._out
        if out and self._writer is not None:
            self._writer.write(http_chunk(out[0]) if len(out) == 1 else chunked(b"".join(out)))
        out.clear()

    async def cut(self, data: bytes | None) -> None:
        """End now: ``data`` goes after whatever the peer has not read yet, then the connection closes."""
        self.closed = True
        port = self._port
        transport = port.http_end_now(self.send, chunked(data or b"") + b"0\r\n\r\n") if port is not None else None
        if transport is None:
            await self.end(data)
            return
        _linger_then_abort(transport, self.linger)


class WsConn:
    """An accepted WebSocket."""

    transport = "ws"
    label = "ws"  # what the metrics call it
    __slots__ = ("_out", "_port", "_writer", "closed", "headers", "linger", "send")

    def __init__(self, scope: MutableMapping[str, Any], send: Any, linger: float) -> None:
        self.send = scope.get("tokenfan.raw_send", send)  # accepted already: skip the wrappers
        self.headers: list[tuple[bytes, bytes]] = scope.get("headers") or []  # the handshake's (its traceparent)
        self.linger = linger
        self.closed = False
        self._port = port_of(scope)
        self._writer = self._port.ws_writer(self.send) if self._port is not None else None
        self._out: list[bytes] = []  # whole frames taken by write_now, written at flush

    @classmethod
    def of(cls, ws: Any, linger: float) -> WsConn:
        """The connection of an accepted Starlette ``WebSocket``: its ASGI ``send`` (Starlette's own
        ``WebSocket.send`` checks the socket's state on every message, which the delivery core's writes
        do not need), or the server's raw one when the scope carries it."""
        return cls(ws.scope, ws._send, linger)  # noqa: SLF001  (Starlette's: this is its one reader)

    async def write(self, text: str) -> None:
        await self.send({"type": "websocket.send", "text": text})

    async def end(self, text: str | None, code: int = 1000, reason: str = "") -> None:
        """A normal close: the last message, then a close frame (bounded wait)."""
        with contextlib.suppress(*PEER_GONE):
            async with asyncio.timeout(ENDING_TIMEOUT):
                if text is not None:
                    await self.send({"type": "websocket.send", "text": text})
                await self.send({"type": "websocket.close", "code": code, "reason": reason})
        self.closed = True

    def write_now(self, data: bytes, step: Step | None = None) -> bool:
        """Take one text message (UTF-8 ``data``) without awaiting (a server port's WebSocket without
        compression only) while the transport is writable; False otherwise: the reader's loop sends it.
        Within a ``step`` every message of the step goes out in one write at the step's flush."""
        writer = self._writer
        if writer is None or writer.blocked():
            return False
        out = self._out
        out.append(ws_text(data))
        if step is None:
            self.flush()
        elif len(out) == 1:
            step.hold(self)
        return True

    def flush(self) -> None:
        """Write what ``write_now`` took (whole frames, in order) in one transport write."""
        out = self._out
        if out and self._writer is not None:
            self._writer.write(out[0] if len(out) == 1 else b"".join(out))
        out.clear()

    async def cut(self, code: int, reason: str, text: str | None = None) -> None:
        """Close with ``code`` now, without waiting for the stalled peer."""
        if self.closed:
            return
        self.closed = True
        port = self._port
        transport = port.ws_end_now(self.send, ws_ending(text, code, reason)) if port is not None else None
        if transport is None:
            await self.end(text, code, reason)
            return
        _linger_then_abort(transport, self.linger)
