"""The owner lease (``--broker``): each gateway refreshes its key in Redis; a mirror whose owner's lease is
missing knows the owner is gone. Its value says whether the gateway serves (``1``; ``1p``: and it is present
on its presence channel) or drains (``draining``: it was told to stop, so it adopts nothing and nothing is
handed over to it).

Two ways an owner is found gone, for two kinds of fault:

- **Killed** (SIGKILL, OOM, a node that stops): its connections close at once, so its subscription to its
  presence channel (``tokenfan:p:{<gid>}``) is gone from Redis's ``PUBSUB NUMSUB`` within a round trip. Mirrors
  check it after a short quiet (``--broker-presence-check``): failover in a fraction of a second.
- **Partitioned** (its link to Redis holds bytes; nothing is closed, so Redis still counts its subscription):
  its lease is not refreshed and expires after ``--broker-lease-ttl``. The owner *fences itself* before that
  can happen anywhere: :attr:`OwnerLease.valid_until` is the send time of the last refresh Redis confirmed plus
  the TTL minus :func:`fence_margin`; past it, ``on_fenced(True)`` makes the gateway send the readers of its
  listed streams to resume on a replica (and ``/health`` says not ready). Its streams' logs and generations go
  on, delivering nothing (nothing reaches Redis): once it writes again, each stream that nobody adopted
  meanwhile goes on (``on_fenced(False)``), and each that a replica adopted is refused by its epoch
  (:mod:`gateway.scaleout.redis_fence`) and given up. The epochs keep the streams safe even if this clock is late.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable

from gateway.config import BrokerTimings
from gateway.scaleout import broker_codec as codec
from gateway.scaleout.redis_clients import Clients
from gateway.scaleout.redis_support import REDIS_ERRORS, Backoff, cancel_requested

log = logging.getLogger(__name__)


def fence_margin(t: BrokerTimings) -> float:
    """How long before its lease can expire in Redis a gateway fences itself: a quarter of the TTL, at most
    0.5 s. The lease cannot expire before the send time of its last confirmed refresh plus the TTL (Redis
    received it later); the margin absorbs event-loop lag on this side, so that the owner's readers are told
    to move before another replica can adopt the stream. Beyond it only the epochs protect the streams."""
    return min(0.5, t.lease_ttl / 4)




class OwnerLease:
    """Refresh this gateway's lease; ``on_lost()`` whenever it was missing (first run, Redis restarted);
    ``on_fenced(True)`` when it went unconfirmed so long that it may expire, ``on_fenced(False)`` when it is
    confirmed again (see the module docstring)."""

    def __init__(self, clients: Clients, t: BrokerTimings, on_lost: Callable[[], None],
                 on_fenced: Callable[[bool], None] | None = None, gateway_id: str | None = None) -> None:
        self.clients, self.redis, self.t, self.on_lost, self.on_fenced = clients, clients.redis, t, on_lost, on_fenced
        self.gateway_id = gateway_id or uuid.uuid4().hex[:16]
        self.draining = False
        self.fenced = False  # the lease went unconfirmed past valid_until, and no refresh was confirmed since
        self.valid_until = 0.0  # monotonic: no other replica can find the lease missing before this
        self.error: BaseException | None = None  # why the last refresh failed (None: it was confirmed)
        self.present_as: str | None = None  # the gateway id whose presence channel this gateway subscribes to
        self._timer: asyncio.TimerHandle | None = None
        self._changed = asyncio.Event()  # the presence subscription came up: refresh the lease's value at once
        self._presence: asyncio.Task[None] | None = None

    @property
    def value(self) -> bytes:
        if self.draining:
            return b"draining"
        return b"1p" if self.present_as == self.gateway_id else b"1"

    async def run(self) -> None:
        self._presence = asyncio.create_task(self._stay_present(), name="broker-presence")
        try:
            await self._refresh_forever()
        finally:
            if self._timer is not None:
                self._timer.cancel()
            self._presence.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._presence

    async def _refresh_forever(self) -> None:
        ttl_ms = int(self.t.lease_ttl * 1000)
        held = False
        while not cancel_requested():
            sent = time.monotonic()
            try:
                previous = await self.redis.set(codec.lease_key(self.gateway_id), self.value, px=ttl_ms, get=True)
                if previous is None or not held:
                    if held:
                        log.warning("broker: Redis lost this gateway's lease (restarted?); repairing local streams")
                    self.on_lost()
                held = True
                self.error = None
                self._confirmed(sent)
            except REDIS_ERRORS as exc:
                if held:
                    log.warning("broker: refreshing the lease failed: %s", exc)
                held = False
                self.error = exc
            with contextlib.suppress(TimeoutError):  # early when the presence subscription changed: say so now
                async with asyncio.timeout(self.t.lease_interval):
                    await self._changed.wait()
            self._changed.clear()

    def _confirmed(self, sent: float) -> None:
        """A refresh sent at ``sent`` is in Redis: no replica can find the lease missing before sent + TTL."""
        if self.fenced:
            log.warning("broker: lease confirmed again: its listed streams go on where Redis says they are still "
                        "this gateway's")
            self.fenced = False
            if self.on_fenced is not None:
                self.on_fenced(False)
        self.valid_until = sent + self.t.lease_ttl - fence_margin(self.t)
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(loop.time() + (self.valid_until - time.monotonic()), self._expire)

    def _expire(self) -> None:
        """The lease went unconfirmed until it may expire: fence this gateway (once per confirmed lease)."""
        self._timer = None
        if self.fenced or self.draining:
            return
        self.fenced = True
        log.warning("broker: this gateway's lease was not confirmed for %.2fs (Redis unreachable?): the readers "
                    "of its listed streams resume on a replica, and it is not ready until Redis confirms it again",
                    self.t.lease_ttl - fence_margin(self.t))
        if self.on_fenced is not None:
            self.on_fenced(True)

    async def _stay_present(self) -> None:
        """Subscribe to this gateway's presence channel (again after an error)."""
        backoff = Backoff(self.t.backoff_max)
        lost = False
        while not cancel_requested():
            sub = self.clients.subscription(codec.presence_channel(self.gateway_id))
            try:
                if lost:
                    await self.clients.refresh()
                await sub.open()
                self.present_as = self.gateway_id
                self._changed.set()
                lost = False
                backoff.reset()
                while not cancel_requested():
                    await sub.get(min(self.t.block, 0.5))
            except REDIS_ERRORS as exc:
                log.info("broker: presence subscription lost (%s); subscribing again", exc)
                lost = True
            finally:
                if self.present_as is not None:  # the lease says so at once, not at its next refresh
                    self.present_as = None
                    self._changed.set()
                with contextlib.suppress(*REDIS_ERRORS):
                    await sub.aclose()
            await asyncio.sleep(backoff.next())

    async def drain(self) -> None:
        """From now on the lease says ``draining`` (written at once, then at every refresh)."""
        self.draining = True
        await self.redis.set(codec.lease_key(self.gateway_id), self.value, px=int(self.t.lease_ttl * 1000))

    async def others_serving(self) -> int:
        """How many other gateways hold a lease that says they serve."""
        mine, keys = codec.lease_key(self.gateway_id).encode(), []
        async for key in self.redis.scan_iter(match=codec.lease_key("*"), count=1000):
            if key != mine:
                keys.append(key)
        pipe = self.redis.pipeline(transaction=False)  # not MGET: on a cluster the leases are in many slots
        for key in keys:
            pipe.get(key)
        values = await pipe.execute() if keys else []
        return sum(v is not None and v.startswith(b"1") for v in values)

    async def release(self) -> None:
        await self.redis.delete(codec.lease_key(self.gateway_id))
