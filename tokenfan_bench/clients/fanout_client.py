"""One client process of ``tokenfan bench fanout``: thousands of raw SSE and WebSocket subscribers.

Each subscriber is an ``asyncio.Protocol`` on its own connection (from its own loopback source address, so
20,000 connections do not run out of ephemeral ports), that parses what it gets: HTTP/1.1 chunked SSE
(:class:`~tokenfan_bench.wire.http1.ResponseParser`, :class:`~tokenfan_bench.wire.events.SseDecoder`) or
WebSocket frames (:class:`~tokenfan_bench.wire.events.WsDecoder`, the messages decoded with orjson). Every
read is stamped with ``time.monotonic_ns()`` first thing and parsed later in the same loop turn
(:class:`~tokenfan_bench.clients.fast.ReadBatch`), so one subscriber's parsing never makes another's stamp
late. Receipts go into :mod:`tokenfan_bench.stats.spread` tallies; nothing per event is kept.

A *slow* subscriber (``--slow``) asks for a tiny receive buffer and stops reading after its response
head; it reads again only once the stream was ended, to see whether the gateway cut it.

The coordinator (:mod:`tokenfan_bench.fanout`) drives it over a pipe: ``("open", plan)`` → ``("ready",
info)`` once every subscriber has had its first event; ``("end", None)`` → ``("result", …)`` once every
subscriber has ended (or the end timeout passed).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
import time
from multiprocessing.connection import Connection
from typing import Any, cast

import orjson

from tokenfan_bench.clients.fast import ReadBatch
from tokenfan_bench.stats.spread import Outcome, Tally, add_receipt
from tokenfan_bench.wire.events import OP_CLOSE, OP_PING, OP_PONG, OP_TEXT, SseDecoder, WsDecoder, ws_frame
from tokenfan_bench.wire.http1 import HttpError, ResponseParser

monotonic_ns = time.monotonic_ns
SLOW_RCVBUF = 4096  # bytes the kernel may hold for a slow subscriber (it doubles and floors it)
OPEN_AT_ONCE = 64  # connections being opened at a time by one process


class Subscriber(asyncio.Protocol):
    """One connection reading one stream."""

    def __init__(self, client: FanoutClient, stream: int, transport: str, slow: bool, request: bytes) -> None:
        self.client = client
        self.out = Outcome(stream, transport, slow)
        self.tally: Tally | None = None if slow else client.tallies[stream]
        self.request = request
        self.transport: asyncio.Transport | None = None
        self.http = ResponseParser() if transport == "sse" else None
        self.sse = SseDecoder()
        self.ws: WsDecoder | None = None
        self.head = b""
        self.ended = client.loop.create_future()
        self.first = client.loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.client.batch.add(self.on_data, monotonic_ns(), data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.batch.add(self.on_lost, 0, exc)

    def on_lost(self, _t: int, exc: Exception | None) -> None:
        if exc is not None and not self.out.detail:
            self.out.detail = repr(exc)
        self.finish()

    def finish(self) -> None:
        if not self.first.done():
            self.first.set_result(None)
        if not self.ended.done():
            self.ended.set_result(None)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def on_data(self, t: int, data: bytes) -> None:
        if self.ended.done():
            return
        try:
            if self.http is not None:
                self.on_sse(t, data)
            else:
                self.on_ws(t, data)
        except (HttpError, ValueError, KeyError, TypeError) as exc:
            self.out.end, self.out.detail = "error", f"unreadable: {exc!r}"[:200]
            self.finish()

    def stop_reading(self) -> None:
        """A slow subscriber, subscribed: from here on it reads nothing until the end (it counts as ready)."""
        assert self.transport is not None
        self.transport.pause_reading()
        if not self.first.done():
            self.first.set_result(None)

    def got(self, seq: int, t: int) -> None:
        self.out.got(seq)
        if self.tally is not None:
            add_receipt(self.tally, seq, t)
        if not self.first.done():
            self.first.set_result(None)

    def ended_with(self, end: str, detail: str = "") -> None:
        if self.out.end in ("lost", "") or end == "cut":
            self.out.end = end
        if detail:
            self.out.detail = detail[:200]
        self.finish()

    def on_sse(self, t: int, data: bytes) -> None:
        assert self.http is not None
        body = self.http.feed(data)
        head = self.http.head
        if head is not None and head.status != 200:
            self.ended_with("failed", f"HTTP {head.status}: {self.http.leftover[:120]!r}")
            return
        if self.out.slow and head is not None and not self.client.ending and self.transport is not None:
            self.stop_reading()
        for ev in self.sse.feed(body) if body else ():
            if ev.event == "message":
                if ev.data == b"[DONE]":
                    self.ended_with("done")
                    return
                self.got(int(ev.id or -1), t)
            elif ev.event == "error":
                code = orjson.loads(ev.data).get("error", {}).get("code") or "error"
                self.ended_with("cut" if code == "slow_consumer" else "error", code)
        if self.http.complete:
            self.ended_with("lost", "response ended without [DONE]")

    def on_ws(self, t: int, data: bytes) -> None:
        if self.ws is None:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            if b" 101 " not in self.head[:16]:
                self.ended_with("failed", self.head[:160].decode("latin-1"))
                return
            data, self.ws = self.head[end + 4:], WsDecoder()
            if self.out.slow and self.transport is not None and not self.client.ending:
                self.stop_reading()
        for frame in self.ws.feed(data):
            if frame.opcode == OP_TEXT:
                msg = orjson.loads(frame.payload)
                kind = msg.get("type")
                if kind == "chunk":
                    self.got(msg["seq"], t)
                elif kind == "done":
                    self.ended_with("done")
                    return
                elif kind == "error":
                    self.ended_with("error", str(msg.get("error", {}).get("code")))
                    return
            elif frame.opcode == OP_PING and self.transport is not None:  # unanswered, the server closes 1011
                self.transport.write(ws_frame(OP_PONG, frame.payload, os.urandom(4)))
            elif frame.opcode == OP_CLOSE:
                code = int.from_bytes(frame.payload[:2], "big") if len(frame.payload) >= 2 else 1005
                self.ended_with("cut" if code == 1013 else ("done" if self.out.end == "done" else "lost"),
                                f"close {code}")
                return


def sse_request(host: str, port: int, stream_id: str) -> bytes:
    return (f"GET /v1/streams/{stream_id}/events HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Accept: text/event-stream\r\n\r\n").encode()


def ws_request(host: str, port: int, stream_id: str) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (f"GET /v1/streams/{stream_id}/ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()


class FanoutClient:
    """The subscribers of one process, from a plan: ``host``, ``port``, ``source`` (local address),
    ``streams`` (ids) and ``subs`` (``[stream index, "sse" | "ws", slow]`` each)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, plan: dict[str, Any]) -> None:
        self.loop = loop
        self.plan = plan
        self.batch = ReadBatch(loop)
        self.tallies: list[Tally] = [{} for _ in plan["streams"]]
        self.subs: list[Subscriber] = []
        self.ending = False

    async def open_all(self) -> dict[str, Any]:
        plan = self.plan
        host, port, ids = plan["host"], plan["port"], plan["streams"]
        gate = asyncio.Semaphore(OPEN_AT_ONCE)

        async def open_one(sub: Subscriber) -> None:
            async with gate:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    if sub.out.slow:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RCVBUF)
                    sock.bind((plan["source"], 0))
                    await self.loop.sock_connect(sock, (host, port))
                    await self.loop.create_connection(lambda: sub, sock=sock)
                except OSError as exc:
                    sock.close()
                    sub.out.end, sub.out.detail = "failed", repr(exc)[:200]
                    sub.finish()
                    return
            await sub.first

        for k, kind, slow in plan["subs"]:
            make = sse_request if kind == "sse" else ws_request
            self.subs.append(Subscriber(self, k, kind, slow, make(host, port, ids[k])))
        await asyncio.gather(*(open_one(s) for s in self.subs))
        return {"subscribers": len(self.subs), "failed": sum(1 for s in self.subs if s.out.end == "failed"),
                "max_seq": max((s.out.last for s in self.subs), default=-1)}

    async def end_all(self, timeout: float) -> None:
        self.ending = True
        for s in self.subs:  # the slow ones read again: what the gateway left them says if it cut them
            if s.out.slow and s.transport is not None and not s.transport.is_closing():
                with contextlib.suppress(RuntimeError):
                    s.transport.resume_reading()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(s.ended for s in self.subs))
        for s in self.subs:
            s.finish()


def serve(conn: Connection, nice: int = 0) -> None:
    """The process's body: run the plan the coordinator sends, answer on ``conn`` (at niceness ``nice``)."""
    import resource

    import uvloop

    if nice:
        os.nice(nice)

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        cmd, plan = await loop.run_in_executor(None, conn.recv)
        assert cmd == "open"
        client = FanoutClient(loop, plan)
        info = await client.open_all()
        conn.send(("ready", info))
        cmd, end_timeout = await loop.run_in_executor(None, conn.recv)
        assert cmd == "end"
        await client.end_all(end_timeout)
        await asyncio.sleep(0)
        conn.send(("result", {"tallies": client.tallies, "outcomes": [s.out.as_row() for s in client.subs],
                              "cpu_s": time.process_time()}))

    uvloop.run(main())
