"""gateway/core/bare.py without a server: the deferred finalisers, and a detached WebSocket's answers to the
frames a client sends (websockets' parser), against a transport that records what is written."""

from __future__ import annotations

import asyncio
import os
import struct
from typing import Any

from gateway.core.bare import BareWs, Detached, defer


def test_finalisers_run_now_without_a_detached_connection_and_at_its_end_with_one() -> None:
    ran: list[str] = []
    defer({}, lambda: ran.append("now"))
    assert ran == ["now"]
    detached = Detached()
    scope: dict[str, Any] = {"tokenfan.detached": detached}
    defer(scope, lambda: ran.append("inner"))
    defer(scope, lambda: 1 / 0)  # a finaliser's bug is logged; the others still run
    defer(scope, lambda: ran.append("outer"))
    assert ran == ["now"]
    detached.done()
    assert ran == ["now", "inner", "outer"]
    defer(scope, lambda: ran.append("late"))  # registered after the end: run at once, never lost
    assert ran[-1] == "late"


class Recorder:
    """The transport side of a socket: what was written, whether it was closed."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closing = False

    def write(self, data: bytes) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True


def masked(opcode: int, payload: bytes, fin: bool = True) -> bytes:
    mask = os.urandom(4)
    n = len(payload)
    head = struct.pack("!BB", (0x80 if fin else 0) | opcode, 0x80 | n) if n < 126 else \
        struct.pack("!BBH", (0x80 if fin else 0) | opcode, 0x80 | 126, n)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def run(script: Any) -> Recorder:
    async def main() -> Recorder:
        transport = Recorder()
        ws = BareWs(transport, [], 1.0, False, max_size=1000, ping_interval=None, ping_timeout=None)  # type: ignore[arg-type]
        script(ws)
        return transport

    return asyncio.run(main())


def test_a_ping_is_answered_with_its_payload_even_split_across_reads() -> None:
    frame = masked(0x9, b"hello")
    transport = run(lambda ws: [ws.data_received(frame[:3]), ws.data_received(frame[3:])])
    assert bytes(transport.out) == b"\x8a\x05hello" and not transport.closing


def test_text_from_the_client_is_skipped_and_a_close_is_echoed_then_the_socket_closes() -> None:
    def script(ws: BareWs) -> None:
        ws.data_received(masked(0x1, b"ignored", fin=False) + masked(0x0, b" too") +
                         masked(0x8, struct.pack("!H", 1001) + b"going"))

    transport = run(script)
    assert bytes(transport.out) == b"\x88\x02" + struct.pack("!H", 1001) and transport.closing


def test_a_frame_over_the_limit_or_unmasked_fails_the_connection_with_its_code() -> None:
    too_big = run(lambda ws: ws.data_received(masked(0x1, b"x" * 1001)))
    assert bytes(too_big.out[:4]) == b"\x88" + bytes([len(too_big.out) - 2]) + struct.pack("!H", 1009)
    assert too_big.closing
    unmasked = run(lambda ws: ws.data_received(b"\x81\x02hi"))
    assert bytes(unmasked.out[2:4]) == struct.pack("!H", 1002) and unmasked.closing
