"""The python client (``--client python``): httpx for SSE (HTTP/1.1, and HTTP/2 through httpx's h2
support for ``sse-h2``) and ``websockets`` for WebSocket. ~190 µs of CPU per received event: kept
as a reference for the fast client and for comparisons with earlier runs.

Timestamps: the receive time is taken right after each read returns, then the subscriber yields
once before parsing (see :func:`_let_others_stamp`).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from typing import Any

import httpx
import orjson
import websockets
from websockets.asyncio.client import connect as ws_connect

from tokenfan_bench.clients.recorder import Recorder, on_sse_event, on_ws_message
from tokenfan_bench.wire.events import SseDecoder

PY_ERRORS: tuple[type[Exception], ...] = (httpx.HTTPError, websockets.exceptions.WebSocketException, OSError,
                                              orjson.JSONDecodeError, KeyError, TypeError)


async def _let_others_stamp() -> None:
    """Yield once between taking a receive time and parsing.

    When several subscribers' data arrive in one event-loop iteration, their coroutines resume one
    after the other; without this, the second one's timestamp would include the first one's
    parsing, a fixed per-stream order bias between two subscribers of the same stream.
    """
    await asyncio.sleep(0)


async def subscribe_sse(http: httpx.AsyncClient, url: str, rec: Recorder) -> None:
    async with http.stream("GET", url, headers={"Accept": "text/event-stream"}) as r:
        rec.connected_ns = time.time_ns()
        if r.status_code != 200:
            rec.fail(f"SSE HTTP {r.status_code}")
            return
        dec = SseDecoder()
        async for data in r.aiter_raw():
            t = time.time_ns()  # before parsing: every event completed by this read arrived now
            await _let_others_stamp()
            for ev in dec.feed(data):
                on_sse_event(rec, t, ev)
    if not rec.done:
        rec.fail("SSE closed before [DONE]")


async def subscribe_ws(url: str, rec: Recorder, ssl_ctx: ssl.SSLContext | None) -> None:
    async with ws_connect(url, compression=None, max_size=None, ping_interval=None, proxy=None,
                          open_timeout=30, close_timeout=2, ssl=ssl_ctx if url.startswith("wss:") else None) as ws:
        rec.connected_ns = time.time_ns()
        async for raw in ws:
            t = time.time_ns()
            await _let_others_stamp()
            on_ws_message(rec, t, raw)
    if not rec.done:
        rec.fail("WS closed before done")


class PythonBackend:
    """httpx + websockets."""

    name = "python"
    errors = PY_ERRORS
    transports = ("sse", "ws", "sse-h2")

    def __init__(self, slots: int, timeout: float, cafile: str | None) -> None:
        from tokenfan_bench.clients.fast import client_ssl_context

        ssl_ctx = client_ssl_context(cafile) if cafile else None
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=4 * slots + 8)
        kw: dict[str, Any] = {"limits": limits, "trust_env": False, "timeout": httpx.Timeout(timeout, connect=30.0),
                              "verify": ssl_ctx if ssl_ctx is not None else False}
        self.http = httpx.AsyncClient(**kw)
        self._h2kw = kw
        self._http2: httpx.AsyncClient | None = None
        self.ssl_ctx = ssl_ctx or client_ssl_context(None)

    async def post(self, url: str, body: bytes) -> tuple[int, bytes]:
        r = await self.http.post(url, content=body, headers={"Content-Type": "application/json"})
        return r.status_code, r.content

    async def subscribe(self, transport: str, info: dict[str, Any], rec: Recorder) -> None:
        if transport == "sse":
            await subscribe_sse(self.http, info["events_url"], rec)
        elif transport == "sse-h2":
            if self._http2 is None:  # one client: httpx multiplexes its HTTP/2 requests on few connections
                self._http2 = httpx.AsyncClient(http1=False, http2=True, **self._h2kw)  # h2c for http://
            await subscribe_sse(self._http2, info["events_url"], rec)
        else:
            await subscribe_ws(info["ws_url"], rec, self.ssl_ctx)

    async def aclose(self) -> None:
        await self.http.aclose()
        if self._http2 is not None:
            await self._http2.aclose()
