"""Durable means replicated (``--broker-replicas``): how many Redis replicas must acknowledge a pipeline of a
listed stream's records before its events reach readers, so that a replica promoted in the primary's place
holds whatever a reader read.

The publisher appends ``WAIT numreplicas timeout`` to each pipeline (one per pipeline, never per event;
:meth:`gateway.scaleout.broker.Broker._send`). ``auto`` asks for every replica the primary has online (``INFO
replication``, read at start and every :data:`CHECK_S`), so a primary without replicas costs nothing and one
whose replica drops out stops waiting for it at the next check; a count asks for that many whatever ``INFO``
says. Replicas that do not answer within ``--broker-replica-timeout`` *hold* delivery: nothing they did not
acknowledge reaches a reader, and the wait is retried (a ``PUBLISH`` on the gateway's own presence channel
then ``WAIT``: the retry's connection must have written for its ``WAIT`` to cover the earlier writes, which the
replication stream orders before it). Redis documents that ``WAIT`` narrows the window without closing it (a
failover may still promote a replica that lacks an acknowledged write): the store's rollback checks
(:mod:`gateway.scaleout.redis_fence`, ``stream_rolled_back``) are the backstop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gateway.scaleout import broker_codec as codec
from gateway.scaleout.redis_support import REDIS_ERRORS, cancel_requested

log = logging.getLogger(__name__)

CHECK_S = 1.0  # how often ``auto`` reads INFO replication


def online(info: dict[str, Any]) -> int:
    """The replicas ``INFO replication`` (as redis-py parses it) shows online (a replica still syncing cannot
    acknowledge yet; a server that is itself a replica has none that count)."""
    if info.get("role") != "master":
        return 0
    return sum(1 for k, v in info.items() if k.startswith("slave") and k[5:].isdigit() and isinstance(v, dict)
               and v.get("state") == "online")


class Replicas:
    """The replicas each pipeline waits for: ``setting`` (``--broker-replicas``; None: ``auto``)."""

    def __init__(self, redis: Any, setting: int | None, timeout: float) -> None:
        self.redis, self.setting, self.timeout = redis, setting, timeout
        self.online = 0  # as last read (auto)
        self.holding = False  # a WAIT fell short and delivery is held (logged once per episode)
        self._failing = False  # INFO failed last time (logged once per streak)

    @property
    def needed(self) -> int:
        return self.setting if self.setting is not None else self.online

    @property
    def wait_args(self) -> tuple[int, int]:
        """``WAIT``'s arguments: the replicas needed and the timeout in milliseconds."""
        return self.needed, max(1, int(self.timeout * 1000))

    async def refresh(self) -> None:
        if self.setting is not None:
            return
        n = online(await self.redis.info("replication"))
        if n != self.online:
            log.info("broker: the Redis primary has %d replicas online: each pipeline waits for %d", n, n)
        self.online = n

    async def check(self) -> None:
        """:meth:`refresh`, an error logged once per streak (and the last answer kept): a Redis that refuses
        ``INFO`` (an ACL) leaves ``auto`` waiting for no replica, so say how to ask for them."""
        try:
            await self.refresh()
            self._failing = False
        except REDIS_ERRORS as exc:
            if not self._failing:
                log.warning("broker: INFO replication failed (%s): --broker-replicas auto waits for %d replicas "
                            "until it answers (set --broker-replicas N where INFO is not allowed)", exc, self.online)
            self._failing = True

    async def run(self) -> None:
        """``auto``: :meth:`check` every :data:`CHECK_S`."""
        if self.setting is not None:
            return
        while not cancel_requested():
            await self.check()
            await asyncio.sleep(CHECK_S)

    def acked(self, replies: int | None) -> bool:
        """Whether a pipeline's ``WAIT`` reply (None: none was sent) says enough replicas hold it; logs the
        start and the end of each hold."""
        ok = replies is None or replies >= self.needed
        if ok == self.holding:
            self.holding = not ok
            if ok:
                log.warning("broker: the Redis replicas acknowledged again; delivery goes on")
            else:
                log.warning("broker: %d of %d Redis replicas acknowledged within %gs: delivery of listed streams is "
                            "held (nothing unreplicated reaches a reader) and the wait retried", replies, self.needed,
                            self.timeout)
        return ok

    def queue_wait(self, pipe: Any, gateway_id: str, *, write: bool) -> bool:
        """Queue ``WAIT`` on ``pipe`` if replicas are needed (``write``: a ``PUBLISH`` first, for a pipeline
        that may write nothing itself); whether it did."""
        n, ms = self.wait_args
        if n <= 0:
            return False
        if write:
            pipe.publish(codec.presence_channel(gateway_id), b"")
        pipe.wait(n, ms)
        return True
