"""Fan-out streams: one generation, any number of subscribers, resumable without loss.

A :class:`Stream` is an append-only log of events (one per OpenAI chunk, numbered by ``seq``
from 0). Every event is serialized once per wire format when it is published; all subscribers of
that format get the same bytes. A subscriber is only a cursor into the log, so joining late,
resuming after ``seq`` and following the live tail are the same loop: send what is past the
cursor, then wait. There is no seam between replay and live.

Fairness: on publish, subscribers are woken per transport group, SSE first for even ``seq`` and
WebSocket first for odd ``seq``, so neither transport is systematically written first; within a
group the starting subscriber rotates with ``seq``, so no subscriber is always first either.

One pass: :meth:`Stream.append` writes a new event to every caught-up reader itself
(:meth:`gateway.core.delivery.Reader.write_now`, inside the engine step that produced it); a reader's own loop
(:func:`follow`) runs only for replay, resume and back-pressure. Slow subscribers follow
:class:`SlowConsumerPolicy`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import orjson

from engine_worker import protocol as p
from gateway.core.generation import ChunkEvent
from gateway.errors import APIError, stream_expired, stream_lost, stream_not_found

log = logging.getLogger(__name__)

Transport = Literal["sse", "ws"]
TRANSPORTS: tuple[Transport, Transport] = ("sse", "ws")
State = Literal["running", "done", "error", "cancelled", "moved"]  # moved: its generation goes on elsewhere

if TYPE_CHECKING:
    from gateway.core.conn import Step
    from gateway.core.delivery import Reader
    from gateway.core.generation import Template


class _NoCache(dict):  # type: ignore[type-arg]
    """``Event.frames`` of an event published to one reader at most (any event of an unlisted stream; a
    listed stream's while one client reads it, e.g. a stored response): nothing shares its frames, so
    keeping them would only double the memory the log holds and cost more than building a frame again
    for a reader who joins later (measured by ``tokenfan bench pass``, mode d: 0.6 µs per event)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


NO_CACHE: dict[str, Any] = _NoCache()


class Event:
    """One published payload (an OpenAI chunk or a Responses event) and its frames, built lazily.

    ``payload`` is what OpenAI clients receive; ``timing`` is tokenfan's ``{seq, emit_ns, sent_ns}``
    object that fan-out frames add as ``"tokenfan"``. Each wire frame is built at most once per
    event (:mod:`gateway.core.framing` caches it in ``frames``), however many readers send it. An event
    rendered from a ``template`` (:class:`gateway.core.generation.Template`) keeps only its text: its JSON
    is rendered (with its ``seq``) when a frame is built, its ``payload`` dict parsed only when something
    asks for it (a merge, the broker), so a retained log holds each token's text once.
    """

    __slots__ = ("_payload", "_sent_ns", "_timing", "emit_ns", "finish_reason", "frames", "ids", "migrated", "seq",
                 "template", "text")

    def __init__(self, seq: int, payload: dict[str, Any] | None, timing: dict[str, Any] | None, text: str,
                 finish_reason: str | None, frames: dict[str, Any] | None = None, *,
                 template: Template | None = None, emit_ns: int = 0, sent_ns: int = 0,
                 ids: list[int] | tuple[()] = (), migrated: bool = False) -> None:
        if payload is None and template is None:
            raise ValueError("an event needs its payload or its template")
        self.seq = seq
        self._payload = payload
        self.template = template
        self._timing = timing  # None: built from seq/emit_ns/sent_ns when asked for (fan-out frames, broker)
        self.emit_ns = emit_ns or (timing.get("emit_ns") or 0 if timing is not None else 0)
        self._sent_ns = sent_ns  # only for the timing object built on demand
        self.text = text
        self.finish_reason = finish_reason
        self.frames: dict[str, Any] = {} if frames is None else frames
        self.ids = ids  # output token ids of the deltas behind it: what a gateway that adopts the stream resumes
        self.migrated = migrated  # the first event after its generation moved to another engine (timing: a gap)

    def __repr__(self) -> str:
        return f"Event(seq={self.seq}, text={self.text!r}, finish_reason={self.finish_reason!r})"

    @property
    def payload(self) -> dict[str, Any]:
        """The payload as a dict (a template's event parses its JSON each time: it is rarely asked for)."""
        if self._payload is None:
            return orjson.loads(self.json)  # type: ignore[no-any-return]
        return self._payload

    @property
    def timing(self) -> dict[str, Any]:
        """tokenfan's ``{seq, emit_ns, sent_ns}`` object (or the one the event came with)."""
        if self._timing is None:
            self._timing = {"seq": self.seq, "emit_ns": self.emit_ns, "sent_ns": self._sent_ns}
            if self.migrated:  # the gap before it is a migration's, not the transport's (the bench skips it)
                self._timing["migrated"] = True
        return self._timing

    @property
    def json(self) -> bytes:
        """The payload alone, as OpenAI clients get it (not cached: orjson's output buffer is
        oversized, so frames keep tight copies built from it instead)."""
        if self.template is not None:
            return self.template.render(self.text, self.seq)
        return orjson.dumps(self._payload)

    @property
    def chunk(self) -> dict[str, Any]:
        """The payload with the ``tokenfan`` timing object (what fan-out subscribers and the broker carry)."""
        return {**self.payload, "tokenfan": self.timing}

    @property
    def size(self) -> int:
        """Bytes held for retention: the text and the encoded forms (an estimate; frames are lazy)."""
        return 3 * len(self.text) + 512


def encode_event(seq: int, chunk: dict[str, Any], text: str, finish_reason: str | None,
                 ids: list[int] | tuple[()] = ()) -> Event:
    """An event from a chunk that may carry its ``tokenfan`` object (as the broker stores it)."""
    payload = dict(chunk)
    timing = payload.pop("tokenfan", None) or {"seq": seq, "emit_ns": p.now_ns(), "sent_ns": p.now_ns()}
    return Event(seq, payload, timing, text, finish_reason, ids=ids, migrated=bool(timing.get("migrated")))


class MergeRules(Protocol):
    """An API's rule for merging a lagging reader's content events (:func:`coalesce`); the delivery core
    knows no payload shape: the OpenAI chunks' rules are :data:`gateway.api.openai.render.CHUNK_MERGE`, the
    Responses events' :data:`gateway.api.responses.stream.RESPONSES_MERGE`."""

    def group(self, payload: dict[str, Any]) -> object | None:
        """The run a content event may merge into (only with neighbours of the same group); None: never
        merged (lifecycle, usage, tool-call events keep their own event, nothing in them rebuilt)."""
        ...

    def merged(self, run: list[Event], text: str) -> dict[str, Any]:
        """The payload of a merged run: its last event's, carrying all of the run's ``text``."""
        ...


def coalesce(events: list[Event], rules: MergeRules) -> list[Event]:
    """Merge runs of content events into one event each (text concatenated, no text lost).

    A merged event takes the ``seq`` of the last event it covers, so resuming after it is exact;
    its ``tokenfan`` object records ``first_seq`` and ``coalesced`` (how many events it merged).
    Which events are content, and how a run's payload is rebuilt, is the API's ``rules``.
    """
    out: list[Event] = []
    run: list[Event] = []
    key: object | None = None

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append(_merge(run, rules))
        run.clear()

    for ev in events:
        group = rules.group(ev.payload)
        if group is not None and run and group == key:
            run.append(ev)
            continue
        flush()
        if group is None:
            out.append(ev)
        else:
            run.append(ev)
            key = group
    flush()
    return out


def _merge(run: list[Event], rules: MergeRules) -> Event:
    last = run[-1]
    text = "".join(e.text for e in run)
    timing = {**last.timing, "first_seq": run[0].seq, "coalesced": len(run), "sent_ns": p.now_ns()}
    return Event(last.seq, rules.merged(run, text), timing, text, last.finish_reason)


@dataclass(slots=True)
class SlowConsumerPolicy:
    """What happens to a subscriber that cannot keep up.

    - Events that were already in the log when the subscriber's current write began (a late
      joiner's replay, a resume, a burst) are sent event by event, at most ``replay_batch`` per
      write, so every token keeps its own event and timing.
    - A subscriber is *lagging* when more than ``coalesce_after`` events were published while its
      last write was in progress (the client, not the producer, is the bottleneck); then its pending
      content events are merged (:func:`coalesce`) so it catches up with fewer, larger events. The same
      merge applies when the stream has failed or was cancelled, so the notice is not stuck behind a
      backlog (no text is lost: it arrives merged, then the notice).
    - A single write that does not complete within ``send_timeout`` seconds (the client stopped
      reading and the transport buffer is full) closes the subscriber with a ``slow_consumer``
      reason (SSE error event; WebSocket close 1013). It can resume from its last ``seq``.
    Memory per subscriber is bounded by the transport's write buffer: the subscriber itself holds
    only a cursor into the shared log.
    """

    coalesce_after: int = 8
    send_timeout: float = 10.0
    replay_batch: int = 64
    linger: float = 10.0  # after a cut, seconds the connection may still flush its ending before it is reset

    def plan(self, events: list[Event], cursor: int, lagging: bool, failing: bool = False,
             rules: MergeRules | None = None) -> list[Event]:
        """The next write for a reader at ``cursor``. ``failing``: the stream ended with an error or a
        cancel, so its notice must not queue behind a backlog: everything pending is merged by the API's
        ``rules`` (None: this reader never gets merged events)."""
        if rules is not None and (lagging or failing) and len(events) - cursor > self.coalesce_after:
            return coalesce(events[cursor:], rules)
        return events[cursor:cursor + self.replay_batch]


class SlowConsumer(Exception):
    """A write did not complete within the policy's send timeout."""


@dataclass(eq=False)
class Stream:
    id: str
    endpoint: str
    model: str
    created_ns: int = field(default_factory=p.now_ns)
    events: list[Event] = field(default_factory=list)
    state: State = "running"
    error: APIError | None = None
    size: int = 0
    finished_at: float | None = None
    task: asyncio.Task[None] | None = None  # the pump (or the broker mirror's feed)
    mirrored: bool = False  # fed from the broker, not generated here (see gateway.scaleout.broker)
    # Listed streams are found by id (fan-out, background responses) and retained after they end;
    # an unlisted stream is the private log of one POST SSE response or one /v1/ws request.
    listed: bool = True
    # A detached generation outlives its readers (fan-out streams, background responses): it is
    # aborted only when its last reader is cut as too slow, or on an explicit cancel.
    detached: bool = True
    meta: dict[str, Any] = field(default_factory=dict)  # per-API extras (e.g. a response's transcript)
    # What another gateway needs to continue a listed stream whose owner is gone (gateway.api.adoption): the
    # engine request (msgpack of engine_worker.protocol.Submit) and the API's renderer options (JSON-able).
    request: bytes = b""
    options: dict[str, Any] = field(default_factory=dict)
    handover: bool = False  # being handed to another gateway (SIGTERM): it ends here "moved", without an end

    def __post_init__(self) -> None:
        # dicts as insertion-ordered sets: the rotation in _wake needs a stable order
        self._waiters: dict[Transport, dict[Subscription, None]] = {"sse": {}, "ws": {}}

    @property
    def finished(self) -> bool:
        return self.state != "running"

    def subscriber_count(self) -> int:
        return len(self._waiters["sse"]) + len(self._waiters["ws"])

    def publish(self, ev: ChunkEvent, step: Step | None = None) -> Event:
        """Append the next payload, stamped with its ``seq`` and timing (``step``: the engine step that
        produced it, whose clock read it shares), and write it to the caught-up readers. A payload that
        numbers itself (``ev.seq``) must land at that ``seq``."""
        seq = len(self.events)
        if ev.seq is not None and ev.seq != seq:
            raise ValueError(f"stream {self.id}: a payload numbered {ev.seq} published at seq {seq}")
        w = self._waiters
        shared = self.listed and len(w["sse"]) + len(w["ws"]) > 1  # frames built once for several readers
        return self.append(Event(seq, ev.payload, None, ev.text, ev.finish_reason, {} if shared else NO_CACHE,
                                 template=ev.template, emit_ns=ev.emit_ns,
                                 sent_ns=step.wall_ns if step is not None else p.now_ns(), ids=ev.ids,
                                 migrated=ev.migrated), step)

    def append(self, event: Event, step: Step | None = None) -> Event:
        """Add an already built event (its ``seq`` must be the next one) and write it to the readers."""
        if event.seq != len(self.events):
            raise ValueError(f"stream {self.id}: event seq {event.seq}, expected {len(self.events)}")
        self.events.append(event)
        self.size += event.size
        self._wake(event.seq, event, step)
        return event

    def finish(self, state: State, error: APIError | None = None) -> None:
        if self.finished:
            return
        self.state = state
        self.error = error
        self.finished_at = time.monotonic()
        self._wake(len(self.events))

    def _wake(self, seq: int, event: Event | None = None, step: Step | None = None) -> None:
        """One pass over the readers for a new event (or the end): a caught-up reader that writes in the
        publisher's pass gets the event written here and now (:meth:`gateway.core.delivery.Reader.write_now`);
        any other reader's loop is woken."""
        sse, ws = self._waiters["sse"], self._waiters["ws"]
        if len(sse) + len(ws) == 1:  # one reader (a POST response, a /v1/ws request): nothing to rotate
            self._wake_one(next(iter(sse or ws)), seq, event, step)
            return
        for group in ((sse, ws) if seq % 2 == 0 else (ws, sse)):
            if not group:
                continue
            subs = list(group)
            k = seq % len(subs)
            for sub in subs[k:] + subs[:k] if k else subs:
                self._wake_one(sub, seq, event, step)

    @staticmethod
    def _wake_one(sub: Subscription, seq: int, event: Event | None, step: Step | None) -> None:
        if event is not None and sub.parked and sub.cursor == seq and sub.reader is not None \
                and sub.reader.write_now(event, step):
            sub.cursor = seq + 1
            sub.last_write = sub.reader.last_write
        else:
            sub.waiter.set()

    def _register(self, sub: Subscription) -> None:
        self._waiters[sub.transport][sub] = None

    def _unregister(self, sub: Subscription) -> None:
        self._waiters[sub.transport].pop(sub, None)


# Writers: the transport-specific half of a subscriber.
WriteEvents = Callable[[list[Event]], Awaitable[None]]
WriteIdle = Callable[[], Awaitable[None]]


@dataclass(eq=False, slots=True)
class Subscription:
    """One subscriber's state as the :class:`Watchdog` sees it."""

    transport: Transport
    task: asyncio.Task[Any] | None
    waiter: asyncio.Event = field(default_factory=asyncio.Event)
    cursor: int = 0  # the next seq this reader sends
    parked: bool = False  # its loop waits, caught up: the publisher may write for it (``reader``)
    reader: Reader | None = None  # writes in the publisher's pass (None: only its own loop writes)
    busy_since: float | None = None  # monotonic start of the write in progress
    last_write: float = field(default_factory=time.monotonic)
    ping_due: bool = False
    slow: bool = False


class Watchdog:
    """One task per gateway instead of one timer per write or wait.

    Every ``tick`` seconds it closes subscribers whose current write has been blocked longer than
    ``send_timeout`` (their task is cancelled and :func:`follow` turns that into
    :class:`SlowConsumer`), and wakes subscribers idle longer than ``keepalive`` so they send a
    keep-alive. Timers per write cost more than the writes themselves at thousands of subscribers.
    """

    def __init__(self, send_timeout: float, keepalive: float | None, tick: float = 0.25) -> None:
        self.send_timeout = send_timeout
        self.keepalive = keepalive
        self.tick = min(tick, send_timeout / 2, keepalive / 2 if keepalive else tick)
        self.subs: dict[Subscription, None] = {}
        self._task: asyncio.Task[None] | None = None

    def add(self, sub: Subscription) -> None:
        self.subs[sub] = None
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="stream-watchdog")

    def remove(self, sub: Subscription) -> None:
        self.subs.pop(sub, None)

    async def _run(self) -> None:
        while self.subs:
            await asyncio.sleep(self.tick)
            self.check(time.monotonic())

    def check(self, now: float) -> None:
        for sub in list(self.subs):
            if sub.busy_since is not None:
                if now - sub.busy_since > self.send_timeout and not sub.slow and sub.task is not None:
                    sub.slow = True
                    sub.task.cancel()
            elif self.keepalive is not None and now - sub.last_write > self.keepalive:
                sub.ping_due = True
                sub.waiter.set()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


async def follow(
    stream: Stream, transport: Transport, after: int, write: WriteEvents, policy: SlowConsumerPolicy,
    watchdog: Watchdog, *, idle: WriteIdle | None = None, reader: Reader | None = None,
    merge: MergeRules | None = None,
) -> int:
    """Send every event with ``seq > after`` and then the live tail until the stream ends.

    Returns the last ``seq`` sent (``after`` if none). Raises :class:`SlowConsumer` when the
    watchdog finds a write blocked past the send timeout. ``idle`` (if given) is called when the
    watchdog asks for a keep-alive. With ``reader``, a caught-up reader's live events are written by
    the publisher in its one pass over the readers (:meth:`Stream._wake`); this loop only wakes for
    what that could not write (replay, a full buffer, the end). ``merge``: the API's rules for merging
    the content events of a reader that lags (None: never merged). The caller writes the stream's ending.
    """
    # Lagging = more than coalesce_after events were published while our last write was in progress:
    # the client is the bottleneck, so merge. Events that were already there when a write started
    # (a late joiner's replay, a burst from the broker) are history, sent event by event.
    lagging = False
    # A reader that was following a running stream gets its backlog merged when the stream fails, so the
    # notice is not stuck behind it; one that joins a finished stream replays it event by event.
    live = not stream.finished
    sub = Subscription(transport, asyncio.current_task(), cursor=after + 1, reader=reader)
    stream._register(sub)
    watchdog.add(sub)

    async def timed(coro: Awaitable[None]) -> None:
        sub.busy_since = time.monotonic()
        try:
            await coro
        except asyncio.CancelledError:
            if sub.slow:
                if sub.task is not None:
                    sub.task.uncancel()
                raise SlowConsumer(f"a write was blocked for more than {watchdog.send_timeout:g}s") from None
            raise
        sub.busy_since = None
        sub.last_write = time.monotonic()

    try:
        while True:
            sub.waiter.clear()
            if sub.cursor < len(stream.events):
                batch = policy.plan(stream.events, sub.cursor, lagging,
                                    live and stream.state in ("error", "cancelled"), merge)
                sub.cursor = batch[-1].seq + 1
                head = len(stream.events)
                await timed(write(batch))
                lagging = len(stream.events) - head > policy.coalesce_after
                continue
            lagging = False
            if stream.finished:
                return sub.cursor - 1
            if sub.ping_due:
                sub.ping_due = False
                if idle is not None:
                    await timed(idle())
                else:
                    sub.last_write = time.monotonic()
                continue
            sub.parked = True
            try:
                await sub.waiter.wait()
            finally:
                sub.parked = False
    finally:
        stream._unregister(sub)
        watchdog.remove(sub)


@dataclass(slots=True)
class Retention:
    """How long finished streams stay resumable, and how many bytes all retained streams may hold."""

    finished_ttl: float = 300.0
    max_bytes: int = 256 << 20
    max_streams: int = 10_000  # running + retained
    max_subscribers: int = 10_000  # per stream
    tombstones: int = 100_000  # expired ids remembered for 410 (vs 404)


class StreamHub:
    """All streams of one gateway: creation, lookup (404 / 410), retention and eviction."""

    def __init__(self, retention: Retention) -> None:
        self.retention = retention
        self.streams: dict[str, Stream] = {}
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._gone: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.total_bytes = 0  # held by finished (retained) streams

    def check_capacity(self) -> None:
        """Raise the 429 if no stream can be created now (after evicting what is due)."""
        self.evict()
        if len(self.streams) >= self.retention.max_streams:
            raise APIError(429, f"Too many streams ({len(self.streams)}); the limit is {self.retention.max_streams}.",
                           type="rate_limit_error", code="too_many_streams", retry_after=1.0)

    def create(self, endpoint: str, model: str, stream_id: str | None = None, *, listed: bool = True) -> Stream:
        """A new running stream (call :meth:`check_capacity` first to refuse early). An unlisted
        stream is not kept here: only its readers hold it, and it is gone when they are."""
        stream = Stream(id=stream_id or "str-" + uuid.uuid4().hex, endpoint=endpoint, model=model, listed=listed)
        if listed:
            self.streams[stream.id] = stream
        return stream

    def drop(self, stream_id: str) -> None:
        """Delete a stream now: from then on its id is unknown (404, as OpenAI answers for a deleted
        response), not expired (410)."""
        if stream_id in self._finished:
            self._drop(stream_id, tombstone=False)
        else:
            self.streams.pop(stream_id, None)

    def forget(self, stream: Stream) -> None:
        """Remove a stream that never started (its announcement failed)."""
        if self.streams.get(stream.id) is stream:
            del self.streams[stream.id]

    def get(self, stream_id: str) -> Stream:
        stream = self.streams.get(stream_id)
        if stream is not None and stream.finished and self._expired(stream, time.monotonic()):
            self.evict()
            stream = self.streams.get(stream_id)
        if stream is not None:
            return stream
        if stream_id in self._gone:
            raise stream_expired(stream_id, f" (finished streams are kept {self.retention.finished_ttl:g}s)")
        raise stream_not_found(stream_id)

    def mark_finished(self, stream: Stream) -> None:
        """Start the retention clock of a stream that ended (a still running one is ended as lost
        first: nothing may sit at the head of the retention order unfinished and block eviction)."""
        if not stream.listed or self.streams.get(stream.id) is not stream or stream.id in self._finished:
            return
        if not stream.finished:
            stream.finish("error", stream_lost(stream.id, "it ended without an end marker"))
        self._finished[stream.id] = None
        self.total_bytes += stream.size
        self.evict()

    def _expired(self, s: Stream, now: float) -> bool:
        return s.finished_at is not None and now - s.finished_at > self.retention.finished_ttl

    def evict(self) -> None:
        """Drop finished streams past their TTL, then the oldest finished ones while over the byte budget."""
        now = time.monotonic()
        while self._finished:
            sid = next(iter(self._finished))
            if not self._expired(self.streams[sid], now) and self.total_bytes <= self.retention.max_bytes:
                break
            self._drop(sid)

    def _drop(self, sid: str, tombstone: bool = True) -> None:
        del self._finished[sid]
        s = self.streams.pop(sid)
        self.total_bytes -= s.size
        if not tombstone:
            return
        self._gone[sid] = None
        while len(self._gone) > self.retention.tombstones:
            self._gone.popitem(last=False)
