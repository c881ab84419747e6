"""The load of ``tokenfan bench cpu``: many long generations held open, their events counted cheaply.

The client's own CPU is part of what is measured (reported per event beside every figure), so it does
as little as it can per read: no HTTP or SSE parsing, no JSON decoding. A reader counts the
occurrences of its mode's event marker in the raw bytes (``data: {`` for chat chunks, the
``response.output_text.delta`` event line for the Responses API, one chunk message per WebSocket frame),
carrying the marker's length - 1 bytes over from one read to the next so a marker split by a read is
counted once. Only the capacity readers also take each event's ``emit_ns`` (one regular expression per
read) to compute delivery latency, as :mod:`tokenfan_bench.stats.metrics` defines it: fan-out chunks always
carry it, POST SSE and ``/v1/ws`` chunks when asked with ``?tokenfan_timing=1``.

Modes (the issue's names):

- ``a`` POST SSE: ``POST /v1/chat/completions`` with ``stream: true``, one connection each.
- ``b`` fan-out: ``POST /v1/streams``, then ``readers`` ``GET events_url`` SSE readers per stream.
- ``c`` ``/v1/ws``: ``generations`` requests multiplexed on each WebSocket connection.
- ``d`` Responses SSE: ``POST /v1/responses`` with ``stream: true``, one connection each.

The same client talks to the gateway and to :mod:`tokenfan_bench.servers.raw_floor` (the floor).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import orjson
import picows

time_ns = time.time_ns

CHAT_EVENT = b"data: {"
RESPONSES_EVENT = b"event: response.output_text.delta\n"
WS_CHUNK = b'{"type":"chunk"'
_EMIT = re.compile(rb'"emit_ns":(\d+)')
_ENDS = {"chat": (b"data: [DONE]",), "responses": (b"event: response.completed", b"event: response.incomplete",
                                                    b"event: response.failed")}
MODES = ("a", "b", "c", "d")
MODE_NAMES = {"a": "POST SSE", "b": "fan-out SSE", "c": "/v1/ws", "d": "Responses SSE"}


def count_markers(tail: bytes, data: bytes, marker: bytes) -> tuple[int, bytes]:
    """Occurrences of ``marker`` in ``tail + data`` and the new tail (the last ``len(marker) - 1`` bytes).

    The tail never holds a whole marker, so nothing is counted twice across reads."""
    buf = tail + data if tail else data
    keep = len(marker) - 1
    return buf.count(marker), buf[-keep:] if keep else b""


@dataclass
class Tally:
    """What the readers of one load received (shared by all of them: one object, plain counters)."""

    events: int = 0  # content events (chat chunks, Responses deltas, WS chunk messages)
    ended: int = 0  # generations (or readers) that saw their end
    started: int = 0  # readers that received their first event
    errors: list[str] = field(default_factory=list)
    latencies_ns: list[int] | None = None  # recv - emit per event (capacity runs only)

    def fail(self, why: str) -> None:
        if len(self.errors) < 1000:
            self.errors.append(why[:300])


@dataclass(frozen=True)
class Target:
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> Target:
        u = urlsplit(url)
        return cls(u.hostname or "127.0.0.1", u.port or 80)

    def request(self, method: str, path: str, body: bytes = b"", close: bool = False) -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
        if close:
            head += "connection: close\r\n"
        if body:
            head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        return head.encode() + b"\r\n" + body


class SseReader(asyncio.Protocol):
    """One HTTP/1.1 response carrying SSE: counts ``marker`` occurrences until an end marker."""

    def __init__(self, tally: Tally, request: bytes, marker: bytes, ends: Iterable[bytes],
                 timing: bool = False) -> None:
        self.tally, self.request, self.marker, self.ends = tally, request, marker, tuple(ends)
        self.timing = timing
        self.transport: asyncio.Transport | None = None
        self.tail = b""
        self.head_checked = False
        self.first = True
        self.done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's transports are not asyncio's classes
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if not self.head_checked:
            self.head_checked = True
            if not data.startswith(b"HTTP/1.1 200"):
                self.tally.fail(f"HTTP {data[:200]!r}")
                self.close()
                return
        n, self.tail = count_markers(self.tail, data, self.marker)
        if n:
            self.tally.events += n
            if self.first:
                self.first = False
                self.tally.started += 1
            if self.timing and self.tally.latencies_ns is not None:
                t = time_ns()
                self.tally.latencies_ns.extend(t - int(e) for e in _EMIT.findall(data))
        if any(e in data for e in self.ends):
            self.finish()

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self.tally.ended += 1
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done:
            self.done = True
            self.tally.fail(f"connection lost before the end: {exc}")

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class MuxReader(picows.WSListener):  # type: ignore[misc]
    """One ``/v1/ws`` connection: counts chunk messages; ``done`` / ``error`` messages end a request."""

    def __init__(self, tally: Tally, timing: bool = False) -> None:
        super().__init__()
        self.tally = tally
        self.timing = timing and tally.latencies_ns is not None
        self.transport: picows.WSTransport | None = None
        self.seen: set[bytes] = set()  # request ids that received their first chunk
        self.closing = False

    def on_ws_connected(self, transport: picows.WSTransport) -> None:
        self.transport = transport

    def on_ws_frame(self, transport: picows.WSTransport, frame: picows.WSFrame) -> None:
        if frame.msg_type != picows.WSMsgType.TEXT:
            if frame.msg_type == picows.WSMsgType.CLOSE and not self.closing:
                self.tally.fail(f"ws closed {frame.get_close_code()}")
            return
        payload = frame.get_payload_as_bytes()
        if payload.startswith(WS_CHUNK):
            self.tally.events += 1
            if self.timing:
                m = _EMIT.search(payload)
                if m is not None:
                    self.tally.latencies_ns.append(time_ns() - int(m.group(1)))  # type: ignore[union-attr]
            if len(self.seen) < 1_000_000:
                rid = payload[payload.find(b'"id":') + 5:payload.find(b',"data"')]
                if rid not in self.seen:
                    self.seen.add(rid)
                    self.tally.started += 1
        elif b'"type":"done"' in payload:
            self.tally.ended += 1
        else:
            self.tally.fail(f"ws {payload[:200]!r}")
            self.tally.ended += 1

    def close(self) -> None:
        self.closing = True
        if self.transport is not None and not self.transport.is_disconnected:
            self.transport.disconnect(False)


def chat_body(max_tokens: int, seed: int) -> dict[str, Any]:
    return {"model": "synthetic", "messages": [{"role": "user", "content": "tokenfan bench"}],
            "max_tokens": max_tokens, "ignore_eos": True, "seed": seed}


class Load:
    """One mode's generations against one server: :meth:`open` starts them (spread over ``ramp``
    seconds), :meth:`wait_started` / :meth:`wait_ended` follow them, :meth:`close` drops them all."""

    def __init__(self, url: str, mode: str, *, generations: int, readers: int = 1, per_connection: int = 50,
                 max_tokens: int, ramp: float = 1.0, timing: bool = False, seed: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
        self.url, self.mode, self.target = url.rstrip("/"), mode, Target.of(url)
        self.generations, self.readers, self.per_connection = generations, readers, per_connection
        self.max_tokens, self.ramp, self.timing, self.seed = max_tokens, ramp, timing, seed
        self.tally = Tally(latencies_ns=[] if timing else None)
        self.sse: list[SseReader] = []
        self.ws: list[MuxReader] = []
        self.stream_ids: list[str] = []  # mode b: stopped by :meth:`aclose` (a stream outlives its readers)

    @property
    def expected_readers(self) -> int:
        """Readers (or /v1/ws requests) that each end once."""
        return self.generations * (self.readers if self.mode == "b" else 1)

    async def open(self) -> None:
        """Start every generation; returns once all are requested (events keep arriving)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if self.mode == "c":
            conns = -(-self.generations // self.per_connection)
            starts = [self._mux(i, min(self.per_connection, self.generations - i * self.per_connection),
                                t0 + self.ramp * i / conns) for i in range(conns)]
        else:
            starts = [self._one(i, t0 + self.ramp * i / self.generations) for i in range(self.generations)]
        await asyncio.gather(*starts)

    async def _at(self, when: float) -> None:
        delay = when - asyncio.get_running_loop().time()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _connect(self, reader: SseReader) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_connection(lambda: reader, self.target.host, self.target.port)
        except OSError as exc:
            reader.done = True
            self.tally.fail(f"connect: {exc}")
        self.sse.append(reader)

    async def _one(self, i: int, when: float) -> None:
        await self._at(when)
        seed = self.seed * 1_000_003 + i
        if self.mode == "a":
            body = orjson.dumps({**chat_body(self.max_tokens, seed), "stream": True})
            path = "/v1/chat/completions" + ("?tokenfan_timing=1" if self.timing else "")
            await self._connect(SseReader(self.tally, self.target.request("POST", path, body),
                                          CHAT_EVENT, _ENDS["chat"], self.timing))
        elif self.mode == "d":
            body = orjson.dumps({"model": "synthetic", "input": "tokenfan bench", "stream": True,
                                 "max_output_tokens": self.max_tokens})
            path = "/v1/responses" + ("?tokenfan_timing=1" if self.timing else "")
            await self._connect(SseReader(self.tally, self.target.request("POST", path, body),
                                          RESPONSES_EVENT, _ENDS["responses"], self.timing))
        else:  # b: a fan-out stream, then its readers
            body = orjson.dumps({**chat_body(self.max_tokens, seed), "endpoint": "chat.completions"})
            try:
                info = orjson.loads(await self._call("POST", "/v1/streams", body, 201))
            except (OSError, ValueError) as exc:
                self.tally.fail(f"POST /v1/streams: {exc}")
                return
            self.stream_ids.append(info["id"])
            path = urlsplit(info["events_url"]).path
            await asyncio.gather(*(self._connect(SseReader(self.tally, self.target.request("GET", path), CHAT_EVENT,
                                                           _ENDS["chat"], self.timing))
                                   for _ in range(self.readers)))

    async def _call(self, method: str, path: str, body: bytes = b"", expect: int = 200) -> bytes:
        """One request on its own connection; the answer's body (``content-length`` framed)."""
        reader, writer = await asyncio.open_connection(self.target.host, self.target.port)
        try:
            writer.write(self.target.request(method, path, body, close=True))
            head = (await reader.readuntil(b"\r\n\r\n")).lower()
            if not head.startswith(b"http/1.1 %d" % expect):
                raise ValueError(head[:200].decode("latin-1"))
            length = re.search(rb"\r\ncontent-length: *(\d+)", head)
            return await reader.readexactly(int(length.group(1))) if length else b""
        finally:
            writer.close()

    async def _mux(self, i: int, n: int, when: float) -> None:
        await self._at(when)
        ws_url = "ws" + self.url[self.url.index(":"):] + "/v1/ws" + ("?tokenfan_timing=1" if self.timing else "")
        try:
            transport, listener = await picows.ws_connect(lambda: MuxReader(self.tally, self.timing), ws_url,
                                                          websocket_handshake_timeout=30, enable_auto_pong=True)
        except (OSError, picows.WSError) as exc:
            self.tally.fail(f"ws connect: {exc}")
            return
        assert isinstance(listener, MuxReader)
        self.ws.append(listener)
        for j in range(n):
            body = chat_body(self.max_tokens, self.seed * 1_000_003 + i * self.per_connection + j)
            transport.send(picows.WSMsgType.TEXT, orjson.dumps(
                {"type": "request", "id": f"g{i}-{j}", "endpoint": "chat.completions", "body": body}))

    async def wait_started(self, timeout: float) -> None:
        """Until every reader has received an event (or ``timeout``: then TimeoutError)."""
        await self._wait(lambda: self.tally.started + len(self.tally.errors) >= self.expected_readers, timeout,
                         "first events")

    async def wait_ended(self, timeout: float) -> None:
        await self._wait(lambda: self.tally.ended + len(self.tally.errors) >= self.expected_readers, timeout,
                         "ends")

    async def _wait(self, cond: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"mode {self.mode}: {what} of {self.expected_readers} readers not seen in "
                                   f"{timeout:g} s (started {self.tally.started}, ended {self.tally.ended}, "
                                   f"errors {len(self.tally.errors)}: {self.tally.errors[:3]})")
            await asyncio.sleep(0.05)

    async def aclose(self) -> None:
        """Close every reader, then stop the fan-out streams (their generation would go on without
        readers and be charged to the next measurement)."""
        self.close()
        for i in range(0, len(self.stream_ids), 50):
            await asyncio.gather(*(self._call("DELETE", f"/v1/streams/{sid}") for sid in self.stream_ids[i:i + 50]),
                                 return_exceptions=True)
        self.stream_ids.clear()

    def close(self) -> None:
        for r in self.sse:
            r.done = True  # our own close is no error
            r.close()
        for w in self.ws:
            w.close()
