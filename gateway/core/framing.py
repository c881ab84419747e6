"""Wire frames of every delivery path (pure: events in, bytes or text out).

A :class:`Framing` turns a stream's events and its ending into what one kind of reader writes:

  framing            event                                   normal end            failure / cancel
  ``openai_sse``     ``data: {chunk}``                        ``data: [DONE]``      ``event: error``
  ``fanout_sse``     ``id: seq`` + ``data: {chunk+tokenfan}``  ``data: [DONE]``      ``event: error`` / ``event: end``
  ``fanout_ws``      ``{"type":"chunk","seq","data"}``        ``{"type":"done"}``   ``{"type":"error"}``, close 1011
  ``mux_ws``         ``{"type":"chunk","id","data"}``         ``{"type":"done","id"}``  ``{"type":"error","id"}``

The Responses API's framings (its events, its terminal events, its merge rules) live with that API, in
:mod:`gateway.api.responses_stream`: this module knows OpenAI chunks only as bytes to wrap.

A reader that is cut for being too slow never gets a normal end: SSE readers get an
``event: error`` with code ``slow_consumer``, WebSocket readers a close 1013.
Frames shared by all readers of one format are cached on the event (``Event.frames``). A framing
names the API's merge rules for a lagging reader (``merge``; the chat and completions chunks' by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import orjson

from gateway.core import sse
from gateway.core.generation import CHUNK_MERGE
from gateway.core.streams import Event, MergeRules, Stream
from gateway.errors import APIError

Transport = Literal["sse", "ws"]

END_CANCELLED = sse.event(b'{"reason":"cancelled"}', event="end") + sse.DONE


def slow_consumer_error(send_timeout: float, resumable: bool) -> APIError:
    hint = " Resume with Last-Event-ID (or ?after=) to continue." if resumable else ""
    return APIError(503, f"Reader too slow: a write was blocked for more than {send_timeout:g}s.{hint}",
                    type="server_error", code="slow_consumer")


@dataclass(frozen=True, slots=True)
class Ending:
    """What a reader writes when its stream is over (``frame``) and, for WebSocket, how it closes."""

    frame: bytes | str | None
    close_code: int = 1000
    reason: str = ""
    last: bool = True  # the connection ends here (False: a /v1/ws request ends, the socket stays)


class Framing:
    """Base of the per-path framings: ``frame`` builds one event's frame, ``ending`` the close."""

    name = "base"
    transport: Transport = "sse"
    resumable = False
    mergeable = True  # a lagging reader may get content events merged (False: every event on its own)
    merge: MergeRules = CHUNK_MERGE  # how they merge: the API's rules

    def frame(self, ev: Event) -> bytes | str:
        cached = ev.frames.get(self.name)
        if cached is None:
            cached = ev.frames[self.name] = self.build(ev)
        return cached

    def build(self, ev: Event) -> bytes | str:
        raise NotImplementedError

    def frame_bytes(self, ev: Event) -> bytes:
        """The frame as bytes (what a direct write puts on the wire; WebSocket: the text payload)."""
        f = self.frame(ev)
        return f if isinstance(f, bytes) else f.encode()

    def join(self, frames: list[bytes | str]) -> list[bytes | str]:
        """Frames to write for a batch: SSE frames concatenate into one write, WS messages stay apart."""
        if self.transport == "sse" and len(frames) > 1:
            return [b"".join(frames)]  # type: ignore[arg-type]
        return frames

    def ending(self, stream: Stream) -> Ending:
        raise NotImplementedError

    def cut(self, send_timeout: float) -> Ending:
        err = slow_consumer_error(send_timeout, self.resumable)
        if self.transport == "sse":
            return Ending(sse.event(err.to_bytes(), event="error"))
        return Ending(None, 1013, "slow consumer" + (": resume with ?after=<last seq>" if self.resumable else ""))


class OpenAISse(Framing):
    """POST ``stream: true`` on the chat and completions endpoints."""

    name = "openai_sse"

    def build(self, ev: Event) -> bytes:
        return b"data: " + ev.json + b"\n\n"

    def frame_bytes(self, ev: Event) -> bytes:
        return self.frame(ev)  # type: ignore[return-value]  # build() gives bytes: no str to encode

    def ending(self, stream: Stream) -> Ending:
        if stream.state == "error" and stream.error is not None:
            return Ending(sse.event(stream.error.to_bytes(), event="error"))
        if stream.state == "cancelled":
            return Ending(END_CANCELLED)
        return Ending(sse.DONE)


class FanoutSse(OpenAISse):
    """``GET /v1/streams/{id}/events``: numbered events for ``Last-Event-ID`` resume."""

    name = "fanout_sse"
    resumable = True

    def build(self, ev: Event) -> bytes:
        return _fanout_frames(ev)[0]


def _fanout_frames(ev: Event) -> tuple[bytes, bytes]:
    """Both fan-out frames from one serialization (readers of both transports are the common case); the
    WebSocket one is kept as UTF-8 bytes, what the direct write sends, and decoded only for the slow path."""
    payload = ev.json  # a JSON object: the timing object is spliced in before its closing brace
    data = payload[:-1] + b',"tokenfan":' + orjson.dumps(ev.timing) + b"}" if len(payload) > 2 \
        else orjson.dumps(ev.chunk)
    sse_frame = ev.frames[FanoutSse.name] = b"id: %d\ndata: %b\n\n" % (ev.seq, data)
    ws_frame = ev.frames[FanoutWs.name] = b'{"type":"chunk","seq":%d,"data":%b}' % (ev.seq, data)
    return sse_frame, ws_frame


class FanoutWs(Framing):
    """``/v1/streams/{id}/ws``."""

    name = "fanout_ws"
    transport: Transport = "ws"
    resumable = True

    def build(self, ev: Event) -> bytes:
        return _fanout_frames(ev)[1]

    def frame_bytes(self, ev: Event) -> bytes:
        cached = ev.frames.get(self.name)
        return cached if cached is not None else _fanout_frames(ev)[1]

    def frame(self, ev: Event) -> str:
        return self.frame_bytes(ev).decode()

    def ending(self, stream: Stream) -> Ending:
        if stream.state == "cancelled":
            return Ending('{"type":"done","reason":"cancelled"}', 1000, "cancelled")
        if stream.state == "error" and stream.error is not None:
            return Ending(orjson.dumps({"type": "error", "error": stream.error.body()["error"]}).decode(),
                          1011, "generation failed")
        return Ending('{"type":"done"}', 1000, "done")


class MuxWs(Framing):
    """One request of the ``/v1/ws`` multiplexer, tagged by the client's ``id``."""

    transport: Transport = "ws"

    def __init__(self, cid: str) -> None:
        self.name = "mux_ws:" + cid  # frames differ per request id
        self.cid = cid
        self._id_bytes = orjson.dumps(cid)

    def frame(self, ev: Event) -> str:  # per-request (the id differs): not cached
        return self.frame_bytes(ev).decode()

    def frame_bytes(self, ev: Event) -> bytes:
        return b'{"type":"chunk","id":%b,"data":%b}' % (self._id_bytes, ev.json)

    def ending(self, stream: Stream) -> Ending:
        if stream.state == "error" and stream.error is not None:
            return Ending(orjson.dumps({"type": "error", "id": self.cid, "error": stream.error.body()["error"]}).decode(),
                          last=False)
        if stream.state == "cancelled":
            return Ending(mux_cancelled(self.cid), last=False)
        return Ending(orjson.dumps({"type": "done", "id": self.cid}).decode(), last=False)


def mux_cancelled(cid: str) -> str:
    """``/v1/ws``'s final message of a cancelled request."""
    return orjson.dumps({"type": "done", "id": cid, "cancelled": True}).decode()


OPENAI_SSE = OpenAISse()
FANOUT_SSE = FanoutSse()
FANOUT_WS = FanoutWs()
