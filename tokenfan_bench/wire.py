"""What a subscriber receives, decoded (pure: bytes in, values out; no I/O, no event loop).

:class:`SseDecoder` splits an SSE byte stream into events; :func:`chunk_sample` reduces a chunk
object to the few numbers the bench records. Both transports carry the same chunk JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class SseEvent(NamedTuple):
    event: str  # "message" unless an ``event:`` field says otherwise
    id: str | None
    data: bytes


@dataclass(slots=True)
class SseDecoder:
    """Incremental SSE parser: ``feed(bytes) -> complete events``; comments are dropped.

    Only what tokenfan sends is supported: LF line endings, one ``data:`` line per event (a second
    one is joined with ``\\n`` as the spec says).
    """

    _buf: bytes = b""

    def feed(self, data: bytes) -> list[SseEvent]:
        buf = self._buf + data if self._buf else data
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return []
        self._buf = buf[end + 2:]
        out: list[SseEvent] = []
        for block in buf[:end].split(b"\n\n"):
            ev = parse_block(block)
            if ev is not None:
                out.append(ev)
        return out


def parse_block(block: bytes) -> SseEvent | None:
    event, eid, data = "message", None, []
    for line in block.split(b"\n"):
        if not line or line[:1] == b":":
            continue
        name, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"id":
            eid = value.decode()
        elif name == b"event":
            event = value.decode()
    if not data:
        return None  # a comment, or a retry:-only block
    return SseEvent(event, eid, data[0] if len(data) == 1 else b"\n".join(data))


class ChunkSample(NamedTuple):
    seq: int
    emit_ns: int
    sent_ns: int  # the gateway's publish time (0 if absent)
    deltas: int  # engine deltas this event carries (>1 when the gateway coalesced a lagging subscriber)
    content: bool  # carries completion text (role-only and usage chunks do not)
    finish: bool  # carries a finish_reason


def chunk_sample(chunk: dict[str, Any]) -> ChunkSample:
    tf = chunk["tokenfan"]
    choices = chunk.get("choices")
    content = finish = False
    if choices:
        c = choices[0]
        delta = c.get("delta")
        content = bool(delta.get("content") if delta is not None else c.get("text"))
        finish = c.get("finish_reason") is not None
    return ChunkSample(tf["seq"], tf["emit_ns"], tf.get("sent_ns", 0), tf.get("coalesced", 1), content, finish)
