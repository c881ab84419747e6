"""The fast client backend of the bench workers: HTTP/1.1 and WebSocket (:mod:`tokenfan_bench.clients.fast`)
and HTTP/2 (:mod:`tokenfan_bench.clients.fast_h2`) behind one ``post`` / ``subscribe``."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenfan_bench.clients.fast import (
    FAST_ERRORS,
    H1Pool,
    ReadBatch,
    client_ssl_context,
    subscribe_ws,
    target_of,
)
from tokenfan_bench.clients.fast_h2 import H2Pool
from tokenfan_bench.clients.recorder import Recorder


class FastBackend:
    """H1Pool per origin, picows, :mod:`tokenfan_bench.clients.fast_h2` for the HTTP/2 arms and
    :mod:`tokenfan_bench.clients.quic` (aioquic) for ``sse-h3`` and ``wt``."""

    name = "fast"
    transports = ("sse", "ws", "sse-h2", "ws-h2", "sse-h3", "wt")

    def __init__(self, cafile: str | None, h2_streams_per_connection: int = 1) -> None:
        self.batch = ReadBatch(asyncio.get_running_loop())
        self.ssl_ctx = client_ssl_context(cafile)
        self.h2_ssl_ctx = client_ssl_context(cafile, "h2")
        self.pools: dict[tuple[str, str, int], H1Pool] = {}
        self.h2_streams_per_connection = h2_streams_per_connection
        self.h2pools: dict[tuple[str, str, int], H2Pool] = {}
        self.cafile = cafile
        self.quic: Any = None  # tokenfan_bench.clients.quic.QuicBackend, on the first QUIC arm
        self.errors: tuple[type[Exception], ...] = FAST_ERRORS
        try:  # a QUIC arm's failure is a subscriber's error too
            from tokenfan_bench.clients.quic import QUIC_ERRORS

            self.errors = (*FAST_ERRORS, *QUIC_ERRORS)
        except ImportError:  # aioquic is a gateway dependency, but the bench may run without it
            pass

    def _pool(self, url: str) -> tuple[H1Pool, str]:
        scheme, host, port, target = target_of(url)
        pool = self.pools.get((scheme, host, port))
        if pool is None:
            pool = self.pools[scheme, host, port] = H1Pool(self.batch, host, port,
                                                           self.ssl_ctx if scheme == "https" else None)
        return pool, target

    def _h2pool(self, url: str) -> tuple[H2Pool, str]:
        scheme, host, port, target = target_of(url)
        pool = self.h2pools.get((scheme, host, port))
        if pool is None:
            pool = self.h2pools[scheme, host, port] = H2Pool(
                self.batch, scheme, host, port, self.h2_ssl_ctx if scheme in ("https", "wss") else None,
                self.h2_streams_per_connection)
        return pool, target

    async def post(self, url: str, body: bytes) -> tuple[int, bytes]:
        pool, target = self._pool(url)
        head, data = await pool.fetch("POST", target, {"content-type": "application/json"}, body)
        return head.status, data

    async def subscribe(self, transport: str, info: dict[str, Any], rec: Recorder) -> None:
        if transport == "sse":
            pool, target = self._pool(info["events_url"])
            await pool.sse(target, rec)
        elif transport == "ws":
            url = info["ws_url"]
            await subscribe_ws(url, rec, self.batch, self.ssl_ctx if url.startswith("wss:") else None)
        elif transport == "sse-h2":
            h2pool, target = self._h2pool(info["events_url"])
            await h2pool.sse(target, rec)
        elif transport in ("sse-h3", "wt"):
            if self.quic is None:
                from tokenfan_bench.clients.quic import QuicBackend

                self.quic = QuicBackend(self.cafile, self.h2_streams_per_connection)
            await self.quic.subscribe(transport, info, rec)
        else:  # ws-h2
            h2pool, target = self._h2pool(info["ws_url"])
            await h2pool.websocket(target, rec)

    async def aclose(self) -> None:
        for pool in self.pools.values():
            pool.close()
        for h2pool in self.h2pools.values():
            h2pool.close()
        if self.quic is not None:
            await self.quic.aclose()
