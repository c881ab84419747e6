"""A reader's own loop over a stream (:func:`follow`) and the one watchdog of all of them.

:func:`follow` sends a reader everything past its cursor, then parks at the tail, where the publisher
writes for it in its own pass (:meth:`gateway.core.streams.Stream.append`); it wakes only for what that
could not write (replay, resume, a full buffer, the end). The :class:`Watchdog` cuts a reader whose write is
blocked past the policy's send timeout and asks idle readers for a keep-alive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.core.backpressure import SlowConsumer, SlowConsumerPolicy
from gateway.core.merge import MergeRules
from gateway.core.streams import Event, LiveWriter, Stream, Transport

BEYOND_WAIT_S = 10.0  # longest wait of a reader whose resume point lies beyond the log for the log to reach it


class RolledBack(Exception):
    """The reader read events the log no longer holds (a store that lost them, and a new owner that continues
    the log from before them): it ends with ``stream_rolled_back``, never skipping to the new owner's events."""

    def __init__(self, seq: int, held: int) -> None:
        super().__init__(f"the reader read up to event {seq - 1}, the log now holds {held}")
        self.seq, self.held = seq, held


# Writers: the transport-specific half of a subscriber.
WriteEvents = Callable[[list[Event]], Awaitable[None]]
WriteIdle = Callable[[], Awaitable[None]]
Turn = Callable[[], Awaitable[None]]  # waits for the loop turn's share of subscriber work


class Wake:
    """What wakes one reader's loop: an ``asyncio.Event`` for a single waiter, without the Event's deque
    of waiters (about 600 bytes a reader, at thousands of readers): a future exists only while it waits."""

    __slots__ = ("_fut", "_set")

    def __init__(self) -> None:
        self._set = False
        self._fut: asyncio.Future[None] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> None:
        if self._set:
            return
        self._fut = asyncio.get_running_loop().create_future()
        try:
            await self._fut
        finally:
            self._fut = None


@dataclass(eq=False, slots=True)
class Subscription:
    """One subscriber's state as the :class:`Watchdog` sees it."""

    transport: Transport
    task: asyncio.Task[Any] | None
    relay: bool = False  # it feeds another worker's mirror (see Stream._wake)
    standby: bool = False  # it feeds the stream's standby: it reads the pending events too (Stream.append)
    waiter: Wake = field(default_factory=Wake)
    cursor: int = 0  # the next seq this reader sends
    parked: bool = False  # its loop waits, caught up: the publisher may write for it (``reader``)
    reader: LiveWriter | None = None  # writes in the publisher's pass (None: only its own loop writes)
    busy_since: float | None = None  # monotonic start of the write in progress
    last_write: float = field(default_factory=time.monotonic)
    ping_due: bool = False
    slow: bool = False
    rolled_back: int | None = None  # see Stream.continue_at


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
    watchdog: Watchdog, *, idle: WriteIdle | None = None, reader: LiveWriter | None = None,
    merge: MergeRules | None = None, relay: bool = False, standby: bool = False, turn: Turn | None = None,
) -> int:
    """Send every event with ``seq > after`` and then the live tail until the stream ends.

    Returns the last ``seq`` sent (``after`` if none). Raises :class:`SlowConsumer` when the
    watchdog finds a write blocked past the send timeout. ``idle`` (if given) is called when the
    watchdog asks for a keep-alive. With ``reader``, a caught-up reader's live events are written by
    the publisher in its one pass over the readers (:meth:`Stream.append`); this loop only wakes for
    what that could not write (replay, a full buffer, the end). ``merge``: the API's rules for merging
    the content events of a reader that lags (None: never merged). ``relay``: it feeds another worker's
    mirror (written first in every pass); ``standby``: it feeds the mirror an adopter would continue from, so
    it reads a gated stream's events before they are committed (:attr:`Stream.pending`, which wait for it) and
    ends once the stream finished, before its end is sealed. ``turn``: awaited before each write of this loop
    (a bounded share of the loop turn: :class:`gateway.core.turns.Turnstile`). The caller writes the stream's
    ending.

    A resume point beyond the log (a mirror still reading it, or a store that lost what the reader read) waits
    up to :data:`BEYOND_WAIT_S` for the log to reach it. Raises :class:`RolledBack` when it does not, when the
    stream ends short of it, or when a new owner continues the log from before it (:meth:`Stream.continue_at`);
    at once when nothing can bring the log to it: the stream is this gateway's own, finished, and its whole log
    (committed or not) is shorter, or its latest owner continued it from before the resume point. On this
    gateway's own running stream it waits with no deadline: the log grows to it.
    """
    # Lagging = more than coalesce_after events were published while our last write was in progress:
    # the client is the bottleneck, so merge. Events that were already there when a write started
    # (a late joiner's replay, a burst from the broker) are history, sent event by event.
    lagging = False
    # A reader that was following a running stream gets its backlog merged when the stream fails, so the
    # notice is not stuck behind it; one that joins a finished stream replays it event by event.
    live = not stream.finished
    sub = Subscription(transport, asyncio.current_task(), relay, standby, cursor=after + 1, reader=reader)
    stream.add_follower(sub)
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

    def held() -> int:  # what this reader may read: a standby reads what is not committed yet too
        return stream.next_seq if standby else len(stream.events)

    beyond_until = time.monotonic() + BEYOND_WAIT_S if sub.cursor > held() else None
    try:
        if beyond_until is not None:
            if stream.continued_at is not None and sub.cursor > stream.continued_at:
                raise RolledBack(sub.cursor, stream.continued_at)
            if not stream.mirrored and sub.cursor > stream.next_seq:
                if stream.finished:  # its own whole log is shorter: nothing can bring it there
                    raise RolledBack(sub.cursor, stream.next_seq)
                # its own running stream: its log grows to the point (a client may resume ahead of what it
                # read, as `starting_after` does right after creating a background response); no deadline
                beyond_until = None
        while True:
            sub.waiter.clear()
            if turn is not None and sub.cursor < held():
                await turn()  # before the checks: the log may have moved (or rolled back) meanwhile
            if sub.rolled_back is not None:
                raise RolledBack(sub.cursor, sub.rolled_back)
            events = stream.events + stream.pending if standby and stream.pending else stream.events
            if sub.cursor < len(events):
                batch = policy.plan(events, sub.cursor, lagging, live and stream.state in ("error", "cancelled"),
                                    merge)
                sub.cursor = batch[-1].seq + 1
                head = len(stream.events)
                await timed(write(batch))
                lagging = len(stream.events) - head > policy.coalesce_after
                continue
            lagging = False
            if sub.cursor > len(stream.events) and stream.over and stream.state in ("done", "cancelled"):
                raise RolledBack(sub.cursor, len(stream.events))  # a normal end short of what it read
            if stream.over or stream.paused or (standby and stream.finished):
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
                if beyond_until is None:
                    await sub.waiter.wait()
                else:
                    async with asyncio.timeout_at(asyncio.get_running_loop().time()
                                                  + max(0.0, beyond_until - time.monotonic())):
                        await sub.waiter.wait()
            except TimeoutError:
                raise RolledBack(sub.cursor, len(stream.events)) from None
            finally:
                sub.parked = False
            if beyond_until is not None and sub.cursor <= held():
                beyond_until = None  # the log reached it
    finally:
        stream.remove_follower(sub)
        watchdog.remove(sub)
