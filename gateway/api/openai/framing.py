"""Frames of the chat and completions chunks on every path (pure: events in, bytes or text out).

  framing            event                                   normal end            failure / cancel
  ``openai_sse``     ``data: {chunk}``                        ``data: [DONE]``      ``event: error``
  (``+timing``)      ``data: {chunk+tokenfan}``
  ``fanout_sse``     ``id: seq`` + ``data: {chunk+tokenfan}``  ``data: [DONE]``      ``event: error`` / ``event: end``
  ``fanout_ws``      ``{"type":"chunk","seq","data"}``        ``{"type":"done"}``   ``{"type":"error"}``, close 1011
  ``mux_ws``         ``{"type":"chunk","id","data"}``         ``{"type":"done","id"}``  ``{"type":"error","id"}``

A lagging reader gets content chunks merged by :data:`gateway.api.chat_render.CHUNK_MERGE`.
``+timing`` (``?tokenfan_timing=1`` on ``POST /v1/chat/completions`` / ``/v1/completions`` and on ``/v1/ws``, for
benchmarks): each chunk also carries tokenfan's timing object as fan-out chunks do (``"tokenfan"``: ``seq``,
``emit_ns``, ``sent_ns``), which OpenAI clients ignore; without it nothing changes on the token path.
"""

from __future__ import annotations

import orjson

from gateway.api.chat_render import CHUNK_MERGE
from gateway.core import sse
from gateway.core.framing import Ending, Framing, Transport
from gateway.core.merge import MergeRules
from gateway.core.streams import Event, Stream

END_CANCELLED = sse.event(b'{"reason":"cancelled"}', event="end") + sse.DONE


class OpenAISse(Framing):
    """POST ``stream: true`` on the chat and completions endpoints."""

    name = "openai_sse"
    merge: MergeRules | None = CHUNK_MERGE

    def build(self, ev: Event) -> bytes:
        return sse.data(ev.json)

    def frame_bytes(self, ev: Event) -> bytes:
        return self.frame(ev)  # type: ignore[return-value]  # build() gives bytes: no str to encode

    def ending(self, stream: Stream) -> Ending:
        if stream.state == "error" and stream.error is not None:
            return Ending(sse.event(stream.error.to_bytes(), event="error"))
        if stream.state == "cancelled":
            return Ending(END_CANCELLED)
        return Ending(sse.DONE)


class OpenAISseTiming(OpenAISse):
    """:class:`OpenAISse` whose chunks carry the ``tokenfan`` timing object (``?tokenfan_timing=1``)."""

    name = "openai_sse+timing"

    def build(self, ev: Event) -> bytes:
        return sse.data(timed_json(ev))


class FanoutSse(OpenAISse):
    """``GET /v1/streams/{id}/events``: numbered events for ``Last-Event-ID`` resume."""

    name = "fanout_sse"
    resumable = True

    def build(self, ev: Event) -> bytes:
        return _fanout_frames(ev)[0]


def timed_json(ev: Event) -> bytes:
    """The chunk's JSON with the ``tokenfan`` timing object, as ``orjson.dumps(ev.timed_payload)`` gives it: spliced
    in before the closing brace of the chunk's own JSON, never parsed."""
    payload = ev.json
    return payload[:-1] + b',"tokenfan":' + orjson.dumps(ev.timing) + b"}" if len(payload) > 2 \
        else orjson.dumps(ev.timed_payload)


def _fanout_frames(ev: Event) -> tuple[bytes, bytes]:
    """Both fan-out frames from one serialization (readers of both transports are the common case); the
    WebSocket one is kept as UTF-8 bytes, what the direct write sends, and decoded only for the slow path."""
    data = timed_json(ev)
    sse_frame = ev.frames[FanoutSse.name] = sse.numbered(ev.seq, data)
    ws_frame = ev.frames[FanoutWs.name] = b'{"type":"chunk","seq":%d,"data":%b}' % (ev.seq, data)
    return sse_frame, ws_frame


class FanoutWs(Framing):
    """``/v1/streams/{id}/ws``."""

    name = "fanout_ws"
    transport: Transport = "ws"
    merge: MergeRules | None = CHUNK_MERGE
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
    merge: MergeRules | None = CHUNK_MERGE

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


class MuxWsTiming(MuxWs):
    """:class:`MuxWs` whose chunks carry the ``tokenfan`` timing object (the socket's ``?tokenfan_timing=1``)."""

    def frame_bytes(self, ev: Event) -> bytes:
        return b'{"type":"chunk","id":%b,"data":%b}' % (self._id_bytes, timed_json(ev))


def mux_cancelled(cid: str) -> str:
    """``/v1/ws``'s final message of a cancelled request."""
    return orjson.dumps({"type": "done", "id": cid, "cancelled": True}).decode()


OPENAI_SSE = OpenAISse()
OPENAI_SSE_TIMING = OpenAISseTiming()
FANOUT_SSE = FanoutSse()
FANOUT_WS = FanoutWs()
