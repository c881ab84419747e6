"""The owner lease (``--broker``): each gateway refreshes its key in Redis; a mirror whose owner's lease is
missing knows the owner is gone. Its value says whether the gateway serves (``1``) or drains (``draining``:
it was told to stop, so it adopts nothing and nothing is handed over to it)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from gateway.config import BrokerTimings
from gateway.scaleout import broker_codec as codec
from gateway.scaleout.redis_support import REDIS_ERRORS, cancel_requested

log = logging.getLogger(__name__)


class OwnerLease:
    """Refresh this gateway's lease; ``on_lost()`` whenever it was missing (first run, Redis restarted)."""

    def __init__(self, redis: Any, gateway_id: str, t: BrokerTimings, on_lost: Callable[[], None]) -> None:
        self.redis, self.gateway_id, self.t, self.on_lost = redis, gateway_id, t, on_lost
        self.value = b"1"

    async def run(self) -> None:
        key, ttl_ms = codec.lease_key(self.gateway_id), int(self.t.lease_ttl * 1000)
        held = False
        while not cancel_requested():
            try:
                previous = await self.redis.set(key, self.value, px=ttl_ms, get=True)
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

    async def drain(self) -> None:
        """From now on the lease says ``draining`` (written at once, then at every refresh)."""
        self.value = b"draining"
        await self.redis.set(codec.lease_key(self.gateway_id), self.value, px=int(self.t.lease_ttl * 1000))

    async def others_serving(self) -> int:
        """How many other gateways hold a lease that says they serve."""
        mine, keys = codec.lease_key(self.gateway_id).encode(), []
        async for key in self.redis.scan_iter(match=codec.lease_key("*"), count=1000):
            if key != mine:
                keys.append(key)
        values = await self.redis.mget(keys) if keys else []
        return sum(v == b"1" for v in values)

    async def release(self) -> None:
        await self.redis.delete(codec.lease_key(self.gateway_id))
