"""One slow-reader contract on every delivery path, checked with raw sockets that stop reading.

Each case opens one path from a socket with a 2 KB receive window, lets the gateway fill every buffer
with 2,000-character tokens, and then checks: the reader is cut (``--send-timeout`` 1 s), its
generation is aborted in the engine (it was the only reader), and when the client finally reads what
reached it, the stream ends with the explicit notice (SSE ``event: error`` slow_consumer, WebSocket
close 1013) and never with a normal end.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.helpers import fat_gateway, metric, stalled_client, wait_until

BODY = {"prompt": "x", "max_tokens": 8000, "ignore_eos": True}


@pytest.fixture(scope="module")
def fat_url(ipc_dir: Path) -> Iterator[str]:
    with fat_gateway(ipc_dir, "stall") as url:
        yield url


def _post(body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(raw), raw))


def _ws_upgrade(path: str) -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()


def _masked_text(payload: bytes) -> bytes:
    mask = os.urandom(4)
    n = len(payload)
    head = struct.pack("!BB", 0x81, 0x80 | n) if n < 126 else struct.pack("!BBH", 0x81, 0x80 | 126, n)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _create_stream(url: str) -> str:
    r = httpx.post(url + "/v1/streams", json={"endpoint": "completions", **BODY})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _drain(sock: socket.socket, limit_s: float = 20.0) -> bytes:
    """Everything the gateway sent, read until it closes the connection."""
    sock.settimeout(2.0)
    out = bytearray()
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            data = sock.recv(1 << 16)
        except (TimeoutError, ConnectionResetError):
            break
        if not data:
            break
        out += data
    return bytes(out)


def _ws_frames(raw: bytes) -> list[tuple[int, bytes]]:
    """Server frames (unmasked) after the 101 response: (opcode, payload)."""
    pos = raw.index(b"\r\n\r\n") + 4
    frames = []
    while pos + 2 <= len(raw):
        b0, b1 = raw[pos], raw[pos + 1]
        n, pos = b1 & 0x7F, pos + 2
        if n == 126:
            n, pos = struct.unpack("!H", raw[pos:pos + 2])[0], pos + 2
        elif n == 127:
            n, pos = struct.unpack("!Q", raw[pos:pos + 8])[0], pos + 8
        if pos + n > len(raw):
            break
        frames.append((b0 & 0x0F, raw[pos:pos + n]))
        pos += n
    return frames


def _check_sse(raw: bytes) -> None:
    assert b"slow_consumer" in raw[-4096:], raw[-600:]
    assert b"data: [DONE]" not in raw


def _check_ws(raw: bytes, done_marker: bytes) -> None:
    frames = _ws_frames(raw)
    assert frames, raw[:300]
    opcode, payload = frames[-1]
    assert opcode == 0x8 and struct.unpack("!H", payload[:2])[0] == 1013, frames[-1]
    assert not any(op == 0x1 and done_marker in p for op, p in frames)


PATHS: dict[str, Callable[[str], tuple[bytes, list[bytes], Callable[[bytes], None]]]] = {
    "post_sse": lambda url: (_post({**BODY, "stream": True}), [], _check_sse),
    "fanout_sse": lambda url: (f"GET /v1/streams/{_create_stream(url)}/events HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
                               [], _check_sse),
    "fanout_ws": lambda url: (_ws_upgrade(f"/v1/streams/{_create_stream(url)}/ws"), [],
                              lambda raw: _check_ws(raw, b'"type":"done"')),
    "mux_ws": lambda url: (_ws_upgrade("/v1/ws"), [_masked_text(json.dumps(
        {"type": "request", "id": f"r{i}", "endpoint": "completions", "body": {**BODY, "stream": True}}).encode())
        for i in range(3)], lambda raw: _check_ws(raw, b'"type":"done"')),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_a_reader_that_stops_reading_is_cut_its_generation_aborted_and_told_why(fat_url: str, path: str) -> None:
    url = fat_url
    network_before = metric(url, "tokenfan_errors_total", {"class": "network"})
    aborted_before = metric(url, "tokenfan_requests_aborted_total")
    request, messages, check = PATHS[path](url)
    sock = stalled_client(url, request)
    try:
        if messages:
            time.sleep(0.3)  # the 101 arrives first
            for m in messages:
                sock.sendall(m)
        wait_until(lambda: metric(url, "tokenfan_errors_total", {"class": "network"}) > network_before,
                   timeout=25, what=f"{path}: the stalled reader is cut")
        # The only reader was cut: its generation(s) are aborted in the engine, not run to the end.
        wait_until(lambda: metric(url, "tokenfan_requests_aborted_total") > aborted_before, timeout=10,
                   what=f"{path}: generation aborted")
        wait_until(lambda: httpx.get(url + "/health").json()["engine"]["running"] == 0, timeout=10,
                   what=f"{path}: engine idle")
        check(_drain(sock))
    finally:
        sock.close()
