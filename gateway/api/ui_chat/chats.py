"""Which stream runs a chat's answer now: chat id -> stream id, here and, with ``--broker``, in Redis.

``GET /api/chat/{id}/stream`` knows only the chat's id. The gateway that runs the answer (its owner) keeps
the id of its stream in :class:`ChatIndex` while it runs; with ``--broker`` it also writes it to Redis,
so a replica that does not run it finds the stream id there and mirrors the stream like any listed stream.

The Redis entry uses the broker's keyed store for small values (:meth:`Publisher.put_transcript` /
:meth:`StreamBroker.transcript`, where stored responses keep their transcripts under ``resp_`` ids) under
``ui-chat:<chat id>``: the stream id while the answer runs, empty once it ended (written only if the entry
still names that stream, so a newer answer of the chat is not hidden; a newer answer started on another
replica in the same few milliseconds can still be). Writes are in the background, as the transcripts'.
With ``--workers`` and no broker, the index is per worker.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from gateway.errors import APIError

if TYPE_CHECKING:
    from gateway.core.streams import Stream
    from gateway.state import Gateway

log = logging.getLogger(__name__)

KEY_PREFIX = "ui-chat:"
RUNNING_TTL_S = 24 * 3600  # bounds an entry whose owner died before it could clear it


def broker_key(chat_id: str) -> str:
    return KEY_PREFIX + chat_id


class ChatIndex:
    """The chats whose answers this gateway runs, and the lookup of the others' through the broker."""

    def __init__(self) -> None:
        self.running: dict[str, str] = {}  # chat id -> stream id, while the stream runs here
        self._tasks: set[asyncio.Task[None]] = set()

    def started(self, gw: Gateway, chat_id: str, stream: Stream) -> None:
        """``stream`` answers ``chat_id`` now; forgotten when its generation ends."""
        self.running[chat_id] = stream.id
        if gw.publisher is not None:
            gw.publisher.put_transcript(broker_key(chat_id), stream.id.encode(), RUNNING_TTL_S)
        if stream.task is not None:
            stream.task.add_done_callback(lambda _t: self.ended(gw, chat_id, stream.id))

    def ended(self, gw: Gateway, chat_id: str, stream_id: str) -> None:
        if self.running.get(chat_id) == stream_id:
            del self.running[chat_id]
        if gw.publisher is not None and gw.remote is not None:
            task = asyncio.get_running_loop().create_task(self._clear(gw, chat_id, stream_id),
                                                          name=f"ui-chat-clear-{stream_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _clear(self, gw: Gateway, chat_id: str, stream_id: str) -> None:
        assert gw.publisher is not None and gw.remote is not None
        key = broker_key(chat_id)
        try:
            if await gw.remote.transcript(key) == stream_id.encode():
                gw.publisher.put_transcript(key, b"", gw.config.retention.finished_ttl)
        except APIError as exc:  # the broker's 503: the entry then expires by its TTL
            log.warning("ui chat %s: its ended stream stays named in Redis (%s)", chat_id, exc)

    async def lookup(self, gw: Gateway, chat_id: str) -> str | None:
        """The id of the stream answering ``chat_id`` here or (``--broker``) on another replica, or None."""
        local = self.running.get(chat_id)
        if local is not None or gw.publisher is None or gw.remote is None:
            return local
        data = await gw.remote.transcript(broker_key(chat_id))
        return data.decode() if data else None
