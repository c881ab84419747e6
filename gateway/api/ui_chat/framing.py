"""The UI message stream on the wire (pure): SSE ``data: {part}`` frames, ``data: [DONE]`` at the end.

As ``ai`` 7.0.173 writes it (``src/ui-message-stream/json-to-sse-transform-stream.ts``) and reads it
(``@ai-sdk/provider-utils`` 5.0.81 ``parseJsonEventStream``: every ``data:`` is one part, ``[DONE]`` is
skipped, comments and event names are ignored), with the header ``x-vercel-ai-ui-message-stream: v1``
(``src/ui-message-stream/ui-message-stream-headers.ts``).

  stream state   what the log already ends with        the ending written
  done           ``finish``                            ``data: [DONE]``
  error          ``error`` (the renderer's)            ``data: [DONE]``; else an ``error`` part first (a
                                                       mirror whose owner was lost, a lost stream)
  cancelled      ``abort``                             ``data: [DONE]``; else an ``abort`` part first
  cut (slow)     —                                     an ``error`` part (slow_consumer), no [DONE]
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.core import sse
from gateway.core.framing import Ending, Framing
from gateway.core.streams import Event, Stream
from gateway.errors import slow_consumer

HEADER = (b"x-vercel-ai-ui-message-stream", b"v1")
TERMINAL = {"finish", "error", "abort"}


def part_frame(part: dict[str, Any]) -> bytes:
    return sse.data(orjson.dumps(part))


class UiMessageMerge:
    """Parts for a lagging reader (:class:`gateway.core.merge.MergeRules`): consecutive ``text-delta`` (or
    ``reasoning-delta``) parts of one part id merge into one; every other part keeps its own event."""

    def group(self, payload: dict[str, Any]) -> object | None:
        kind = payload.get("type")
        return (kind, payload.get("id")) if kind in ("text-delta", "reasoning-delta") else None

    def merged(self, run: list[Event], text: str) -> dict[str, Any]:
        return {**run[-1].payload, "delta": text}


UI_MERGE = UiMessageMerge()


def _last_type(stream: Stream) -> str | None:
    return stream.events[-1].payload.get("type") if stream.events else None


class UiMessageSse(Framing):
    """One reader of a chat's answer: ``POST /api/chat`` or a resume (``GET /api/chat/{id}/stream``)."""

    name = "ui_message_sse"
    resumable = True
    merge = UI_MERGE

    def build(self, ev: Event) -> bytes:
        return sse.data(ev.json)

    def frame_bytes(self, ev: Event) -> bytes:
        return self.frame(ev)  # type: ignore[return-value]  # build() gives bytes

    def ending(self, stream: Stream) -> Ending:
        if _last_type(stream) in TERMINAL:
            return Ending(sse.DONE)
        if stream.state == "error" and stream.error is not None:
            return Ending(part_frame({"type": "error", "errorText": stream.error.message}) + sse.DONE)
        if stream.state == "cancelled":
            return Ending(part_frame({"type": "abort", "reason": "cancelled"}) + sse.DONE)
        return Ending(sse.DONE)

    def cut(self, send_timeout: float) -> Ending:
        err = slow_consumer(send_timeout, resumable=False)
        return Ending(part_frame({"type": "error", "errorText": err.message + " Reload to resume the answer."}))


UI_MESSAGE_SSE = UiMessageSse()

