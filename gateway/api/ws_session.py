"""What the two request/response WebSocket protocols share (``/v1/ws`` and the Responses API's
WebSocket mode): one receive loop, many generations in flight, one connection that a cut ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from starlette.websockets import WebSocket

from gateway.core.conn import PEER_GONE, WsConn
from gateway.errors import APIError, error_class
from gateway.state import Gateway

log = logging.getLogger(__name__)


class WsSession:
    """Receive client messages until the client leaves or a reader cut the socket; then cancel every
    generation task (each aborts its generation on the way out). Subclasses implement :meth:`on_message`."""

    def __init__(self, gw: Gateway, ws: WebSocket) -> None:
        self.gw = gw
        self.ws = ws
        self.conn = WsConn.of(ws, gw.policy.linger)
        self.tasks: dict[Any, asyncio.Task[None]] = {}
        self.writes: set[asyncio.Task[None]] = set()  # send_text's, cancelled with the generations at the end
        self.cut = asyncio.Event()
        self.closing = False  # the session is ending: no new generation starts

    async def run(self) -> None:
        cut_wait = asyncio.ensure_future(self.cut.wait())
        try:
            while True:
                recv = asyncio.ensure_future(self.ws.receive())
                await asyncio.wait({recv, cut_wait}, return_when=asyncio.FIRST_COMPLETED)
                if not recv.done():
                    recv.cancel()
                    break  # a reader was cut as too slow: the socket is closed already
                msg = recv.result()
                if msg["type"] == "websocket.disconnect":
                    break
                raw = msg.get("text") or msg.get("bytes") or b""
                self.on_message(raw.encode() if isinstance(raw, str) else raw)
        finally:
            self.closing = True
            cut_wait.cancel()
            tasks = [*self.tasks.values(), *self.writes]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def on_message(self, raw: bytes) -> None:
        raise NotImplementedError

    def spawn(self, key: Any, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None] | None:
        """Run ``work`` as the generation task ``key`` (None, and ``work`` closed, once the session ends)."""
        if self.closing or self.cut.is_set():
            work.close()
            return None
        task = asyncio.create_task(work, name=name)
        self.tasks[key] = task
        task.add_done_callback(lambda _t: self.tasks.pop(key, None) if self.tasks.get(key) is _t else None)
        return task

    def send_text(self, text: str, err: APIError | None = None) -> None:
        """Queue one message (errors are counted); never blocks the receive loop."""
        if err is not None:
            self.gw.metrics.errors.labels(error_class(err)).inc()
        task = asyncio.create_task(self.write(text), name="ws-send")
        self.writes.add(task)
        task.add_done_callback(self._written)

    def _written(self, task: asyncio.Task[None]) -> None:
        self.writes.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("sending a WebSocket message failed", exc_info=exc)

    async def write(self, text: str) -> None:
        if not self.conn.closed:
            with contextlib.suppress(*PEER_GONE):  # the client left or the socket was cut: nobody to tell
                await self.conn.write(text)

    async def cut_now(self, code: int, reason: str) -> None:
        """A reader of this socket was cut: close it at once and end the session."""
        self.cut.set()
        await self.conn.cut(code, reason)
