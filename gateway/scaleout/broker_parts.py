"""The small parts of ``--broker`` beside the publisher (:mod:`gateway.scaleout.broker`), each on its own Redis keys
(:mod:`gateway.scaleout.broker_codec`):

- :class:`OwnerLease`: this gateway's lease, refreshed while it runs; a lease found missing means Redis
  lost its data, so the publisher repairs every local stream.
- :class:`CancelRpc`: ``DELETE`` on a replica that does not own the stream is published on
  ``tokenfan:cancel`` with a reply key; every listening gateway answers yes (it ran the stream and
  cancelled it) or no, so :meth:`CancelRpc.ask` returns the truth. The listener resubscribes after any error.
- :class:`RedisTranscripts`: a finished stored response's transcript, for ``previous_response_id`` anywhere.
- :class:`RedisLink`: the mirror's :class:`~gateway.scaleout.mirror.Link` through Redis: ``XREAD`` from the start
  of ``tokenfan:s:<id>``, read again from the start after an outage; the owners' leases; the cancel RPC.

Blocking reads (``XREAD BLOCK``, ``BLPOP``) use their own client whose socket timeout is longer than the
block time: with redis-py's default 5 s socket timeout a quiet ``XREAD`` would fail inside a healthy read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.exceptions import RedisError

from gateway.config import BrokerTimings
from gateway.core.streams import Stream
from gateway.errors import APIError, stream_expired, stream_lost, stream_not_found
from gateway.scaleout import broker_codec as codec
from gateway.scaleout.mirror import Item, Lease, Opened, Quiet

log = logging.getLogger(__name__)

KNOWN_TTL_S = 24 * 3600  # the 410-vs-404 marker, and the bound on a key whose owner died mid-stream
ACK_TTL_S = 30
REDIS_ERRORS = (RedisError, OSError, TimeoutError)  # redis-py's errors; sockets; asyncio timeouts


def broker_unavailable(exc: BaseException) -> APIError:
    return APIError(503, f"The stream broker (Redis) is unavailable ({type(exc).__name__}: {exc}); retry shortly.",
                    type="server_error", code="broker_unavailable", retry_after=1.0)


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


def cancel_requested() -> bool:
    """Whether this task was asked to stop, even if redis-py swallowed the CancelledError (see
    :func:`gateway.scaleout.mirror.stop_tasks`): every loop here checks it, so one ``cancel()`` always ends it."""
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


class OwnerLease:
    """Refresh this gateway's lease; ``on_lost()`` whenever it was missing (first run, Redis restarted)."""

    def __init__(self, redis: Any, gateway_id: str, t: BrokerTimings, on_lost: Callable[[], None]) -> None:
        self.redis, self.gateway_id, self.t, self.on_lost = redis, gateway_id, t, on_lost

    async def run(self) -> None:
        key, ttl_ms = codec.lease_key(self.gateway_id), int(self.t.lease_ttl * 1000)
        held = False
        while not cancel_requested():
            try:
                previous = await self.redis.set(key, b"1", px=ttl_ms, get=True)
                if previous is None or not held:
                    if held:
                        log.warning("broker: Redis lost this gateway's lease (restarted?); repairing local streams")
                    self.on_lost()
                held = True
            except REDIS_ERRORS as exc:
                if held:
                    log.warning("broker: refreshing the lease failed: %s", exc)
                held = False
            await asyncio.sleep(self.t.lease_interval)

    async def release(self) -> None:
        await self.redis.delete(codec.lease_key(self.gateway_id))


class CancelRpc:
    """Cancels across replicas over pub/sub. ``local_cancel(id)`` cancels a generation this gateway runs
    and says whether it did; ``running_here(id)``: a mirror of it here has not ended (worth asking again)."""

    def __init__(self, redis: Any, blocking: Any, t: BrokerTimings, local_cancel: Callable[[str], bool],
                 running_here: Callable[[str], bool]) -> None:
        self.redis, self.blocking, self.t = redis, blocking, t
        self.local_cancel, self.running_here = local_cancel, running_here

    async def ask(self, stream_id: str) -> bool:
        """True once the replica that runs the stream confirms it cancelled it; False if no gateway claims
        it within ``cancel_timeout`` (its owner is gone, or it ended meanwhile). APIError 503 without Redis."""
        req = codec.CancelRequest(stream_id, codec.ack_key(uuid.uuid4().hex))
        deadline = time.monotonic() + self.t.cancel_timeout
        try:
            while True:
                listeners = await self.redis.publish(codec.CANCEL_CHANNEL, codec.encode_cancel(req))
                answers = 0
                while answers < listeners:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    reply = await self.blocking.blpop([req.reply_to], timeout=max(0.01, min(left, self.t.block)))
                    if reply is None:
                        continue
                    if reply[1] == codec.ACK_YES:
                        return True
                    answers += 1
                # Nobody holds it right now. The owner's listener may be resubscribing after a Redis
                # restart: ask again while the stream still runs here and time is left.
                if not self.running_here(stream_id) or time.monotonic() + 0.25 >= deadline:
                    return False
                await asyncio.sleep(0.25)
        except REDIS_ERRORS as exc:
            raise broker_unavailable(exc) from exc

    async def listen(self) -> None:
        """Answer every cancel published by another replica, resubscribing after any error."""
        backoff = Backoff(self.t.backoff_max)
        lost = False
        while not cancel_requested():
            pubsub = self.redis.pubsub()
            try:
                await pubsub.subscribe(codec.CANCEL_CHANNEL)
                if lost:
                    log.warning("broker: cancel listener resubscribed")
                lost = False
                backoff.reset()
                while not cancel_requested():
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=self.t.block)
                    if msg is not None and msg.get("type") == "message":
                        await self._answer(msg["data"])
            except REDIS_ERRORS as exc:
                if not lost:
                    log.warning("broker: cancel listener lost Redis (%s); resubscribing", exc)
                lost = True
            finally:
                with contextlib.suppress(*REDIS_ERRORS):
                    await pubsub.aclose()
            await asyncio.sleep(backoff.next())

    async def _answer(self, data: bytes) -> None:
        try:
            req = codec.decode_cancel(data)
        except codec.CodecError as exc:
            log.warning("broker: %s", exc)
            return
        held = self.local_cancel(req.stream_id)
        if held:
            log.info("broker: cancelled stream %s for another replica", req.stream_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(req.reply_to, codec.ACK_YES if held else codec.ACK_NO)
        pipe.expire(req.reply_to, ACK_TTL_S)
        await pipe.execute()


class RedisTranscripts:
    """Finished stored responses' transcripts, so ``previous_response_id`` works on any replica."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.puts: set[asyncio.Task[None]] = set()  # writes in flight

    def put(self, response_id: str, data: bytes, ttl: float) -> None:
        """Keep it for ``ttl`` s (in the background: a failure only logs)."""

        async def put() -> None:
            try:
                await self.redis.set(codec.transcript_key(response_id), data, px=max(1, int(ttl * 1000)))
            except REDIS_ERRORS as exc:
                log.warning("transcript of %s not stored in Redis (%s): previous_response_id works on this "
                            "replica only", response_id, exc)

        task = asyncio.create_task(put(), name=f"transcript-{response_id}")
        self.puts.add(task)
        task.add_done_callback(self.puts.discard)

    async def get(self, response_id: str) -> bytes | None:
        try:
            data = await self.redis.get(codec.transcript_key(response_id))
        except REDIS_ERRORS as exc:
            raise broker_unavailable(exc) from exc
        return bytes(data) if data is not None else None


class RedisLink:
    """The mirror's link through Redis (:class:`gateway.scaleout.mirror.Link`)."""

    def __init__(self, redis: Any, blocking: Any, t: BrokerTimings, cancels: CancelRpc,
                 finished_ttl: Callable[[], float]) -> None:
        self.redis, self.blocking, self.t, self.cancels = redis, blocking, t, cancels
        self.finished_ttl = finished_ttl

    async def open(self, stream_id: str) -> Opened:
        key = codec.stream_key(stream_id)
        try:
            first = await self.redis.xrange(key, count=1)
            known = bool(first) or bool(await self.redis.exists(codec.known_key(stream_id)))
        except REDIS_ERRORS as exc:
            raise broker_unavailable(exc) from exc
        if not first:
            raise stream_expired(stream_id) if known else stream_not_found(stream_id)
        try:
            header = codec.decode(first[0][1])
        except codec.CodecError:
            header = None
        if not isinstance(header, codec.Header):
            raise stream_lost(stream_id, "its header is missing in the broker", status=410)
        return Opened(header, self._records(stream_id))

    async def _records(self, stream_id: str) -> AsyncGenerator[Item, None]:
        key = codec.stream_key(stream_id)
        last_id: bytes | str = b"0-0"
        backoff = Backoff(self.t.backoff_max)
        unreachable: BaseException | None = None
        while True:
            if cancel_requested():  # redis-py may have swallowed the cancellation
                raise asyncio.CancelledError
            try:
                reply = await self.blocking.xread({key: last_id}, count=512, block=max(1, int(self.t.block * 1000)))
            except REDIS_ERRORS as exc:
                if unreachable is None:
                    log.info("broker: mirror of %s lost Redis (%s); reconnecting", stream_id, exc)
                unreachable = exc
                # Read again from the start once back: the owner may have rewritten the stream (a
                # restart without persistence); the mirror skips the repeats.
                last_id = b"0-0"
                yield Quiet(exc)
                await asyncio.sleep(backoff.next())
                continue
            if unreachable is not None:
                log.info("broker: mirror of %s reconnected", stream_id)
                unreachable = None
                backoff.reset()
            if not reply:
                yield Quiet()
                continue
            for entry_id, fields in reply[0][1]:
                last_id = entry_id
                yield codec.decode(fields)

    async def lease(self, owner: str) -> Lease:
        if not owner:
            return Lease("missing")
        try:
            ttl_ms = int(await self.redis.pttl(codec.lease_key(owner)))
        except REDIS_ERRORS:
            return Lease("unknown")
        if ttl_ms == -1:  # held without an expiry (set by hand)
            return Lease("held")
        return Lease("held", ttl_ms / 1000) if ttl_ms >= 0 else Lease("missing")

    async def cancel(self, stream_id: str, owner: str) -> bool:
        return await self.cancels.ask(stream_id)  # published to every replica: the owner answers

    async def record_owner_lost(self, stream: Stream, err: APIError) -> None:
        """Write the ``owner_lost`` end, so that later readers get it at once."""
        key = codec.stream_key(stream.id)
        with contextlib.suppress(*REDIS_ERRORS):
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(key, codec.encode_end("error", len(stream.events), err), nomkstream=True)
            pipe.expire(key, max(1, int(self.finished_ttl())))
            await pipe.execute()
