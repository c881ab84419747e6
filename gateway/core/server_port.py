"""What the delivery core asks of the server beneath ASGI, when there is one that can answer.

ASGI gives a response only an awaited ``send``. The core needs three things more (:mod:`gateway.core.conn`,
:mod:`gateway.core.bare`): a frame written without awaiting while the socket is writable (the one-pass write
of an engine step), an ending written *after* a stalled peer's buffer without waiting for it (a cut), and a
fan-out subscriber's socket taken out of the server once its response started (``--detach-subscribers``).

:class:`ServerPort` is that ask. Its one implementation, :mod:`gateway.http.uvicorn_shim`, is the only module
that reads or writes uvicorn's private objects; it checks their shape at start-up and, on a uvicorn it was not
written for, there is no port. The port travels in each exchange's scope (:data:`SERVER_KEY`, put there by
:class:`gateway.http.middleware.RawSend`); without it (another server, HTTP/3, a failed check) every method
of the core takes the plain ASGI path. Everything here is duck-typed: the core imports no ASGI server.
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

SERVER_KEY = "tokenfan.server"


class Writer(Protocol):
    """An exchange's transport as the one-pass write uses it (bytes already framed by the core)."""

    def blocked(self) -> bool:
        """The server's flow control says the transport's buffer is full, or the connection is closing or
        closed (for a WebSocket: a close frame was sent)."""
        ...

    def write(self, data: bytes) -> None:
        """Append ``data`` to the transport's buffer, unless the connection is closing."""
        ...


@dataclass(frozen=True, slots=True)
class Taken:
    """A socket the server let go of: its transport, whether its flow control had paused writing, and (a
    WebSocket) the keep-alive and size limits the server applied to it."""

    transport: asyncio.Transport
    paused: bool
    max_size: int | None = None
    ping_interval: float | None = None
    ping_timeout: float | None = None


class ServerPort(Protocol):
    """The server's side of one exchange, found from the server's own ``send`` (``None`` when ``send`` is not
    this server's: the exchange then takes the ASGI path)."""

    def http_writer(self, send: Any) -> Writer | None:
        """A started HTTP/1.1 response that is chunked and under the server's flow control."""
        ...

    def http_end_now(self, send: Any, ending: bytes) -> asyncio.Transport | None:
        """Write ``ending`` (the last chunk and the terminating one) after whatever is buffered, mark the
        response complete and not to be kept alive; the transport, for the caller to close."""
        ...

    def http_detachable(self, send: Any) -> bool:
        """Whether an SSE response on this exchange could be taken once started (asked before its head)."""
        ...

    def take_http(self, send: Any) -> Taken | None:
        """The socket of a started, chunked response with nothing more in flight on it (no pipelined
        request, the client still there), the server's objects made to forget it."""
        ...

    def ws_writer(self, send: Any) -> Writer | None:
        """An accepted WebSocket whose frames may be written into its transport (no compression)."""
        ...

    def ws_end_now(self, send: Any, ending: bytes) -> asyncio.Transport | None:
        """Write ``ending`` (a last message and a close frame); the server writes nothing more on it."""
        ...

    def take_ws(self, send: Any) -> Taken | None:
        """The socket of an accepted WebSocket with nothing received and not yet handled, no close under way,
        the server's keep-alive stopped and its objects made to forget it."""
        ...


def port_of(scope: MutableMapping[str, Any]) -> ServerPort | None:
    """The server port of an exchange (None: the ASGI path)."""
    port: ServerPort | None = scope.get(SERVER_KEY)
    return port
