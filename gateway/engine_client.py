"""The gateway's side of the engine link: one ZeroMQ DEALER, one reader task.

The reader routes every incoming message by request id into that request's own
:class:`RequestHandle` (no queue is shared between requests). A pinger sends ``Ping`` every
``heartbeat_interval``; the engine is *healthy* while a ``Heartbeat`` arrived within
``heartbeat_timeout``. When it stops answering, every in-flight request fails with
``engine_unavailable`` at once, so clients get an explicit error instead of a silent stall.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.asyncio

from engine_worker import protocol as p
from engine_worker.curve import connect_curve
from gateway.errors import APIError, engine_unavailable

log = logging.getLogger(__name__)


class RequestHandle:
    """Events of one request: an ``Accepted`` first, then deltas, or an ``APIError``."""

    __slots__ = ("request_id", "trace_id", "_queue", "accepted", "done", "_client", "on_close")

    def __init__(self, client: EngineClient, request_id: str, trace_id: str) -> None:
        self._client = client
        self.request_id = request_id
        self.trace_id = trace_id
        self._queue: asyncio.Queue[p.Delta | APIError] = asyncio.Queue()
        self.accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.done = False
        self.on_close: list[Callable[[], None]] = []

    def _push(self, item: p.Delta | APIError) -> None:
        self._queue.put_nowait(item)

    def _fail(self, err: APIError) -> None:
        if not self.accepted.done():
            self.accepted.set_exception(err)
            self.accepted.exception()  # mark retrieved: the consumer may be gone
        self._queue.put_nowait(err)

    async def wait_accepted(self, timeout: float) -> int:
        """Prompt token count once the engine accepted the request; raises APIError."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.accepted), timeout)
        except TimeoutError as exc:
            raise engine_unavailable(f"the engine did not accept the request within {timeout:.0f}s") from exc

    async def deltas(self, idle: float | None = None) -> AsyncIterator[p.Delta | None]:
        """Deltas until the one with a finish reason; ``None`` after each ``idle`` seconds without one
        (a keep-alive tick); raises APIError on failure."""
        while True:
            if idle is None:
                item = await self._queue.get()
            else:
                try:
                    item = await asyncio.wait_for(self._queue.get(), idle)
                except TimeoutError:
                    yield None
                    continue
            if isinstance(item, APIError):
                self.done = True
                raise item
            yield item
            if item.finish_reason is not None:
                self.done = True
                return

    def close(self) -> None:
        """Forget the request; abort it in the engine if it had not finished (sync: safe in ``finally``)."""
        callbacks, self.on_close = self.on_close, []
        for cb in callbacks:
            cb()
        self._client._forget(self.request_id, abort=not self.done)


@dataclass
class EngineClient:
    address: str
    heartbeat_interval: float = 0.25
    heartbeat_timeout: float = 1.0
    curve_dir: Path | None = None
    _handles: dict[str, RequestHandle] = field(default_factory=dict)
    last_heartbeat: p.Heartbeat | None = None
    bad_frames: int = 0
    aborts_sent: int = 0

    def __post_init__(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_beat_at = 0.0
        self._was_healthy = False
        self._submitted_since_beat = 0

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
        sock.connect(self.address)
        self._sock = sock
        self._tasks = [asyncio.create_task(self._reader(), name="engine-reader"),
                       asyncio.create_task(self._pinger(), name="engine-pinger")]
        log.info("attached to engine at %s", self.address)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._handles:
            self._abort(list(self._handles))
        if self._sock is not None:
            self._sock.close(linger=0)
        self._ctx.term()

    # -- health ----------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return time.monotonic() - self._last_beat_at < self.heartbeat_timeout

    @property
    def model(self) -> str | None:
        return self.last_heartbeat.model if self.last_heartbeat else None

    def load(self) -> tuple[int, int]:
        hb = self.last_heartbeat
        return (hb.running, hb.waiting) if hb else (0, 0)

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    def routing_load(self) -> int:
        """Engine-reported load plus what this gateway submitted since that report."""
        running, waiting = self.load()
        return running + waiting + self._submitted_since_beat

    async def _pinger(self) -> None:
        while True:
            self._send(p.Ping(sent_ns=p.now_ns()))
            await asyncio.sleep(self.heartbeat_interval)
            healthy = self.healthy
            if self._was_healthy and not healthy:
                log.error("engine at %s missed heartbeats for %.1fs: failing %d in-flight requests",
                          self.address, self.heartbeat_timeout, len(self._handles))
                err = engine_unavailable("the engine stopped answering (crashed or restarting)")
                for h in list(self._handles.values()):
                    h._fail(err)
                self._handles.clear()
            self._was_healthy = healthy

    # -- requests --------------------------------------------------------------------------

    def submit(self, submit: p.Submit) -> RequestHandle:
        """Send a request to the engine; raises APIError(503) if the engine is down."""
        if not self.healthy:
            raise engine_unavailable()
        handle = RequestHandle(self, submit.request_id, submit.trace_id)
        self._handles[submit.request_id] = handle
        self._submitted_since_beat += 1
        if not self._send(submit):
            del self._handles[submit.request_id]
            raise engine_unavailable("the engine socket is not connected")
        return handle

    def fail_all(self, err: APIError) -> int:
        """Fail every in-flight request with ``err`` and abort them in the engine; returns how many."""
        handles = list(self._handles.values())
        self._handles.clear()
        if handles:
            self._abort([h.request_id for h in handles])
        for h in handles:
            h.done = True
            h._fail(err)
        return len(handles)

    def _forget(self, request_id: str, abort: bool) -> None:
        if self._handles.pop(request_id, None) is not None and abort:
            self._abort([request_id])

    def _abort(self, request_ids: list[str]) -> None:
        self.aborts_sent += len(request_ids)
        self._send(p.Abort(request_ids=request_ids))

    def _send(self, msg: p.Message) -> bool:
        """Send without blocking; False if the engine is not connected (IMMEDIATE) or the send failed."""
        assert self._sock is not None
        try:
            # zmq.asyncio returns a Future, already done for a NOBLOCK send: its exception is the outcome.
            fut = self._sock.send_multipart(p.encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            log.warning("engine send failed: %s", exc)
            return False
        if not fut.done():
            fut.add_done_callback(_log_send_failure)
            return True
        exc = fut.exception()
        if exc is None:
            return True
        if not isinstance(exc, zmq.Again):
            log.warning("engine send failed: %s", exc)
        return False

    async def _reader(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            try:
                msg = p.decode(frames)
            except p.WireError as exc:
                self.bad_frames += 1
                log.warning("dropped bad frame from engine: %s", exc)
                continue
            if isinstance(msg, p.DeltaBatch):
                for d in msg.deltas:
                    h = self._handles.get(d.request_id)
                    if h is not None:
                        h._push(d)
                        if d.finish_reason is not None:
                            h.done = True
                            self._handles.pop(d.request_id, None)
            elif isinstance(msg, p.Accepted):
                h = self._handles.get(msg.request_id)
                if h is not None and not h.accepted.done():
                    h.accepted.set_result(msg.prompt_tokens)
            elif isinstance(msg, p.Error):
                self._on_error(msg)
            elif isinstance(msg, p.Heartbeat):
                if self.last_heartbeat is None or self.last_heartbeat.engine_id != msg.engine_id:
                    log.info("engine %s up: %s model=%s", msg.engine_id, msg.backend, msg.model)
                self.last_heartbeat = msg
                self._submitted_since_beat = 0
                self._last_beat_at = time.monotonic()
            else:
                self.bad_frames += 1
                log.warning("unexpected %s from engine", type(msg).__name__)

    def _on_error(self, msg: p.Error) -> None:
        err = APIError.from_engine(msg.code, msg.message, msg.param)
        if not msg.request_id:
            log.error("engine error: %s", msg.message)
            return
        h = self._handles.pop(msg.request_id, None)
        if h is not None:
            h.done = True
            h._fail(err)


def _log_send_failure(fut: asyncio.Future[object]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("engine send failed: %s", fut.exception())
