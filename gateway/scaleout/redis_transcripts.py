"""Stored responses' transcripts in Redis (``--broker``), so ``previous_response_id`` works on any replica."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gateway.scaleout import broker_codec as codec
from gateway.scaleout.redis_fence import Fence
from gateway.scaleout.redis_support import REDIS_ERRORS, broker_unavailable

log = logging.getLogger(__name__)


class RedisTranscripts:
    """Finished stored responses' transcripts, so ``previous_response_id`` works on any replica."""

    def __init__(self, redis: Any, fence: Fence) -> None:
        self.redis, self.fence = redis, fence
        self.puts: set[asyncio.Task[None]] = set()  # writes in flight

    def put(self, response_id: str, data: bytes, ttl: float, epoch: int = 0) -> None:
        """Keep it for ``ttl`` s (in the background: a failure only logs). ``epoch``: the stream's owner's, so a
        gateway that lost the stream to another cannot write it (fenced: nothing is written)."""

        async def put() -> None:
            key, px = codec.transcript_key(response_id), max(1, int(ttl * 1000))
            try:
                if epoch:
                    if not await self.fence.set_if(self.redis, response_id, epoch, key, data, px):
                        log.warning("transcript of %s not stored: another gateway owns the response now", response_id)
                    return
                await self.redis.set(key, data, px=px)
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
