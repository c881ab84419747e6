"""What a subscriber receives, decoded (pure: bytes in, values out; no I/O, no event loop).

:class:`SseDecoder` (from :mod:`gateway.core.sse`) splits an SSE byte stream into events; :func:`sample_sse` / :func:`sample_ws`
reduce a chunk (JSON bytes) to the few numbers the bench records, decoding only those fields
(msgspec, typed: ~1 µs a chunk); :func:`chunk_sample` does the same for an already decoded chunk.
Both transports carry the same chunk JSON. :class:`WsDecoder` and :func:`ws_frame` are the
WebSocket framing of the raw floor server and of WebSocket over HTTP/2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from gateway.core.sse import SseDecoder, SseEvent, parse_block

__all__ = ["ChunkSample", "SseDecoder", "SseEvent", "parse_block"]  # the SSE decoder lives with the encoder


class ChunkSample(NamedTuple):
    seq: int
    emit_ns: int
    sent_ns: int  # the gateway's publish time (0 if absent)
    deltas: int  # engine deltas this event carries (>1 when the gateway coalesced a lagging subscriber)
    content: bool  # carries completion text (role-only and usage chunks do not)
    finish: bool  # carries a finish_reason
    migrated: bool = False  # the first event after its generation moved to another engine (a failover gap)


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None
    finish_reason: str | None = None


class _Tokenfan(msgspec.Struct):
    seq: int
    emit_ns: int
    sent_ns: int = 0
    coalesced: int = 1
    migrated: bool = False


class _Chunk(msgspec.Struct):
    tokenfan: _Tokenfan
    choices: list[_Choice] = []


class WsMessage(msgspec.Struct):
    """A fan-out WebSocket message: ``chunk`` (with ``data``), ``done`` (``reason`` if it did not
    finish normally) or ``error``."""

    type: str
    data: _Chunk | None = None
    reason: str | None = None
    error: Any = None


_chunk = msgspec.json.Decoder(_Chunk).decode
_ws = msgspec.json.Decoder(WsMessage).decode


def _sample(c: _Chunk) -> ChunkSample:
    tf = c.tokenfan
    content = finish = False
    if c.choices:
        ch = c.choices[0]
        content = bool(ch.delta.content if ch.delta is not None else ch.text)
        finish = ch.finish_reason is not None
    return ChunkSample(tf.seq, tf.emit_ns, tf.sent_ns, tf.coalesced, content, finish, tf.migrated)


def sample_sse(data: bytes) -> ChunkSample:
    """The sample of one chunk's JSON; ValueError (msgspec's errors) when it is not a chunk."""
    return _sample(_chunk(data))


def decode_ws(raw: bytes | str) -> tuple[WsMessage, ChunkSample | None]:
    """A WebSocket message, and the sample of its chunk if it is one; ValueError if malformed."""
    msg = _ws(raw)
    if msg.type == "chunk":
        if msg.data is None:
            raise ValueError("chunk message without data")
        return msg, _sample(msg.data)
    return msg, None


def chunk_sample(chunk: dict[str, Any]) -> ChunkSample:
    tf = chunk["tokenfan"]
    choices = chunk.get("choices")
    content = finish = False
    if choices:
        c = choices[0]
        delta = c.get("delta")
        content = bool(delta.get("content") if delta is not None else c.get("text"))
        finish = c.get("finish_reason") is not None
    return ChunkSample(tf["seq"], tf["emit_ns"], tf.get("sent_ns", 0), tf.get("coalesced", 1), content, finish,
                       bool(tf.get("migrated")))


# -- WebSocket frames (RFC 6455), for the raw floor server and WebSocket over HTTP/2 ---------------

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0, 1, 2, 8, 9, 10


class WsFrame(NamedTuple):
    opcode: int
    fin: bool
    payload: bytes  # unmasked


def ws_frame(opcode: int, payload: bytes, mask: bytes | None = None) -> bytes:
    """One final frame; ``mask`` (4 bytes) for a client's frame, none for a server's."""
    n = len(payload)
    head = bytes([0x80 | opcode])
    bit = 0x80 if mask else 0
    if n < 126:
        head += bytes([bit | n])
    elif n < 1 << 16:
        head += bytes([bit | 126]) + n.to_bytes(2, "big")
    else:
        head += bytes([bit | 127]) + n.to_bytes(8, "big")
    if mask:
        return head + mask + apply_mask(payload, mask)
    return head + payload


def apply_mask(data: bytes, mask: bytes) -> bytes:
    n = len(data)
    key = int.from_bytes((mask * (n // 4 + 1))[:n], "big")
    return (int.from_bytes(data, "big") ^ key).to_bytes(n, "big")


def ws_close_payload(code: int, reason: str = "") -> bytes:
    return code.to_bytes(2, "big") + reason.encode()[:120]


@dataclass(slots=True)
class WsDecoder:
    """Incremental frame parser: ``feed(bytes) -> complete frames`` (masked or not)."""

    max_size: int = 1 << 26
    _buf: bytes = b""

    def feed(self, data: bytes) -> list[WsFrame]:
        buf = self._buf + data if self._buf else data
        out: list[WsFrame] = []
        pos, n = 0, len(buf)
        while n - pos >= 2:
            b0, b1 = buf[pos], buf[pos + 1]
            size, p = b1 & 0x7F, pos + 2
            if size == 126:
                if n - p < 2:
                    break
                size, p = int.from_bytes(buf[p:p + 2], "big"), p + 2
            elif size == 127:
                if n - p < 8:
                    break
                size, p = int.from_bytes(buf[p:p + 8], "big"), p + 8
            if size > self.max_size:
                raise ValueError(f"WebSocket frame of {size} bytes is over the {self.max_size} limit")
            mask = None
            if b1 & 0x80:
                if n - p < 4:
                    break
                mask, p = buf[p:p + 4], p + 4
            if n - p < size:
                break
            payload = buf[p:p + size]
            out.append(WsFrame(b0 & 0x0F, bool(b0 & 0x80), apply_mask(payload, mask) if mask else payload))
            pos = p + size
        self._buf = buf[pos:]
        return out
