"""The mirror's link over Redis (``--broker``): a stream's header and records by ``XREAD``, from the start again
after an outage, and its owner's lease and cancel (:class:`gateway.scaleout.mirror.Link`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable

from gateway.config import BrokerTimings
from gateway.core.streams import Stream
from gateway.errors import APIError, stream_expired, stream_lost, stream_not_found
from gateway.scaleout import broker_codec as codec
from gateway.scaleout.mirror import Item, Lease, Opened, Quiet
from gateway.scaleout.redis_cancel import CancelRpc
from gateway.scaleout.redis_clients import Clients
from gateway.scaleout.redis_fence import Fence
from gateway.scaleout.redis_support import REDIS_ERRORS, Backoff, broker_unavailable, cancel_requested

log = logging.getLogger(__name__)

LEASE_CACHE_S = 0.05  # an owner's lease, as asked by one mirror, answers the others for this long


class RedisLink:
    """The mirror's link through Redis (:class:`gateway.scaleout.mirror.Link`)."""

    def __init__(self, clients: Clients, t: BrokerTimings, cancels: CancelRpc,
                 finished_ttl: Callable[[], float], fence: Fence) -> None:
        self.clients, self.redis, self.blocking, self.t, self.cancels = clients, clients.redis, clients.blocking, t, cancels
        self.finished_ttl = finished_ttl
        self.fence = fence
        self._leases: dict[str, tuple[float, Lease]] = {}  # owner -> (monotonic time asked, answer): shared
        # until then a closed presence subscription proves nothing: this link just lost Redis (a restart, a
        # failover), and an owner's subscription may still be on its way to the server that answers now
        self._unsettled_until = 0.0

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
        # a quiet mirror looks up every presence check (a killed owner is noticed in a fraction of a second)
        block_ms = max(1, int(min(self.t.block, self.t.presence_check or self.t.block) * 1000))
        last_id: bytes | str = b"0-0"
        backoff = Backoff(self.t.backoff_max)
        unreachable: BaseException | None = None
        while True:
            if cancel_requested():  # redis-py may have swallowed the cancellation
                raise asyncio.CancelledError
            try:
                reply = await self.blocking.xread({key: last_id}, count=512, block=block_ms)
            except REDIS_ERRORS as exc:
                if unreachable is None:
                    log.info("broker: mirror of %s lost Redis (%s); reconnecting", stream_id, exc)
                unreachable = exc
                self._unsettled_until = time.monotonic() + self.t.lease_ttl
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
        """The owner's lease and, if its value says it keeps one, whether its presence subscription is open
        (answers younger than :data:`LEASE_CACHE_S` are shared by the mirrors of one owner's streams)."""
        if not owner:
            return Lease("missing")
        now = time.monotonic()
        cached = self._leases.get(owner)
        if cached is not None and now - cached[0] < LEASE_CACHE_S:
            return cached[1]
        pipe = self.redis.pipeline(transaction=False)
        pipe.pttl(codec.lease_key(owner))
        pipe.get(codec.lease_key(owner))
        if not self.clients.sharded:  # on a cluster PUBSUB goes to the channel's primary, not in a pipeline
            pipe.pubsub_numsub(codec.presence_channel(owner))
        try:
            ttl_ms, value, *numsub = await pipe.execute()
            if value == b"1p":
                subscribers = int(numsub[0][0][1]) if numsub else await self.clients.numsub(codec.presence_channel(owner))
        except REDIS_ERRORS:
            self._unsettled_until = time.monotonic() + self.t.lease_ttl
            return Lease("unknown")
        present = subscribers > 0 if value == b"1p" and now >= self._unsettled_until else None
        if int(ttl_ms) == -1:  # held without an expiry (set by hand)
            lease = Lease("held", present=present)
        else:
            lease = Lease("held", int(ttl_ms) / 1000, present=present) if int(ttl_ms) >= 0 else Lease("missing")
        if len(self._leases) > 1024:
            self._leases.clear()
        self._leases[owner] = (now, lease)
        return lease

    async def cancel(self, stream_id: str, owner: str) -> bool:
        return await self.cancels.ask(stream_id)  # published to every replica: the owner answers

    async def record_owner_lost(self, stream: Stream, err: APIError, header: codec.Header) -> None:
        """Write the ``owner_lost`` end, so that later readers get it at once: fenced (the lost owner's epoch
        taken over first), so a partitioned owner that comes back cannot write after it."""
        with contextlib.suppress(*REDIS_ERRORS):
            if stream.epoch > header.epoch:  # this gateway took it over, and its adoption failed
                epoch: int | None = stream.epoch
            else:
                epoch = await self.fence.take(self.redis, stream.id, header.epoch) if header.epoch else 0
            if header.epoch and epoch is None:
                return  # another gateway took the stream over meanwhile: its records follow
            pipe = self.redis.pipeline(transaction=False)
            end = codec.encode_end("error", len(stream.events), err)
            if epoch:
                self.fence.append(pipe, stream.id, epoch, [end], expire_s=max(1, int(self.finished_ttl())))
            else:
                key = codec.stream_key(stream.id)
                pipe.xadd(key, end, nomkstream=True)
                pipe.expire(key, max(1, int(self.finished_ttl())))
            await pipe.execute()
