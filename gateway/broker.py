"""Fan-out across gateway replicas through Redis Streams (``--broker redis://…``).

The gateway that runs a generation (its *owner*) appends every published event to the Redis stream
``tokenfan:s:<id>``: a header entry (``created`` = model, ``endpoint``) before the stream's id is handed
out, one entry per event (``seq``, ``data`` = the chunk JSON with its ``tokenfan`` object, ``text``,
``fin``), then a terminal entry (``end`` = done | error | cancelled, ``error`` = the OpenAI error JSON).
Any other replica asked for a stream it does not hold builds a local *mirror*: a :class:`Stream` in its
own hub fed by ``XREAD`` from the start of the Redis stream. Subscribers then follow the mirror exactly
as they follow a local stream, so replay, resume (``Last-Event-ID`` / ``after``), coalescing and
slow-consumer handling are the same on every replica, and a restarted gateway loses no retained stream.

Retention in Redis follows ``--stream-ttl`` (the key expires that long after the end); a marker key
``tokenfan:k:<id>`` lives longer so an expired id answers 410, not 404. ``DELETE`` on a replica that
does not own the stream is forwarded on the ``tokenfan:cancel`` channel to the owner. A mirror whose
owner vanished mid-generation ends with ``owner_lost`` after ``--broker-idle-timeout`` seconds without
a new entry.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from gateway.errors import APIError
from gateway.streams import Event, Stream, StreamHub, encode_event

log = logging.getLogger(__name__)

CANCEL_CHANNEL = "tokenfan:cancel"
KNOWN_TTL_S = 24 * 3600


def _key(stream_id: str) -> str:
    return f"tokenfan:s:{stream_id}"


def _known(stream_id: str) -> str:
    return f"tokenfan:k:{stream_id}"


class Broker:
    """One Redis connection pool per gateway; publishing is pipelined once per event-loop turn."""

    def __init__(self, url: str, hub: StreamHub, *, idle_timeout: float = 60.0) -> None:
        import redis.asyncio as redis

        self.url = url
        self.hub = hub
        self.idle_timeout = idle_timeout
        self.redis: Any = redis.from_url(url)
        self._pending: list[tuple[str, dict[bytes, bytes], int | None]] = []
        self._flush_scheduled = False
        self._flushed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cancel_task: asyncio.Task[None] | None = None
        self.local_cancel: Any = None  # set by the app: (stream_id) -> bool

    async def start(self) -> None:
        await self.redis.ping()
        self._cancel_task = asyncio.create_task(self._listen_cancels(), name="broker-cancel")
        log.info("broker: Redis Streams at %s", self.url)

    async def close(self) -> None:
        await self.flush()
        for t in [*self._tasks, *( [self._cancel_task] if self._cancel_task else [])]:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.redis.aclose()

    # -- owner side --------------------------------------------------------------------------

    async def created(self, stream: Stream) -> None:
        """Announce a new stream before its id is handed out, so any replica finds it at once."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(_key(stream.id), {b"created": stream.model.encode(), b"endpoint": stream.endpoint.encode()})
        pipe.expire(_key(stream.id), KNOWN_TTL_S)  # bounded even if this owner dies mid-stream
        pipe.set(_known(stream.id), b"1", ex=KNOWN_TTL_S)
        try:
            await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - the stream still works on this replica
            log.error("broker: announcing stream %s failed: %s", stream.id, exc)

    def published(self, stream: Stream, event: Event) -> None:
        """Queue one event of a local stream for Redis (sent with the next pipeline flush)."""
        fields = {b"seq": b"%d" % event.seq, b"data": orjson.dumps(event.chunk), b"text": event.text.encode(),
                  b"fin": (event.finish_reason or "").encode()}
        self._queue(stream.id, fields, None)

    def ended(self, stream: Stream) -> None:
        err = orjson.dumps(stream.error.body()) if stream.error is not None else b""
        self._queue(stream.id, {b"end": stream.state.encode(), b"error": err}, int(self.hub.retention.finished_ttl))

    def _queue(self, stream_id: str, fields: dict[bytes, bytes], expire_s: int | None) -> None:
        self._pending.append((stream_id, fields, expire_s))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            task = asyncio.get_running_loop().create_task(self.flush())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        if not pending:
            return
        pipe = self.redis.pipeline(transaction=False)
        for stream_id, fields, expire_s in pending:
            pipe.xadd(_key(stream_id), fields)
            if expire_s is not None:
                pipe.expire(_key(stream_id), max(1, expire_s))
                pipe.set(_known(stream_id), b"1", ex=KNOWN_TTL_S)
        try:
            await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - a broker outage must not break local streaming
            log.error("broker: publishing %d entries failed: %s", len(pending), exc)

    async def cancel_remote(self, stream_id: str) -> bool:
        """Ask the owning replica to cancel; True if some gateway listened."""
        return bool(await self.redis.publish(CANCEL_CHANNEL, stream_id.encode()))

    async def _listen_cancels(self) -> None:
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(CANCEL_CHANNEL)
        async for message in pubsub.listen():
            if message.get("type") == "message" and self.local_cancel is not None:
                self.local_cancel(message["data"].decode())

    # -- mirror side -------------------------------------------------------------------------

    async def mirror(self, stream_id: str) -> Stream:
        """A local stream fed from Redis, or APIError 404 / 410."""
        existing = self.hub.streams.get(stream_id)
        if existing is not None:
            return existing
        first = await self.redis.xrange(_key(stream_id), count=1)
        if not first:
            if await self.redis.exists(_known(stream_id)):
                raise APIError(410, f"Stream {stream_id} is no longer retained.", code="stream_expired", param="id")
            raise APIError(404, f"No stream with id {stream_id}.", code="stream_not_found", param="id")
        existing = self.hub.streams.get(stream_id)  # created meanwhile by a concurrent subscriber
        if existing is not None:
            return existing
        self.hub.check_capacity()
        header = first[0][1]
        stream = self.hub.create(header.get(b"endpoint", b"").decode(), header.get(b"created", b"").decode(),
                                 stream_id=stream_id)
        stream.mirrored = True
        task = asyncio.create_task(self._feed(stream), name=f"mirror-{stream_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        stream.task = task
        return stream

    async def _feed(self, stream: Stream) -> None:
        last_id = b"0-0"
        try:
            while True:
                reply = await self.redis.xread({_key(stream.id): last_id}, block=int(self.idle_timeout * 1000),
                                               count=512)
                if not reply:
                    stream.finish("error", APIError(
                        502, "The gateway running this stream stopped publishing it.", type="server_error",
                        code="owner_lost"))
                    return
                for entry_id, fields in reply[0][1]:
                    last_id = entry_id
                    if b"created" in fields:
                        continue
                    if b"end" in fields:
                        err = None
                        if fields.get(b"error"):
                            e = orjson.loads(fields[b"error"])["error"]
                            err = APIError(503, e["message"], type=e["type"], param=e["param"], code=e["code"])
                        stream.finish(fields[b"end"].decode(), err)  # type: ignore[arg-type]
                        return
                    self._append(stream, fields)
        except asyncio.CancelledError:
            if not stream.finished:
                stream.finish("cancelled")
            raise
        finally:
            self.hub.mark_finished(stream)

    @staticmethod
    def _append(stream: Stream, fields: dict[bytes, bytes]) -> None:
        seq = int(fields[b"seq"])
        if seq != len(stream.events):
            return  # duplicate or out of order: never the case for one XADD writer, but never corrupt the log
        chunk = orjson.loads(fields[b"data"])
        stream.append(encode_event(seq, chunk, fields[b"text"].decode(), fields[b"fin"].decode() or None))

