"""The client side of HTTP/2 (RFC 9113), minimal and sans I/O: bytes in, events out, bytes to send.

Why not the ``h2`` library: it costs ~26 µs of CPU per DATA frame here (measured: its state machine
and event objects per frame), more than the whole 15 µs budget of a bench client per event. What a
bench subscriber needs is small: open streams with one HEADERS frame, read HEADERS and DATA, answer
SETTINGS and PING, return flow-control credit, notice RST_STREAM and GOAWAY. Header blocks are
(de)compressed with ``hpack`` (once per stream, not per event).

Flow control: streams are opened with the largest window (2^31-1 bytes) and never replenished (a
bench stream never gets near it); the connection window is topped up by a WINDOW_UPDATE whenever
half of it has been used. Server push is disabled. The client sends little data (WebSocket frames
over RFC 8441 streams), so it ignores its own send windows.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
# SETTINGS identifiers
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE = 1, 2, 3, 4, 5
MAX_HEADER_LIST_SIZE, ENABLE_CONNECT_PROTOCOL = 6, 8
MAX_WINDOW = (1 << 31) - 1
CANCEL, NO_ERROR, PROTOCOL_ERROR = 0x8, 0x0, 0x1
_HEAD = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
_SETTING = struct.Struct(">HI")


class H2Error(ValueError):
    """The peer broke the protocol (or answered with GOAWAY/RST_STREAM where that is fatal)."""


class Frame(NamedTuple):
    type: int
    flags: int
    stream: int
    payload: bytes


def frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return _HEAD.pack(len(payload) << 8 | ftype, flags, stream) + payload


def settings_frame(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in values.items()))


def window_update(stream: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream, struct.pack(">I", increment))


class FrameReader:
    """Splits a byte stream into frames."""

    __slots__ = ("_buf", "max_size")

    def __init__(self, max_size: int = 1 << 24) -> None:
        self._buf = b""
        self.max_size = max_size

    def feed(self, data: bytes) -> list[Frame]:
        buf = self._buf + data if self._buf else data
        out: list[Frame] = []
        pos, n = 0, len(buf)
        while n - pos >= 9:
            lt, flags, sid = _HEAD.unpack_from(buf, pos)
            size = lt >> 8
            if size > self.max_size:
                raise H2Error(f"frame of {size} bytes is over the {self.max_size} limit")
            if n - pos - 9 < size:
                break
            out.append(Frame(lt & 0xFF, flags, sid & 0x7FFFFFFF, buf[pos + 9:pos + 9 + size]))
            pos += 9 + size
        self._buf = buf[pos:] if pos < n else b""
        return out


def _unpad(f: Frame) -> bytes:
    p = f.payload
    if f.flags & PADDED:
        if not p or p[0] >= len(p):
            raise H2Error("bad padding")
        return p[1:len(p) - p[0]]
    return p


# Events: (kind, stream, value, end_stream); kind one of the names below.
EV_HEADERS, EV_DATA, EV_RESET, EV_GOAWAY, EV_SETTINGS = "headers", "data", "reset", "goaway", "settings"
Event = tuple[str, int, object, bool]


class H2Client:
    """One client connection. ``receive(bytes) -> events``; ``data_to_send() -> bytes``.

    Events: ``("headers", stream, [(name, value)…], end_stream)``, ``("data", stream, bytes,
    end_stream)``, ``("reset", stream, error_code, True)``, ``("goaway", last_stream, error_code, True)``,
    ``("settings", 0, {id: value}, False)`` (the server's settings, each time they change).
    """

    def __init__(self, header_table_size: int = 4096) -> None:
        self._reader = FrameReader()
        self._enc, self._dec = hpack.Encoder(), hpack.Decoder()
        self._out: list[bytes] = [PREFACE, settings_frame({ENABLE_PUSH: 0, INITIAL_WINDOW_SIZE: MAX_WINDOW,
                                                          HEADER_TABLE_SIZE: header_table_size}),
                                  window_update(0, MAX_WINDOW - 65535)]
        self._next = 1
        self._unacked = 0  # connection-level DATA bytes received since the last WINDOW_UPDATE
        self._block: tuple[int, int, list[bytes]] | None = None  # a header block waiting for CONTINUATION
        self.peer: dict[int, int] = {MAX_CONCURRENT_STREAMS: 1 << 31, ENABLE_CONNECT_PROTOCOL: 0}
        self.goaway: int | None = None  # last stream id the server will process, once it said GOAWAY

    # -- sending --------------------------------------------------------------------------------

    def open(self, headers: list[tuple[str, str]], end_stream: bool) -> int:
        """Start a request; returns its stream id."""
        sid = self._next
        self._next += 2
        block = self._enc.encode(headers)
        self._out.append(frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), sid, block))
        return sid

    def send_data(self, stream: int, data: bytes, end_stream: bool = False) -> None:
        self._out.append(frame(DATA, END_STREAM if end_stream else 0, stream, data))

    def reset(self, stream: int, code: int = CANCEL) -> None:
        self._out.append(frame(RST_STREAM, 0, stream, struct.pack(">I", code)))

    def data_to_send(self) -> bytes:
        out, self._out = self._out, []
        return b"".join(out)

    @property
    def streams_opened(self) -> int:
        return self._next // 2

    # -- receiving ------------------------------------------------------------------------------

    def receive(self, data: bytes) -> list[Event]:
        events: list[Event] = []
        for f in self._reader.feed(data):
            t = f.type
            if t == DATA:
                self._unacked += len(f.payload)
                if self._unacked > MAX_WINDOW // 2:
                    self._out.append(window_update(0, self._unacked))
                    self._unacked = 0
                events.append((EV_DATA, f.stream, _unpad(f), bool(f.flags & END_STREAM)))
            elif self._block is not None and t != CONTINUATION:
                raise H2Error("header block interrupted")
            elif t == HEADERS:
                body = _unpad(f)
                if f.flags & PRIORITY_FLAG:
                    body = body[5:]
                self._header_block(f.stream, f.flags, body, events)
            elif t == CONTINUATION:
                if self._block is None or self._block[0] != f.stream:
                    raise H2Error("unexpected CONTINUATION")
                sid, flags, parts = self._block
                parts.append(f.payload)
                if f.flags & END_HEADERS:
                    self._block = None
                    self._header_block(sid, flags | END_HEADERS, b"".join(parts), events)
            elif t == SETTINGS:
                if not f.flags & ACK:
                    for i in range(0, len(f.payload) - 5, 6):
                        k, v = _SETTING.unpack_from(f.payload, i)
                        self.peer[k] = v
                        if k == HEADER_TABLE_SIZE:
                            self._enc.header_table_size = v
                    self._out.append(frame(SETTINGS, ACK, 0))
                    events.append((EV_SETTINGS, 0, dict(self.peer), False))
            elif t == PING:
                if not f.flags & ACK:
                    self._out.append(frame(PING, ACK, 0, f.payload))
            elif t == RST_STREAM:
                events.append((EV_RESET, f.stream, struct.unpack(">I", f.payload[:4])[0], True))
            elif t == GOAWAY:
                last, code = struct.unpack(">II", f.payload[:8])
                self.goaway = last & 0x7FFFFFFF
                events.append((EV_GOAWAY, self.goaway, code, True))
            elif t == PUSH_PROMISE:
                raise H2Error("PUSH_PROMISE although push is disabled")
            # PRIORITY, WINDOW_UPDATE and unknown types: nothing to do for a reader
        return events

    def _header_block(self, sid: int, flags: int, block: bytes, events: list[Event]) -> None:
        if not flags & END_HEADERS:
            self._block = (sid, flags, [block])
            return
        try:
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self._dec.decode(block, raw=True)]
        except hpack.HPACKError as exc:
            raise H2Error(f"bad header block: {exc}") from exc
        events.append((EV_HEADERS, sid, headers, bool(flags & END_STREAM)))
