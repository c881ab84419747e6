"""Every use of uvicorn's private objects, in one module: written for uvicorn :data:`WRITTEN_FOR`, checked at
start-up, and off (loudly) on any other.

What the gateway does beneath uvicorn's ASGI interface:

- :class:`HeaderTimeoutProtocol`: uvicorn's httptools HTTP/1.1 protocol with read deadlines (slowloris): it
  overrides the parser callbacks and, on a body deadline, fails the request cycle (``cycle.disconnected``,
  ``cycle.message_event``); after a WebSocket upgrade it drops its parser (``handle_websocket_upgrade``).
- :class:`GracefulServer`: ``uvicorn.Server`` that drains before its own shutdown, handles SIGTERM without
  re-raising it (``capture_signals``) and, with ``--workers``, serves the shared port once the engine link is
  up (its ``startup`` builds the protocol as uvicorn's own does: ``server_state``, ``lifespan.state``).
- :class:`UvicornPort`: the delivery core's :class:`gateway.core.server_port.ServerPort`, found from uvicorn's
  own ``send`` (a bound method of its ``RequestResponseCycle`` or its sans-I/O WebSocket protocol): the
  one-pass write reads the flow control (``cycle.flow.write_paused``, ``proto.writable``) and writes into the
  transport; a cut writes the ending after what is buffered and marks the cycle complete (``response_complete``,
  ``keep_alive``, ``close_sent``); a fan-out subscriber's socket is taken (``--detach-subscribers``): uvicorn's
  protocol and cycle forget it (``server_state.connections``, ``transport``, ``pipeline``, ``stop_keepalive``,
  the websockets library's ``conn.reader.buffer`` and ``conn.events``) and, once its ASGI call returned, are
  unlinked (the protocol's, the cycle's or ``conn``'s attributes cleared: their reference cycles go at once).

:func:`connection_problems` lists what differs from :data:`SHAPE` (every class and attribute used, read from
the classes and their methods' ``self.x = ...`` assignments) and whether the running uvicorn is of a series of
:data:`WRITTEN_FOR`. :func:`server_port` runs it once at start-up: on any problem it logs an error naming it
and returns None, so every exchange takes the plain ASGI path (fan-out subscribers stay in their ASGI call, as
with ``--detach-subscribers false``; no one-pass write; cuts through ASGI, bounded). :func:`server_problems`
checks what :class:`GracefulServer` overrides; the gateway refuses to start without it (its SIGTERM drain).
tests/test_uvicorn_shim.py runs both on the installed uvicorn and on a simulated other one.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import functools
import importlib
import inspect
import logging
import signal
import socket
import textwrap
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.core.server_port import Taken
from gateway.errors import ClientError

log = logging.getLogger("tokenfan.server")

# uvicorn release series whose private objects this module was written against: 0.54 (what `make setup`
# installs); 0.52.4 and 0.53.0 pass tests/test_uvicorn_shim.py, tests/e2e/test_detached.py and
# test_stalled_readers.py too (0.50.2 and before lack the sans-I/O WebSocket's `disconnected`). pyproject.toml
# asks for these series, below the next minor. Another: no port (above).
WRITTEN_FOR = ("0.52", "0.53", "0.54")

# Every class this module reaches into, and what of it is used (methods, class or instance attributes).
SHAPE: dict[str, tuple[str, ...]] = {
    "uvicorn.protocols.http.httptools_impl:HttpToolsProtocol": (
        "cycle", "pipeline", "connections", "transport", "parser", "loop", "client", "connection_made",
        "connection_lost", "on_message_begin", "on_headers_complete", "on_message_complete",
        "handle_websocket_upgrade"),
    "uvicorn.protocols.http.httptools_impl:RequestResponseCycle": (
        "send", "transport", "flow", "chunked_encoding", "response_started", "response_complete", "disconnected",
        "more_body", "keep_alive", "message_event"),
    "uvicorn.protocols.http.flow_control:FlowControl": ("write_paused",),
    "uvicorn.protocols.websockets.websockets_sansio_impl:WebSocketsSansIOProtocol": (
        "send", "transport", "connections", "conn", "queue", "config", "writable", "close_sent",
        "handshake_complete", "disconnected", "ping_interval", "ping_timeout", "stop_keepalive"),
    "websockets.protocol:Protocol": ("reader", "events", "extensions"),
    "websockets.streams:StreamReader": ("buffer",),
    "uvicorn.config:Config": ("ws_max_size", "http_protocol_class", "backlog"),
}
SERVER_SHAPE: dict[str, tuple[str, ...]] = {
    "uvicorn.server:Server": ("capture_signals", "startup", "shutdown", "handle_exit", "servers", "server_state",
                              "lifespan", "config"),
    "uvicorn.config:Config": ("http_protocol_class", "backlog"),
}


# -- the shape check ------------------------------------------------------------------------------------------

def _assigned(cls: type) -> set[str]:
    """The ``self.x`` a class's own methods assign (its instance attributes); empty if its source is unreadable."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


def members(cls: type) -> set[str]:
    """A class's methods and class attributes, and the instance attributes its classes' methods assign."""
    return set(dir(cls)).union(*(_assigned(c) for c in cls.__mro__ if c is not object))


def shape_problems(shape: dict[str, tuple[str, ...]]) -> list[str]:
    """What differs from ``shape``: a class that cannot be imported, or the members it lacks."""
    out = []
    for path, needed in shape.items():
        module, _, name = path.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            out.append(f"{path} is not there")
            continue
        missing = sorted(set(needed) - members(cls))
        if missing:
            out.append(f"{path} has no {', '.join(missing)}")
    return out


def supported(version: str) -> bool:
    return any(version == series or version.startswith(series + ".") for series in WRITTEN_FOR)


def connection_problems(version: str | None = None) -> list[str]:
    """Why :class:`UvicornPort` cannot be used with the running uvicorn (empty: it can)."""
    version = version or uvicorn.__version__
    out = [] if supported(version) else [
        f"uvicorn {version} is not a version this shim was written for ({', '.join(s + '.x' for s in WRITTEN_FOR)})"]
    return out + shape_problems(SHAPE)


def server_problems() -> list[str]:
    """Why :class:`GracefulServer` cannot run on the installed uvicorn (empty: it can)."""
    return shape_problems(SERVER_SHAPE)


def server_port(version: str | None = None) -> UvicornPort | None:
    """The core's port under the running uvicorn, once its checks passed; None, logged as an error, if not."""
    problems = connection_problems(version)
    if problems:
        log.error("uvicorn shim (gateway/http/uvicorn_shim.py) is off: %s. Fan-out subscribers stay in their ASGI "
                  "call (as with --detach-subscribers false) and every write goes through ASGI; install the "
                  "uvicorn pyproject.toml asks for, or port the shim and add the series to WRITTEN_FOR",
                  "; ".join(problems))
        return None
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    log.info("uvicorn %s: the shim's shape checks passed", version or uvicorn.__version__)
    return UvicornPort(RequestResponseCycle, WebSocketsSansIOProtocol)


# -- the delivery core's port -----------------------------------------------------------------------------------

class _Gone:
    """What uvicorn's forgotten protocol and cycle hold instead of the transport: anything it still does to the
    connection (close it when its ASGI call returns, a graceful-shutdown close) goes nowhere."""

    __slots__ = ()

    def close(self) -> None: ...

    def abort(self) -> None: ...

    def write(self, data: bytes) -> None: ...

    def is_closing(self) -> bool:
        return True

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


GONE = _Gone()


def _forget(proto: Any, part: Any) -> None:
    """uvicorn's protocol lets go of the connection: out of the server's set (its graceful shutdown does not
    wait for it), its timers cancelled, its transport replaced by :data:`GONE`; once the exchange's ASGI call
    returned, it and ``part`` (its request cycle, or its WebSocket's sans-I/O connection) are unlinked
    (:func:`_unlink`)."""
    proto.connections.discard(proto)
    if isinstance(proto, HeaderTimeoutProtocol):
        proto.disarm()
    proto.transport = GONE
    task = asyncio.current_task()  # the exchange's ASGI call, which returns next
    if task is not None:
        task.add_done_callback(lambda _: _unlink(proto, part))


def _unlink(proto: Any, part: Any) -> None:
    """Drop what a forgotten protocol and its ``part`` hold (the request cycle's scope holds the cycle's own
    ``send``; the websockets connection, its reader and events), so they and their reference cycles (about 44
    objects a subscriber) go at once by reference counting, not in a later collection."""
    for obj in (part, proto):
        if hasattr(obj, "__dict__"):
            vars(obj).clear()


class _HttpWriter:
    """A chunked response's transport under uvicorn's flow control."""

    __slots__ = ("flow", "transport")

    def __init__(self, cycle: Any) -> None:
        self.flow, self.transport = cycle.flow, cycle.transport

    def blocked(self) -> bool:
        return bool(self.flow.write_paused) or self.transport.is_closing()

    def write(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)


class _WsWriter:
    """An accepted WebSocket's transport under its protocol's flow control (``writable``)."""

    __slots__ = ("proto",)

    def __init__(self, proto: Any) -> None:
        self.proto = proto

    def blocked(self) -> bool:
        p = self.proto
        return not p.writable.is_set() or p.close_sent or p.transport.is_closing()

    def write(self, data: bytes) -> None:
        p = self.proto
        if not p.close_sent and not p.transport.is_closing():
            p.transport.write(data)


class UvicornPort:
    """:class:`gateway.core.server_port.ServerPort` for uvicorn's httptools request cycle and its sans-I/O
    WebSocket protocol (the classes the checks passed for); None for any other ``send``."""

    __slots__ = ("cycle_class", "ws_class")

    def __init__(self, cycle_class: type, ws_class: type) -> None:
        self.cycle_class, self.ws_class = cycle_class, ws_class

    def _cycle(self, send: Any) -> Any:
        owner = getattr(send, "__self__", None)
        return owner if isinstance(owner, self.cycle_class) else None

    def _ws(self, send: Any) -> Any:
        owner = getattr(send, "__self__", None)
        return owner if isinstance(owner, self.ws_class) else None

    # -- HTTP/1.1

    def http_writer(self, send: Any) -> _HttpWriter | None:
        cycle = self._cycle(send)
        return _HttpWriter(cycle) if cycle is not None and cycle.chunked_encoding else None

    def http_end_now(self, send: Any, ending: bytes) -> asyncio.Transport | None:
        cycle = self._cycle(send)
        if cycle is None or not cycle.chunked_encoding or cycle.transport.is_closing():
            return None
        transport: asyncio.Transport = cycle.transport
        transport.write(ending)
        cycle.response_complete = True  # uvicorn writes nothing more for it
        cycle.keep_alive = False
        return transport

    def http_detachable(self, send: Any) -> bool:
        return self._cycle(send) is not None

    def take_http(self, send: Any) -> Taken | None:
        cycle = self._cycle(send)
        if cycle is None or not cycle.chunked_encoding or not cycle.response_started \
                or cycle.response_complete or cycle.disconnected or cycle.more_body:
            return None
        transport = cycle.transport
        proto = transport.get_protocol()
        if transport.is_closing() or proto.cycle is not cycle or proto.pipeline:
            return None
        taken = Taken(transport, bool(cycle.flow.write_paused))
        _forget(proto, cycle)
        cycle.transport = GONE
        cycle.response_complete = True  # its ASGI call returns without uvicorn closing or reusing the socket
        return taken

    # -- WebSocket

    def ws_writer(self, send: Any) -> _WsWriter | None:
        proto = self._ws(send)
        return _WsWriter(proto) if proto is not None and not proto.conn.extensions else None

    def ws_end_now(self, send: Any, ending: bytes) -> asyncio.Transport | None:
        proto = self._ws(send)
        if proto is None or proto.transport.is_closing():
            return None
        transport: asyncio.Transport = proto.transport
        transport.write(ending)
        proto.close_sent = True  # uvicorn writes nothing more on this socket
        return transport

    def take_ws(self, send: Any) -> Taken | None:
        proto = self._ws(send)
        if proto is None or proto.conn.extensions or not proto.handshake_complete or proto.close_sent \
                or proto.disconnected or proto.transport.is_closing() or proto.conn.reader.buffer \
                or proto.conn.events or not proto.queue.empty():
            return None
        taken = Taken(proto.transport, not proto.writable.is_set(), max_size=proto.config.ws_max_size,
                      ping_interval=proto.ping_interval, ping_timeout=proto.ping_timeout)
        proto.stop_keepalive()
        _forget(proto, proto.conn)
        return taken


# -- the HTTP/1.1 protocol: read deadlines ----------------------------------------------------------------------

class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with read deadlines (slowloris):

    - the request head must be complete ``header_timeout`` seconds after the connection is made or
      after the request's first byte, else the connection is closed;
    - a request body must be complete ``body_timeout`` seconds after its head, else the client gets
      408 (OpenAI error shape, ``Connection: close``) if no response has started, and the connection
      is closed either way; the app sees a disconnect.

    The deadlines are two timer handles per connection, armed and cancelled at parser callbacks: no
    cost per response write. Configured by subclassing (:func:`protocol_class`).
    """

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.header_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # a keep-alive connection's next request
            self._arm(self.header_timeout, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self.disarm()
        super().on_headers_complete()
        if not self.parser.should_upgrade() and not self._private():
            self._arm(self.body_timeout, self._body_timed_out)  # cancelled at once if there is no body

    def _private(self) -> bool:
        """A peer worker's request on this worker's private Unix socket (--workers): its body is a standby's
        acknowledgements for as long as its relay runs (gateway.scaleout.peers), so it has no deadline."""
        sock = self.transport.get_extra_info("socket")
        return sock is not None and sock.family == socket.AF_UNIX

    def on_message_complete(self) -> None:
        self.disarm()
        super().on_message_complete()

    def _arm(self, delay: float, callback: Any) -> None:
        self.disarm()
        if delay > 0:
            self._deadline = self.loop.call_later(delay, callback)

    def disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_timed_out(self) -> None:
        self._deadline = None
        log.info("closing %s: request head not complete after %.1f s", self.client, self.header_timeout)
        self.transport.close()

    def _body_timed_out(self) -> None:
        self._deadline = None
        log.info("closing %s: request body not complete after %.1f s", self.client, self.body_timeout)
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and not self.transport.is_closing():
            body = ClientError(408, f"The request body did not arrive within {self.body_timeout:g} s.",
                            code="request_timeout").to_bytes()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def handle_websocket_upgrade(self) -> None:
        super().handle_websocket_upgrade()
        # uvicorn drops this protocol for the WebSocket's; without its parser (which points back at it) it
        # goes at once by reference counting instead of in a later collection (one per WebSocket)
        self.parser = None  # type: ignore[assignment]


def protocol_class(header_timeout: float, body_timeout: float) -> type[HeaderTimeoutProtocol]:
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout})


# -- the server: drain, signals, the shared port of --workers ----------------------------------------------------

class GracefulServer(uvicorn.Server):
    """``uvicorn.Server`` that awaits ``drain`` before its own shutdown and handles ``signals`` without
    re-raising them; with ``public`` (``--workers``) it serves the private socket at once and the shared port
    when ``listen`` (given the port's ``asyncio.Server``, not yet serving) decides."""

    def __init__(self, config: uvicorn.Config, *, signals: tuple[int, ...], drain: Callable[[], Awaitable[None]],
                 public: socket.socket | None = None,
                 listen: Callable[[asyncio.Server], Coroutine[Any, Any, None]] | None = None,
                 on_hup: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.signals, self.drain, self.public, self.listen = signals, drain, public, listen
        self.on_hup = on_hup  # SIGHUP: reload keys, secrets and certificates (gateway.http.reload)
        self.gate: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in self.signals:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        if self.on_hup is not None:
            loop.add_signal_handler(signal.SIGHUP, self.on_hup)
        try:
            yield
        finally:
            for sig in self.signals:
                loop.remove_signal_handler(sig)
            if self.on_hup is not None:
                loop.remove_signal_handler(signal.SIGHUP)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.public is None or self.listen is None:
            return
        config = self.config

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]  # as uvicorn's own startup does
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=_loop)

        loop = asyncio.get_running_loop()
        server = await loop.create_server(create_protocol, sock=self.public, backlog=config.backlog,
                                          start_serving=False)
        self.servers.append(server)
        self.gate = loop.create_task(self.listen(server), name="listen-when-ready")

    async def shutdown(self, sockets: Any = None) -> None:
        if self.gate is not None:
            self.gate.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.gate
        for server in self.servers:
            server.close()  # stop accepting; open connections (SSE and WS) carry on
        await self.drain()
        await super().shutdown(sockets)


@functools.cache
def _checked_server() -> None:
    problems = server_problems()
    if problems:
        raise SystemExit(f"tokenfan cannot serve on uvicorn {uvicorn.__version__}: {'; '.join(problems)} "
                         "(gateway/http/uvicorn_shim.py); install the uvicorn pyproject.toml asks for")


def graceful_server(config: uvicorn.Config, **kwargs: Any) -> GracefulServer:
    """A :class:`GracefulServer`, once what it overrides was found in the installed uvicorn (else a clear exit)."""
    _checked_server()
    return GracefulServer(config, **kwargs)
