"""The floor: a minimal fan-out server that writes pre-encoded SSE and WebSocket frames.

It speaks just enough of the gateway's fan-out API for the bench clients (``POST /v1/streams``,
``GET events_url`` as SSE, ``ws_url`` as WebSocket, ``/health``, ``/metrics`` with
``process_cpu_seconds_total``) and paces every stream like the synthetic engine (TTFT, then one
token every ``1/tokens_per_s``). Each stream has one ticker; on every token it formats the chunk
once (a byte template with the numbers spliced in) and writes the same frame to each subscriber:
``transport.write`` for SSE (HTTP/1.1 chunked, keep-alive), ``websockets`` server for WS.
No engine, no ZeroMQ, no ASGI, no per-subscriber tasks: what is left is the cost of the sockets.

Run: ``python -m tokenfan_bench.raw_server --port P --ws-port Q --tokens-per-s 20 --ttft-ms 20``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidState

WORDS = [b" The", b" gateway", b" writes", b" every", b" token", b" to", b" each", b" subscriber", b"."]
CHUNK = (b'{"id":"%s","object":"chat.completion.chunk","created":%d,"model":"raw","system_fingerprint":null,'
         b'"choices":[{"index":0,"delta":{%s},"logprobs":null,"finish_reason":%s}],'
         b'"tokenfan":{"seq":%d,"emit_ns":%d,"sent_ns":%d}}')


@dataclass(eq=False)
class RawStream:
    id: str
    max_tokens: int
    frames: list[tuple[bytes, str]] = field(default_factory=list)  # (SSE chunk frame, WS text)
    sse: set[asyncio.StreamWriter] = field(default_factory=set)
    ws: set[ServerConnection] = field(default_factory=set)
    finished: asyncio.Event = field(default_factory=asyncio.Event)


def ws_write(s: RawStream, ws: ServerConnection, payload: bytes) -> None:
    """Frame and write without awaiting (no lock, no drain): the floor, not a robust server."""
    try:
        ws.protocol.send_text(payload)
        ws.send_data()
    except (InvalidState, ConnectionClosed):
        s.ws.discard(ws)


def http_chunk(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


SSE_DONE = http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"


class RawServer:
    def __init__(self, tokens_per_s: float, ttft_ms: float, host: str, port: int, ws_port: int) -> None:
        self.interval = 1.0 / tokens_per_s
        self.ttft = ttft_ms / 1000.0
        self.host, self.port, self.ws_port = host, port, ws_port
        self.streams: dict[str, RawStream] = {}
        self.sent = {"sse": 0, "ws": 0}

    # -- generation ---------------------------------------------------------------------------

    def publish(self, s: RawStream, seq: int, delta: bytes, finish: bytes) -> None:
        now = time.time_ns()
        data = CHUNK % (s.id.encode(), now // 1_000_000_000, delta, finish, seq, now, now)
        frame = http_chunk(b"id: %d\ndata: %b\n\n" % (seq, data))
        text = f'{{"type":"chunk","seq":{seq},"data":{data.decode()}}}'
        s.frames.append((frame, text))
        for w in list(s.sse):
            if w.is_closing():
                s.sse.discard(w)
            else:
                w.write(frame)
        self.sent["sse"] += len(s.sse)
        payload = text.encode()
        for ws in list(s.ws):
            ws_write(s, ws, payload)
        self.sent["ws"] += len(s.ws)

    async def tick(self, s: RawStream) -> None:
        loop = asyncio.get_running_loop()
        self.publish(s, 0, b'"role":"assistant","content":""', b"null")
        start = loop.time() + self.ttft
        for k in range(s.max_tokens):
            delay = start + k * self.interval - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            word = WORDS[k % len(WORDS)]
            finish = b'"length"' if k == s.max_tokens - 1 else b"null"
            self.publish(s, k + 1, b'"content":"%b"' % word, finish)
        s.finished.set()
        for w in s.sse:
            w.write(SSE_DONE)
        for ws in list(s.ws):
            ws_write(s, ws, b'{"type":"done"}')

    # -- HTTP -----------------------------------------------------------------------------------

    async def handle_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                path = urlsplit(target).path
                if method == "POST" and path == "/v1/streams":
                    self.create(body, writer)
                elif method == "GET" and path.startswith("/v1/streams/") and path.endswith("/events"):
                    await self.events(path.split("/")[3], writer)
                elif path == "/health":
                    respond(writer, 200, b'{"status":"ok"}')
                elif path == "/metrics":
                    respond(writer, 200, self.metrics(), b"text/plain; version=0.0.4")
                else:
                    respond(writer, 404, b'{"error":"not found"}')
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    def create(self, body: bytes, writer: asyncio.StreamWriter) -> None:
        req = orjson.loads(body or b"{}")
        s = RawStream(id="raw-" + uuid.uuid4().hex, max_tokens=int(req.get("max_tokens", 16)))
        self.streams[s.id] = s
        asyncio.get_running_loop().create_task(self.tick(s))
        host = f"{self.host}"
        respond(writer, 201, orjson.dumps({
            "id": s.id, "object": "tokenfan.stream",
            "events_url": f"http://{host}:{self.port}/v1/streams/{s.id}/events",
            "ws_url": f"ws://{host}:{self.ws_port}/v1/streams/{s.id}/ws"}))

    async def events(self, sid: str, writer: asyncio.StreamWriter) -> None:
        s = self.streams.get(sid)
        if s is None:
            respond(writer, 404, b'{"error":"no such stream"}')
            return
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        writer.write(b"".join(f for f, _ in s.frames))
        if s.finished.is_set():
            writer.write(SSE_DONE)
            return
        s.sse.add(writer)
        try:
            await s.finished.wait()
        finally:
            s.sse.discard(writer)

    async def handle_ws(self, ws: ServerConnection) -> None:
        sid = ws.request.path.split("/")[3] if ws.request is not None else ""
        s = self.streams.get(sid)
        if s is None:
            await ws.close(1008, "no such stream")
            return
        for _, text in s.frames:
            ws.protocol.send_text(text.encode())
        ws.send_data()
        if not s.finished.is_set():
            s.ws.add(ws)
            try:
                await s.finished.wait()
            finally:
                s.ws.discard(ws)
        else:
            ws.protocol.send_text(b'{"type":"done"}')
            ws.send_data()
        try:
            await ws.close(1000, "done")
        except ConnectionClosed:
            pass

    def metrics(self) -> bytes:
        cpu = time.process_time()
        return (b"process_cpu_seconds_total %f\n" % cpu
                + b"".join(b'tokenfan_chunks_sent_total{transport="%s"} %d\n' % (t.encode(), n)
                           for t, n in self.sent.items()))

    async def serve(self) -> None:
        http = await asyncio.start_server(self.handle_http, self.host, self.port, backlog=4096)
        async with http, serve(self.handle_ws, self.host, self.ws_port, compression=None, ping_interval=None,
                               max_size=None, backlog=4096):
            await asyncio.Future()


def respond(writer: asyncio.StreamWriter, status: int, body: bytes, ctype: bytes = b"application/json") -> None:
    reason = {200: b"OK", 201: b"Created", 404: b"Not Found"}.get(status, b"")
    writer.write(b"HTTP/1.1 %d %b\r\ncontent-type: %b\r\ncontent-length: %d\r\n\r\n%b"
                 % (status, reason, ctype, len(body), body))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tokenfan_bench.raw_server", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True, help="HTTP (SSE) port")
    ap.add_argument("--ws-port", type=int, required=True, help="WebSocket port")
    ap.add_argument("--tokens-per-s", type=float, default=20.0)
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ns = ap.parse_args(argv)
    server = RawServer(ns.tokens_per_s, ns.ttft_ms, ns.host, ns.port, ns.ws_port)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(server.serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
