"""What the delivery core needs to know about Responses events, kept with the Responses API: how a
response's stream is framed on each transport, which events end it, and how a lagging reader's text
deltas merge. The delivery core (:mod:`gateway.core.streams`, :mod:`gateway.core.framing`) knows no payload shape.

  framing            event                                   failure without a terminal event
  ``responses_sse``  ``event: <type>`` + ``data: {event}``    ``event: error`` (the Responses error event)
  ``responses_ws``   ``{event}`` (+ the lane's ``stream_id``)  the WebSocket error shape; the socket stays

A text delta rendered from its item's :class:`gateway.api.responses.request.TextDeltaTemplate` is framed from
its bytes, never parsed into a dict (the same bytes as the dict's: tests/test_responses_template.py).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.api.responses.request import TERMINAL_TYPES
from gateway.api.responses.templates import TextDeltaTemplate
from gateway.api.responses.ws import ws_error, ws_event, ws_text
from gateway.core import sse
from gateway.core.framing import Ending, Framing, Transport
from gateway.core.streams import Event, Stream
from gateway.errors import APIError


class ResponsesMerge:
    """Responses events for a lagging reader (:class:`gateway.core.merge.MergeRules`): consecutive
    ``response.output_text.delta`` events of one item merge; every other event keeps its own."""

    def group(self, payload: dict[str, Any]) -> object | None:
        return payload.get("item_id") if payload.get("type") == "response.output_text.delta" else None

    def merged(self, run: list[Event], text: str) -> dict[str, Any]:
        return {**run[-1].payload, "delta": text}


RESPONSES_MERGE = ResponsesMerge()


def has_terminal(stream: Stream) -> bool:
    """Whether the response's log already ends with its terminal event (completed, failed, incomplete)."""
    return bool(stream.events) and stream.events[-1].payload.get("type") in TERMINAL_TYPES


class ResponsesSse(Framing):
    """Responses API over SSE: ``event: <type>`` + ``data:``; the terminal event is in the log.
    ``timing`` (``?tokenfan_timing=1``, for benchmarks): each event also carries the ``tokenfan`` timing
    object (``emit_ns``, ``sent_ns``, ``seq``), which the SDKs ignore."""

    name = "responses_sse"
    resumable = True
    merge = RESPONSES_MERGE

    def __init__(self, timing: bool = False) -> None:
        self.timing = timing
        if timing:
            self.name = "responses_sse+timing"

    def build(self, ev: Event) -> bytes:
        t = ev.template
        if isinstance(t, TextDeltaTemplate):
            if not self.timing:
                return t.sse(ev.text, ev.seq)
            return sse.named(t.TYPE_BYTES, _with_timing(ev))
        data = orjson.dumps(ev.timed_payload) if self.timing else ev.json
        return sse.named(str(ev.payload.get("type", "message")).encode(), data)

    def ending(self, stream: Stream) -> Ending:
        if stream.state == "error" and stream.error is not None and not has_terminal(stream):
            return Ending(sse.event(orjson.dumps({"type": "error", **_error_fields(stream.error),
                                                  "sequence_number": len(stream.events)}), event="error"))
        return Ending(None)


class ResponsesWs(Framing):
    """Responses API WebSocket mode: each event one JSON text message (with the lane's ``stream_id``
    on a named lane, and errors in the WebSocket error shape); the socket stays open."""

    name = "responses_ws"
    transport: Transport = "ws"
    resumable = False
    merge = RESPONSES_MERGE

    def __init__(self, stream_id: str | None = None, timing: bool = False) -> None:
        self.stream_id = stream_id
        self.timing = timing
        self.name = "responses_ws" + ("+timing" if timing else "") + (":" + stream_id if stream_id else "")

    def build(self, ev: Event) -> str:
        if isinstance(ev.template, TextDeltaTemplate):
            return ws_text(_with_timing(ev) if self.timing else ev.json, self.stream_id)
        return self.build_payload(ev.timed_payload if self.timing else ev.payload)

    def build_payload(self, payload: dict[str, object]) -> str:
        if payload.get("type") == "error":
            return orjson.dumps(ws_event(payload, self.stream_id)).decode()
        return ws_text(orjson.dumps(payload), self.stream_id)

    def ending(self, stream: Stream) -> Ending:
        if stream.state == "error" and stream.error is not None and not has_terminal(stream):
            return Ending(orjson.dumps(ws_error(stream.error, self.stream_id, len(stream.events))).decode(),
                          last=False)
        return Ending(None, last=False)


def _with_timing(ev: Event) -> bytes:
    """``orjson.dumps(ev.timed_payload)`` of a templated event without parsing it: its JSON with the ``tokenfan``
    timing object spliced in before the closing brace (the key ``ev.timed_payload`` adds last)."""
    return ev.json[:-1] + b',"tokenfan":' + orjson.dumps(ev.timing) + b"}"


def _error_fields(err: APIError) -> dict[str, object]:
    e = err.body()["error"]
    return {"code": e["code"], "message": e["message"], "param": e["param"]}


RESPONSES_SSE = ResponsesSse()
RESPONSES_SSE_TIMING = ResponsesSse(timing=True)
