"""The one delivery core: every generation is a :class:`~gateway.streams.Stream`, every reader a cursor.

    engine deltas ──► pump ──► Stream log ──► reader (follow + Watchdog) ──► Framing ──► Conn
                                      └─────► reader … (fan-out: any number, any transport)

- :func:`start_generation` admits a request, submits it, creates its stream (listed for fan-out
  and background responses, unlisted for a POST SSE response or one ``/v1/ws`` request) and starts the
  one :func:`pump` that appends the generation's payloads.
- :func:`read` is the only reader loop, for every path: it follows the log through
  :func:`gateway.streams.follow` (replay, live tail, coalescing when behind, keep-alives), writes the
  :mod:`gateway.framing` frames to a :mod:`gateway.conn` connection and records the per-transport
  metrics. A write blocked longer than ``--send-timeout`` ends the reader with the framing's cut
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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from gateway import sse
from gateway.conn import HttpConn, WsConn
from gateway.errors import APIError, EngineError, error_class, to_api_error
from gateway.framing import Ending, Framing
from gateway.generation import ChunkEvent, chunk_events
from gateway.openai_api import ParsedRequest
from gateway.streams import DirectWrite, Event, SlowConsumer, Stream, follow

if TYPE_CHECKING:
    from gateway.engine_client import RequestHandle
    from gateway.openai_api import ChunkBuilder
    from gateway.state import Gateway

log = logging.getLogger(__name__)

# (handle, builder) -> the payloads of one generation; the default gives OpenAI chunks.
Source = Callable[["RequestHandle", "ChunkBuilder"], AsyncIterator[ChunkEvent]]
# (stream, error or None) -> closing payloads appended to the log when the generation fails or is cancelled
Finalizer = Callable[[Stream, APIError | None], list[ChunkEvent]]


async def _chunks(handle: RequestHandle, builder: ChunkBuilder) -> AsyncIterator[ChunkEvent]:
    async for ev in chunk_events(handle, builder):
        assert ev is not None
        yield ev


async def start_generation(
    gw: Gateway, parsed: ParsedRequest, scope: Any, *, listed: bool, detached: bool | None = None,
    source: Source = _chunks, finalizer: Finalizer | None = None, stream_id: str | None = None,
    endpoint: str | None = None,
) -> Stream:
    """Admit, submit and wait for the engine's accept; then the stream exists and its pump runs.

    ``listed``: findable by id and retained after it ends; ``detached`` (default: ``listed``): the
    generation outlives its readers. Raises :class:`APIError` (admission, validation, broker) or
    :class:`EngineError`."""
    if listed:
        try:
            gw.hub.check_capacity()
        except APIError as err:
            raise gw.refused(err) from None
    handle, builder = await gw.open(parsed, scope)
    stream = gw.hub.create(endpoint or parsed.endpoint, builder.model, stream_id=stream_id or handle.request_id,
                           listed=listed)
    stream.detached = listed if detached is None else detached
    if listed and gw.publisher is not None:
        try:
            await gw.publisher.created(stream)  # announced before its id is handed out
        except BaseException:
            handle.close()
            gw.hub.forget(stream)
            raise
    stream.task = asyncio.create_task(pump(gw, stream, handle, source(handle, builder), finalizer),
                                      name=f"pump-{stream.id}")
    return stream


async def pump(gw: Gateway, stream: Stream, handle: RequestHandle, payloads: AsyncIterator[ChunkEvent],
               finalizer: Finalizer | None = None) -> None:
    """Engine deltas -> stream events, until the generation ends, fails or is cancelled."""
    publisher = gw.publisher if stream.listed else None
    tokens = gw.metrics.tokens

    def publish(ev: ChunkEvent) -> None:
        event = stream.publish(ev)
        if publisher is not None:
            publisher.published(stream, event)
        if ev.tokens:
            tokens.inc(ev.tokens)

    try:
        async for ev in payloads:
            publish(ev)
        stream.finish("done")
    except (APIError, EngineError) as exc:
        err = to_api_error(exc)
        gw.metrics.errors.labels(error_class(err)).inc()
        for ev in finalizer(stream, err) if finalizer else ():
            publish(ev)
        stream.finish("error", err)
    except asyncio.CancelledError:
        if not handle.done:
            gw.metrics.aborted.inc()
            log.info("generation %s aborted (no reader left, or cancelled)", stream.id)
        for ev in finalizer(stream, None) if finalizer else ():
            publish(ev)
        stream.finish("cancelled")
        raise
    finally:
        handle.close()  # aborts the engine request if it had not finished
        if publisher is not None:
            publisher.ended(stream)
        gw.hub.mark_finished(stream)
        gw.metrics.retained.set(gw.hub.total_bytes)


def cancel(stream: Stream) -> bool:
    """Cancel the generation behind a local stream; False if it already ended or is not ours."""
    if stream.finished or stream.mirrored or stream.task is None or stream.task.done():
        return False
    stream.task.cancel()
    return True


async def stop(gw: Gateway, stream: Stream) -> bool:
    """Cancel a stream's generation wherever it runs and wait for its end: here, or on the replica or worker
    that owns it (through the broker, waiting at most 5 s for its end to arrive). False if it had ended."""
    if stream.mirrored and not stream.finished:
        assert gw.broker is not None and stream.task is not None
        if not await gw.broker.cancel_remote(stream.id):
            return False
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(stream.task), 5.0)
        return True
    if not cancel(stream):
        return False
    assert stream.task is not None
    with contextlib.suppress(asyncio.CancelledError):
        await stream.task
    return True


def resume_point(raw: str | None, param: str) -> int:
    """The ``seq`` a reader resumes after (``Last-Event-ID``, ``?after=``, ``starting_after``): an integer
    ≥ -1, or -1 (from the start) when absent; else a 400 naming ``param``."""
    try:
        value = sse.parse_last_event_id(raw)
    except ValueError as exc:
        raise APIError(400, f"{param} must be an integer event id >= -1 (-1: from the start), got {raw!r}.",
                       param=param, code="invalid_value") from exc
    return -1 if value is None else value


def release(stream: Stream, cut: bool) -> None:
    """A reader left: abort the generation if nobody can read it any more."""
    if stream.finished or stream.subscriber_count():
        return
    if not stream.detached or (cut and not stream.mirrored):
        cancel(stream)


# -- readers ----------------------------------------------------------------------------------


class ReaderMeter:
    """Per-reader metrics, observed once per write (not per event): TTFT, inter-write gap, delivery
    latency (engine emit of the newest event written -> the write), chunks written."""

    __slots__ = ("_chunks", "_delivery", "_itl", "_last", "_t0", "_ttft")

    def __init__(self, gw: Gateway, transport: str, t0: float) -> None:
        m = gw.metrics
        self._ttft = m.ttft.labels(transport)
        self._itl = m.itl.labels(transport)
        self._delivery = m.delivery.labels(transport)
        self._chunks = m.chunks.labels(transport)
        self._t0 = t0
        self._last: float | None = None

    def wrote(self, batch: list[Event]) -> None:
        now = time.monotonic()
        if any(e.text for e in batch):
            if self._last is None:
                self._ttft.observe(now - self._t0)
            else:
                self._itl.observe(now - self._last)
            self._last = now
        emit_ns = batch[-1].timing.get("emit_ns") or 0
        if emit_ns:
            self._delivery.observe(max(0, time.time_ns() - emit_ns) / 1e9)
        self._chunks.inc(len(batch))


def _first_token_observer(direct: DirectWrite, meter: ReaderMeter) -> DirectWrite:
    """The reader's TTFT when its first content goes out in the publisher's pass."""

    def write(ev: Event) -> bool:
        if not direct(ev):
            return False
        if meter._last is None and ev.text:
            meter.wrote([ev])
        return True

    return write


def _pass_meter(gw: Gateway) -> Callable[[str, Event, int], None]:
    """Metrics of the publisher's one-pass writes, observed once per event and transport (every reader
    written in that pass shares its timing): chunks written, delivery latency, gap since the last pass."""
    m = gw.metrics
    chunks = {t: m.chunks.labels(t) for t in ("sse", "ws")}
    delivery = {t: m.delivery.labels(t) for t in ("sse", "ws")}
    itl = {t: m.itl.labels(t) for t in ("sse", "ws")}
    last: dict[str, float] = {}

    def observe(transport: str, ev: Event, n: int) -> None:
        chunks[transport].inc(n)
        emit_ns = ev.timing.get("emit_ns")
        if emit_ns:
            delivery[transport].observe(max(0, time.time_ns() - emit_ns) / 1e9)
        if ev.text:
            now = time.monotonic()
            prev = last.get(transport)
            if prev is not None:
                itl[transport].observe(now - prev)
            last[transport] = now

    return observe


@dataclass(slots=True)
class Outcome:
    """How a reader ended: the ending to write, whether it was cut, the last seq it sent."""

    ending: Ending
    cut: bool
    last_seq: int


async def read(gw: Gateway, stream: Stream, framing: Framing, after: int, conn: HttpConn | WsConn,
               *, t0: float | None = None, idle: Callable[[], Awaitable[None]] | None = None) -> Outcome:
    """Follow ``stream`` past ``after`` and write it to ``conn`` until it ends or the reader is cut.

    The caller writes the returned ending (or :func:`finish_reader` does it for a whole connection)."""
    m = gw.metrics
    meter = ReaderMeter(gw, framing.transport, time.monotonic() if t0 is None else t0)
    delay = gw.config.inject_delay.get(framing.transport, 0.0)
    active = m.active_streams.labels(framing.transport)
    conn_write = conn.write

    async def write(batch: list[Event]) -> None:
        if delay:
            await asyncio.sleep(delay)
        frames = framing.join([framing.frame(e) for e in batch])
        for f in frames:
            await conn_write(f)  # type: ignore[arg-type]
        meter.wrote(batch)

    # --inject-delay (bench calibration) turns the one pass off for every transport, so the arms differ
    # only by the injected delay, not by the path their writes take.
    one_pass = gw.config.direct_write and not gw.config.inject_delay
    direct = conn.direct(framing.name, framing.frame_bytes) if one_pass else None
    if direct is not None:
        if stream.on_direct is None:
            stream.on_direct = _pass_meter(gw)
        direct = _first_token_observer(direct, meter)
    active.inc()
    last = after
    try:
        last = await follow(stream, framing.transport, after, write, gw.policy, gw.watchdog, idle=idle,
                            direct=direct, merge=framing.mergeable)
    except SlowConsumer:
        m.errors.labels("network").inc()
        log.info("reader of %s cut: a write was blocked for more than %gs", stream.id, gw.policy.send_timeout)
        return Outcome(framing.cut(gw.policy.send_timeout), True, last)
    finally:
        active.dec()
    return Outcome(framing.ending(stream), False, last)


async def until_disconnect(work: Awaitable[Any], receive: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``work`` until it finishes or the client disconnects (then cancel it and return None)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            msg = await receive()
            if msg["type"] in ("http.disconnect", "websocket.disconnect"):
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


class SseResponse:
    """An ASGI response that is one SSE reader of a stream (POST SSE, fan-out events, Responses SSE)."""

    def __init__(self, gw: Gateway, stream: Stream, framing: Framing, after: int, *, preamble: bytes = b"",
                 t0: float | None = None) -> None:
        self.gw, self.stream, self.framing, self.after = gw, stream, framing, after
        self.preamble = preamble
        self.t0 = t0

    headers: ClassVar[list[tuple[bytes, bytes]]] = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        gw, stream = self.gw, self.stream
        conn = HttpConn(scope, send, gw.policy.linger)
        outcome: Outcome | None = None
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            if self.preamble:
                await conn.write(self.preamble)
            keepalive = b": keep-alive\n\n"

            async def idle() -> None:
                await conn.write(keepalive)

            outcome = await until_disconnect(read(gw, stream, self.framing, self.after, conn, t0=self.t0,
                                                  idle=idle), receive)
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
