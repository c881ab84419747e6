"""A switchable TCP endpoint: the one address every gateway reaches Redis at, standing for a managed Redis
endpoint (a DNS name or a proxy that leads to the current primary). :meth:`Endpoint.switch` leads it to
another server and closes every connection it carries, as a failover does (the old primary's connections die
with it). :meth:`Endpoint.hold` stops forwarding while every connection stays open (bytes wait in the kernel's
buffers, then die with the connection): between a primary and its replica, a replication link that falls
behind without breaking. Byte for byte, no delay; it runs its own event loop in a daemon thread, so a synchronous bench and
an in-process async test drive it alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading


class Endpoint:
    """Listens on ``host``:``port`` (a free port) and forwards each connection to ``host``:``target``."""

    def __init__(self, target: int, host: str = "127.0.0.1") -> None:
        self.host, self.target = host, target
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._closed = False
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self.port: int = sock.getsockname()[1]
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, sock=sock))
        self._thread = threading.Thread(target=self._loop.run_forever, name="redis-endpoint", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def switch(self, target: int) -> None:
        """Lead new connections to ``target``; every open one is closed (its clients reconnect to ``target``)."""
        asyncio.run_coroutine_threadsafe(self._switch(target), self._loop).result(10)

    def hold(self, held: bool = True) -> None:
        """Stop forwarding (``held``), or go on; connections stay open either way."""
        async def flow() -> None:
            (self._flowing.clear if held else self._flowing.set)()

        asyncio.run_coroutine_threadsafe(flow(), self._loop).result(10)  # in force when this returns

    async def _switch(self, target: int) -> None:
        self.target = target
        for w in list(self._writers):
            w.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(self.host, self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_w}

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while (await self._flowing.wait()) and (data := await r.read(65536)):
                    await self._flowing.wait()
                    w.write(data)
                    await w.drain()
            w.transport.abort()  # either side gone: both go (a dead primary resets its clients)

        try:
            await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        finally:
            self._writers -= {writer, up_w}

    def close(self) -> None:
        """Stop listening and abort every connection (what a held link held is lost)."""
        if self._closed:
            return
        self._closed = True

        async def stop() -> None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            self._flowing.set()  # held pipes see their connections gone and end
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if tasks:
                await asyncio.wait(tasks, timeout=2)

        with contextlib.suppress(RuntimeError, TimeoutError):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
