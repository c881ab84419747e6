"""The steady state of a streamed answer as bytes (pure): a ``response.output_text.delta`` per engine step,
rendered from bytes cut once per message item with only the text and ``sequence_number`` spliced in."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.core import sse


def text_delta_event(item_id: str, output_index: int, text: str, sequence_number: int | str) -> dict[str, Any]:
    """A message item's ``response.output_text.delta`` event: what :meth:`ResponseEvents.delta` appends
    and what :class:`TextDeltaTemplate` is cut from (``sequence_number`` is a string only for that cut)."""
    return {"type": "response.output_text.delta", "item_id": item_id, "output_index": output_index,
            "content_index": 0, "delta": text, "logprobs": [], "sequence_number": sequence_number}


class TextDeltaTemplate:
    """The ``response.output_text.delta`` events of one message item as bytes with two holes, the text and
    the ``sequence_number``: one is ``prefix + orjson.dumps(text) + middle + str(seq) + suffix``, ~0.35 µs
    (the dict and its serialization cost ~0.5 µs, the builder's Python around them as much again). The
    bytes are cut from :func:`text_delta_event`'s own, so both paths give the same bytes; :meth:`sse` is the
    whole SSE frame (``event:`` + ``data:``) in one formatting. A :class:`gateway.core.streams.Template`."""

    __slots__ = ("middle", "prefix", "sse_prefix", "suffix")

    TYPE = "response.output_text.delta"
    TYPE_BYTES = TYPE.encode()
    _TEXT, _SEQ = "\x00tokenfan-text\x00", "\x00tokenfan-seq\x00"

    def __init__(self, item_id: str, output_index: int) -> None:
        whole = orjson.dumps(text_delta_event(item_id, output_index, self._TEXT, self._SEQ))
        self.prefix, rest = whole.split(orjson.dumps(self._TEXT))
        self.middle, self.suffix = rest.split(orjson.dumps(self._SEQ))
        self.sse_prefix = sse.named_prefix(self.TYPE_BYTES) + self.prefix

    def render(self, text: str, seq: int) -> bytes:
        """The event's JSON (``seq``: its ``sequence_number``, the stream log's ``seq``)."""
        return b"%b%b%b%d%b" % (self.prefix, orjson.dumps(text), self.middle, seq, self.suffix)

    def sse(self, text: str, seq: int) -> bytes:
        """The event's SSE frame, as :class:`gateway.api.responses.stream.ResponsesSse` frames a dict event."""
        return b"%b%b%b%d%b%b" % (self.sse_prefix, orjson.dumps(text), self.middle, seq, self.suffix, sse.END)
