"""The one delivery core: every generation is a :class:`~gateway.core.streams.Stream`, every reader a cursor.

    engine step ──► Generation.on_delta ──► Stream.append ──► Reader.write_now ──► Conn (one write per step)
                                                   └──────► reader's own loop (follow): replay, resume, lag

- :func:`start` creates the stream of a request the engine accepted (listed for fan-out and background
  responses, unlisted for a POST SSE response or one ``/v1/ws`` request) and attaches its
  :class:`gateway.core.generation.Generation`, with the API's renderer: from then on the engine link hands
  it each delta in the engine step's pass. The core knows no API: the caller (an API module, through
  :mod:`gateway.api.generations`) has admitted and submitted the request. :func:`pump` only waits for the generation's end (no wake-up per
  token) and turns a cancel of its task into the generation's cancel.
- :func:`read` is the only reader, for every path: a :class:`Reader` writes the :mod:`gateway.core.framing`
  frames to a :mod:`gateway.core.conn` connection, in the publisher's pass while it is caught up
  (:meth:`Reader.write_now`) and from its own loop (:func:`gateway.core.follow.follow`: replay, live tail,
  coalescing when behind, keep-alives) otherwise, with one :class:`ReaderMeter` for both. A write blocked
  longer than ``--send-timeout`` ends the reader with the framing's cut
  (SSE ``event: error`` slow_consumer, WebSocket close 1013), never with a normal end.
- When a reader ends, :func:`release` aborts the generation if nobody else reads it: always, unless the
  generation is *detached* (fan-out streams, background responses), which only a cut of its last reader
  (or an explicit cancel) aborts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from gateway.core import sse
from gateway.core.backpressure import SlowConsumer, SlowConsumerPolicy
from gateway.core.bare import BareConn, BareSse, BareWs, detach_http, detachable_http, run_detached
from gateway.core.conn import HttpConn, WsConn
from gateway.core.follow import RolledBack, Subscription, Watchdog, follow
from gateway.core.framing import Ending, Framing
from gateway.core.generation import Generation, Renderer
from gateway.core.streams import Event, Stream, StreamHub
from gateway.core.turns import Turnstile
from gateway.errors import APIError, bad_resume_point, error_class, stream_rolled_back

if TYPE_CHECKING:
    from gateway.core.metrics import HotHistogram, Metrics, TransportMetrics
    from gateway.core.ports import Publisher, RemoteStreams
    from gateway.core.request import RequestHandle
    from gateway.core.step import Step

log = logging.getLogger(__name__)
Conn = HttpConn | WsConn | BareSse | BareWs  # what a reader writes to

def clock() -> tuple[float, int]:
    """(monotonic seconds, epoch ns): the time of a write outside an engine step."""
    return time.monotonic(), time.time_ns()


@dataclass(eq=False)
class Delivery:
    """The delivery core's parts, handed to it explicitly (the gateway owns them): the stream hub, metrics,
    the slow-reader policy and its watchdog, and the ports to other gateways (:mod:`gateway.core.ports`):
    ``publisher`` (``--broker``: listed streams written to Redis) and ``remote`` (streams another gateway
    runs). ``inject_delay`` (bench calibration), ``direct_write`` (the one-pass write) and ``detach`` (fan-out
    subscribers leave their ASGI call: :mod:`gateway.core.bare`) are settings; ``detached`` holds those
    subscribers' connections (the shutdown ends them); ``turnstile`` bounds the subscriber work of one loop
    turn (each replay write of a reader's own loop, each fan-out subscription's first step)."""

    hub: StreamHub
    metrics: Metrics
    policy: SlowConsumerPolicy
    watchdog: Watchdog
    publisher: Publisher | None = None
    remote: RemoteStreams | None = None
    inject_delay: dict[str, float] = field(default_factory=dict)
    direct_write: bool = True
    detach: bool = True
    detached: set[BareConn] = field(default_factory=set)
    turnstile: Turnstile = field(default_factory=Turnstile)


async def start(delivery: Delivery, handle: RequestHandle, renderer: Renderer, *, endpoint: str, model: str,
                listed: bool, detached: bool | None = None, stream_id: str | None = None,
                options: dict[str, Any] | None = None, local_fallback: bool = False) -> Stream:
    """The stream of an accepted request, its generation attached and its pump running.

    ``renderer``: the API's payloads of this generation. ``listed``: findable by id and retained after it
    ends; ``detached`` (default: ``listed``): the generation outlives its readers. Raises what the
    publisher's announcement raises (the request is then closed). ``options``: what the API needs to render
    the rest of a listed stream if another gateway adopts it (:mod:`gateway.api.adoption`). ``local_fallback``: if
    the publisher refuses the announcement, the stream is kept on this gateway only (listed and retained here,
    not written where other gateways read it) instead of failing."""
    stream = delivery.hub.create(endpoint, model, stream_id=stream_id or handle.request_id, listed=listed)
    stream.detached = listed if detached is None else detached
    stream.trace = handle.trace
    if listed:
        stream.request, stream.options = msgspec.msgpack.encode(handle.submit), options or {}
    publisher = delivery.publisher if listed else None
    if publisher is not None:
        stream.gated = publisher.durable
        try:
            await publisher.created(stream)  # announced before its id is handed out
        except APIError as exc:
            if not local_fallback:
                handle.close()
                delivery.hub.forget(stream)
                raise
            log.warning("stream %s is kept on this gateway only: %s", stream.id, exc.message)
            stream.gated, stream.epoch, publisher = False, 0, None
        except BaseException:
            handle.close()
            delivery.hub.forget(stream)
            raise
    generation = Generation(stream, handle, renderer, delivery.metrics.hot.tokens, publisher)
    generation.start()
    stream.task = asyncio.create_task(pump(delivery, generation), name=f"pump-{stream.id}")
    return stream


async def pump(delivery: Delivery, generation: Generation) -> None:
    """Wait for the generation's end (its deltas arrive in the engine link's pass, not here); a cancel of
    this task cancels the generation. Then the request is released and the stream retained."""
    stream, handle, publisher = generation.stream, generation.handle, generation.publisher
    try:
        err = await asyncio.shield(generation.ended)
        if err is not None:
            delivery.metrics.errors.labels(error_class(err)).inc()
    except asyncio.CancelledError:
        if stream.handover:
            generation.move()
        else:
            if not handle.done:
                delivery.metrics.aborted.inc()
                log.info("generation %s aborted (no reader left, or cancelled)", stream.id)
            generation.cancel()
        raise
    finally:
        handle.close()  # aborts the engine request if it had not finished
        if publisher is not None and stream.state != "moved":
            publisher.ended(stream)
        delivery.hub.mark_finished(stream)
        delivery.metrics.retained.set(delivery.hub.total_bytes)


def hand_over(stream: Stream) -> bool:
    """Stop a local listed stream's generation here without ending it (SIGTERM with a replica to take it:
    ``--handover``): it ends ``moved``, its readers are disconnected without an end (they resume on another
    replica), its engine request is aborted; the replica that adopts it continues from the log."""
    if not stream.listed or stream.finished or stream.mirrored or stream.task is None or stream.task.done():
        return False
    stream.handover = True
    stream.task.cancel()
    return True


MOVED = {"sse": Ending(b""), "ws": Ending(None, 1012, "moved: resume on another replica (Last-Event-ID, ?after=)")}


def cancel(stream: Stream) -> bool:
    """Cancel the generation behind a local stream; False if it already ended or is not ours."""
    if stream.finished or stream.mirrored or stream.task is None or stream.task.done():
        return False
    stream.task.cancel()
    return True


async def stop(delivery: Delivery, stream: Stream) -> bool:
    """Cancel a stream's generation wherever it runs and wait for its end: here, or on the replica or worker
    that owns it (through the broker, waiting at most 5 s for its end to arrive). False if it had ended."""
    if stream.mirrored and not stream.finished:
        assert delivery.remote is not None and stream.task is not None
        if not await delivery.remote.cancel_remote(stream.id):
            return False
        # Wait up to 5 s for the mirror to end. asyncio.wait neither cancels it on timeout nor raises how it
        # ended, and (unlike wait_for on Python 3.11) never swallows a cancel of this caller.
        await asyncio.wait({stream.task}, timeout=5.0)
        return True
    if not cancel(stream):
        return False
    assert stream.task is not None
    with contextlib.suppress(asyncio.CancelledError):
        await stream.task
    return True


async def settled(stream: Stream) -> None:
    """Wait until a stream's readers may see its end (:attr:`Stream.over`: a gated stream's end is durable),
    or it is paused (its owner fenced itself): a whole-response read (a non-streamed response) waits here."""
    sub = Subscription("sse", None)
    stream.add_follower(sub)
    try:
        while not (stream.over or stream.paused):
            sub.waiter.clear()
            sub.cursor = stream.next_seq
            await sub.waiter.wait()
    finally:
        stream.remove_follower(sub)


def resume_point(raw: str | None, param: str) -> int:
    """The ``seq`` a reader resumes after (``Last-Event-ID``, ``?after=``, ``starting_after``): an integer
    ≥ -1, or -1 (from the start) when absent; else a 400 naming ``param``."""
    try:
        value = sse.parse_last_event_id(raw)
    except ValueError as exc:
        raise bad_resume_point(param, raw) from exc
    return -1 if value is None else value


def release(stream: Stream, cut: bool) -> None:
    """A reader left: abort the generation if nobody can read it any more."""
    if stream.finished or stream.subscriber_count():
        return
    if not stream.detached or (cut and not stream.mirrored):
        cancel(stream)


# -- readers ----------------------------------------------------------------------------------


class ReaderMeter:
    """One reader's metrics, whichever path wrote (the publisher's pass or the reader's own loop): each
    chunk counted once; TTFT at its first content write; each inter-token gap from its previous content
    write, on either path; delivery latency (engine emit of the newest event written -> the write)."""

    __slots__ = ("_last", "_m", "_t0")

    def __init__(self, m: TransportMetrics, t0: float) -> None:
        self._m = m
        self._t0 = t0
        self._last: float | None = None  # monotonic time of its last content write

    def wrote(self, chunks: int, text: bool, emit_ns: int, now: float, wall_ns: int) -> None:
        """A write of ``chunks`` events (``text``: any with content) at ``now`` / ``wall_ns``."""
        m = self._m
        m.chunks.value += chunks
        if text:
            if self._last is None:
                m.ttft.observe(now - self._t0)
            else:
                m.itl.observe(now - self._last)
            self._last = now
        if emit_ns:
            m.delivery.observe(max(0, wall_ns - emit_ns) / 1e9)


class Reader:
    """One reader of a stream on one connection: its framing, its connection and its meter.

    :meth:`write_now` is called by the publisher's pass (:meth:`gateway.core.streams.Stream.append`) while the
    reader is caught up; :meth:`write` by the reader's own loop (:func:`gateway.core.follow.follow`) for
    replay, resume and back-pressure. ``clock`` is read for writes outside an engine step.

    ``delay`` (``--inject-delay``, bench calibration): every write of the loop sleeps first, timed into
    ``slept`` (:data:`gateway.core.metrics.INJECTED_DELAY`)."""

    __slots__ = ("clock", "conn", "delay", "framing", "last_write", "meter", "slept")

    def __init__(self, framing: Framing, conn: Conn, meter: ReaderMeter, *, delay: float = 0.0,
                 slept: HotHistogram | None = None, clock: Callable[[], tuple[float, int]] = clock) -> None:
        self.framing = framing
        self.conn = conn
        self.meter = meter
        self.delay = delay
        self.slept = slept
        self.clock = clock
        self.last_write = 0.0

    def write_now(self, ev: Event, step: Step | None) -> bool:
        """Write one live event without awaiting; False if the connection cannot take it now."""
        if not self.conn.write_now(self.framing.frame_bytes(ev), step):
            return False
        now, wall_ns = (step.now, step.wall_ns) if step is not None else self.clock()
        self.last_write = now
        self.meter.wrote(1, bool(ev.text), ev.emit_ns, now, wall_ns)
        return True

    async def write(self, batch: list[Event]) -> None:
        """Write a batch from the reader's own loop (awaits the server: a stalled client blocks here)."""
        if self.delay:
            t0 = time.monotonic()
            await asyncio.sleep(self.delay)
            if self.slept is not None:
                self.slept.observe(time.monotonic() - t0)
        framing = self.framing
        for f in framing.join([framing.frame(e) for e in batch]):
            await self.conn.write(f)  # type: ignore[arg-type]
        now, wall_ns = self.clock()
        self.meter.wrote(len(batch), any(e.text for e in batch), batch[-1].emit_ns, now, wall_ns)


def failed_view(stream: Stream, err: APIError, events: list[Event]) -> Stream:
    """What one reader's framing ends with when its reading fails alone (the stream goes on for the others): the
    stream as if it had failed with ``err`` after ``events``."""
    return Stream(id=stream.id, endpoint=stream.endpoint, model=stream.model, events=events, state="error",
                  error=err, listed=stream.listed, meta=stream.meta)


@dataclass(slots=True)
class Outcome:
    """How a reader ended: the ending to write, whether it was cut, the last seq it sent."""

    ending: Ending
    cut: bool
    last_seq: int


async def read(delivery: Delivery, stream: Stream, framing: Framing, after: int, conn: Conn,
               *, t0: float | None = None, idle: Callable[[], Awaitable[None]] | None = None) -> Outcome:
    """Follow ``stream`` past ``after`` and write it to ``conn`` until it ends or the reader is cut.

    The caller writes the returned ending (or :func:`finish_reader` does it for a whole connection)."""
    m = delivery.metrics
    label = conn.label  # the metrics' transport: the framing's, or the connection's own (``sse-h3``, ``wt``)
    meter = ReaderMeter(m.hot.transport(label), time.monotonic() if t0 is None else t0)
    reader = Reader(framing, conn, meter, delay=delivery.inject_delay.get(label, 0.0),
                    slept=m.hot.injected.get(label))
    active = m.active_streams.labels(label)
    # --inject-delay (bench calibration) turns the one pass off for every transport, so the arms differ
    # only by the injected delay, not by the path their writes take.
    one_pass = delivery.direct_write and not delivery.inject_delay
    if after >= 0:
        m.resumes.labels(label).inc()
    trace = stream.trace.reader(label, after, stream.listed, conn.headers) \
        if stream.trace is not None else None
    active.inc()
    last = after
    try:
        last = await follow(stream, framing.transport, after, reader.write, delivery.policy, delivery.watchdog, idle=idle,
                            reader=reader if one_pass else None,
                            merge=framing.merge, relay=framing.relay, standby=framing.standby,
                            turn=delivery.turnstile.turn)
    except SlowConsumer:
        m.errors.labels("network").inc()
        log.info("reader of %s cut: a write was blocked for more than %gs", stream.id, delivery.policy.send_timeout,
                 extra={"trace": stream.trace})
        m.readers_cut.labels(label).inc()
        if trace is not None:
            trace.cut(delivery.policy.send_timeout)
        return Outcome(framing.cut(delivery.policy.send_timeout), True, last)
    except RolledBack as rb:
        err = stream_rolled_back(stream.id, rb.seq, rb.held)
        log.warning("reader of %s: %s", stream.id, err.message, extra={"trace": stream.trace})
        m.errors.labels(error_class(err)).inc()
        # the view ends where the reader's reading and the log part at the latest, never with the log's own end
        # (a reader past it did not read it: an API whose ending looks for a terminal event must not find one)
        shared = min(rb.held, len(stream.events) - 1 if stream.finished else len(stream.events))
        return Outcome(framing.ending(failed_view(stream, err, stream.events[:max(0, shared)])), False, rb.seq - 1)
    finally:
        active.dec()
        if trace is not None:
            trace.end(last)
    if stream.state == "moved" or stream.paused:  # no end: the reader resumes where the stream goes on
        return Outcome(MOVED[framing.transport], False, last)
    return Outcome(framing.ending(stream), False, last)


async def until_disconnect(work: Awaitable[Any], receive: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``work`` until it finishes or the client disconnects (then cancel it and return None).

    ``work`` runs in the caller's task; one task beside it waits on ``receive`` and cancels the caller when
    the client is gone (or ``receive`` fails): one task per reader fewer than running the work in its own."""
    task = asyncio.current_task()
    assert task is not None
    running, gone = True, False

    async def watch() -> None:
        nonlocal gone
        try:
            while True:
                msg = await receive()
                if msg["type"] in ("http.disconnect", "websocket.disconnect"):
                    return
        finally:
            if running:  # not cancelled by the caller's end: the client is gone
                gone = True
                task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:  # our own cancel, nobody else's
            return None
        raise
    finally:
        running = False
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)


class SseResponse:
    """An ASGI response that is one SSE reader of a stream (POST SSE, fan-out events, Responses SSE).

    ``detachable`` (fan-out subscribers): under uvicorn the response leaves its ASGI call once its head and
    preamble are written (:mod:`gateway.core.bare`), its head then saying ``Connection: close``."""

    __slots__ = ("after", "delivery", "detachable", "framing", "preamble", "stream", "t0")

    def __init__(self, delivery: Delivery, stream: Stream, framing: Framing, after: int, *, preamble: bytes = b"",
                 t0: float | None = None, detachable: bool = False) -> None:
        self.delivery, self.stream, self.framing, self.after = delivery, stream, framing, after
        self.preamble = preamble
        self.t0 = t0
        self.detachable = detachable

    headers: ClassVar[list[tuple[bytes, bytes]]] = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
    closing_headers: ClassVar[list[tuple[bytes, bytes]]] = [*headers, (b"connection", b"close")]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        delivery = self.delivery
        detach = self.detachable and delivery.detach and detachable_http(scope, send)
        conn = HttpConn(scope, send, delivery.policy.linger)
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.closing_headers if detach else self.headers})
            if self.preamble:
                await conn.write(self.preamble)
        except BaseException:
            release(self.stream, cut=False)
            raise
        bare = detach_http(scope, send, delivery.policy.linger) if detach else None
        if bare is not None:
            run_detached(delivery.detached, bare, scope, lambda: self.follow(bare, None))
            return
        await self.follow(conn, receive)

    async def follow(self, conn: HttpConn | BareSse, receive: Any) -> None:
        """Read the stream to its end on ``conn`` and write the ending; ``receive``: the ASGI call's, watched
        for the client leaving (None: a detached connection, whose task is cancelled when it does)."""
        delivery, stream = self.delivery, self.stream
        outcome: Outcome | None = None
        keepalive = sse.comment("keep-alive")

        async def idle() -> None:
            await conn.write(keepalive)

        try:
            work = read(delivery, stream, self.framing, self.after, conn, t0=self.t0, idle=idle)
            outcome = await (work if receive is None else until_disconnect(work, receive))
        finally:
            release(stream, cut=bool(outcome and outcome.cut))
        if outcome is None:
            return  # the client left
        frame = outcome.ending.frame
        data = frame.encode() if isinstance(frame, str) else frame
        if outcome.cut:
            await conn.cut(data)
        else:
            await conn.end(data)
