"""The one mirror: a local :class:`Stream` that follows another gateway's log, record by record.

    Link.open(id) ──► header, async iterator of records ──► Mirror.run ──► Stream.append / finish
      RedisLink (gateway.scaleout.broker_parts): XREAD of tokenfan:s:<id>          (--broker, across replicas)
      PeerLink  (gateway.scaleout.peers): the owner worker's socket, SSE events     (--workers, on one machine)

Both links carry :mod:`gateway.scaleout.broker_codec` records; what the mirror does with them is the same and
pure (:func:`apply`, :class:`Idle`), and a mirror is an ordinary stream of the hub, so replay, resume,
coalescing and slow readers work on it exactly as on the owner.

- Events are placed by ``seq`` (:func:`broker_codec.place`): a repeat is skipped (a link reads again
  from the start after an outage), a hole ends the mirror with ``stream_lost``; so does an end that
  counts more events than the mirror got, or a record that is not ours (the link raises
  :class:`~gateway.scaleout.broker_codec.CodecError`). Never a normal end.
- A link that yields nothing but :class:`Quiet` for ``idle_timeout`` makes the mirror ask for the
  owner's lease: while it is held any quiet gap is fine (a slow prefill, a queue); missing twice,
  ``recheck`` apart (a restarted Redis gives the owner that long to write it again), it ends the mirror
  with ``owner_lost``. A link that could not read all that time ends it with ``broker_unavailable``;
  a link whose iterator ends (the owner worker's socket refuses) ends it with ``owner_lost``.
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
from gateway.errors import APIError, owner_lost, stream_lost
from gateway.scaleout import broker_codec as codec

log = logging.getLogger(__name__)

CATCH_UP_S = 5.0  # longest wait for a new mirror to hold what its owner held when asked


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


@dataclass(frozen=True, slots=True)
class Lease:
    """An owner's lease as its link sees it: ``held`` (for ``remaining`` s; None: no expiry), ``missing``,
    or ``unknown`` (the link could not ask)."""

    state: Literal["held", "missing", "unknown"]
    remaining: float | None = None


class Link(Protocol):
    """Where mirrors read other gateways' logs."""

    async def open(self, stream_id: str) -> Opened:
        """The stream's header and records; APIError 404 / 410 (expired, or its header is lost) / 503."""

    async def lease(self, owner: str) -> Lease: ...

    async def cancel(self, stream_id: str, owner: str) -> bool:
        """Ask the owner to cancel the stream's generation; True once it says it did."""


def mirror_closed() -> APIError:
    return APIError(503, "This gateway stopped mirroring the stream; resume with Last-Event-ID on another replica.",
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
            stream.append(encode_event(entry.seq, entry.chunk, entry.text, entry.finish_reason))
        return None
    if not codec.end_is_complete(entry, have):
        return stream_lost(stream.id, f"its end counts {entry.events} events, the mirror got {have}")
    if entry.state == "error" and entry.error is None:
        return stream_lost(stream.id, "it ended with an error its owner did not record")
    stream.finish(entry.state, entry.error)
    return None


class Idle:
    """When a quiet mirror asks for its owner's lease, and which answers end it (pure: the clock is passed in)."""

    def __init__(self, timeout: float, recheck: float, now: float) -> None:
        self.timeout, self.recheck = timeout, recheck
        self.deadline = now + timeout
        self.misses = 0  # checks in a row that found the lease missing

    def heard(self, now: float) -> None:
        """A record arrived: the owner is alive."""
        self.deadline = now + self.timeout
        self.misses = 0

    def due(self, now: float) -> bool:
        return now >= self.deadline

    def unreachable(self, exc: BaseException) -> APIError:
        return APIError(503, f"The stream broker was unreachable for {self.timeout:g}s ({exc}).",
                        type="server_error", code="broker_unavailable", retry_after=1.0)

    def check(self, now: float, lease: Lease, stream_id: str) -> APIError | None:
        """The lease asked when :meth:`due`: ``owner_lost`` when it is missing the second time in a row,
        else None and the time of the next check (held: just after it would expire unless refreshed,
        so a quiet mirror costs one question per lease period)."""
        if lease.state == "missing":
            self.misses += 1
            if self.misses >= 2:
                return owner_lost(stream_id, f"no record for {self.timeout:g}s and its lease expired")
            self.deadline = now + self.recheck + 0.25
            return None
        if lease.state == "unknown":  # the next read finds out whether the link is gone
            self.deadline = now + self.recheck
            return None
        self.misses = 0
        self.deadline = now + (lease.remaining + 0.05 if lease.remaining is not None else self.timeout)
        return None


class Mirror:
    """One mirrored stream: its link's records applied to its log until an end."""

    def __init__(self, stream: Stream, opened: Opened, link: Link, idle: Idle,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream, self.opened, self.link, self.idle, self.clock = stream, opened, link, idle, clock
        self.caught_up = asyncio.Event()  # the mirror holds what the owner held when the link was opened
        self._progress()

    def _progress(self) -> None:
        if len(self.stream.events) + self.stream.finished >= self.opened.header.held:
            self.caught_up.set()

    async def run(self) -> APIError | None:
        """Follow the link until the stream ends; the error to end it with if it did not end by itself."""
        stream, owner = self.stream, self.opened.header.owner
        async for item in self.opened.records:
            now = self.clock()
            if isinstance(item, Quiet):
                if not self.idle.due(now):
                    continue
                if item.unreachable is not None:
                    return self.idle.unreachable(item.unreachable)
                ending = self.idle.check(now, await self.link.lease(owner), stream.id)
                if ending is not None:
                    return ending
                continue
            self.idle.heard(now)
            ending = apply(stream, item)
            if ending is not None or stream.finished:
                return ending
            if not self.caught_up.is_set():
                self._progress()
        return owner_lost(stream.id, "its link ended before the stream did")


class Mirrors:
    """This gateway's mirrors of other gateways' streams over one :class:`Link`: create, cancel, close.

    ``on_owner_lost`` (Redis): record an ``owner_lost`` end where later readers find it at once."""

    def __init__(self, hub: StreamHub, link: Link, *, idle_timeout: float, recheck: float,
                 on_owner_lost: Callable[[Stream, APIError], Awaitable[None]] | None = None) -> None:
        self.hub, self.link = hub, link
        self.idle_timeout, self.recheck = idle_timeout, recheck
        self.on_owner_lost = on_owner_lost
        self._tasks: set[asyncio.Task[None]] = set()
        self._owners: dict[str, str] = {}  # mirrored stream id -> its owner, for cancels

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
        self._owners[stream_id] = h.owner
        m = Mirror(stream, opened, self.link, Idle(self.idle_timeout, self.recheck, time.monotonic()))
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
        return await self.link.cancel(stream_id, self._owners.get(stream_id, ""))

    async def close(self) -> None:
        """Stop every mirror (each ends with ``mirror_closed``); see :func:`stop_tasks`."""
        await stop_tasks(self._tasks)

    async def _run(self, m: Mirror) -> None:
        stream = m.stream
        ending: APIError | None = None
        try:
            ending = await m.run()
            if ending is not None and ending.code == "owner_lost" and self.on_owner_lost is not None:
                await self.on_owner_lost(stream, ending)
        except asyncio.CancelledError:
            ending = mirror_closed()
            raise
        except codec.CodecError as exc:  # a record that is not ours: what follows cannot be trusted
            ending = stream_lost(stream.id, str(exc))
        except Exception as exc:  # a bug here must still end the stream explicitly
            log.exception("mirror of %s failed", stream.id)
            ending = stream_lost(stream.id, f"its mirror failed ({type(exc).__name__})")
        finally:
            if not stream.finished:
                stream.finish("error", ending or mirror_closed())
            m.caught_up.set()
            await m.opened.records.aclose()

    def _done(self, task: asyncio.Task[None], stream: Stream) -> None:
        """However the mirror ended (even cancelled before it ran), the stream is finished, then retained."""
        self._tasks.discard(task)
        self._owners.pop(stream.id, None)
        if not stream.finished:
            stream.finish("error", mirror_closed())
        self.hub.mark_finished(stream)


class Mirroring:
    """What ``--broker`` and ``--workers`` share of :class:`gateway.core.ports.RemoteStreams`: mirrors and remote
    cancels, over each one's link."""

    mirrors: Mirrors

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
