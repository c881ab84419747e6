"""The write side of one client connection, as the delivery core needs it.

Two operations: ``write`` (await until the server took the frame; a stalled client makes it block,
which the :class:`gateway.streams.Watchdog` turns into a cut) and ``cut`` (end the connection with a
final frame *without waiting on the stalled peer*).

``cut`` needs what ASGI does not give: after a blocked write the server's ``send`` is stuck waiting
for the peer to drain, so a final frame sent through it would wait as well. Under uvicorn (HTTP/1.1)
the transport is reachable from the server's own ``send`` (kept by :class:`gateway.middleware.RawSend`),
so the ending is appended to the transport buffer directly (chunk-framed for HTTP, a WebSocket close
frame for WS), the transport is closed (it flushes what it holds if the peer reads again) and aborted
after ``linger`` seconds if it never does. Under any other server the ending is sent through ASGI with a
short timeout and the connection left to the server. This is the one place that knows uvicorn's objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.streams import DirectWrite, Event

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


def chunked(data: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%b\r\n" % (len(data), data) if data else b""


def _server_side(send: Any) -> Any:
    """uvicorn's per-request cycle (HTTP) or protocol (WS) behind its own ``send``, else None."""
    owner = getattr(send, "__self__", None)
    return owner if owner is not None and hasattr(owner, "transport") else None


def _linger_then_abort(transport: asyncio.Transport, linger: float) -> None:
    transport.close()  # flushes what is buffered if the peer reads again, then closes
    asyncio.get_running_loop().call_later(linger, transport.abort)


class HttpConn:
    """The body of one streaming HTTP response (SSE)."""

    transport = "sse"

    def __init__(self, scope: MutableMapping[str, Any], send: Any, linger: float) -> None:
        self.send = scope.get("tokenfan.raw_send", send)  # the response has started: skip the wrappers
        self._safe_send = send
        self.linger = linger
        self.closed = False

    async def write(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes | None) -> None:
        """The normal last write (the response completes)."""
        with contextlib.suppress(*PEER_GONE):
            async with asyncio.timeout(ENDING_TIMEOUT):
                await self.send({"type": "http.response.body", "body": data or b"", "more_body": False})
        self.closed = True

    def direct(self, name: str, frame: Callable[[Event], bytes]) -> DirectWrite | None:
        """A synchronous writer for the publisher's one pass (uvicorn, chunked HTTP/1.1 only): the
        event's frame, chunk-framed once per event for every reader, straight into the transport while
        the server's flow control says it is writable; otherwise None/False and the reader's loop sends."""
        cycle = _server_side(self.send)
        flow = getattr(cycle, "flow", None)
        if cycle is None or flow is None or not (getattr(cycle, "chunked_encoding", False) or _h11_chunked(cycle)):
            return None
        transport = cycle.transport
        key = name + "/chunk-head"  # only the small chunk head is kept: the frame itself is not copied

        def write(ev: Event) -> bool:
            if flow.write_paused or transport.is_closing():
                return False
            data = frame(ev)
            head = ev.frames.get(key)
            if head is None:
                head = ev.frames[key] = b"%x\r\n" % len(data)
            transport.writelines((head, data, b"\r\n"))
            return True

        return write

    async def cut(self, data: bytes | None) -> None:
        """End now: ``data`` goes after whatever the peer has not read yet, then the connection closes."""
        self.closed = True
        cycle = _server_side(self.send)
        transport = getattr(cycle, "transport", None)
        if transport is None or transport.is_closing():
            await self.end(data)
            return
        payload = data or b""
        if hasattr(cycle, "conn") and hasattr(cycle.conn, "send"):  # uvicorn h11: let h11 frame it
            import h11

            out = (cycle.conn.send(h11.Data(data=payload)) if payload else b"") + cycle.conn.send(h11.EndOfMessage())
        elif getattr(cycle, "chunked_encoding", False):  # uvicorn httptools
            out = chunked(payload) + b"0\r\n\r\n"
        else:
            out = payload
        transport.write(out)
        for attr in ("response_complete",):
            if hasattr(cycle, attr):
                setattr(cycle, attr, True)
        if hasattr(cycle, "keep_alive"):
            cycle.keep_alive = False
        _linger_then_abort(transport, self.linger)


def _h11_chunked(cycle: Any) -> bool:
    writer = getattr(getattr(cycle, "conn", None), "_writer", None)
    return type(writer).__name__ == "ChunkedWriter"


class WsConn:
    """An accepted WebSocket."""

    transport = "ws"

    def __init__(self, scope: MutableMapping[str, Any], send: Any, linger: float) -> None:
        self.send = scope.get("tokenfan.raw_send", send)  # accepted already: skip the wrappers
        self.linger = linger
        self.closed = False

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

    def direct(self, name: str, frame: Callable[[Event], bytes]) -> DirectWrite | None:
        """A synchronous writer for the publisher's one pass (uvicorn's sans-I/O WebSocket, no
        compression only): one pre-built frame per event for every reader, straight into the transport
        while it is writable."""
        proto = _server_side(self.send)
        writable = getattr(proto, "writable", None)
        if proto is None or writable is None or not hasattr(proto, "close_sent") \
                or getattr(getattr(proto, "conn", None), "extensions", None):
            return None
        transport = proto.transport
        key = name + "/ws-head"  # only the small frame head is kept: the payload itself is not copied

        def write(ev: Event) -> bool:
            if not writable.is_set() or proto.close_sent or transport.is_closing():
                return False
            data = frame(ev)
            head = ev.frames.get(key)
            if head is None:
                head = ev.frames[key] = ws_head(0x1, len(data))
            transport.writelines((head, data))
            return True

        return write

    async def cut(self, code: int, reason: str, text: str | None = None) -> None:
        """Close with ``code`` now, without waiting for the stalled peer."""
        if self.closed:
            return
        self.closed = True
        proto = _server_side(self.send)
        transport = getattr(proto, "transport", None)
        if transport is None or transport.is_closing() or not hasattr(proto, "close_sent"):
            await self.end(text, code, reason)
            return
        out = (ws_frame(0x1, text.encode()) if text is not None else b"") + ws_close_frame(code, reason)
        transport.write(out)
        proto.close_sent = True  # uvicorn writes nothing more on this socket
        _linger_then_abort(transport, self.linger)
