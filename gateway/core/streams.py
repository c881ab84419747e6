"""The stream log: one generation's events, appended once, read by any number of readers.

A :class:`Stream` is an append-only log of events (one per payload, numbered by ``seq`` from 0). Every event
is serialized once per wire format when it is first framed; all readers of that format get the same bytes.
A reader is only a cursor into the log (a :class:`Follower`), so joining late, resuming after ``seq`` and
following the live tail are the same loop (:func:`gateway.core.follow.follow`). :class:`StreamHub` holds a
gateway's listed streams: lookup (404 / 410), retention and eviction.

Fairness: on publish, followers are woken per transport group, SSE first for even ``seq`` and WebSocket
first for odd ``seq``, so neither transport is systematically written first; within a group the starting
follower rotates with ``seq``, so no follower is always first either.

One pass: :meth:`Stream.append` writes a new event to every caught-up follower itself (its
:class:`LiveWriter`, inside the engine step that produced it); a follower's own loop runs only for replay,
resume and back-pressure. This module knows its readers only by the two protocols below.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import orjson

from engine_worker import protocol as p
from gateway.core.step import Step
from gateway.errors import APIError, stream_expired, stream_lost, stream_not_found, too_many_streams

if TYPE_CHECKING:
    from gateway.core.tracing import GenerationTrace

Transport = Literal["sse", "ws"]
TRANSPORTS: tuple[Transport, Transport] = ("sse", "ws")
State = Literal["running", "done", "error", "cancelled", "moved"]  # moved: its generation goes on elsewhere


class Template(Protocol):
    """A generation's payload as pre-encoded bytes with holes (the chat API's ``ChunkTemplate``, the
    Responses API's ``TextDeltaTemplate``): rendering splices in an event's text and, for a payload that numbers itself (a
    Responses event's ``sequence_number``), its ``seq`` in the stream's log."""

    def render(self, text: str, seq: int) -> bytes: ...


class ChunkEvent:
    """One payload to append: its dict (``payload``), or its ``template`` and text (the template renders the
    JSON; :attr:`parsed` parses it only if asked for), the engine emit time of the delta behind it, and its
    accounting. ``seq``: the log position a payload that numbers itself names (the stream checks it)."""

    __slots__ = ("emit_ns", "finish_reason", "ids", "migrated", "payload", "seq", "template", "text", "tokens",
                 "usage")

    def __init__(self, chunk: dict[str, Any] | None, emit_ns: int, text: str, tokens: int,
                 finish_reason: str | None = None, usage: p.Usage | None = None, *,
                 template: Template | None = None, seq: int | None = None) -> None:
        self.payload = chunk  # None when rendered from a template
        self.template = template
        self.seq = seq
        self.emit_ns = emit_ns  # engine emit time of the delta behind this chunk
        self.text = text  # the content text it carries ("" for role/usage chunks)
        self.tokens = tokens
        self.finish_reason = finish_reason
        self.usage = usage
        self.ids: list[int] | tuple[()] = ()  # output token ids of the deltas behind it (what an adopter resumes)
        self.migrated = False  # the first payload after the generation moved to another engine

    @property
    def parsed(self) -> dict[str, Any] | None:
        """The payload as a dict (rendered and parsed if it comes from a template)."""
        if self.payload is None and self.template is not None:
            self.payload = orjson.loads(self.template.render(self.text, self.seq or 0))
        return self.payload


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
    rendered from a ``template`` (:class:`Template`) keeps only its text: its JSON
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
    def timed_payload(self) -> dict[str, Any]:
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


class LiveWriter(Protocol):
    """What writes a live event for a caught-up follower in the publisher's pass
    (:class:`gateway.core.delivery.Reader`)."""

    last_write: float

    def write_now(self, ev: Event, step: Step | None) -> bool:
        """Write ``ev`` without awaiting; False if the connection cannot take it now."""
        ...


class Waker(Protocol):
    """What wakes a follower's loop (:class:`gateway.core.follow.Wake`)."""

    def set(self) -> None: ...


class Follower(Protocol):
    """A reader of a stream as the log sees it (:class:`gateway.core.follow.Subscription`): its cursor,
    whether its loop is parked at the tail, what writes for it then, and what wakes its loop."""

    transport: Transport
    relay: bool  # it feeds another worker's mirror of the stream (written first in every pass, at once)
    standby: bool  # it feeds the stream's standby: it gets a gated stream's events before they are committed
    cursor: int
    parked: bool
    reader: LiveWriter | None
    last_write: float
    rolled_back: int | None  # it read past this point, where a new owner continues the log (:meth:`Stream.continue_at`)

    @property
    def waiter(self) -> Waker: ...


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
    trace: GenerationTrace | None = None  # its generation's trace, for its readers (None: tracing is off)
    # Durable delivery (``--broker``; ``--workers`` without one: its standby worker): a *gated* stream's new
    # events wait in ``pending`` until the publisher says the broker (the standby) holds them (:meth:`commit`),
    # and its end reaches readers once the end record is there (``sealed``): a reader never sees what an adopter
    # of the stream would not read. ``epoch``: the fencing
    # token of this gateway's ownership of it (every write to the broker carries it).
    gated: bool = False
    sealed: bool = False
    paused: bool = False  # its owner fenced itself (--broker): its readers are sent to resume on a replica
    epoch: int = 0
    pending: list[Event] = field(default_factory=list)
    continued_at: int | None = None  # where its latest new owner continued its log (:meth:`continue_at`)

    def __post_init__(self) -> None:
        # dicts as insertion-ordered sets: the rotation in _wake needs a stable order
        self._waiters: dict[Transport, dict[Follower, None]] = {"sse": {}, "ws": {}}
        self._relays: dict[Follower, None] = {}  # see _wake
        self._standbys: dict[Follower, None] = {}  # relays that read the pending events too (see append)

    @property
    def finished(self) -> bool:
        return self.state != "running"

    @property
    def over(self) -> bool:
        """Whether its readers may end: it finished and, if gated, its end is durable (or it moved away)."""
        return self.state != "running" and (self.sealed or not self.gated or self.state == "moved")

    @property
    def next_seq(self) -> int:
        return len(self.events) + len(self.pending)

    def subscriber_count(self) -> int:
        return len(self._waiters["sse"]) + len(self._waiters["ws"]) + len(self._relays) + len(self._standbys)

    def publish(self, ev: ChunkEvent, step: Step | None = None) -> Event:
        """Append the next payload, stamped with its ``seq`` and timing (``step``: the engine step that
        produced it, whose clock read it shares), and write it to the caught-up readers. A payload that
        numbers itself (``ev.seq``) must land at that ``seq``."""
        seq = self.next_seq
        if ev.seq is not None and ev.seq != seq:
            raise ValueError(f"stream {self.id}: a payload numbered {ev.seq} published at seq {seq}")
        w = self._waiters
        shared = self.listed and len(w["sse"]) + len(w["ws"]) > 1  # frames built once for several readers
        return self.append(Event(seq, ev.payload, None, ev.text, ev.finish_reason, {} if shared else NO_CACHE,
                                 template=ev.template, emit_ns=ev.emit_ns,
                                 sent_ns=step.wall_ns if step is not None else p.now_ns(), ids=ev.ids,
                                 migrated=ev.migrated), step)

    def append(self, event: Event, step: Step | None = None) -> Event:
        """Add an already built event (its ``seq`` must be the next one) and write it to the readers (a gated
        stream's: to its standby relays at once, to the others once committed)."""
        if event.seq != self.next_seq:
            raise ValueError(f"stream {self.id}: event seq {event.seq}, expected {self.next_seq}")
        if self.gated:
            self.pending.append(event)
            for standby in self._standbys:
                self._wake_one(standby, event.seq, event, None)
            return event
        self.events.append(event)
        self.size += event.size
        self._wake(event.seq, event, step)
        return event

    def commit(self, upto: int, sealed: bool = False) -> None:
        """The broker holds this gated stream's events below ``upto`` (and, ``sealed``, its end): they, and
        then the end, reach the readers."""
        k = 0
        for ev in self.pending:
            if ev.seq >= upto:
                break
            k += 1
            self.events.append(ev)
            self.size += ev.size
            self._wake(ev.seq, ev, committed=True)
        if k:
            del self.pending[:k]
        if sealed and not self.pending and self.finished and not self.sealed:
            self.sealed = True
            self._wake(len(self.events), committed=True)

    def continue_at(self, seq: int) -> None:
        """A new owner continues the log at ``seq`` (it adopted the stream from a log of ``seq`` events): events
        from ``seq`` on, read from a store that lost them since, are dropped, and every reader already past
        ``seq`` is marked :attr:`Follower.rolled_back` with it (it ends with ``stream_rolled_back``, never reading
        the new owner's events as the rest of what it read)."""
        self.continued_at = seq
        if seq < self.next_seq:
            kept = (self.events + self.pending)[:seq]
            self.events, self.pending = kept[:len(self.events)], kept[len(self.events):]
            self.size = sum(e.size for e in self.events)
        for group in (self._relays, self._waiters["sse"], self._waiters["ws"]):
            for sub in group:
                if sub.cursor > seq and (sub.rolled_back is None or seq < sub.rolled_back):
                    sub.rolled_back = seq
                    sub.waiter.set()

    def pause(self, paused: bool) -> None:
        """While paused, every reader (new ones too, after what is committed) ends with the resume-elsewhere
        ending (:data:`gateway.core.delivery.MOVED`); the log and the generation go on."""
        self.paused = paused
        if paused:
            self._wake(self.next_seq)

    def relinquish(self) -> None:
        """This gateway lost the stream (fenced: another owns it now): what the broker does not hold is
        dropped, never shown, and it ends ``moved`` here (its readers resume on a replica that has it)."""
        self.pending.clear()
        if self.state == "moved":
            return
        self.state = "moved"
        self.finished_at = time.monotonic()
        self._wake(len(self.events))

    def finish(self, state: State, error: APIError | None = None) -> None:
        if self.finished:
            return
        self.state = state
        self.error = error
        self.finished_at = time.monotonic()
        self._wake(len(self.events))

    def _wake(self, seq: int, event: Event | None = None, step: Step | None = None, committed: bool = False) -> None:
        """One pass over the readers for a new event (or the end): a caught-up reader that writes in the
        publisher's pass gets the event written here and now (:meth:`LiveWriter.write_now`);
        any other reader's loop is woken.

        Relays (another worker's mirror, ``--workers``) come first and are written at once, not at the
        step's end: that worker then writes its share of the readers on its core while this one writes its
        own. A pass outside an engine step (a mirror's, a broker commit's) is a step of its own: one
        clock read, and each connection written once at its end. A commit (``committed``) skips the standby
        relays: they had those events when they were appended."""
        if not committed:
            for standby in self._standbys:
                self._wake_one(standby, seq, event, None)
        for relay in self._relays:
            self._wake_one(relay, seq, event, None)
        sse, ws = self._waiters["sse"], self._waiters["ws"]
        if len(sse) + len(ws) <= 1:  # one reader (a POST response, a /v1/ws request): nothing to rotate
            if sse or ws:
                self._wake_one(next(iter(sse or ws)), seq, event, step)
            return
        own = step is None and event is not None
        if own:
            step = Step(time.monotonic(), time.time_ns())
        for group in ((sse, ws) if seq % 2 == 0 else (ws, sse)):
            if not group:
                continue
            subs = list(group)
            k = seq % len(subs)
            for sub in subs[k:] + subs[:k] if k else subs:
                self._wake_one(sub, seq, event, step)
        if own:
            assert step is not None
            step.flush()

    @staticmethod
    def _wake_one(sub: Follower, seq: int, event: Event | None, step: Step | None) -> None:
        if event is not None and sub.parked and sub.cursor == seq and sub.reader is not None \
                and sub.reader.write_now(event, step):
            sub.cursor = seq + 1
            sub.last_write = sub.reader.last_write
        else:
            sub.waiter.set()

    def add_follower(self, sub: Follower) -> None:
        """``sub`` reads this stream: woken (or written to) by every new event and by the end."""
        self._group(sub)[sub] = None

    def remove_follower(self, sub: Follower) -> None:
        self._group(sub).pop(sub, None)

    def _group(self, sub: Follower) -> dict[Follower, None]:
        return self._standbys if sub.standby else self._relays if sub.relay else self._waiters[sub.transport]


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
            raise too_many_streams(len(self.streams), self.retention.max_streams)

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
