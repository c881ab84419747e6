"""The floor: one process writing pre-framed events to N connections in a tight loop.

It speaks just enough of the gateway's API for the bench clients, on one port:
``POST /v1/streams``, ``GET events_url`` (SSE over HTTP/1.1, chunked, keep-alive), ``ws_url``
(WebSocket upgrade on the same port), ``DELETE /v1/streams/{id}``, ``/health`` and ``/metrics`` (``process_cpu_seconds_total``),
and paces every stream like the synthetic engine (TTFT, then one token every ``1/tokens_per_s``; with
``--steps shared`` on one step clock, as ``--synthetic-steps shared``).
For ``tokenfan bench cpu`` (:mod:`tokenfan_bench.cpu.gateway_cost`) also the per-request paths, minimally:
``POST /v1/chat/completions`` and ``POST /v1/responses`` with ``stream: true`` (the chunks, resp. the
``response.created`` / ``response.output_text.delta`` / ``response.completed`` events, nothing else) and
``/v1/ws`` (``request`` messages multiplexed on one socket; ``chunk`` and ``done`` messages back); with
``?tokenfan_timing=1`` their chunks carry the ``tokenfan`` timing object too, as the gateway's do.
``--stream-interval N`` sends N tokens per event, one event every N steps (the engine's ``--stream-interval``).

One timer heap drives every stream. When tokens are due, each is formatted once (a byte template
with the numbers spliced in), framed once per wire format (an HTTP chunk holding the SSE event, a
WebSocket text frame), and the same bytes go to every subscriber with ``transport.write`` in one
loop (a ``/v1/ws`` socket gets one write per tick for all its generations): no engine, no ZeroMQ, no ASGI, no task and no await per connection or per stream, no
per-subscriber state but the socket. What is left is the cost of the sockets.

Run: ``python -m tokenfan_bench.servers.raw_floor --port P --tokens-per-s 20 --ttft-ms 20``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import hashlib
import heapq
import itertools
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import orjson

from tokenfan_bench.wire.events import (
    OP_CLOSE,
    OP_PING,
    OP_PONG,
    OP_TEXT,
    WS_GUID,
    WsDecoder,
    ws_close_payload,
    ws_frame,
)

WORDS = [b" The", b" gateway", b" writes", b" every", b" token", b" to", b" each", b" subscriber", b"."]
CHUNK = (b'{"id":"%s","object":"chat.completion.chunk","created":%d,"model":"raw","system_fingerprint":null,'
         b'"choices":[{"index":0,"delta":{%s},"logprobs":null,"finish_reason":%s}],'
         b'"tokenfan":{"seq":%d,"emit_ns":%d,"sent_ns":%d}}')
PLAIN_CHUNK = (b'{"id":"%s","object":"chat.completion.chunk","created":%d,"model":"raw","system_fingerprint":null,'
               b'"choices":[{"index":0,"delta":{%s},"logprobs":null,"finish_reason":%s}]}')
RESP_DELTA = (b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","item_id":"msg_%s",'
              b'"output_index":0,"content_index":0,"delta":"%s","logprobs":[],"sequence_number":%d}\n\n')
SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n")
MAX_HEAD = 64 * 1024
TIMER_RESOLUTION = 0.001  # seconds: uvloop's clock (libuv's uv_now) moves in whole milliseconds


def http_chunk(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


SSE_DONE = http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
WS_DONE = ws_frame(OP_TEXT, b'{"type":"done"}') + ws_frame(OP_CLOSE, ws_close_payload(1000, "done"))


@dataclass(eq=False)
class RawStream:
    id: str
    max_tokens: int
    next_seq: int = 0
    sse_frames: list[bytes] = field(default_factory=list)  # for late joiners
    ws_frames: list[bytes] = field(default_factory=list)
    sse: list[asyncio.Transport] = field(default_factory=list)
    ws: list[asyncio.Transport] = field(default_factory=list)
    posts: list[asyncio.Transport] = field(default_factory=list)  # POST /v1/chat/completions, stream
    responses: list[asyncio.Transport] = field(default_factory=list)  # POST /v1/responses, stream
    mux: list[tuple[asyncio.Transport, bytes]] = field(default_factory=list)  # /v1/ws: (socket, JSON of the id)
    finished: bool = False
    fanout: bool = True  # keep frames for late joiners (the per-request paths have no late joiners)
    timing: bool = False  # the per-request paths' chunks carry the timing object (?tokenfan_timing=1)


def respond(transport: asyncio.Transport, status: int, body: bytes, ctype: bytes = b"application/json") -> None:
    reason = {200: b"OK", 201: b"Created", 400: b"Bad Request", 404: b"Not Found"}.get(status, b"")
    transport.write(b"HTTP/1.1 %d %b\r\ncontent-type: %b\r\ncontent-length: %d\r\n\r\n%b"
                    % (status, reason, ctype, len(body), body))


class RawServer:
    def __init__(self, tokens_per_s: float, ttft_ms: float, host: str, port: int, shared_steps: bool = False,
                 stream_interval: int = 1) -> None:
        self.stream_interval = stream_interval  # tokens per event
        self.interval = stream_interval / tokens_per_s
        self.hold_ns = int((stream_interval - 1) / tokens_per_s * 1e9)  # a merged event's oldest token: this old
        self.shared_steps = shared_steps
        self._mux_out: dict[asyncio.Transport, list[bytes]] = {}  # /v1/ws frames of this tick, per socket
        self.ttft = ttft_ms / 1000.0
        self.host, self.port = host, port
        self.streams: dict[str, RawStream] = {}
        self.sent = {"sse": 0, "ws": 0}
        self._due: list[tuple[float, int, RawStream]] = []  # (time, tie-breaker, stream)
        self._tie = itertools.count()
        self._timer: asyncio.Handle | None = None  # the pending tick (uvloop's handles have no when())
        self._timer_at = 0.0

    # -- generation ---------------------------------------------------------------------------

    def publish(self, s: RawStream) -> None:
        seq = s.next_seq
        s.next_seq += 1
        now = time.time_ns()
        emit = now - self.hold_ns if seq > 1 else now  # a merged event's oldest token, as the engine stamps it
        if seq == 0:
            delta, finish = b'"role":"assistant","content":""', b"null"
        else:
            delta = b'"content":"%b"' % self.text(seq)
            finish = b'"length"' if seq == s.max_tokens else b"null"
        if s.fanout:
            data = CHUNK % (s.id.encode(), now // 1_000_000_000, delta, finish, seq, emit, now)
            sse = http_chunk(b"id: %d\ndata: %b\n\n" % (seq, data))
            ws = ws_frame(OP_TEXT, b'{"type":"chunk","seq":%d,"data":%b}' % (seq, data))
            s.sse_frames.append(sse)
            s.ws_frames.append(ws)
            for t in s.sse:
                t.write(sse)
            for t in s.ws:
                t.write(ws)
            self.sent["sse"] += len(s.sse)
            self.sent["ws"] += len(s.ws)
        if s.posts or s.mux:
            plain = (CHUNK % (s.id.encode(), now // 1_000_000_000, delta, finish, seq, emit, now) if s.timing
                     else PLAIN_CHUNK % (s.id.encode(), now // 1_000_000_000, delta, finish))
            if s.posts:
                frame = http_chunk(b"data: %b\n\n" % plain)
                for t in s.posts:
                    t.write(frame)
            for t, cid in s.mux:
                self._mux_out.setdefault(t, []).append(
                    ws_frame(OP_TEXT, b'{"type":"chunk","id":%b,"data":%b}' % (cid, plain)))
        if s.responses and seq > 0:
            frame = http_chunk(RESP_DELTA % (s.id.encode(), self.text(seq), seq))
            for t in s.responses:
                t.write(frame)
        if seq == s.max_tokens:
            self.finish(s)

    def text(self, seq: int) -> bytes:
        """The text of content event ``seq`` (> 0): ``--stream-interval`` words."""
        n = self.stream_interval
        return b"".join(WORDS[((seq - 1) * n + i) % len(WORDS)] for i in range(n)) if n > 1 \
            else WORDS[(seq - 1) % len(WORDS)]

    def events(self, max_tokens: int) -> int:
        """Content events of a generation of ``max_tokens`` tokens."""
        return -(-max_tokens // self.stream_interval)

    def finish(self, s: RawStream) -> None:
        s.finished = True
        for t in s.sse:
            t.write(SSE_DONE)
        for t in s.ws:
            t.write(WS_DONE)
        for t in s.posts:
            t.write(SSE_DONE)
        for t in s.responses:
            t.write(http_chunk(b'event: response.completed\ndata: {"type":"response.completed","sequence_number":%d,'
                               b'"response":{"id":"%s","status":"completed"}}\n\n' % (s.max_tokens + 1, s.id.encode()))
                    + b"0\r\n\r\n")
        for t, cid in s.mux:
            self._mux_out.setdefault(t, []).append(ws_frame(OP_TEXT, b'{"type":"done","id":%b}' % cid))
        s.sse.clear()
        s.ws.clear()
        s.posts.clear()
        s.responses.clear()
        s.mux.clear()

    def schedule(self, s: RawStream, at: float) -> None:
        heapq.heappush(self._due, (at, next(self._tie), s))
        if self._timer is None or at < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._arm(at)

    def _arm(self, at: float) -> None:
        self._timer = asyncio.get_running_loop().call_at(at, self.tick)
        self._timer_at = at

    def tick(self) -> None:
        """The one callback that writes every event: runs when the earliest token is due and publishes
        every token due by then (a timer callback: no task, no wake-up event, no timeout context)."""
        self._timer = None
        due = self._due
        # Tokens due within the timer resolution go now: uvloop's clock moves in whole milliseconds, so a
        # timer for a later instant of the same millisecond would fire again at once, and again (a spin).
        now = asyncio.get_running_loop().time() + TIMER_RESOLUTION
        while due and due[0][0] <= now:
            at, _, s = heapq.heappop(due)
            if s.finished:  # its reader left
                continue
            self.publish(s)
            if not s.finished:
                heapq.heappush(due, (at + self.interval, next(self._tie), s))
        if due:
            self._arm(due[0][0])
        self.flush()

    def flush(self) -> None:
        """One write per ``/v1/ws`` socket for everything this tick produced on it."""
        for t, frames in self._mux_out.items():
            t.write(b"".join(frames))
        self._mux_out.clear()

    # -- requests -------------------------------------------------------------------------------

    def start(self, s: RawStream) -> None:
        self.streams[s.id] = s
        self.publish(s)  # the role chunk at once, as the gateway does
        self.flush()
        at = asyncio.get_running_loop().time() + self.ttft
        if self.shared_steps:
            at = math.ceil(at / self.interval) * self.interval
        self.schedule(s, at)

    def generate(self, body: bytes, transport: asyncio.Transport, path: str, timing: bool = False) -> RawStream:
        """``POST /v1/chat/completions`` or ``/v1/responses`` with ``stream: true``: this response only."""
        req = orjson.loads(body or b"{}")
        s = RawStream(id="raw-" + uuid.uuid4().hex, max_tokens=self.events(int(req.get("max_tokens")
                                                                                or req.get("max_output_tokens") or 16)),
                      fanout=False, timing=timing)
        transport.write(SSE_HEAD)
        if path == "/v1/responses":
            transport.write(http_chunk(b'event: response.created\ndata: {"type":"response.created",'
                                       b'"sequence_number":0,"response":{"id":"%s","status":"in_progress"}}\n\n'
                                       % s.id.encode()))
            s.responses.append(transport)
        else:
            s.posts.append(transport)
        self.start(s)
        return s

    def mux_request(self, msg: dict[str, Any], transport: asyncio.Transport, timing: bool = False) -> RawStream:
        """A ``/v1/ws`` ``request`` message: chunks tagged with its ``id`` on this socket."""
        body = msg.get("body") or {}
        s = RawStream(id="raw-" + uuid.uuid4().hex, max_tokens=self.events(int(body.get("max_tokens", 16))),
                      fanout=False, timing=timing)
        s.mux.append((transport, orjson.dumps(str(msg.get("id")))))
        self.start(s)
        return s

    def create(self, body: bytes, transport: asyncio.Transport) -> None:
        req = orjson.loads(body or b"{}")
        s = RawStream(id="raw-" + uuid.uuid4().hex, max_tokens=self.events(int(req.get("max_tokens", 16))))
        self.start(s)
        respond(transport, 201, orjson.dumps({
            "id": s.id, "object": "tokenfan.stream",
            "events_url": f"http://{self.host}:{self.port}/v1/streams/{s.id}/events",
            "ws_url": f"ws://{self.host}:{self.port}/v1/streams/{s.id}/ws"}))

    def cancel(self, s: RawStream) -> None:
        """``DELETE /v1/streams/{id}``: the generation stops (its subscribers get their end)."""
        if not s.finished:
            self.finish(s)
            self.flush()

    def subscribe_sse(self, s: RawStream, transport: asyncio.Transport) -> None:
        transport.write(SSE_HEAD + b"".join(s.sse_frames) + (SSE_DONE if s.finished else b""))
        if not s.finished:
            s.sse.append(transport)

    def subscribe_ws(self, s: RawStream, transport: asyncio.Transport, key: str) -> None:
        accept = base64.b64encode(hashlib.sha1(key.encode() + WS_GUID).digest())
        transport.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                        b"sec-websocket-accept: %b\r\n\r\n" % accept + b"".join(s.ws_frames)
                        + (WS_DONE if s.finished else b""))
        if not s.finished:
            s.ws.append(transport)

    def drop(self, transport: asyncio.Transport, sids: list[str]) -> None:
        for sid in sids:
            s = self.streams.get(sid)
            if s is None:
                continue
            for subs in (s.sse, s.ws, s.posts, s.responses):
                with contextlib.suppress(ValueError):
                    subs.remove(transport)
            s.mux = [(t, cid) for t, cid in s.mux if t is not transport]
            if not s.fanout and not (s.posts or s.responses or s.mux):
                s.finished = True  # its only reader left: stop generating (as the gateway aborts)
                self.streams.pop(sid, None)

    def metrics(self) -> bytes:
        return (b"process_cpu_seconds_total %f\n" % time.process_time()
                + b"".join(b'tokenfan_chunks_sent_total{transport="%s"} %d\n' % (t.encode(), n)
                           for t, n in self.sent.items()))

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: RawConnection(self), self.host, self.port, backlog=4096)
        async with server:
            await server.serve_forever()


class RawConnection(asyncio.Protocol):
    """HTTP/1.1 requests one at a time; after a WebSocket upgrade, client frames (close, ping)."""

    def __init__(self, server: RawServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.ws: WsDecoder | None = None
        self.mux = False  # a /v1/ws socket (requests come as messages)
        self.timing = False  # /v1/ws?tokenfan_timing=1
        self.sids: list[str] = []  # the streams this connection reads

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.server.drop(self.transport, self.sids)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if self.ws is not None:
            self.ws_received(data)
            return
        self.buf += data
        while not self.transport.is_closing():
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    self.transport.close()
                return
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            length = int(headers.get("content-length", "0"))
            if len(self.buf) < end + 4 + length:
                return
            body, self.buf = self.buf[end + 4:end + 4 + length], self.buf[end + 4 + length:]
            try:
                method, target, _ = lines[0].split(" ", 2)
            except ValueError:
                respond(self.transport, 400, b'{"error":"bad request line"}')
                self.transport.close()
                return
            url = urlsplit(target)
            self.route(method, url.path, headers, body, "tokenfan_timing=1" in url.query)
            if self.ws is not None:
                return

    def route(self, method: str, path: str, headers: dict[str, str], body: bytes, timing: bool = False) -> None:
        srv, t = self.server, self.transport
        assert t is not None
        parts = path.split("/")  # "", "v1", "streams", id, "events" | "ws"
        if method == "POST" and path == "/v1/streams":
            srv.create(body, t)
        elif method == "POST" and path in ("/v1/chat/completions", "/v1/responses"):
            self.sids.append(srv.generate(body, t, path, timing).id)
        elif method == "GET" and path == "/v1/ws" and "sec-websocket-key" in headers:
            self.ws, self.mux, self.timing = WsDecoder(), True, timing
            accept = base64.b64encode(hashlib.sha1(headers["sec-websocket-key"].encode() + WS_GUID).digest())
            t.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
                    b"sec-websocket-accept: %b\r\n\r\n" % accept)
        elif method == "DELETE" and len(parts) == 4 and parts[2] == "streams" and parts[3] in srv.streams:
            srv.cancel(srv.streams[parts[3]])
            respond(t, 200, b'{"id":"%s","state":"cancelled"}' % parts[3].encode())
        elif method == "GET" and len(parts) == 5 and parts[2] == "streams" and parts[4] in ("events", "ws"):
            s = srv.streams.get(parts[3])
            if s is None:
                respond(t, 404, b'{"error":"no such stream"}')
            elif parts[4] == "events":
                self.sids.append(s.id)
                srv.subscribe_sse(s, t)
            elif "sec-websocket-key" in headers:
                self.sids.append(s.id)
                self.ws = WsDecoder()
                srv.subscribe_ws(s, t, headers["sec-websocket-key"])
            else:
                respond(t, 400, b'{"error":"not a WebSocket upgrade"}')
        elif path == "/health":
            respond(t, 200, b'{"status":"ok"}')
        elif path == "/metrics":
            respond(t, 200, srv.metrics(), b"text/plain; version=0.0.4")
        else:
            respond(t, 404, b'{"error":"not found"}')

    def ws_received(self, data: bytes) -> None:
        assert self.ws is not None and self.transport is not None
        try:
            frames = self.ws.feed(data)
        except ValueError:
            self.transport.close()
            return
        for f in frames:
            if f.opcode == OP_CLOSE:  # the client's answer to our close (or its own): the TCP side ends here
                self.transport.close()
                return
            if f.opcode == OP_PING:
                self.transport.write(ws_frame(OP_PONG, f.payload))
            elif f.opcode == OP_TEXT and self.mux:
                msg = orjson.loads(f.payload)
                if msg.get("type") == "request":
                    self.sids.append(self.server.mux_request(msg, self.transport, self.timing).id)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tokenfan_bench.servers.raw_floor", description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True, help="HTTP port (SSE and WebSocket)")
    ap.add_argument("--tokens-per-s", type=float, default=20.0)
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--steps", choices=("per-stream", "shared"), default="per-stream",
                    help="pace like the synthetic engine's --synthetic-steps")
    ap.add_argument("--stream-interval", type=int, default=1, help="tokens per event, like the engine's")
    ns = ap.parse_args(argv)
    server = RawServer(ns.tokens_per_s, ns.ttft_ms, ns.host, ns.port, ns.steps == "shared", ns.stream_interval)
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
