"""The one mirror: a local :class:`Stream` that follows another gateway's log, record by record.

    Link.open(id) ──► header, async iterator of records ──► Mirror.run ──► Stream.append / finish
      RedisLink (gateway.scaleout.redis_link): XREAD of tokenfan:{<id>}:s         (--broker, across replicas)
      PeerLink  (gateway.scaleout.peers): the owner worker's socket, SSE events     (--workers, on one machine)

Both links carry :mod:`gateway.scaleout.broker_codec` records; what the mirror does with them is the same and
pure (:func:`apply`, :class:`Idle`), and a mirror is an ordinary stream of the hub, so replay, resume,
coalescing and slow readers work on it exactly as on the owner.

- Events are placed by ``seq`` (:func:`broker_codec.place`): a repeat is skipped (a link reads again
  from the start after an outage), a hole ends the mirror with ``stream_lost``; so does an end that
  counts more events than the mirror got, or a record that is not ours (the link raises
  :class:`~gateway.scaleout.broker_codec.CodecError`). Never a normal end.
- A link that yields nothing but :class:`Quiet` for ``lease_check`` seconds makes the mirror ask for the
  owner's lease: while it is held any quiet gap is fine (a slow prefill, a queue); missing twice,
  ``recheck`` apart (a restarted Redis gives the owner that long to write it again), the owner is gone:
  the mirror offers the stream for adoption (``adopt``: one gateway continues it from its log, see
  :mod:`gateway.api.adoption`; the others keep mirroring what it writes, under its header), and ends it
  with ``owner_lost`` only if nobody can. A link that could not read for ``idle_timeout`` ends it with
  ``broker_unavailable``; a link whose iterator ends (the owner worker's socket refuses) with ``owner_lost``.
- A new owner's header names the events it continues from (``at``): a mirror that held more (read from a
  store that lost them since) drops them, and its readers past that point end with ``stream_rolled_back``
  (:meth:`gateway.core.streams.Stream.continue_at`), never reading the new owner's events as the rest.
- Every exit finishes the stream before :meth:`StreamHub.mark_finished`, so a mirror never blocks
  eviction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.core.streams import Stream, StreamHub, encode_event
from gateway.errors import APIError, StreamError, owner_lost, stream_lost
from gateway.scaleout import broker_codec as codec

log = logging.getLogger(__name__)

CATCH_UP_S = 5.0  # longest wait for a new mirror to hold what its owner held when asked
PRESENCE_RECHECK = 0.1  # a closed owner connection is asked about again this much later before it counts


@dataclass(frozen=True, slots=True)
class Quiet:
    """No record within the link's poll interval; ``unreachable``: the link's last error, while it cannot read."""

    unreachable: BaseException | None = None


Item = codec.Entry | Quiet  # a link raises codec.CodecError for a record that is not ours


@dataclass(frozen=True, slots=True)
class Opened:
    """A stream found on its link: its header, then its records (from the first) as they come."""

    header: codec.Header
    records: AsyncGenerator[Item, None]


Adoption = Literal["adopted", "elsewhere", "no"]
# (stream, its latest header) -> this gateway adopted it, another did, or nobody can
Adopt = Callable[[Stream, codec.Header], Awaitable[Adoption]]


@dataclass(frozen=True, slots=True)
class Lease:
    """An owner's lease as its link sees it: ``held`` (for ``remaining`` s; None: no expiry), ``missing``,
    or ``unknown`` (the link could not ask). ``certain``: a missing lease that cannot come back (a worker's
    socket that refuses, or answers with another pid), unlike a key a restarted Redis lost. ``present``: the
    owner's own connection to the link is open (False: closed, so the owner was killed); None: not known."""

    state: Literal["held", "missing", "unknown"]
    remaining: float | None = None
    certain: bool = False
    present: bool | None = None


class Claims(Protocol):
    """Who decides which gateway adopts a stream: the broker (Redis ``SET NX``) or the workers (a file)."""

    async def claim(self, stream: Stream, header: codec.Header) -> bool:
        """True for exactly one gateway asking for ``stream`` of the lost owner its ``header`` names."""

    def adopted(self, stream: Stream) -> None:
        """This gateway owns ``stream`` from now on (the broker writes its header naming it)."""


class Link(Protocol):
    """Where mirrors read other gateways' logs."""

    async def open(self, stream_id: str) -> Opened:
        """The stream's header and records; APIError 404 / 410 (expired, or its header is lost) / 503."""

    async def lease(self, owner: str) -> Lease: ...

    async def cancel(self, stream_id: str, owner: str) -> bool:
        """Ask the owner to cancel the stream's generation; True once it says it did."""


def mirror_closed() -> APIError:
    return StreamError(503, ("This gateway stopped mirroring the stream; resume with Last-Event-ID (or "
                             "?after=<last seq>) on another replica."),
                       type="server_error", code="mirror_closed", retry_after=1.0)


def apply(stream: Stream, entry: codec.Entry) -> APIError | None:
    """Apply one record to the mirror's log; an error that must end the stream, or None (the stream may now
    be finished)."""
    if isinstance(entry, codec.Header):
        return None
    have = len(stream.events)
    if isinstance(entry, codec.EventEntry):
        where = codec.place(entry.seq, have)
        if where == "hole":
            return stream_lost(stream.id, f"events {have} to {entry.seq - 1} are missing")
        if where == "append":
            stream.append(encode_event(entry.seq, entry.chunk, entry.text, entry.finish_reason, list(entry.ids)))
        return None
    if not codec.end_is_complete(entry, have):
        return stream_lost(stream.id, f"its end counts {entry.events} events, the mirror got {have}")
    if entry.state == "error" and entry.error is None:
        return stream_lost(stream.id, "it ended with an error its owner did not record")
    stream.finish(entry.state, entry.error)
    return None


class Idle:
    """When a quiet mirror asks for its owner's lease, and which answers end it (pure: the clock is passed in).

    ``lease_check``: seconds of quiet before the first question; ``timeout``: seconds the link may be
    unreachable before the mirror gives up (``broker_unavailable``). ``presence_check``: seconds of quiet
    before asking whether the owner's connection is still open (None: only its lease is asked); closed on
    two questions :data:`PRESENCE_RECHECK` apart, the owner was killed (no need to wait out its lease)."""

    def __init__(self, timeout: float, recheck: float, now: float, lease_check: float | None = None,
                 presence_check: float | None = None) -> None:
        self.timeout, self.recheck = timeout, recheck
        self.lease_check = timeout if lease_check is None else lease_check
        self.presence_check = presence_check
        self.first_check = min(self.lease_check, presence_check or self.lease_check)
        self.deadline = now + self.first_check
        self.misses = 0  # checks in a row that found the lease missing
        self.absent = 0  # checks in a row that found the lease held but its owner's connection closed
        self.unreachable_since: float | None = None

    def heard(self, now: float) -> None:
        """A record arrived: the owner is alive."""
        self.deadline = now + self.first_check
        self.misses = 0
        self.absent = 0
        self.unreachable_since = None

    def due(self, now: float) -> bool:
        return now >= self.deadline

    def cut_off(self, now: float) -> bool:
        """The link is unreachable now: whether it has been for ``timeout``."""
        if self.unreachable_since is None:
            self.unreachable_since = now
        return now - self.unreachable_since >= self.timeout

    def unreachable(self, exc: BaseException) -> APIError:
        return StreamError(503, f"The stream broker was unreachable for {self.timeout:g}s ({exc}).",
                        type="server_error", code="broker_unavailable", retry_after=1.0)

    def check(self, now: float, lease: Lease, stream_id: str) -> APIError | None:
        """The lease asked when :meth:`due`: ``owner_lost`` when it is missing the second time in a row (the
        first, if it is certainly gone), else None and the time of the next check (held: just after it would expire unless refreshed,
        so a quiet mirror costs one question per lease period)."""
        if lease.state == "held" and lease.present is False:
            self.absent += 1
            if self.absent >= 2:
                return owner_lost(stream_id, "its owner's connection to the broker closed (the gateway was killed)")
            self.deadline = now + PRESENCE_RECHECK
            return None
        self.absent = 0
        if lease.state == "missing":
            self.misses += 1
            if self.misses >= 2 or lease.certain:
                return owner_lost(stream_id, f"no record for {self.lease_check:g}s and its owner's lease expired")
            self.deadline = now + self.recheck + 0.25
            return None
        if lease.state == "unknown":  # the next read finds out whether the link is gone
            self.deadline = now + self.recheck
            return None
        self.misses = 0
        if lease.present and self.presence_check is not None:  # keep an eye on its connection while quiet
            self.deadline = now + self.presence_check
            return None
        self.deadline = now + (lease.remaining + 0.05 if lease.remaining is not None else self.timeout)
        return None


ADOPTED = APIError(200, "adopted", code="adopted")  # Mirror.run's result when this gateway took the stream over


class Mirror:
    """One mirrored stream: its link's records applied to its log until an end (or its adoption here)."""

    def __init__(self, stream: Stream, opened: Opened, link: Link, idle: Idle,
                 clock: Callable[[], float] = time.monotonic, adopt: Adopt | None = None) -> None:
        self.stream, self.opened, self.link, self.idle, self.clock = stream, opened, link, idle, clock
        self.header = opened.header  # the latest: a gateway that adopts the stream writes its own
        self.adopt = adopt
        self.caught_up = asyncio.Event()  # the mirror holds what the owner held when the link was opened
        self._progress()

    def _progress(self) -> None:
        if len(self.stream.events) + self.stream.finished >= self.opened.header.held:
            self.caught_up.set()

    async def run(self) -> APIError | None:
        """Follow the link until the stream ends; the error to end it with if it did not end by itself."""
        stream = self.stream
        async for item in self.opened.records:
            now = self.clock()
            if isinstance(item, Quiet):
                if item.unreachable is not None:
                    if self.idle.cut_off(now):
                        return self.idle.unreachable(item.unreachable)
                    continue
                self.idle.unreachable_since = None
                if not self.idle.due(now):
                    continue
                ending = self.idle.check(now, await self.link.lease(self.header.owner), stream.id)
                if ending is None:
                    continue
                adoption = await self.adopt(stream, self.header) if self.adopt is not None else "no"
                if adoption == "adopted":
                    return ADOPTED
                if adoption == "no":
                    return ending
                self.idle.heard(self.clock())  # another gateway took it over: its header and events follow
                continue
            self.idle.heard(now)
            if isinstance(item, codec.Header):
                self.header = item  # a new owner (it adopted the stream)
                if item.at is not None and item.at < stream.next_seq:
                    # it continues a log shorter than this mirror's (its store lost what this mirror read
                    # before): what follows is its log, and readers past it cannot read on as one answer
                    log.warning("mirror of %s: its new owner continues from %d events, this mirror held %d",
                                stream.id, item.at, stream.next_seq)
                    stream.continue_at(item.at)
                continue
            ending = apply(stream, item)
            if ending is not None or stream.finished:
                return ending
            if not self.caught_up.is_set():
                self._progress()
        return owner_lost(stream.id, "its link ended before the stream did")


class MirrorSet:
    """This gateway's mirrors of other gateways' streams over one :class:`Link`: create, cancel, close.

    ``on_owner_lost`` (Redis): record an ``owner_lost`` end where later readers find it at once."""

    def __init__(self, hub: StreamHub, link: Link, *, idle_timeout: float, recheck: float,
                 on_owner_lost: Callable[[Stream, APIError, codec.Header], Awaitable[None]] | None = None,
                 lease_check: float | None = None, presence_check: float | None = None) -> None:
        self.hub, self.link = hub, link
        self.idle_timeout, self.recheck, self.lease_check = idle_timeout, recheck, lease_check
        self.presence_check = presence_check
        self.on_owner_lost = on_owner_lost
        self.adopt: Adopt | None = None  # set by the app: who continues a stream whose owner is gone
        self._adopted: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._mirrors: dict[str, Mirror] = {}  # by stream id: its owner (the latest header's), for cancels

    async def mirror(self, stream_id: str) -> Stream:
        """The stream, mirrored here (once it holds what its owner held when asked, within
        :data:`CATCH_UP_S`); APIError 404 / 410 / 503 from the link, 429 if the hub is full."""
        existing = self.hub.streams.get(stream_id)
        if existing is not None:
            return existing
        opened = await self.link.open(stream_id)
        existing = self.hub.streams.get(stream_id)  # created meanwhile by a concurrent subscriber
        if existing is not None:
            await opened.records.aclose()
            return existing
        try:
            self.hub.check_capacity()
        except APIError:
            await opened.records.aclose()
            raise
        h = opened.header
        stream = self.hub.create(h.endpoint, h.model, stream_id=stream_id)
        stream.mirrored, stream.detached = True, h.detached
        stream.request = h.request  # the engine request: its trace context joins this mirror's readers to the owner's trace
        idle = Idle(self.idle_timeout, self.recheck, time.monotonic(), self.lease_check, self.presence_check)
        m = Mirror(stream, opened, self.link, idle, adopt=self.adopt)
        self._mirrors[stream_id] = m
        task = asyncio.create_task(self._run(m), name=f"mirror-{stream_id}")
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, stream))
        stream.task = task
        if not m.caught_up.is_set():
            # asyncio.timeout, not wait_for (Python 3.11's drops a cancel that lands as the catch-up does). No
            # shield: the timeout cancels only this caller's wait(), never the event or the mirror task that sets it.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CATCH_UP_S):
                    await m.caught_up.wait()
        return stream

    async def cancel_remote(self, stream_id: str) -> bool:
        m = self._mirrors.get(stream_id)
        return await self.link.cancel(stream_id, m.header.owner if m is not None else "")

    async def close(self) -> None:
        """Stop every mirror (each ends with ``mirror_closed``); see :func:`stop_tasks`."""
        await stop_tasks(self._tasks)

    async def _run(self, m: Mirror) -> None:
        stream = m.stream
        ending: APIError | None = None
        try:
            ending = await m.run()
            if ending is ADOPTED:
                self._adopted.add(stream.id)  # a local stream now: its pump finishes and retains it
                return
            if ending is not None and ending.code == "owner_lost" and self.on_owner_lost is not None:
                await self.on_owner_lost(stream, ending, m.header)
        except asyncio.CancelledError:
            ending = mirror_closed()
            raise
        except codec.CodecError as exc:  # a record that is not ours: what follows cannot be trusted
            ending = stream_lost(stream.id, str(exc))
        except Exception as exc:  # a bug here must still end the stream explicitly
            log.exception("mirror of %s failed", stream.id)
            ending = stream_lost(stream.id, f"its mirror failed ({type(exc).__name__})")
        finally:
            if not stream.finished and ending is not ADOPTED:
                stream.finish("error", ending or mirror_closed())
            m.caught_up.set()
            await m.opened.records.aclose()

    def _done(self, task: asyncio.Task[None], stream: Stream) -> None:
        """However the mirror ended (even cancelled before it ran), the stream is finished, then retained."""
        self._tasks.discard(task)
        self._mirrors.pop(stream.id, None)
        if stream.id in self._adopted:
            self._adopted.discard(stream.id)
            return
        if not stream.finished:
            stream.finish("error", mirror_closed())
        self.hub.mark_finished(stream)


class RemoteStreamsByMirror:
    """What ``--broker`` and ``--workers`` share of :class:`gateway.core.ports.RemoteStreams`: mirrors and remote
    cancels, over each one's link."""

    mirrors: MirrorSet

    async def mirror(self, stream_id: str) -> Stream:
        return await self.mirrors.mirror(stream_id)

    async def cancel_remote(self, stream_id: str) -> bool:
        """True once the gateway that runs the stream says it cancelled it."""
        return await self.mirrors.cancel_remote(stream_id)


async def stop_tasks(tasks: set[asyncio.Task[None]]) -> None:
    """Cancel until done: redis-py sends with ``asyncio.wait_for``, which on Python 3.11 drops a
    cancellation that arrives as the send completes, so one ``cancel()`` may not stop a task."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)
