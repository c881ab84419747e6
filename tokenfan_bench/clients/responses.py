"""The Responses API arms, ``resp-sse`` and ``resp-ws``: each subscriber runs its own response.

- ``resp-sse``: ``POST /v1/responses?tokenfan_timing=1`` with ``stream: true`` on a keep-alive
  HTTP/1.1 connection (:class:`~tokenfan_bench.clients.fast.H1Pool`), read as SSE.
- ``resp-ws``: WebSocket mode on ``ws://…/v1/responses?tokenfan_timing=1`` (picows): one
  ``response.create`` message per response; the connection is kept for the slot's next response,
  as the mode intends (and as the SSE arm reuses its HTTP connection).

A response is one generation per client, so these arms cannot share a stream with another arm: the
bench runs them with separate streams (unpaired statistics). Every event is recorded with its
receive time and the ``tokenfan`` timing object (``seq``, ``emit_ns``, ``sent_ns``); content events
are the ``response.output_text.delta`` ones. The request start (``post_ns``, TTFT's origin) is taken
when the request is written, after the connection is acquired, on both arms; ``connected_ns`` is the
same instant, so every event counts as live.

A subscriber succeeds when its ``sequence_number``s are contiguous from 0, the deltas joined equal
the ``response.output_text.done`` text (every token arrived, in order), and the response ends with
``response.completed`` or ``response.incomplete`` (``max_output_tokens``). Timestamping is the fast
client's (:mod:`tokenfan_bench.clients.fast`): stamped first thing per read, parsed in a
:class:`~tokenfan_bench.clients.fast.ReadBatch`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import orjson
import picows

from tokenfan_bench.clients.fast import (
    PARSE_ERRORS,
    BatchedWsListener,
    H1Pool,
    ReadBatch,
    Sink,
    client_ssl_context,
    target_of,
)
from tokenfan_bench.clients.recorder import Recorder
from tokenfan_bench.wire.events import ChunkSample, SseDecoder
from tokenfan_bench.wire.http1 import ResponseHead, request

RESPONSES_TRANSPORTS = ("resp-sse", "resp-ws")
DELTA = "response.output_text.delta"
ERROR_PREVIEW = 300  # characters of an unexpected body or event kept in the subscriber's error

time_ns = time.time_ns


class _Timing(msgspec.Struct):
    seq: int
    emit_ns: int
    sent_ns: int = 0


class _Details(msgspec.Struct):
    reason: str | None = None


class _Response(msgspec.Struct):
    status: str | None = None
    incomplete_details: _Details | None = None


class ResponseEvent(msgspec.Struct):
    """The fields of a Responses API event the bench needs (the rest is skipped by the decoder)."""

    type: str
    sequence_number: int = -1
    tokenfan: _Timing | None = None
    delta: str | None = None
    text: str | None = None
    response: _Response | None = None


decode_event = msgspec.json.Decoder(ResponseEvent).decode


class ResponseRecorder(Recorder):
    """A :class:`Recorder` that also keeps the text deltas, to check them against the final text."""

    __slots__ = ("parts",)

    def __init__(self, stream: int, post_ns: int) -> None:
        super().__init__(stream, post_ns)
        self.parts: list[str] = []


def on_response_event(rec: ResponseRecorder, recv_ns: int, raw: bytes) -> bool:
    """Record one event (JSON bytes); True when it ends the response. ValueError if malformed."""
    ev = decode_event(raw)
    typ, tf = ev.type, ev.tokenfan
    if typ == "error" or typ == "response.failed":
        rec.fail(f"{typ}: {raw[:ERROR_PREVIEW]!r}")
        return True
    if tf is None:
        rec.fail(f"{typ} without tokenfan timing (does the gateway support ?tokenfan_timing=1?)")
        return True
    is_delta = typ == DELTA
    terminal = typ == "response.completed" or typ == "response.incomplete"
    rec.rows.append((recv_ns, ChunkSample(ev.sequence_number, tf.emit_ns, tf.sent_ns, 1, is_delta, terminal)))
    if is_delta:
        rec.parts.append(ev.delta or "")
    elif typ == "response.output_text.done":
        if "".join(rec.parts) != (ev.text or ""):
            rec.fail(f"the deltas ({sum(map(len, rec.parts))} chars) differ from the final text "
                     f"({len(ev.text or '')} chars)")
    elif terminal:
        r = ev.response
        reason = r.incomplete_details.reason if r is not None and r.incomplete_details is not None else None
        if typ == "response.incomplete" and reason != "max_output_tokens":
            rec.fail(f"response.incomplete: {reason}")
        rec.done = True
    return terminal


def response_body(max_tokens: int) -> dict[str, Any]:
    return {"input": "tokenfan bench", "max_output_tokens": max_tokens}


# -- SSE over HTTP/1.1 ---------------------------------------------------------------------------


class ResponseSse(Sink):
    """The SSE answer of one ``POST /v1/responses``. Events are ``event: <type>\\ndata: {…}`` blocks;
    the type is also in the data, so only the ``data:`` field is decoded."""

    def __init__(self, rec: ResponseRecorder, fut: asyncio.Future[None]) -> None:
        self.rec, self.fut = rec, fut
        self._buf = b""  # the body of an error answer
        self._dec = SseDecoder()
        self._status = 0
        self._ended = False

    def head(self, t: int, head: ResponseHead) -> None:
        self._status = head.status

    def body(self, t: int, data: bytes) -> None:
        rec = self.rec
        if self._status != 200:
            self._buf = (self._buf + data)[:ERROR_PREVIEW]
            return
        if rec.error is not None or self._ended:
            return
        try:
            for ev in self._dec.feed(data):
                if on_response_event(rec, t, ev.data):
                    self._ended = True
                    return
        except PARSE_ERRORS as exc:
            rec.fail(f"resp-sse: {type(exc).__name__}: {exc}"[:ERROR_PREVIEW])

    def end(self, error: BaseException | None) -> None:
        if self._status and self._status != 200:
            self.rec.fail(f"POST /v1/responses: HTTP {self._status} {self._buf!r}"[:ERROR_PREVIEW])
        elif error is not None:
            self.rec.fail(f"resp-sse: {type(error).__name__}: {error}"[:ERROR_PREVIEW])
        elif not self.rec.done:
            self.rec.fail("resp-sse: the response ended before response.completed")
        if not self.fut.done():
            self.fut.set_result(None)


async def respond_sse(pool: H1Pool, target: str, body: bytes, rec: ResponseRecorder) -> None:
    conn = await pool.acquire()
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    sink = ResponseSse(rec, fut)
    req = request("POST", target, pool.authority, {"content-type": "application/json", "accept": "text/event-stream"},
                  body)
    rec.post_ns = rec.connected_ns = time_ns()
    conn.send(req, sink)
    try:
        await fut
    finally:
        conn.abandon(sink)


# -- WebSocket mode (picows) ---------------------------------------------------------------------


class ResponseWs(BatchedWsListener):
    """One WebSocket-mode connection; carries one response at a time (``start``), then is reused."""

    label = "resp-ws:"
    close_ok_is_end = True  # any close ends the connection's use

    def __init__(self, batch: ReadBatch) -> None:
        super().__init__(batch)
        self.rec: ResponseRecorder | None = None
        self.fut: asyncio.Future[None] | None = None
        self.closed = False

    def on_ws_disconnected(self, transport: picows.WSTransport) -> None:
        self.batch.add(self._end, 0, "resp-ws: connection closed before response.completed")

    def start(self, rec: ResponseRecorder, body: bytes) -> asyncio.Future[None]:
        assert self.transport is not None and self.rec is None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.rec, self.fut = rec, fut
        rec.post_ns = rec.connected_ns = time_ns()
        self.transport.send(picows.WSMsgType.TEXT, body)
        return fut

    def _finish(self) -> None:
        fut, self.rec, self.fut = self.fut, None, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _on_message(self, t: int, payload: bytes) -> None:
        rec = self.rec
        if rec is None:
            return  # late events of an abandoned response
        try:
            ended = on_response_event(rec, t, payload)
        except PARSE_ERRORS as exc:
            rec.fail(f"resp-ws: {type(exc).__name__}: {exc}"[:ERROR_PREVIEW])
            ended = True
        if ended:
            self._finish()

    def _on_end(self, _t: int, why: str | None) -> None:
        self.closed = True
        if self.rec is not None and why is not None:  # every end of this listener says why
            self.rec.fail(why)
        self._finish()


class ResponsesClient:
    """Runs the Responses arms of one worker (fast client only): an HTTP/1.1 pool for ``resp-sse``,
    idle WebSocket-mode connections for ``resp-ws``."""

    def __init__(self, url: str, client: str, cafile: str | None) -> None:
        if client != "fast":
            raise ValueError("the resp-sse and resp-ws arms need --client fast")
        self.batch = ReadBatch(asyncio.get_running_loop())
        scheme, host, port, _ = target_of(url)
        self.ssl_ctx = client_ssl_context(cafile) if scheme in ("https", "wss") else None
        self.pool = H1Pool(self.batch, host, port, self.ssl_ctx)
        base = url.rstrip("/")
        self.post_target = target_of(base + "/v1/responses?tokenfan_timing=1")[3]
        self.ws_url = ("wss" if self.ssl_ctx else "ws") + base[base.index(":"):] + "/v1/responses?tokenfan_timing=1"
        self.idle: list[ResponseWs] = []
        self.all: set[ResponseWs] = set()

    async def respond(self, transport: str, max_tokens: int, rec: ResponseRecorder) -> None:
        body = response_body(max_tokens)
        if transport == "resp-sse":
            await respond_sse(self.pool, self.post_target, orjson.dumps({**body, "stream": True}), rec)
            return
        ws = await self._ws()
        fut = ws.start(rec, orjson.dumps({"type": "response.create", **body}))
        try:
            await fut
        finally:
            if ws.rec is None and not ws.closed and rec.error is None:
                self.idle.append(ws)
            else:  # abandoned or failed: its events could reach the next response
                ws.rec = ws.fut = None
                self._drop(ws)

    async def _ws(self) -> ResponseWs:
        while self.idle:
            ws = self.idle.pop()
            if not ws.closed:
                return ws
            self._drop(ws)
        _, listener = await picows.ws_connect(lambda: ResponseWs(self.batch), self.ws_url, ssl_context=self.ssl_ctx,
                                              websocket_handshake_timeout=30, enable_auto_pong=True,
                                              max_frame_size=1 << 30)
        assert isinstance(listener, ResponseWs)
        self.all.add(listener)
        return listener

    def _drop(self, ws: ResponseWs) -> None:
        self.all.discard(ws)
        if ws.transport is not None and not ws.transport.is_disconnected:
            ws.transport.disconnect(False)

    def close(self) -> None:
        self.pool.close()
        for ws in list(self.all):
            self._drop(ws)
        self.idle.clear()
