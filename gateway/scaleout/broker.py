"""Fan-out across gateway replicas through Redis Streams (``--broker redis://…``).

The gateway that runs a generation (its *owner*) writes the Redis stream ``tokenfan:s:<id>``: a header
before the stream's id is handed out, one record per event, then an end record (records and keys in
:mod:`gateway.scaleout.broker_codec`). Any other replica asked for a stream it does not hold mirrors it
(:mod:`gateway.scaleout.mirror`, through :class:`~gateway.scaleout.redis_link.RedisLink`), so replay, resume, coalescing
and slow readers work the same on every replica.

:class:`Broker` is the owner's side, the publisher, and wires the other parts (:mod:`gateway.scaleout.redis_lease`, :mod:`~gateway.scaleout.redis_cancel`, :mod:`~gateway.scaleout.redis_transcripts`, :mod:`~gateway.scaleout.redis_link`:
the owner lease, the cancel RPC, the transcripts, the mirrors' link). Faults, and what each side does:

- **Redis unreachable.** New work (:meth:`Broker.created`, mirroring, a remote cancel) raises 503
  ``broker_unavailable`` with ``Retry-After``. The owner's own readers are not affected: its log is in
  memory, so nothing is queued for Redis meanwhile (the stream is only marked *dirty*). Once Redis
  answers, every dirty stream is *repaired*: the owner reads the last record Redis holds and writes what
  follows from its log, or the whole stream again if the key is gone (a restart without persistence).
  MirrorSet reconnect with backoff and read again from the start, placing events by ``seq``.
- **Owner gone.** Every gateway refreshes a lease key; a quiet mirror ends with ``owner_lost`` only
  when its owner's lease is gone (:class:`gateway.scaleout.mirror.Idle`), and writes that end to Redis so later
  readers get it at once.
- **Lost records.** Events are written with ``XADD NOMKSTREAM``, so a key is never re-created without
  its header: a missing key makes the owner rewrite the stream. A key without a header answers 410
  ``stream_lost``; a hole or a short end ends a mirror with ``stream_lost``, never with a normal end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from gateway.config import BrokerTimings
from gateway.core.streams import Event, Stream, StreamHub
from gateway.errors import stream_lost
from gateway.scaleout import broker_codec as codec
from gateway.scaleout.mirror import MirrorSet, RemoteStreamsByMirror, stop_tasks
from gateway.scaleout.redis_cancel import CancelRpc
from gateway.scaleout.redis_lease import OwnerLease
from gateway.scaleout.redis_link import RedisLink
from gateway.scaleout.redis_support import (
    KNOWN_TTL_S,
    REDIS_ERRORS,
    Backoff,
    broker_unavailable,
    cancel_requested,
    redact,
)
from gateway.scaleout.redis_transcripts import RedisTranscripts

__all__ = ["Backoff", "Broker", "BrokerTimings", "redact"]

log = logging.getLogger(__name__)

HANDOVER_SETTLE_S = 0.1  # SIGTERM: how long the other workers of a stopping server get to say they drain too


class Broker(RemoteStreamsByMirror):
    """One gateway's link to Redis: publishing its streams (:class:`gateway.core.ports.Publisher`), and
    mirrors, cancels and transcripts of other replicas' (:class:`gateway.core.ports.RemoteStreams`).

    ``local_cancel(stream_id)`` cancels a generation this gateway runs and says whether it did.
    """

    def __init__(self, url: str, hub: StreamHub, *, idle_timeout: float, local_cancel: Callable[[str], bool],
                 timings: BrokerTimings | None = None) -> None:
        self.url = url
        self.hub = hub
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
        self.lease = OwnerLease(self._redis, self.gateway_id, t, on_lost=self._repair_all)
        self.cancels = CancelRpc(self._redis, self._blocking, t, local_cancel, self._mirror_running)
        self.transcripts = RedisTranscripts(self._redis)
        link = RedisLink(self._redis, self._blocking, t, self.cancels, lambda: hub.retention.finished_ttl)
        self.mirrors = MirrorSet(hub, link, idle_timeout=idle_timeout, recheck=t.lease_interval,
                               on_owner_lost=link.record_owner_lost, lease_check=t.lease_ttl)
        # owner side: (stream id, fields, seconds to expire the key after this entry or None)
        self._pending: list[tuple[str, codec.Fields, int | None]] = []
        self._dirty: set[str] = set()  # own streams Redis may be behind on: repaired from the log
        self._up = True
        self._wake = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []
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
        for name, coro in (("broker-publisher", self._run_publisher()), ("broker-lease", self.lease.run()),
                           ("broker-cancels", self.cancels.listen())):
            self._background.append(asyncio.create_task(coro, name=name))

    async def successor(self) -> bool:
        """Mark this gateway draining, give a server's other workers (stopped by the same signal) a moment to
        do the same, then: whether another gateway serves (see :meth:`OwnerLease.others_serving`)."""
        try:
            async with asyncio.timeout(self.t.op_timeout * 2):
                await self.lease.drain()
                await asyncio.sleep(HANDOVER_SETTLE_S)
                return await self.lease.others_serving() > 0
        except (TimeoutError, *REDIS_ERRORS):
            return False

    async def hand_over(self) -> None:
        """Before this gateway exits with streams other replicas adopt: what is queued reaches Redis, then the
        lease goes (no refresh after it), so their mirrors find it missing at their next check."""
        for task in self._background:
            if task.get_name() == "broker-lease":
                task.cancel()
        with contextlib.suppress(*REDIS_ERRORS):
            async with asyncio.timeout(self.t.op_timeout * 2):
                await self._flush_once()
                await self.lease.release()

    async def close(self) -> None:
        """Stop; the last records (the ends written at shutdown) get one bounded attempt."""
        self._closing = True
        await stop_tasks(set(self._background))
        await stop_tasks(self.transcripts.puts)
        with contextlib.suppress(*REDIS_ERRORS):
            async with asyncio.timeout(self.t.op_timeout * 2):
                await self._flush_once()
                await self.lease.release()
        await self.mirrors.close()
        await self._redis.aclose()
        await self._blocking.aclose()

    # -- other replicas' transcripts (mirror and cancel_remote: RemoteStreamsByMirror) ----------------------

    async def transcript(self, response_id: str) -> bytes | None:
        return await self.transcripts.get(response_id)

    def put_transcript(self, response_id: str, data: bytes, ttl: float) -> None:
        self.transcripts.put(response_id, data, ttl)

    def _mirror_running(self, stream_id: str) -> bool:
        s = self.hub.streams.get(stream_id)
        return s is not None and not s.finished

    # -- this gateway's streams (gateway.core.ports.Publisher) --------------------------------------------------------------------------

    async def created(self, stream: Stream) -> None:
        """Announce a new stream before its id is handed out; APIError 503 if Redis does not take it."""
        key = codec.stream_key(stream.id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(key, codec.encode_header_of(stream, self.gateway_id))
        pipe.expire(key, KNOWN_TTL_S)  # bounded even if this owner dies mid-stream
        pipe.set(codec.known_key(stream.id), b"1", ex=KNOWN_TTL_S)
        try:
            await pipe.execute()
        except REDIS_ERRORS as exc:
            log.warning("broker: announcing stream %s failed: %s", stream.id, exc)
            raise broker_unavailable(exc) from exc

    async def claim(self, stream_id: str, owner: str) -> bool:
        """Take over a stream whose owner ``owner`` is gone: True for exactly one gateway (the one whose
        ``SET NX`` of the stream's adoption key for that owner succeeds)."""
        try:
            return bool(await self._redis.set(codec.adopt_key(stream_id, owner), self.gateway_id.encode(), nx=True,
                                              ex=KNOWN_TTL_S))
        except REDIS_ERRORS as exc:
            log.warning("broker: claiming stream %s failed: %s", stream_id, exc)
            return False

    def adopted(self, stream: Stream) -> None:
        """This gateway owns ``stream`` from now on: its header again, naming this gateway (other replicas'
        mirrors then check this gateway's lease), then its events as they come."""
        self._queue(stream.id, codec.encode_header_of(stream, self.gateway_id), None)

    def published(self, stream: Stream, event: Event) -> None:
        """Queue one event of a local stream for the next pipeline."""
        self._queue(stream.id, codec.encode_event_of(event), None)

    def ended(self, stream: Stream) -> None:
        """Queue the end of a local stream; its key then expires with the stream's retention."""
        self._queue(stream.id, codec.encode_end_of(stream), max(1, int(self.hub.retention.finished_ttl)))

    def _queue(self, stream_id: str, fields: codec.Fields, expire_s: int | None) -> None:
        if self._up and stream_id not in self._dirty and len(self._pending) < self.t.max_pending:
            self._pending.append((stream_id, fields, expire_s))
        else:
            self._dirty.add(stream_id)  # Redis is behind on it: the repair writes it from the log
        self._wake.set()

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
        if stream is not None and stream.state == "moved":
            return 0  # handed over: its adopter writes the rest
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
            pipe.xadd(key, codec.encode_header_of(stream, self.gateway_id))
            pipe.set(codec.known_key(stream_id), b"1", ex=KNOWN_TTL_S)
            start, n = 0, 2
        for ev in stream.events[start:]:
            pipe.xadd(key, codec.encode_event_of(ev), nomkstream=True)
            n += 1
        if stream.finished:
            pipe.xadd(key, codec.encode_end_of(stream), nomkstream=True)
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
