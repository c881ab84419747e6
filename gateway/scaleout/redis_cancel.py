"""Cancels across replicas (``--broker``): pub/sub with a reply key, so ``DELETE`` on any replica says whether
the owner really cancelled."""

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
from gateway.scaleout.redis_support import (
    ACK_TTL_S,
    REDIS_ERRORS,
    Backoff,
    broker_unavailable,
    cancel_requested,
)

log = logging.getLogger(__name__)


class CancelRpc:
    """Cancels across replicas over pub/sub. ``local_cancel(id)`` cancels a generation this gateway runs
    and says whether it did; ``running_here(id)``: a mirror of it here has not ended (worth asking again)."""

    def __init__(self, clients: Clients, t: BrokerTimings, local_cancel: Callable[[str], bool],
                 running_here: Callable[[str], bool]) -> None:
        self.clients, self.redis, self.blocking, self.t = clients, clients.redis, clients.blocking, t
        self.local_cancel, self.running_here = local_cancel, running_here

    async def ask(self, stream_id: str) -> bool:
        """True once the replica that runs the stream confirms it cancelled it; False if no gateway claims
        it within ``cancel_timeout`` (its owner is gone, or it ended meanwhile). APIError 503 without Redis."""
        req = codec.CancelRequest(stream_id, codec.ack_key(uuid.uuid4().hex))
        deadline = time.monotonic() + self.t.cancel_timeout
        try:
            while True:
                listeners = await self.clients.publish(codec.CANCEL_CHANNEL, codec.encode_cancel(req))
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
            sub = self.clients.subscription(codec.CANCEL_CHANNEL)
            try:
                if lost:
                    await self.clients.refresh()
                await sub.open()
                if lost:
                    log.warning("broker: cancel listener resubscribed")
                lost = False
                backoff.reset()
                while not cancel_requested():
                    data = await sub.get(self.t.block)
                    if data is not None:
                        await self._answer(data)
            except REDIS_ERRORS as exc:
                if not lost:
                    log.warning("broker: cancel listener lost Redis (%s); resubscribing", exc)
                lost = True
            finally:
                with contextlib.suppress(*REDIS_ERRORS):
                    await sub.aclose()
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
