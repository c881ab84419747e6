"""Fan-out across gateway replicas through Redis Streams (``--broker redis://…``).

The gateway that runs a generation (its *owner*) writes the Redis stream ``tokenfan:s:<id>``: a header
before the stream's id is handed out, one entry per event, then an end entry (records and keys in
:mod:`gateway.broker_codec`). Any other replica asked for a stream it does not hold builds a local
*mirror*: a :class:`Stream` in its own hub fed by ``XREAD`` from the start of the Redis stream, so
replay, resume, coalescing and slow readers work the same on every replica.

Faults, and what each side does:

- **Redis unreachable.** New work (:meth:`Broker.created`, :meth:`Broker.mirror`,
  :meth:`Broker.cancel_remote`) raises 503 ``broker_unavailable`` with ``Retry-After``. The owner's
  own readers are not affected: its log is in memory, so nothing is queued for Redis meanwhile
  (the stream is only marked *dirty*). Once Redis answers, every dirty stream is *repaired*: the owner
  reads the last entry Redis holds and writes what follows from its log, or the whole stream again if
  the key is gone (a restart without persistence). Mirrors reconnect with backoff and read again from
  the start, placing events by ``seq``: repeats are skipped, a hole ends the stream with
  ``stream_lost``, never with a normal end.
- **Owner gone.** Every gateway refreshes a lease key. A mirror that sees no new entry for
  ``idle_timeout`` (``--broker-idle-timeout``) checks its owner's lease: while the owner lives, any
  quiet gap is fine (a slow prefill, a queue); when the lease has expired (checked twice) the mirror
  ends with ``owner_lost`` and writes that end to Redis, so later readers get it at once. A mirror
  that cannot reach Redis for ``idle_timeout`` ends with ``broker_unavailable``.
- **Lost records.** Events are written with ``XADD NOMKSTREAM``, so a key is never re-created without
  its header: a missing key makes the owner rewrite the stream. A key without a header answers 410
  ``stream_lost``; an end that counts more events than the mirror got ends with ``stream_lost``.
- **Cancel.** ``DELETE`` on a replica that does not own the stream is published on
  ``tokenfan:cancel`` with a reply key; every listening gateway answers yes (it ran the stream and
  cancelled it) or no, so :meth:`Broker.cancel_remote` returns the truth. The listener resubscribes
  after any error.

Blocking reads (``XREAD BLOCK``, ``BLPOP``) run on their own connection pool whose socket timeout is
longer than the block time: with redis-py's default 5 s socket timeout a quiet ``XREAD`` would fail
inside a healthy read. Every mirror exit finishes the stream before :meth:`StreamHub.mark_finished`,
so a mirror never blocks eviction.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway import broker_codec as codec
from gateway.broker_codec import BrokerTimings
from gateway.errors import APIError
from gateway.streams import Event, Stream, StreamHub, encode_event

log = logging.getLogger(__name__)

KNOWN_TTL_S = 24 * 3600  # the 410-vs-404 marker, and the bound on a key whose owner died mid-stream
ACK_TTL_S = 30
REDIS_ERRORS = (RedisError, OSError, TimeoutError)  # redis-py's errors; sockets; asyncio timeouts


def broker_unavailable(exc: BaseException) -> APIError:
    return APIError(503, f"The stream broker (Redis) is unavailable ({type(exc).__name__}: {exc}); retry shortly.",
                    type="server_error", code="broker_unavailable", retry_after=1.0)


def stream_lost(stream_id: str, detail: str) -> APIError:
    return APIError(502, f"Stream {stream_id} is incomplete in the broker: {detail}.", type="server_error",
                    code="stream_lost")


def mirror_closed() -> APIError:
    return APIError(503, "This gateway stopped mirroring the stream; resume with Last-Event-ID on another replica.",
                    type="server_error", code="mirror_closed", retry_after=1.0)


class Backoff:
    """Reconnect delays: doubling from ``first`` up to ``cap``, each drawn from [step/2, step] so replicas
    do not reconnect in lockstep; :meth:`reset` after a success."""

    def __init__(self, cap: float, first: float = 0.05) -> None:
        self.cap, self.first, self._n = cap, first, 0

    def next(self) -> float:
        delay = min(self.cap, self.first * 2 ** self._n)
        self._n += 1
        return random.uniform(delay / 2, delay)

    def reset(self) -> None:
        self._n = 0


async def stop_tasks(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel until done: redis-py sends with ``asyncio.wait_for``, which on Python 3.11 drops a
    cancellation that arrives as the send completes, so one ``cancel()`` may not stop a task."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.1)


def cancel_requested() -> bool:
    """Whether this task was asked to stop, even if redis-py swallowed the CancelledError (see
    :func:`stop_tasks`): every loop here checks it, so one ``cancel()`` always ends it."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class Broker:
    """One gateway's link to Redis: publishing its streams, mirroring others', forwarding cancels.

    ``local_cancel(stream_id)`` cancels a generation this gateway runs and says whether it did.
    """

    def __init__(self, url: str, hub: StreamHub, *, idle_timeout: float, local_cancel: Callable[[str], bool],
                 timings: BrokerTimings | None = None) -> None:
        self.url = url
        self.hub = hub
        self.idle_timeout = idle_timeout
        self.local_cancel = local_cancel
        self.t = t = timings or BrokerTimings()
        self.gateway_id = uuid.uuid4().hex[:16]
        # One immediate retry, on a new connection: after a Redis restart every pooled connection is
        # stale and fails once. Beyond that we retry ourselves, with backoff, where it is safe.
        once = Retry(NoBackoff(), 1)
        self._redis: Any = Redis.from_url(url, socket_timeout=t.op_timeout, socket_connect_timeout=t.op_timeout,
                                          retry=once)
        self._blocking: Any = Redis.from_url(url, socket_connect_timeout=t.op_timeout, retry=once)
        # set after parsing, so a socket_timeout in the URL cannot undercut the block time
        self._blocking.connection_pool.connection_kwargs["socket_timeout"] = t.block + t.op_timeout
        # owner side: (stream id, fields, seconds to expire the key after this entry or None)
        self._pending: list[tuple[str, codec.Fields, int | None]] = []
        self._dirty: set[str] = set()  # own streams Redis may be behind on: repaired from the log
        self._up = True
        self._wake = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []
        self._puts: set[asyncio.Task[None]] = set()  # transcript writes in flight
        self._mirrors: set[asyncio.Task[None]] = set()
        self._closing = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the publisher, the lease and the cancel listener; a Redis that is down is only logged
        (fan-out work answers 503 until it is back; everything else is unaffected)."""
        try:
            await self._redis.ping()
            log.info("broker: Redis Streams at %s (gateway id %s)", redact(self.url), self.gateway_id)
        except REDIS_ERRORS as exc:
            self._up = False
            log.error("broker: Redis at %s is not reachable (%s); fan-out streams answer 503 until it is",
                      redact(self.url), exc)
        for name, coro in (("broker-publisher", self._run_publisher()), ("broker-lease", self._run_lease()),
                           ("broker-cancels", self._run_cancels())):
            self._background.append(asyncio.create_task(coro, name=name))

    async def close(self) -> None:
        """Stop; the last entries (the ends written at shutdown) get one bounded attempt."""
        self._closing = True
        await stop_tasks(self._background)
        await stop_tasks(self._puts)
        with contextlib.suppress(*REDIS_ERRORS):
            async with asyncio.timeout(self.t.op_timeout * 2):
                await self._flush_once()
                await self._redis.delete(codec.lease_key(self.gateway_id))
        await stop_tasks(self._mirrors)
        await self._redis.aclose()
        await self._blocking.aclose()

    # -- owner side --------------------------------------------------------------------------

    async def created(self, stream: Stream) -> None:
        """Announce a new stream before its id is handed out; APIError 503 if Redis does not take it."""
        key = codec.stream_key(stream.id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(key, codec.encode_header(stream.endpoint, stream.model, self.gateway_id))
        pipe.expire(key, KNOWN_TTL_S)  # bounded even if this owner dies mid-stream
        pipe.set(codec.known_key(stream.id), b"1", ex=KNOWN_TTL_S)
        try:
            await pipe.execute()
        except REDIS_ERRORS as exc:
            log.warning("broker: announcing stream %s failed: %s", stream.id, exc)
            raise broker_unavailable(exc) from exc

    def published(self, stream: Stream, event: Event) -> None:
        """Queue one event of a local stream for the next pipeline."""
        self._queue(stream.id, codec.encode_event(event.seq, event.chunk, event.text, event.finish_reason), None)

    def ended(self, stream: Stream) -> None:
        """Queue the end of a local stream; its key then expires with the stream's retention."""
        self._queue(stream.id, self._end_fields(stream), max(1, int(self.hub.retention.finished_ttl)))

    def _queue(self, stream_id: str, fields: codec.Fields, expire_s: int | None) -> None:
        if self._up and stream_id not in self._dirty and len(self._pending) < self.t.max_pending:
            self._pending.append((stream_id, fields, expire_s))
        else:
            self._dirty.add(stream_id)  # Redis is behind on it: the repair writes it from the log
        self._wake.set()

    @staticmethod
    def _end_fields(stream: Stream) -> codec.Fields:
        if not stream.finished:  # the pump died without an end state: never tell mirrors it is done
            return codec.encode_end("error", len(stream.events),
                                    stream_lost(stream.id, "its generation ended without an end state"))
        return codec.encode_end(stream.state, len(stream.events), stream.error)  # type: ignore[arg-type]

    async def _run_publisher(self) -> None:
        while not (self._closing or cancel_requested()):
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._flush_once()
            except REDIS_ERRORS as exc:
                log.warning("broker: Redis unreachable (%s); publishing resumes from each stream's log once it "
                            "is back", exc)
                await self._outage()

    async def _outage(self) -> None:
        """Wait for Redis with backoff. Meanwhile nothing is queued: streams are only marked dirty and
        repaired from their logs afterwards, so memory does not grow with the outage."""
        self._up = False
        self._dirty.update(sid for sid, _, _ in self._pending)
        self._pending.clear()
        backoff = Backoff(self.t.backoff_max)
        while not (self._closing or cancel_requested()):
            await asyncio.sleep(backoff.next())
            try:
                await self._redis.ping()
            except REDIS_ERRORS:
                continue
            log.warning("broker: Redis reachable again; repairing %d streams", len(self._dirty))
            self._up = True
            self._wake.set()
            return

    async def _flush_once(self) -> None:
        """Send what is queued, then repair dirty streams; raises the Redis error if either fails."""
        batch, self._pending = self._pending, []
        if batch:
            try:
                missing = await self._send(batch)
            except BaseException:
                self._dirty.update(sid for sid, _, _ in batch)
                raise
            if missing:
                log.warning("broker: %d streams were missing in Redis; writing them again", len(missing))
                self._dirty.update(missing)
        if self._dirty:
            await self._repair()

    async def _send(self, batch: list[tuple[str, codec.Fields, int | None]]) -> set[str]:
        """Pipeline the batch; the ids of streams whose key was gone (``NOMKSTREAM`` wrote nothing)."""
        pipe = self._redis.pipeline(transaction=False)
        xadds: list[tuple[int, str]] = []
        n = 0
        for stream_id, fields, expire_s in batch:
            key = codec.stream_key(stream_id)
            pipe.xadd(key, fields, nomkstream=True)
            xadds.append((n, stream_id))
            n += 1
            if expire_s is not None:
                pipe.expire(key, expire_s)
                pipe.set(codec.known_key(stream_id), b"1", ex=KNOWN_TTL_S)
                n += 2
        results = await pipe.execute()
        return {sid for i, sid in xadds if results[i] is None}

    async def _repair(self) -> None:
        """Bring Redis level with the log of every dirty stream (idempotent: readers skip repeats)."""
        ids = list(self._dirty)
        self._dirty.clear()
        repaired = set(ids)
        self._pending = [e for e in self._pending if e[0] not in repaired]  # the repair writes these too
        try:
            for i in range(0, len(ids), 256):
                part = ids[i:i + 256]
                pipe = self._redis.pipeline(transaction=False)
                for sid in part:
                    pipe.xrevrange(codec.stream_key(sid), count=1)
                lasts = await pipe.execute()
                pipe = self._redis.pipeline(transaction=False)
                queued = sum(self._repair_one(pipe, sid, last[0][1] if last else None)
                             for sid, last in zip(part, lasts, strict=True))
                if queued:
                    await pipe.execute()
        except BaseException:
            self._dirty.update(ids)
            raise

    def _repair_one(self, pipe: Any, stream_id: str, last_fields: codec.Fields | None) -> int:
        """Queue on ``pipe`` what Redis lacks of one stream, given its last entry there; how many commands."""
        key = codec.stream_key(stream_id)
        last: codec.Entry | None = None
        if last_fields is not None:
            try:
                last = codec.decode(last_fields)
            except codec.CodecError:
                last = None  # unreadable: write every event again, readers skip the repeats
        if isinstance(last, codec.EndEntry):
            return 0
        stream = self.hub.streams.get(stream_id)
        if stream is None or stream.mirrored:
            if last_fields is None:
                return 0
            # evicted here before its end reached Redis: end it there explicitly, never leave it open
            err = stream_lost(stream_id, "its owner dropped it before the broker had its end")
            pipe.xadd(key, codec.encode_end("error", None, err), nomkstream=True)
            return 1
        n = 0
        start = last.seq + 1 if isinstance(last, codec.EventEntry) else 0
        if last_fields is None:  # the key is gone (a Redis restart without persistence): write it anew
            pipe.xadd(key, codec.encode_header(stream.endpoint, stream.model, self.gateway_id))
            pipe.set(codec.known_key(stream_id), b"1", ex=KNOWN_TTL_S)
            start, n = 0, 2
        for ev in stream.events[start:]:
            pipe.xadd(key, codec.encode_event(ev.seq, ev.chunk, ev.text, ev.finish_reason), nomkstream=True)
            n += 1
        if stream.finished:
            pipe.xadd(key, self._end_fields(stream), nomkstream=True)
            ttl = self.hub.retention.finished_ttl
            if stream.finished_at is not None:
                ttl -= time.monotonic() - stream.finished_at
            pipe.expire(key, max(1, int(ttl)))
            n += 2
        elif last_fields is None:
            pipe.expire(key, KNOWN_TTL_S)
            n += 1
        return n

    def _repair_all(self) -> None:
        self._dirty.update(s.id for s in self.hub.streams.values() if not s.mirrored)
        self._wake.set()

    async def _run_lease(self) -> None:
        """Refresh this gateway's lease; a lease found missing means Redis lost its data (or was out of
        reach), so every local stream is checked and repaired."""
        ttl_ms = int(self.t.lease_ttl * 1000)
        held = False
        while not (self._closing or cancel_requested()):
            try:
                previous = await self._redis.set(codec.lease_key(self.gateway_id), b"1", px=ttl_ms, get=True)
                if previous is None or not held:
                    if held:
                        log.warning("broker: Redis lost this gateway's lease (restarted?); repairing local streams")
                    self._repair_all()
                held = True
            except REDIS_ERRORS as exc:
                if held:
                    log.warning("broker: refreshing the lease failed: %s", exc)
                held = False
            await asyncio.sleep(self.t.lease_interval)

    # -- cancels -----------------------------------------------------------------------------

    def put_transcript(self, response_id: str, data: bytes, ttl: float) -> None:
        """Keep a finished response's transcript in Redis for ``ttl`` s, so any replica can continue it."""

        async def put() -> None:
            try:
                await self._redis.set(codec.transcript_key(response_id), data, px=max(1, int(ttl * 1000)))
            except REDIS_ERRORS as exc:
                log.warning("transcript of %s not stored in Redis (%s): previous_response_id works on this "
                            "replica only", response_id, exc)

        task = asyncio.create_task(put(), name=f"transcript-{response_id}")
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    async def transcript(self, response_id: str) -> bytes | None:
        try:
            data = await self._redis.get(codec.transcript_key(response_id))
        except REDIS_ERRORS as exc:
            raise broker_unavailable(exc) from exc
        return bytes(data) if data is not None else None

    async def cancel_remote(self, stream_id: str) -> bool:
        """Ask the replica that runs the stream to cancel it; True once it confirms it did.

        False if no gateway claims it within ``cancel_timeout`` (its owner is gone, or the stream
        ended meanwhile). APIError 503 if Redis is unreachable."""
        req = codec.CancelRequest(stream_id, codec.ack_key(uuid.uuid4().hex))
        deadline = time.monotonic() + self.t.cancel_timeout
        try:
            while True:
                listeners = await self._redis.publish(codec.CANCEL_CHANNEL, codec.encode_cancel(req))
                answers = 0
                while answers < listeners:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    reply = await self._blocking.blpop([req.reply_to], timeout=max(0.01, min(left, self.t.block)))
                    if reply is None:
                        continue
                    if reply[1] == codec.ACK_YES:
                        return True
                    answers += 1
                # Nobody holds it right now. The owner's listener may be resubscribing after a Redis
                # restart: ask again while the stream still runs here and time is left.
                mirror = self.hub.streams.get(stream_id)
                if mirror is None or mirror.finished or time.monotonic() + 0.25 >= deadline:
                    return False
                await asyncio.sleep(0.25)
        except REDIS_ERRORS as exc:
            raise broker_unavailable(exc) from exc

    async def _run_cancels(self) -> None:
        backoff = Backoff(self.t.backoff_max)
        lost = False
        while not (self._closing or cancel_requested()):
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(codec.CANCEL_CHANNEL)
                if lost:
                    log.warning("broker: cancel listener resubscribed")
                lost = False
                backoff.reset()
                while not (self._closing or cancel_requested()):
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=self.t.block)
                    if msg is not None and msg.get("type") == "message":
                        await self._answer_cancel(msg["data"])
            except REDIS_ERRORS as exc:
                if not lost:
                    log.warning("broker: cancel listener lost Redis (%s); resubscribing", exc)
                lost = True
            finally:
                with contextlib.suppress(*REDIS_ERRORS):
                    await pubsub.aclose()
            await asyncio.sleep(backoff.next())

    async def _answer_cancel(self, data: bytes) -> None:
        try:
            req = codec.decode_cancel(data)
        except codec.CodecError as exc:
            log.warning("broker: %s", exc)
            return
        held = self.local_cancel(req.stream_id)
        if held:
            log.info("broker: cancelled stream %s for another replica", req.stream_id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.rpush(req.reply_to, codec.ACK_YES if held else codec.ACK_NO)
        pipe.expire(req.reply_to, ACK_TTL_S)
        await pipe.execute()

    # -- mirror side -------------------------------------------------------------------------

    async def mirror(self, stream_id: str) -> Stream:
        """A local stream fed from Redis; APIError 404 / 410 (expired, or its header is lost) / 503."""
        existing = self.hub.streams.get(stream_id)
        if existing is not None:
            return existing
        try:
            first = await self._redis.xrange(codec.stream_key(stream_id), count=1)
            known = bool(first) or bool(await self._redis.exists(codec.known_key(stream_id)))
        except REDIS_ERRORS as exc:
            raise broker_unavailable(exc) from exc
        if not first:
            if known:
                raise APIError(410, f"Stream {stream_id} is no longer retained.", code="stream_expired", param="id")
            raise APIError(404, f"No stream with id {stream_id}.", code="stream_not_found", param="id")
        try:
            header = codec.decode(first[0][1])
        except codec.CodecError:
            header = None
        if not isinstance(header, codec.Header):
            raise APIError(410, f"Stream {stream_id} cannot be served: its header is missing in the broker.",
                           code="stream_lost", param="id")
        existing = self.hub.streams.get(stream_id)  # created meanwhile by a concurrent subscriber
        if existing is not None:
            return existing
        self.hub.check_capacity()
        stream = self.hub.create(header.endpoint, header.model, stream_id=stream_id)
        stream.mirrored = True
        task = asyncio.create_task(self._feed(stream, header.owner), name=f"mirror-{stream_id}")
        self._mirrors.add(task)
        task.add_done_callback(lambda t: self._feed_done(t, stream))
        stream.task = task
        return stream

    def _feed_done(self, task: asyncio.Task[None], stream: Stream) -> None:
        """However the feed ended (even cancelled before it ran), the stream is finished, then retained."""
        self._mirrors.discard(task)
        if not stream.finished:
            stream.finish("error", mirror_closed())
        self.hub.mark_finished(stream)

    async def _feed(self, stream: Stream, owner: str) -> None:
        """Redis -> the mirror's log, until an end; every way out finishes the stream (then
        :meth:`_feed_done` starts its retention)."""
        key = codec.stream_key(stream.id)
        last_id: bytes | str = b"0-0"
        backoff = Backoff(self.t.backoff_max)
        idle_until = time.monotonic() + self.idle_timeout
        unreachable: BaseException | None = None  # the last Redis error, while reads fail
        misses = 0  # idle checks in a row that found the owner's lease missing
        ending: APIError | None = None
        try:
            while not (self._closing or cancel_requested()):
                wait = idle_until - time.monotonic()
                if wait <= 0:
                    ending, misses, recheck = await self._idle(stream, owner, unreachable, misses)
                    if ending is not None:
                        return
                    idle_until = time.monotonic() + recheck
                    continue
                try:
                    reply = await self._blocking.xread({key: last_id}, count=512,
                                                       block=max(1, int(min(wait, self.t.block) * 1000)))
                except REDIS_ERRORS as exc:
                    if unreachable is None:
                        log.info("broker: mirror of %s lost Redis (%s); reconnecting", stream.id, exc)
                    unreachable = exc
                    # Read again from the start once back: the owner may have rewritten the stream
                    # (a restart without persistence), and events are placed by seq, repeats skipped.
                    last_id = b"0-0"
                    await asyncio.sleep(backoff.next())
                    continue
                if unreachable is not None:
                    log.info("broker: mirror of %s reconnected", stream.id)
                    unreachable = None
                    backoff.reset()
                if not reply:
                    continue
                idle_until = time.monotonic() + self.idle_timeout
                misses = 0
                for entry_id, fields in reply[0][1]:
                    last_id = entry_id
                    ending = self._apply(stream, fields)
                    if ending is not None or stream.finished:
                        return
        except asyncio.CancelledError:
            ending = mirror_closed()
            raise
        except Exception as exc:  # a bug here must still end the stream explicitly
            log.exception("broker: mirror of %s failed", stream.id)
            ending = stream_lost(stream.id, f"its mirror failed ({type(exc).__name__})")
        finally:
            if not stream.finished:
                stream.finish("error", ending or mirror_closed())

    def _apply(self, stream: Stream, fields: codec.Fields) -> APIError | None:
        """Apply one entry; an error that must end the stream, or None (the stream may now be finished)."""
        try:
            entry = codec.decode(fields)
        except codec.CodecError as exc:
            return stream_lost(stream.id, str(exc))
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
            return stream_lost(stream.id, f"its end counts {entry.events} events, the broker had {have}")
        if entry.state == "error" and entry.error is None:
            return stream_lost(stream.id, "it ended with an error the broker did not record")
        stream.finish(entry.state, entry.error)
        return None

    async def _idle(self, stream: Stream, owner: str, unreachable: BaseException | None,
                    misses: int) -> tuple[APIError | None, int, float]:
        """No entry for ``idle_timeout``: (the ending or None, lease misses so far, seconds to the next check).

        Redis out of reach all that time ends the mirror with ``broker_unavailable``. While the owner's
        lease is held the stream is only quiet: the next check is when that lease would expire unless
        refreshed, so a quiet mirror costs one ``PTTL`` per ``lease_ttl``. A lease missing twice,
        ``lease_interval`` apart (a restarted Redis gives the owner that long to write it again),
        means ``owner_lost``, which is also written to Redis so that later readers get it at once."""
        if unreachable is not None:
            return APIError(503, f"The stream broker was unreachable for {self.idle_timeout:g}s ({unreachable}).",
                            type="server_error", code="broker_unavailable", retry_after=1.0), misses, 0.0
        try:
            ttl_ms = int(await self._redis.pttl(codec.lease_key(owner))) if owner else -2
        except REDIS_ERRORS:
            return None, misses, self.t.lease_interval  # the next read finds out whether Redis is gone
        if ttl_ms >= 0:  # held: look again just after it would expire
            return None, 0, ttl_ms / 1000 + 0.05
        if ttl_ms == -1:  # held without an expiry (set by hand)
            return None, 0, self.idle_timeout
        if owner and misses == 0:
            return None, 1, self.t.lease_interval + 0.25
        err = APIError(502, f"The gateway running stream {stream.id} is gone: no entry for "
                            f"{self.idle_timeout:g}s and its lease expired.", type="server_error", code="owner_lost")
        key = codec.stream_key(stream.id)
        with contextlib.suppress(*REDIS_ERRORS):
            pipe = self._redis.pipeline(transaction=False)
            pipe.xadd(key, codec.encode_end("error", len(stream.events), err), nomkstream=True)
            pipe.expire(key, max(1, int(self.hub.retention.finished_ttl)))
            await pipe.execute()
        return err, misses, 0.0
