"""The gateway's side of the engine link: one ZeroMQ DEALER, one reader task.

The reader routes every incoming message by request id into that request's own
:class:`RequestHandle` (no queue is shared between requests). A ``DeltaBatch`` (one engine step) is one
synchronous pass (:meth:`EngineClient._on_batch`): each delta goes straight to its request's
:class:`gateway.core.generation.Generation` (streamed requests), which renders, appends and writes it to the
caught-up readers; then the step's connections are flushed, one write each. A request read whole
(non-streaming) takes its deltas from its handle's queue instead. A pinger sends ``Ping`` every
``heartbeat_interval``; the engine is *healthy* while a ``Heartbeat`` arrived within
``heartbeat_timeout``. When it stops answering, every in-flight request fails with
``engine_unavailable`` at once, so clients get an explicit error instead of a silent stall.

Engine identity: each engine instance names itself by the ``engine_id`` in its heartbeats. A request
lives only as long as the link that carried it, because the engine routes replies by the connection's
ZeroMQ identity, which is new after every reconnect. So in-flight requests are *lost* (handed to
``on_lost``: the :class:`gateway.core.engine_pool.EnginePool` continues them on a healthy engine, or fails
them with ``engine_unavailable``) when

* the connection drops (a socket-monitor ``DISCONNECTED`` event: a killed engine is noticed at once,
  even when a supervisor restarts it faster than ``heartbeat_timeout``); the link then counts as down
  until the next heartbeat, so no request is sent into the gap; or
* a heartbeat carries a new ``engine_id`` (the backstop if the monitor missed the drop): every request
  sent before the ping that heartbeat answers is failed and aborted; one sent after it reached the new
  instance, which processes messages in order, and carries on.

This layer raises and delivers :class:`gateway.errors.EngineError` only; mapping to HTTP is the edge's job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from engine_worker import protocol as p
from engine_worker.curve import connect_curve
from gateway.core.conn import Step
from gateway.errors import APIError, EngineError, to_api_error

if TYPE_CHECKING:
    from gateway.core.generation import Generation

log = logging.getLogger(__name__)

# What a request can fail with: an EngineError from this layer, or whatever the gateway passes to
# ``fail_all`` (e.g. its shutdown error), delivered unchanged.
Failure = EngineError | APIError

# zmq's flags as plain ints: its IntFlag arithmetic showed up in profiles of the hot loop.
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)

# Pings whose send position is remembered, to match a new instance's first heartbeat (~16 s at 4/s).
_PINGS_KEPT = 64


class RequestHandle:
    """Events of one request: an ``Accepted`` first, then deltas, or a failure (:class:`EngineError`).

    Deltas go to the attached :class:`gateway.core.generation.Generation` (:meth:`attach`) in the engine step's
    pass, or, until one is attached, to a queue read by :meth:`deltas`.

    What a continuation on another engine needs is kept here: the ``submit`` as sent, the output token ids
    and the number of text characters received so far. ``engine_rid`` is the id the current engine knows
    it by (``request_id``, then ``request_id.m<n>`` after the n-th migration, so a late delta of a lost
    engine can never mix in)."""

    __slots__ = ("_client", "_queue", "accepted", "closed", "done", "engine_rid", "generation", "lost_at",
                 "migrations", "on_close", "openai", "output_chars", "output_chunks", "output_ids", "rejoined",
                 "request_id", "send_seq", "steps", "submit", "trace_id")

    def __init__(self, client: EngineClient, submit: p.Submit, send_seq: int = 0) -> None:
        self._client = client
        self.submit = submit
        self.request_id = submit.request_id
        self.engine_rid = submit.request_id
        self.trace_id = submit.trace_id
        self.send_seq = send_seq  # position of its Submit among this link's submits (vs. the pings)
        self.output_ids: list[int] = []
        self.output_chars = 0
        self.output_chunks = 0  # chunks of vLLM's OpenAI layer received
        self.steps: list[list[list[int]]] = []  # their engine steps (protocol.Delta.steps): what a continuation replays
        self.migrations = 0
        self.lost_at = 0.0  # monotonic time its engine was lost (0: not migrating)
        self.rejoined = False  # continued on another engine: its next payload is marked (Event.migrated)
        self.closed = False
        self._queue: asyncio.Queue[p.Delta | Failure] = asyncio.Queue()
        self.accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.openai = False  # the engine serves it with vLLM's OpenAI layer: deltas carry whole chunks
        self.done = False
        self.on_close: list[Callable[[], None]] = []
        self.generation: Generation | None = None

    def attach(self, generation: Generation) -> None:
        """Hand every delta from now on to ``generation``, in the engine step's pass (what had queued
        first, in order)."""
        self.generation = generation
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, (EngineError, APIError)):
                generation.on_failure(to_api_error(item))
            else:
                generation.on_delta(item, None)

    def _push(self, item: p.Delta, step: Step) -> None:
        if item.token_ids:
            self.output_ids += item.token_ids
        if item.chunk:
            self.output_chunks += 1
            if item.steps:
                self.steps += item.steps
        self.output_chars += len(item.text)
        if self.lost_at:
            self._client.continued(self, step.now)
        if self.generation is not None:
            self.generation.on_delta(item, step)
        else:
            self._queue.put_nowait(item)

    def _fail(self, err: Failure) -> None:
        if not self.accepted.done():
            self.accepted.set_exception(err)
            self.accepted.exception()  # mark retrieved: the consumer may be gone
        if self.generation is not None:
            self.generation.on_failure(to_api_error(err))
        else:
            self._queue.put_nowait(err)

    async def wait_accepted(self, timeout: float) -> int:
        """Prompt token count once the engine accepted the request; raises EngineError."""
        try:  # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel that lands as the accept does
            async with asyncio.timeout(timeout):
                return await asyncio.shield(self.accepted)
        except TimeoutError as exc:
            raise EngineError.unavailable(f"the engine did not accept the request within {timeout:.0f}s") from exc

    async def deltas(self, idle: float | None = None) -> AsyncIterator[p.Delta | None]:
        """Deltas until the one with a finish reason; ``None`` after each ``idle`` seconds without one
        (a keep-alive tick); raises EngineError on failure."""
        while True:
            if idle is None:
                item = await self._queue.get()
            else:
                try:
                    async with asyncio.timeout(idle):
                        item = await self._queue.get()
                except TimeoutError:
                    yield None
                    continue
            if isinstance(item, (EngineError, APIError)):
                self.done = True
                raise item
            yield item
            if item.finish_reason is not None:
                self.done = True
                return

    def close(self) -> None:
        """Forget the request; abort it in the engine if it had not finished (sync: safe in ``finally``)."""
        self.closed = True
        callbacks, self.on_close = self.on_close, []
        for cb in callbacks:
            cb()
        self._client._forget(self.engine_rid, abort=not self.done)


@dataclass
class EngineClient:
    address: str
    heartbeat_interval: float = 0.25
    heartbeat_timeout: float = 1.0
    curve_dir: Path | None = None
    # The step clock: (monotonic s, epoch ns), read once per DeltaBatch; tests inject their own.
    clock: Callable[[], tuple[float, int]] = field(default=lambda: (time.monotonic(), time.time_ns()))
    _handles: dict[str, RequestHandle] = field(default_factory=dict)
    last_heartbeat: p.Heartbeat | None = None
    bad_frames: int = 0
    aborts_sent: int = 0
    restarts: int = 0  # heartbeats that named a new engine instance after a first one
    disconnects: int = 0  # dropped connections to the engine address
    previous_engine_id: str | None = None
    engine_changed_at: float | None = None  # epoch seconds of the last new engine_id
    # Requests of a lost engine (link dropped, heartbeats missed, a new instance): the pool continues them
    # elsewhere or fails them (None: fail them with the error).
    on_lost: Callable[[EngineClient, list[RequestHandle], EngineError], None] | None = None
    # A continued request's first delta (handle, monotonic now, True) or its refusal (False): the pool's
    # migration accounting.
    on_continued: Callable[[RequestHandle, float, bool], None] | None = None

    def __post_init__(self) -> None:
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
        self._last_beat_at = 0.0
        self._was_healthy = False
        self._submitted_since_beat = 0
        self._submit_seq = 0  # submits sent so far; each handle keeps its own position
        self._pings: OrderedDict[int, int] = OrderedDict()  # ping sent_ns -> submits sent before it

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
        if self._handles:
            self._abort(list(self._handles))
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        if self._monitor_sync is not None:
            self._monitor_sync.close(linger=0)
        self._ctx.term()

    # -- health ----------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return time.monotonic() - self._last_beat_at < self.heartbeat_timeout

    @property
    def engine_id(self) -> str | None:
        return self.last_heartbeat.engine_id if self.last_heartbeat else None

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

    def status(self) -> dict[str, object]:
        """This link for ``/health``: the current instance, how often it changed, what is in flight."""
        hb = self.last_heartbeat
        return {"address": self.address, "healthy": self.healthy, "engine_id": hb.engine_id if hb else None,
                "running": hb.running if hb else None, "waiting": hb.waiting if hb else None,
                "in_flight": self.in_flight, "restarts": self.restarts, "disconnects": self.disconnects,
                "previous_engine_id": self.previous_engine_id, "engine_changed_at": self.engine_changed_at}

    async def _pinger(self) -> None:
        while True:
            sent_ns = p.now_ns()
            self._pings[sent_ns] = self._submit_seq
            while len(self._pings) > _PINGS_KEPT:
                self._pings.popitem(last=False)
            self._send(p.Ping(sent_ns=sent_ns))
            await asyncio.sleep(self.heartbeat_interval)
            healthy = self.healthy
            if self._was_healthy and not healthy:
                log.error("engine at %s missed heartbeats for %.1fs: %d requests in flight",
                          self.address, self.heartbeat_timeout, len(self._handles))
                self._lose(list(self._handles.values()),
                           EngineError.unavailable("the engine stopped answering (crashed or restarting)"), abort=True)
            self._was_healthy = healthy

    async def _watch_link(self) -> None:
        """Fail every in-flight request as soon as the connection drops: the engine can never answer them
        on a new connection (replies are routed by connection identity)."""
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            self.disconnects += 1
            self._last_beat_at = 0.0  # down until the next heartbeat: nothing is sent into the gap
            self._was_healthy = False
            if self._handles:
                log.error("connection to engine %s at %s dropped: %d requests in flight",
                          self.engine_id, self.address, len(self._handles))
                self._lose(list(self._handles.values()),
                           EngineError.unavailable("the connection to the engine dropped (crashed or restarting)"),
                           abort=False)
            else:
                log.warning("connection to engine %s at %s dropped", self.engine_id, self.address)

    # -- requests --------------------------------------------------------------------------

    def submit(self, submit: p.Submit) -> RequestHandle:
        """Send a request to the engine; raises EngineError ``engine_unavailable`` if the engine is down."""
        if not self.healthy:
            raise EngineError.unavailable()
        handle = RequestHandle(self, submit, self._submit_seq)
        if not self._send_handle(handle, submit):
            raise EngineError.unavailable("the engine socket is not connected")
        return handle

    def resume(self, handle: RequestHandle) -> bool:
        """Continue a request another link lost on this engine: its submit with the output so far as
        ``resume`` (:class:`engine_worker.protocol.Submit`), under a new engine id. False if it cannot be
        sent now (the handle is untouched)."""
        if not self.healthy:
            return False
        rid = f"{handle.request_id}.m{handle.migrations}"
        submit = msgspec.structs.replace(handle.submit, request_id=rid, resume=list(handle.output_ids),
                                         resume_chars=handle.output_chars, resume_steps=list(handle.steps))
        previous = handle._client, handle.engine_rid, handle.send_seq
        handle._client, handle.engine_rid, handle.send_seq = self, rid, self._submit_seq
        if self._send_handle(handle, submit):
            return True
        handle._client, handle.engine_rid, handle.send_seq = previous
        return False

    def continued(self, handle: RequestHandle, now: float) -> None:
        """The first delta of a continued request arrived (called by the handle)."""
        if self.on_continued is not None:
            self.on_continued(handle, now, True)
        handle.lost_at = 0.0
        handle.rejoined = True

    def _send_handle(self, handle: RequestHandle, submit: p.Submit) -> bool:
        self._handles[handle.engine_rid] = handle
        if not self._send(submit):
            del self._handles[handle.engine_rid]
            return False
        self._submit_seq += 1
        self._submitted_since_beat += 1
        return True

    def fail_all(self, err: Failure) -> int:
        """Fail every in-flight request with ``err`` and abort them in the engine; returns how many."""
        return self._fail_handles(list(self._handles.values()), err, abort=True)

    def _detach(self, handles: list[RequestHandle], abort: bool) -> None:
        """Take requests off this link; ``abort``: tell the engine too (it may still run them)."""
        for h in handles:
            self._handles.pop(h.engine_rid, None)
        if handles and abort:
            self._abort([h.engine_rid for h in handles])

    def _fail_handles(self, handles: list[RequestHandle], err: Failure, abort: bool) -> int:
        self._detach(handles, abort)
        for h in handles:
            h.done = True
            h._fail(err)
        return len(handles)

    def _lose(self, handles: list[RequestHandle], err: EngineError, abort: bool) -> None:
        """This engine lost these requests: off this link (aborted if it may still run them), then to
        ``on_lost`` (continued elsewhere, or failed there), or failed with ``err``."""
        if self.on_lost is None:
            self._fail_handles(handles, err, abort)
            return
        self._detach(handles, abort)
        self.on_lost(self, handles, err)

    def _forget(self, request_id: str, abort: bool) -> None:
        if self._handles.pop(request_id, None) is not None and abort:
            self._abort([request_id])

    def _abort(self, request_ids: list[str]) -> None:
        self.aborts_sent += len(request_ids)
        self._send(p.Abort(request_ids=request_ids))

    def _send(self, msg: p.Message) -> bool:
        """Send without blocking; False if the engine is not connected (IMMEDIATE) or the send failed."""
        sock = self._sock
        assert sock is not None
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

    async def _reader(self) -> None:
        """Wake when the socket's FD signals; then receive everything it holds, without blocking."""
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
                await readable.wait()
        finally:
            loop.remove_reader(fd)

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            msg = p.decode(frames)
        except p.WireError as exc:
            self.bad_frames += 1
            log.warning("dropped bad frame from engine: %s", exc)
            return
        if isinstance(msg, p.DeltaBatch):
            self._on_batch(msg.deltas)
        elif isinstance(msg, p.Accepted):
            h = self._handles.get(msg.request_id)
            if h is not None and not h.accepted.done():
                h.openai = msg.openai
                h.accepted.set_result(msg.prompt_tokens)
        elif isinstance(msg, p.Error):
            self._on_error(msg)
        elif isinstance(msg, p.Heartbeat):
            self._on_heartbeat(msg)
        else:
            self.bad_frames += 1
            log.warning("unexpected %s from engine", type(msg).__name__)

    def _on_batch(self, deltas: list[p.Delta]) -> None:
        """One engine step, in one pass: every delta to its request (rendered, appended to its stream and
        written to the caught-up readers there), then one write per connection the step touched."""
        step = Step(*self.clock())
        handles = self._handles
        try:
            for d in deltas:
                h = handles.get(d.request_id)
                if h is None:
                    continue
                if d.finish_reason is not None:
                    h.done = True
                    del handles[d.request_id]
                try:
                    h._push(d, step)
                except Exception as exc:  # a bug rendering one request must not stop the link for all
                    log.exception("delivering a delta of %s failed", d.request_id)
                    h._fail(APIError(500, f"The gateway failed to deliver this generation: {exc!r}",
                                     type="server_error", code="internal_error"))
        finally:
            step.flush()

    def _on_heartbeat(self, msg: p.Heartbeat) -> None:
        previous = self.last_heartbeat
        self.last_heartbeat = msg
        # The heartbeat's load counts what the engine had read when it answered the ping; submits sent
        # after that ping are not in it yet (a burst of submits would otherwise all go to one engine).
        self._submitted_since_beat = self._submit_seq - self._pings.get(msg.ping_sent_ns, self._submit_seq)
        self._last_beat_at = time.monotonic()
        if previous is None:
            log.info("engine %s up: %s model=%s", msg.engine_id, msg.backend, msg.model)
            return
        if previous.engine_id == msg.engine_id:
            return
        self.restarts += 1
        self.previous_engine_id = previous.engine_id
        self.engine_changed_at = time.time()
        # A submit sent before the ping this heartbeat answers may have gone to the old instance and be
        # lost; one sent after it can only have reached the new one (a link delivers in order). The
        # earlier ones fail, and are aborted in case the new instance got some of them.
        before = self._pings.get(msg.ping_sent_ns, self._submit_seq)
        stale = [h for h in self._handles.values() if h.send_seq < before]
        log.error("engine at %s restarted: %s -> %s (%s model=%s); %d requests of the old instance lost",
                  self.address, previous.engine_id, msg.engine_id, msg.backend, msg.model, len(stale))
        if stale:
            self._lose(stale, EngineError.unavailable(
                f"the engine restarted (instance {previous.engine_id} replaced by {msg.engine_id})"), abort=True)

    def _on_error(self, msg: p.Error) -> None:
        if not msg.request_id:
            log.error("engine error: %s", msg.message)
            return
        h = self._handles.pop(msg.request_id, None)
        if h is not None:
            if h.lost_at and self.on_continued is not None:
                self.on_continued(h, time.monotonic(), False)
            h.done = True
            h._fail(EngineError(msg.code, msg.message, msg.param, msg.status, msg.error_type))


