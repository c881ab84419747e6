"""Stored responses' transcripts in Redis (``--broker``), so ``previous_response_id`` works on any replica."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gateway.scaleout import broker_codec as codec
from gateway.scaleout.redis_support import REDIS_ERRORS, broker_unavailable

log = logging.getLogger(__name__)


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
