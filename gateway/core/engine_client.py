"""The ZeroMQ driver of the engine link: one DEALER socket, a reader, a pinger and a socket monitor.

It moves what :class:`gateway.core.engine_link.EngineLink` (the link's rules, without I/O: registry,
heartbeats, engine identity and restarts, continuations, load) produces: every message the socket holds is
decoded and handed to the link with the time; after every input, the messages the link wants sent are sent
and its events (:data:`gateway.core.engine_link.LinkEvent`) handed to the pool (``on_lost``,
``on_continued``). A ``DeltaBatch`` (one engine step) is one synchronous pass: each delta goes straight to its
request's :class:`gateway.core.generation.Generation` (streamed requests), which renders, appends and writes
it to the caught-up readers; then the step's connections are flushed, one write each.

The socket refuses to queue a submit for an engine that is not connected (``IMMEDIATE``): such a submit
raises ``engine_unavailable`` (a continuation is not sent), and the link forgets it. A socket-monitor
``DISCONNECTED`` event tells the link at once when a connection drops (a killed engine is noticed even when
a supervisor restarts it faster than ``heartbeat_timeout``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engine_worker import protocol as p
from engine_worker.curve import connect_curve
from gateway.core.engine_link import ContinuationRefused, Continued, EngineLink, Lost, Reattached
from gateway.core.request import Failure, RequestHandle
from gateway.core.step import Step
from gateway.errors import EngineError

log = logging.getLogger(__name__)

# zmq's flags as plain ints: its IntFlag arithmetic showed up in profiles of the hot loop.
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)

__all__ = ["EngineClient", "Failure", "RequestHandle"]


@dataclass
class EngineClient:
    address: str
    heartbeat_interval: float = 0.25
    heartbeat_timeout: float = 1.0
    curve_dir: Path | None = None
    # The step clock: (monotonic s, epoch ns), read once per DeltaBatch; tests inject their own.
    clock: Callable[[], tuple[float, int]] = field(default=lambda: (time.monotonic(), time.time_ns()))
    # Requests of a lost engine (link dropped, heartbeats missed, a new instance): the pool continues them
    # elsewhere or fails them (None: fail them with the error).
    on_lost: Callable[[EngineClient, list[RequestHandle], EngineError], None] | None = None
    # A continued request's first delta (handle, seconds since it was lost, True) or its refusal (False):
    # the pool's migration accounting.
    on_continued: Callable[[RequestHandle, float, bool], None] | None = None
    # A lost request the same engine instance still ran is on this link again: the pool forgets its continuation.
    on_reattached: Callable[[RequestHandle], None] | None = None

    def __post_init__(self) -> None:
        self.link = EngineLink(self.address, self.heartbeat_timeout, self.heartbeat_interval)
        # A plain (blocking-API) socket read from the event loop's selector: the reader drains every
        # message the socket holds per wake-up with NOBLOCK receives. zmq.asyncio's recv_multipart costs
        # two futures and a poller callback per message (~15 µs per engine step here, measured with
        # py-spy under 5,000 tokens/s); this costs one getsockopt and one receive.
        self._ctx = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._monitor_sync: zmq.Socket[bytes] | None = None
        self._readable = asyncio.Event()  # the socket's FD signalled: messages may be waiting
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue a submit for an engine that is not connected
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self.curve_dir is not None:
            connect_curve(sock, self.curve_dir)
        self._monitor_sync = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitor = zmq.asyncio.Socket.from_socket(self._monitor_sync)
        sock.connect(self.address)
        self._sock = sock
        self._tasks = [asyncio.create_task(self._reader(), name="engine-reader"),
                       asyncio.create_task(self._pinger(), name="engine-pinger"),
                       asyncio.create_task(self._watch_link(), name="engine-monitor")]
        log.info("attached to engine at %s", self.address)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self.link.abort_all()
            self._flush()
            self._sock.disable_monitor()
            self._sock.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        if self._monitor_sync is not None:
            self._monitor_sync.close(linger=0)
        self._ctx.term()

    # -- the link's state, read -----------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self.link.healthy(time.monotonic())

    @property
    def last_heartbeat(self) -> p.Heartbeat | None:
        return self.link.last_heartbeat

    @property
    def engine_id(self) -> str | None:
        return self.link.engine_id

    @property
    def model(self) -> str | None:
        hb = self.link.last_heartbeat
        return hb.model if hb else None

    @property
    def bad_frames(self) -> int:
        return self.link.bad_frames

    @property
    def in_flight(self) -> int:
        return self.link.in_flight

    def load(self) -> tuple[int, int]:
        return self.link.load()

    def routing_load(self) -> int:
        """Engine-reported load plus what this gateway submitted since that report."""
        return self.link.routing_load()

    def status(self) -> dict[str, object]:
        """This link for ``/health``: the current instance, how often it changed, what is in flight."""
        return self.link.status(time.monotonic())

    # -- requests --------------------------------------------------------------------------------

    def submit(self, submit: p.Submit) -> RequestHandle:
        """Send a request to the engine; raises EngineError ``engine_unavailable`` if the engine is down."""
        handle = self.link.submit(submit, time.monotonic(), owner=self)
        if not self._flush():
            raise EngineError.unavailable("the engine socket is not connected")
        return handle

    def resume(self, handle: RequestHandle, now: float) -> bool:
        """Continue a request another link lost on this engine (:meth:`EngineLink.resume`). False if it
        cannot be sent now (the handle is as it was)."""
        previous = handle.owner, handle.engine_rid, handle.send_seq
        if not self.link.resume(handle, now, owner=self):
            return False
        if self._flush():
            return True
        handle.owner, handle.engine_rid, handle.send_seq = previous
        return False

    def close_request(self, handle: RequestHandle) -> None:
        """Forget ``handle`` (its ``close``); abort it in the engine if unfinished."""
        self.link.close_request(handle)
        self._flush()

    def fail_all(self, err: Failure) -> int:
        """Fail every in-flight request with ``err`` and abort them in the engine; returns how many."""
        n = self.link.fail_all(err)
        self._flush()
        return n

    # -- moving the link's output ----------------------------------------------------------------

    def _flush(self) -> bool:
        """Send what the link produced and hand its events on; False if a submit could not be sent (the
        link forgot it)."""
        ok = True
        link = self.link
        for msg in link.data_to_send():
            if not self._send(msg) and type(msg) is p.Submit:
                link.unsent(msg)
                ok = False
        for ev in link.events_received():
            if type(ev) is Lost:
                if self.on_lost is not None:
                    self.on_lost(self, ev.handles, ev.error)
                else:
                    for h in ev.handles:
                        h.done = True
                        h.fail(ev.error)
            elif type(ev) is Reattached:
                if self.on_reattached is not None:
                    self.on_reattached(ev.handle)
            elif self.on_continued is not None:
                if type(ev) is Continued:
                    self.on_continued(ev.handle, ev.gap, True)
                elif type(ev) is ContinuationRefused:
                    self.on_continued(ev.handle, 0.0, False)
        return ok

    def _send(self, msg: p.Message) -> bool:
        """Send without blocking; False if the engine is not connected (IMMEDIATE) or the send failed."""
        sock = self._sock
        if sock is None:
            return False
        try:
            sock.send_multipart(p.encode(msg), flags=_NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            log.warning("engine send failed: %s", exc)
            return False
        finally:
            # A send may consume the FD's edge for messages that arrived meanwhile: look again.
            if cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                self._readable.set()

    async def _pinger(self) -> None:
        while True:
            self.link.tick(time.monotonic(), p.now_ns())
            self._flush()
            await asyncio.sleep(self.heartbeat_interval)

    async def _watch_link(self) -> None:
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.link.disconnected()
                self._flush()

    async def _reader(self) -> None:
        """Wake when the socket's FD signals; then receive everything it holds, without blocking, one message
        per loop turn."""
        sock = self._sock
        assert sock is not None
        loop = asyncio.get_running_loop()
        fd = cast(int, sock.getsockopt(zmq.FD))
        readable = self._readable
        loop.add_reader(fd, readable.set)
        try:
            while True:
                readable.clear()
                while cast(int, sock.getsockopt(_EVENTS)) & _POLLIN:
                    try:
                        frames = sock.recv_multipart(_NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_message(frames)
                    # One message (an engine step) per loop turn: a gateway that fell behind its engine
                    # would otherwise drain a queue that refills while it works, for as long as it stays
                    # behind, and run no timer (its pinger), accept or subscriber meanwhile.
                    await asyncio.sleep(0)
                await readable.wait()
        finally:
            loop.remove_reader(fd)

    def _on_message(self, frames: list[bytes]) -> None:
        link = self.link
        try:
            msg = p.decode(frames)
        except p.WireError as exc:
            link.bad_frame(exc)
            return
        if type(msg) is p.DeltaBatch:
            step = Step(*self.clock())
            try:
                link.deliver(msg.deltas, step)
            finally:
                step.flush()
        else:
            link.receive(msg, time.monotonic(), time.time_ns())
        self._flush()
