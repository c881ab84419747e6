"""Fan-out across gateway replicas through Redis Streams (``--broker redis://…``).

``--broker`` is one Redis, a Sentinel-managed primary or a Redis Cluster (:mod:`gateway.scaleout.redis_clients`).
The gateway that runs a generation (its *owner*) writes the Redis stream ``tokenfan:{<id>}:s``: a header
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
- **Partitions** (docs/failures.md). Every write carries the owner's epoch and Redis refuses a stale one
  (:mod:`gateway.scaleout.redis_fence`): a gateway whose stream another replica adopted meanwhile gives it up
  (it ends ``moved`` here, its readers resume where it goes on). Its readers never saw anything Redis does not
  hold: a listed stream is *gated* (:meth:`gateway.core.streams.Stream.commit`), its events reach readers
  once Redis took them. A gateway whose lease went unconfirmed fences itself first (:mod:`~gateway.scaleout.redis_lease`).
- **Failover.** Where the primary has replicas, "Redis took them" means its replicas acknowledged them too
  (``WAIT`` after each pipeline, :mod:`gateway.scaleout.redis_replicas`), so a promoted replica holds what any
  reader here read. Never splice: every append names the log it continues and Redis refuses it on a log of
  another length (:mod:`gateway.scaleout.redis_fence`); after any outage every stream of this gateway is
  compared with its log and written back before anything new is appended (:meth:`Broker._repair`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import NoScriptError

from gateway.config import BrokerTimings
from gateway.core.delivery import hand_over
from gateway.core.streams import Event, Stream, StreamHub
from gateway.errors import APIError
from gateway.scaleout import broker_codec as codec
from gateway.scaleout import redis_clients
from gateway.scaleout import redis_fence as fence
from gateway.scaleout.broker_codec import Header
from gateway.scaleout.mirror import MirrorSet, RemoteStreamsByMirror, stop_tasks
from gateway.scaleout.redis_cancel import CancelRpc
from gateway.scaleout.redis_lease import OwnerLease
from gateway.scaleout.redis_link import RedisLink
from gateway.scaleout.redis_replicas import Replicas
from gateway.scaleout.redis_support import (
    KNOWN_TTL_S,
    REDIS_ERRORS,
    Backoff,
    broker_full,
    broker_unavailable,
    cancel_requested,
    is_oom,
    redact,
)
from gateway.scaleout.redis_transcripts import RedisTranscripts

__all__ = ["Backoff", "Broker", "BrokerTimings", "redact"]

log = logging.getLogger(__name__)

HANDOVER_SETTLE_S = 0.1  # SIGTERM: how long the other workers of a stopping server get to say they drain too


@dataclass(slots=True)
class _Out:
    """What is queued for one stream until the next pipeline: its records, and what to commit once written."""

    stream: Stream
    records: list[codec.Fields] = field(default_factory=list)
    after: int = 0  # the events the log holds before the records (the fenced append checks it)
    upto: int = 0  # its events below this seq are among the records
    end: bool = False  # so is its end record
    expire_s: int = 0  # the key expires this long after the records (0: not set here)
    header: bool = False  # an adopter's header is among them


class Broker(RemoteStreamsByMirror):
    """One gateway's link to Redis: publishing its streams (:class:`gateway.core.ports.Publisher`), and
    mirrors, cancels and transcripts of other replicas' (:class:`gateway.core.ports.RemoteStreams`).

    ``local_cancel(stream_id)`` cancels a generation this gateway runs and says whether it did.
    ``on_fenced(stream, reason)`` (metrics): this gateway gave up a listed stream (``fenced``: its epoch was
    refused) or sent its readers away (``lease``: it fenced
    itself). ``url``: one Redis, Sentinel or Cluster (:mod:`gateway.scaleout.redis_clients`; ValueError if it is
    none of them), ``credentials``: passwords given outside it."""

    durable = True

    def __init__(self, url: str, hub: StreamHub, *, idle_timeout: float, local_cancel: Callable[[str], bool],
                 timings: BrokerTimings | None = None, on_fenced: Callable[[Stream, str], None] | None = None,
                 credentials: redis_clients.Credentials | None = None) -> None:
        self.url = url
        self.hub = hub
        self.t = t = timings or BrokerTimings()
        self.on_fenced = on_fenced
        self.clients = clients = redis_clients.connect(url, t, credentials)
        self._redis: Any = clients.redis
        self._blocking: Any = clients.blocking
        self.fence = fence.Fence(self._redis)
        self.lease = OwnerLease(clients, t, on_lost=self._repair_all, on_fenced=self._fence_all)
        self.cancels = CancelRpc(clients, t, local_cancel, self._mirror_running)
        self.transcripts = RedisTranscripts(self._redis, self.fence)
        link = RedisLink(clients, t, self.cancels, lambda: hub.retention.finished_ttl, self.fence)
        self.mirrors = MirrorSet(hub, link, idle_timeout=idle_timeout, recheck=t.lease_interval,
                               on_owner_lost=link.record_owner_lost, lease_check=t.lease_ttl,
                               presence_check=t.presence_check or None)
        # (a WAIT's reply must come within the socket timeout: at most half of it)
        self.replicas = Replicas(self._redis, t.replicas, min(t.replica_timeout, t.op_timeout / 2))
        self._pending: dict[str, _Out] = {}  # owner side: by stream id, in the order first queued
        # written and in Redis, not yet acknowledged by its replicas: (upto, end) to commit once they are
        self._unacked: dict[str, tuple[Stream, int, bool]] = {}
        self._owed: dict[str, int] = {}  # adopted streams whose header is not in Redis yet: the events it follows
        self._queued = 0  # records in _pending
        self._dirty: set[str] = set()  # own streams Redis may be behind on: repaired from the log
        self._up = True
        self._wake = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []
        self._closing = False

    @property
    def gateway_id(self) -> str:
        """This gateway's id in Redis (its lease, presence channel and claims): one for the process's life, the
        same after it fenced itself (:mod:`gateway.scaleout.redis_lease`)."""
        return self.lease.gateway_id

    def serving(self) -> bool:
        return self.state() == "ok"

    def state(self) -> str:
        """``"ok"``; ``"full"``: Redis answers but refuses writes for lack of memory (``maxmemory`` with
        ``noeviction``); ``"unavailable"``: this gateway's last write or lease refresh failed, or it fenced
        itself. Anything but ``"ok"``: :meth:`created` refuses at once (``/health``'s ``broker``)."""
        if is_oom(self.lease.error):
            return "full"
        if self._up and not self.lease.fenced and self.lease.error is None:
            return "ok"
        return "unavailable"

    def _refusal(self) -> APIError | None:
        """Why a new listed stream cannot be announced now, or None (see :meth:`state`)."""
        state = self.state()
        if state == "ok":
            return None
        if state == "full":
            return broker_full(self.lease.error or ConnectionError("out of memory"))
        if self.lease.fenced:
            return broker_unavailable(ConnectionError("this gateway's lease is not confirmed"))
        return broker_unavailable(self.lease.error or ConnectionError("Redis did not take this gateway's last write"))

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the publisher, the lease and the cancel listener; a Redis that is down is only logged
        (fan-out work answers 503 until it is back; everything else is unaffected). Bounded by the op timeout:
        a Redis that hangs does not hold the gateway's start."""
        try:
            async with asyncio.timeout(self.t.op_timeout):
                await self._redis.ping()
                await self.fence.load(self._redis)
                await self.replicas.check()
            log.info("broker: Redis Streams at %s (gateway id %s)", self.clients.where(), self.gateway_id)
        except REDIS_ERRORS as exc:
            self._up = False
            log.error("broker: Redis at %s is not reachable (%s); fan-out streams answer 503 until it is",
                      self.clients.where(), exc)
        for name, coro in (("broker-publisher", self._run_publisher()), ("broker-lease", self.lease.run()),
                           ("broker-cancels", self.cancels.listen()),
                           ("broker-primary", self.clients.watch(self._repair_all)),
                           ("broker-replicas", self.replicas.run())):
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
        await self.clients.aclose()

    # -- other replicas' transcripts (mirror and cancel_remote: RemoteStreamsByMirror) ----------------------

    async def transcript(self, response_id: str) -> bytes | None:
        return await self.transcripts.get(response_id)

    def put_transcript(self, response_id: str, data: bytes, ttl: float) -> None:
        stream = self.hub.streams.get(response_id)
        epoch = stream.epoch if stream is not None and not stream.mirrored else 0
        self.transcripts.put(response_id, data, ttl, epoch)

    def _mirror_running(self, stream_id: str) -> bool:
        s = self.hub.streams.get(stream_id)
        return s is not None and not s.finished

    # -- this gateway's streams (gateway.core.ports.Publisher) --------------------------------------------------------------------------

    async def created(self, stream: Stream) -> None:
        """Announce a new stream (its epoch 1) before its id is handed out; APIError 503 ``broker_unavailable``
        (or ``broker_full``: Redis is out of memory) at once while :meth:`state` is not ``"ok"``, else if Redis
        does not take it within the op timeout."""
        refusal = self._refusal()
        if refusal is not None:
            raise refusal
        stream.epoch = 1
        key = codec.stream_key(stream.id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(fence.epoch_key(stream.id), b"1", ex=KNOWN_TTL_S)
        pipe.xadd(key, codec.encode_header_of(stream, self.gateway_id))
        pipe.expire(key, KNOWN_TTL_S)  # bounded even if this owner dies mid-stream
        pipe.set(codec.known_key(stream.id), b"1", ex=KNOWN_TTL_S)
        try:
            async with asyncio.timeout(self.t.op_timeout):
                await pipe.execute()
        except REDIS_ERRORS as exc:
            log.warning("broker: announcing stream %s failed: %s", stream.id, exc)
            raise (broker_full if is_oom(exc) else broker_unavailable)(exc) from exc

    async def claim(self, stream: Stream, header: Header) -> bool:
        """Take over a stream whose owner (``header``'s) is gone: True for exactly one gateway, the one whose
        :func:`~gateway.scaleout.redis_fence.Fence.take` of the owner's epoch succeeds (its new epoch is the
        stream's from now on). A header without an epoch (an older gateway's): ``SET NX`` of an adoption key."""
        try:
            if header.epoch:
                epoch = await self.fence.take(self._redis, stream.id, header.epoch)
                if epoch is None:
                    return False
                stream.epoch = epoch
                return True
            return bool(await self._redis.set(codec.adopt_key(stream.id, header.owner), self.gateway_id.encode(),
                                              nx=True, ex=KNOWN_TTL_S))
        except REDIS_ERRORS as exc:
            log.warning("broker: claiming stream %s failed: %s", stream.id, exc)
            return False

    def adopted(self, stream: Stream) -> None:
        """This gateway owns ``stream`` from now on: its header again, naming this gateway and its epoch (other
        replicas' mirrors then check this gateway's lease), then its events as they come, gated."""
        stream.gated = True
        at = stream.next_seq  # the header names the log it continues (a mirror that held more rolls back)
        self._owed[stream.id] = at
        self._queue(stream, codec.encode_header_of(stream, self.gateway_id, at=at), after=at, header=True)

    def published(self, stream: Stream, event: Event) -> None:
        """Queue one event of a local stream for the next pipeline."""
        self._queue(stream, codec.encode_event_of(event), after=event.seq, upto=event.seq + 1)

    def ended(self, stream: Stream) -> None:
        """Queue the end of a local stream; its key then expires with the stream's retention."""
        self._queue(stream, codec.encode_end_of(stream), after=stream.next_seq, end=True,
                    expire_s=max(1, int(self.hub.retention.finished_ttl)))

    def _queue(self, stream: Stream, fields: codec.Fields, *, after: int, upto: int = 0, end: bool = False,
               expire_s: int = 0, header: bool = False) -> None:
        if self._up and stream.id not in self._dirty and self._queued < self.t.max_pending:
            out = self._pending.get(stream.id)
            if out is None:
                out = self._pending[stream.id] = _Out(stream, after=after)
            out.records.append(fields)
            out.upto = max(out.upto, upto)
            out.end = out.end or end
            out.header = out.header or header
            out.expire_s = expire_s or out.expire_s
            self._queued += 1
        else:
            self._dirty.add(stream.id)  # Redis is behind on it: the repair writes it from the log
        self._wake.set()

    async def _run_publisher(self) -> None:
        if not self._up:  # Redis was not reachable at start
            await self._outage()
        while not (self._closing or cancel_requested()):
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._flush_once()
            except REDIS_ERRORS as exc:
                log.warning("broker: Redis %s (%s); publishing resumes from each stream's log once it is back",
                            "is out of memory" if is_oom(exc) else "unreachable", exc)
                await self._outage()

    async def _outage(self) -> None:
        """Wait for Redis with backoff. Meanwhile nothing is queued: streams are only marked dirty and
        repaired from their logs afterwards, so memory does not grow with the outage."""
        self._up = False
        self._dirty.update(self._pending)
        self._pending.clear()
        self._queued = 0
        backoff = Backoff(self.t.backoff_max)
        while not (self._closing or cancel_requested()):
            await asyncio.sleep(backoff.next())
            try:
                await self._redis.ping()
            except REDIS_ERRORS:
                continue
            if is_oom(self.lease.error):  # it answers, but refuses writes: back once the lease is written
                continue
            # Every stream is compared with its log, not only those written during the outage: a replica
            # promoted in the primary's place (or a restarted Redis) may lack what was written before it.
            self._dirty.update(s.id for s in self.hub.streams.values() if not s.mirrored and s.epoch)
            log.warning("broker: Redis reachable again; repairing %d streams", len(self._dirty))
            self._up = True
            self._wake.set()
            return

    async def _flush_once(self) -> None:
        """Send what is queued, then repair dirty streams, then (if replicas still owe an acknowledgement and
        nothing else waited for them) wait for them again; raises the Redis error if any fails."""
        batch, self._pending, self._queued = self._pending, {}, 0
        retry = bool(self._unacked) and not batch and not self._dirty
        if batch:
            try:
                missing = await self._send(list(batch.values()))
            except BaseException:
                self._dirty.update(batch)
                raise
            if missing:
                log.warning("broker: %d streams were missing in Redis; writing them again", len(missing))
                self._dirty.update(missing)
        if self._dirty:
            await self._repair()
        if retry:
            await self._wait_again()

    async def _wait_again(self) -> None:
        """Replicas owe an acknowledgement and nothing else is to be written: ask them again (a ``PUBLISH``
        then ``WAIT``, :mod:`gateway.scaleout.redis_replicas`; the ``WAIT`` blocks up to its timeout, which
        paces the retries)."""
        pipe = self._redis.pipeline(transaction=False)
        waited = self.replicas.queue_wait(pipe, self.gateway_id, write=True)
        replies = await pipe.execute() if waited else []
        self._acked(replies[-1] if waited else None)

    def _acked(self, wait_reply: int | None, held: list[tuple[Stream, int, bool]] | None = None) -> None:
        """A pipeline's ``WAIT`` answered (None: none was needed): if enough replicas hold it, everything written
        so far reaches readers (the replication stream is ordered: an acknowledgement covers every earlier
        write); else ``held`` waits with the rest for the next acknowledgement."""
        for stream, upto, end in held or ():
            was = self._unacked.get(stream.id)
            if was is not None:
                upto, end = max(upto, was[1]), end or was[2]
            self._unacked[stream.id] = (stream, upto, end)
        if not self.replicas.acked(wait_reply):
            self._wake.set()  # the publisher retries the WAIT (if nothing else waits for them first)
            return
        unacked, self._unacked = self._unacked, {}
        for stream, upto, end in unacked.values():
            stream.commit(upto, sealed=end)

    async def _send(self, outs: list[_Out]) -> set[str]:
        """One pipeline: each stream's records in one fenced append, then ``WAIT`` for the replicas; each stream's
        events (and end) that Redis (and they) took reach its readers. The ids of streams whose key (or epoch)
        was gone, or whose log in Redis is not the one the records continue: they are repaired."""
        def queue(pipe: Any) -> None:
            for out in outs:
                self.fence.append(pipe, out.stream.id, out.stream.epoch, out.records, expire_s=out.expire_s,
                                  after=out.after)

        replies, wait_reply = await self._fenced(queue)
        missing: set[str] = set()
        held: list[tuple[Stream, int, bool]] = []
        for out, reply in zip(outs, replies, strict=True):
            st, current = fence.status(reply)
            if st == fence.OK:
                if out.header:
                    self._owed.pop(out.stream.id, None)
                held.append((out.stream, out.upto, out.end))
            elif st == fence.FENCED:
                self._give_up(out.stream, f"its epoch {out.stream.epoch} was refused: another gateway owns it "
                                          f"(epoch {current})")
            else:
                if st == fence.ELSEWHERE:
                    log.warning("broker: Redis holds %d events of stream %s where %d were expected (a failover to "
                                "a replica that was behind?): writing back what it lacks first", fence.held(reply),
                                out.stream.id, out.after)
                missing.add(out.stream.id)
        self._acked(wait_reply, held)
        return missing

    async def _repair(self) -> None:
        """Bring Redis level with the log of every dirty stream (idempotent: readers skip repeats)."""
        ids = list(self._dirty)
        self._dirty.clear()
        for sid in ids:  # the repair writes these too
            out = self._pending.pop(sid, None)
            if out is not None:
                self._queued -= len(out.records)
        try:
            for i in range(0, len(ids), 256):
                part = [s for sid in ids[i:i + 256] if (s := self._own(sid)) is not None]
                pipe = self._redis.pipeline(transaction=False)
                for s in part:
                    pipe.xrevrange(codec.stream_key(s.id), count=fence.SCAN)
                lasts = await pipe.execute()
                wanted = [(s, [e[1] for e in last] if last else None) for s, last in zip(part, lasts, strict=True)]

                written: list[tuple[int, bool]] = []  # each stream's log as queued (it may grow meanwhile)

                def queue(pipe: Any, wanted: list[tuple[Stream, list[codec.Fields] | None]] = wanted,
                          written: list[tuple[int, bool]] = written) -> None:
                    written.clear()
                    written.extend(self._repair_one(pipe, s, entries) for s, entries in wanted)

                if not part:
                    continue
                replies, wait_reply = await self._fenced(queue)
                held: list[tuple[Stream, int, bool]] = []
                for s, reply, (upto, end) in zip(part, replies, written, strict=True):
                    st, current = fence.status(reply)
                    if st == fence.OK:
                        self._owed.pop(s.id, None)
                        held.append((s, upto, end))
                    elif st == fence.FENCED:
                        self._give_up(s, f"its epoch {s.epoch} was refused after an outage: another gateway "
                                         f"adopted it (epoch {current})")
                    else:  # gone again, or written meanwhile: next round
                        self._dirty.add(s.id)
                self._acked(wait_reply, held)
        except BaseException:
            self._dirty.update(ids)
            raise

    async def _fenced(self, queue: Callable[[Any], None]) -> tuple[list[Any], int | None]:
        """Run a pipeline of fenced appends (``queue(pipe)`` queues them), then ``WAIT`` for the replicas if any
        are needed (a ``PUBLISH`` first while earlier writes wait for them: this pipeline's appends may all be
        refused); once more after loading the scripts if Redis has none (NOSCRIPT: it restarted; nothing of the
        pipeline ran). The appends' replies, and the ``WAIT``'s (None: none sent)."""
        for attempt in (0, 1):
            pipe = self._redis.pipeline(transaction=False)
            queue(pipe)
            publish = bool(self._unacked)
            waited = self.replicas.queue_wait(pipe, self.gateway_id, write=publish)
            try:
                replies = list(await pipe.execute())
            except NoScriptError:
                if attempt:
                    raise
                await self.fence.load(self._redis)
                continue
            if not waited:
                return replies, None
            return replies[:-2] if publish else replies[:-1], int(replies[-1])
        raise AssertionError("unreachable")

    def _own(self, stream_id: str) -> Stream | None:
        """The local stream this gateway publishes under ``stream_id``, if it still does."""
        stream = self.hub.streams.get(stream_id)
        if stream is None or stream.mirrored or stream.state == "moved" or not stream.epoch:
            return None  # evicted, a mirror, handed over, or given up: nothing of ours to write
        return stream

    def _repair_one(self, pipe: Any, stream: Stream, last: list[codec.Fields] | None) -> tuple[int, bool]:
        """Queue on ``pipe`` one fenced append of what Redis lacks of ``stream``, given its last entries there,
        newest first (None: the key is gone, and is written anew, header first). The append continues the log
        Redis holds (refused if another write changed it meanwhile: the next round reads it again); an adopter's
        header still owed goes where its log continues the one it adopted. Returns what it makes durable: the
        events below that seq, and whether the end."""
        log_ = stream.events + stream.pending
        records: list[codec.Fields] = []
        have = 0 if last is None else codec.held(last)
        if last is None:  # the key is gone (a Redis restart without persistence): write it anew
            records.append(codec.encode_header_of(stream, self.gateway_id))
            self._owed.pop(stream.id, None)
        if have >= 0:
            if have > len(log_):
                log.warning("broker: Redis holds %d events of stream %s, this gateway's log %d", have, stream.id,
                            len(log_))
            at = self._owed.get(stream.id)
            if at is not None and at >= have:
                records += [codec.encode_event_of(ev) for ev in log_[have:at]]
                records.append(codec.encode_header_of(stream, self.gateway_id, at=at))
                records += [codec.encode_event_of(ev) for ev in log_[at:]]
            else:
                records += [codec.encode_event_of(ev) for ev in log_[have:]]
            if stream.finished:
                records.append(codec.encode_end_of(stream))
        expire = 0
        if stream.finished:
            ttl = self.hub.retention.finished_ttl
            if stream.finished_at is not None:
                ttl -= time.monotonic() - stream.finished_at
            expire = max(1, int(ttl))
        self.fence.append(pipe, stream.id, stream.epoch, records, expire_s=expire, create=last is None,
                          after=None if have < 0 else have)
        return len(log_), stream.finished

    def _repair_all(self) -> None:
        self._dirty.update(s.id for s in self.hub.streams.values() if not s.mirrored and s.epoch)
        self._wake.set()

    # -- fencing: giving up streams another gateway owns (or may own) ---------------------------------------

    def _give_up(self, stream: Stream, why: str) -> None:
        """This gateway no longer owns ``stream``: its generation stops, what Redis does not hold is dropped,
        its readers are told to resume on a replica, and the hub forgets it (a reader here mirrors it)."""
        if stream.state == "moved" and stream.id not in self.hub.streams:
            return
        log.warning("broker: gave up stream %s (%s)", stream.id, why)
        if self.on_fenced is not None:
            self.on_fenced(stream, "fenced")
        self._dirty.discard(stream.id)
        self._unacked.pop(stream.id, None)
        self._owed.pop(stream.id, None)
        out = self._pending.pop(stream.id, None)
        if out is not None:
            self._queued -= len(out.records)
        running = hand_over(stream)  # its pump aborts the engine request; it ends moved
        stream.relinquish()
        stream.paused = False
        task = stream.task

        def forget(_: object = None) -> None:
            if self.hub.streams.get(stream.id) is stream:
                self.hub.drop(stream.id)

        if running and task is not None:
            task.add_done_callback(forget)
        else:
            forget()

    def _fence_all(self, fenced: bool) -> None:
        """This gateway's lease may expire (``fenced``): the readers of every listed stream it owns whose end
        Redis does not hold yet resume on a replica; confirmed again: its streams take readers again (each one
        another gateway adopted meanwhile is given up at its next write, refused by its epoch)."""
        for stream in list(self.hub.streams.values()):
            if not stream.mirrored and stream.epoch and stream.state != "moved" \
                    and not (stream.finished and stream.sealed) and stream.paused != fenced:
                stream.pause(fenced)
                if fenced and self.on_fenced is not None:
                    self.on_fenced(stream, "lease")
        if not fenced:
            self._repair_all()  # every stream written (or refused) at once, not at its next event
