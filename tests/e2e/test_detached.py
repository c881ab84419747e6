"""Fan-out subscribers out of their ASGI call (``--detach-subscribers``, gateway/core/bare.py), from raw sockets.

Once a subscriber's response has started the gateway holds its socket itself (uvicorn forgets it). What the
server and the middlewares did for it must still happen, at the connection's real end: every event and the
end reach it, its client's connection and subscription are counted until it leaves (a limit of 2 connections
takes five subscribers one after another only if each is released), the access log's line is written when it
ends (its duration covers the subscription), and a WebSocket's control frames are answered: the client's
ping, its close, the gateway's own keep-alive pings (a client that stops answering is closed 1011).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.helpers import metric, wait_until
from tests.procs import Proc, start_engine, start_gateway, stop_all


@pytest.fixture(scope="module", params=[True, False], ids=["detached", "in-call"])
def gateway(request: pytest.FixtureRequest, ipc_dir: Path) -> Iterator[tuple[str, Proc, bool]]:
    detach: bool = request.param
    address = f"ipc://{ipc_dir / f'detach-{detach}.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-tokens-per-s", "40",
                          name=f"engine-detach-{detach}")
    try:
        proc, url = start_gateway(address, "--detach-subscribers", str(detach).lower(), "--log-level", "info",
                                  "--max-connections-per-client", "2", "--keepalive-interval", "0.4",
                                  name=f"gateway-detach-{detach}")
    except BaseException:
        engine.stop()
        raise
    try:
        yield url, proc, detach
    finally:
        stop_all([proc, engine])


def _stream(url: str, tokens: int) -> dict:
    r = httpx.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "x", "max_tokens": tokens,
                                              "ignore_eos": True})
    assert r.status_code == 201, r.text
    return dict(r.json())


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=20)


def _read_to_close(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _dechunk(body: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        n = int(size_line, 16)
        if n == 0:
            return out
        out, body = out + body[:n], body[n + 2:]


def _access_lines(proc: Proc, path: str) -> list[dict]:
    return [e for line in proc.log().splitlines() if "tokenfan.access: " in line
            for e in [json.loads(line.split("tokenfan.access: ", 1)[1])] if e["path"] == path]


def test_sse_subscribers_read_every_event_and_are_released_at_their_real_end(
        gateway: tuple[str, Proc, bool]) -> None:
    url, proc, detach = gateway
    info = _stream(url, 30)  # 0.75 s at 40 tokens/s: the first subscribers read it live
    path = f"/v1/streams/{info['id']}/events"
    t0 = time.monotonic()
    reads: list[str] = []
    for _ in range(5):  # one after another, over a limit of 2 connections per client
        sock = _connect(url)
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        raw = _read_to_close(sock)  # the server closes after the end when it said Connection: close
        sock.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert (b"\r\nconnection: close" in head.lower()) is detach, head
        if not detach:
            break  # uvicorn keeps the connection; the reads below need the server's close
        text = _dechunk(body).decode()
        ids = [int(line[4:]) for line in text.splitlines() if line.startswith("id: ")]
        # every event once, in order (a busy engine may put two of the 30 tokens in one step: fewer events)
        assert ids and ids == list(range(len(ids))), text[-300:]
        assert '"finish_reason":"length"' in text.split("id: ")[-1], text[-300:]  # the last event ends it
        assert text.endswith("data: [DONE]\n\n"), text[-200:]
        reads.append(text)
    assert len(set(reads)) <= 1, "the live subscriber and the later ones read the same events"
    live = time.monotonic() - t0
    wait_until(lambda: metric(url, "tokenfan_subscribers", {"transport": "sse"}) == 0, what="subscribers released")
    if detach:
        wait_until(lambda: len(_access_lines(proc, path)) >= 5, what="an access line per subscriber")
        first = _access_lines(proc, path)[0]
        assert first["status"] == 200 and first["duration_ms"] >= 400, first  # written at its end, not its detach
        assert live > 0.4


def test_a_subscriber_that_leaves_is_released_and_its_stream_goes_on(gateway: tuple[str, Proc, bool]) -> None:
    url, _proc, _detach = gateway
    info = _stream(url, 2000)
    socks = [_connect(url) for _ in range(2)]
    for sock in socks:
        sock.sendall(f"GET /v1/streams/{info['id']}/events HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert b"id: " in sock.recv(65536) + sock.recv(65536)
    wait_until(lambda: metric(url, "tokenfan_subscribers", {"transport": "sse"}) == 2, what="two subscribers")
    for sock in socks:
        sock.close()
    wait_until(lambda: metric(url, "tokenfan_subscribers", {"transport": "sse"}) == 0, what="both released")
    third = _connect(url)  # the client's two connections were released too
    third.sendall(f"GET /v1/streams/{info['id']}/events HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    assert third.recv(65536).startswith(b"HTTP/1.1 200")
    third.close()
    assert httpx.get(url + f"/v1/streams/{info['id']}").json()["state"] == "running"
    assert httpx.delete(url + f"/v1/streams/{info['id']}").status_code == 200


# -- WebSocket control frames ----------------------------------------------------------------------------------

def _ws_open(url: str, path: str) -> tuple[socket.socket, bytearray]:
    sock = _connect(url)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    buf = bytearray()
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock, bytearray(rest)


def _masked(opcode: int, payload: bytes) -> bytes:
    mask = os.urandom(4)
    return struct.pack("!BB", 0x80 | opcode, 0x80 | len(payload)) + mask + \
        bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _frame(sock: socket.socket, buf: bytearray) -> tuple[int, bytes] | None:
    """The next server frame (opcode, payload); None when the server closed the socket."""
    while True:
        if len(buf) >= 2:
            n, at = buf[1] & 0x7F, 2
            if n == 126 and len(buf) >= 4:
                n, at = struct.unpack("!H", buf[2:4])[0], 4
            elif n == 127 and len(buf) >= 10:
                n, at = struct.unpack("!Q", buf[2:10])[0], 10
            if (n < 126 or at > 2) and len(buf) >= at + n:
                opcode, payload = buf[0] & 0x0F, bytes(buf[at:at + n])
                del buf[:at + n]
                return opcode, payload
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk


def test_a_websocket_subscriber_answers_pings_and_pings_its_client(gateway: tuple[str, Proc, bool]) -> None:
    url, _proc, _detach = gateway
    info = _stream(url, 2000)
    sock, buf = _ws_open(url, f"/v1/streams/{info['id']}/ws")
    sock.sendall(_masked(0x9, b"are you there"))
    seen: dict[int, list[bytes]] = {}
    answered = 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (b"are you there" not in seen.get(0xA, []) or answered < 2):
        frame = _frame(sock, buf)
        assert frame is not None, "closed while answering its pings"
        seen.setdefault(frame[0], []).append(frame[1])
        if frame[0] == 0x9:  # the gateway's keep-alive ping (every 0.4 s): answered, the connection stays
            sock.sendall(_masked(0xA, frame[1]))
            answered += 1
    assert b"are you there" in seen.get(0xA, []), "the client's ping was not answered"
    assert answered >= 2 and seen.get(0x1), "no keep-alive pings or no messages"
    # stop answering: within ping interval + timeout (0.4 + 0.8 s) the gateway closes 1011
    t0 = time.monotonic()
    while (frame := _frame(sock, buf)) is not None and frame[0] != 0x8:
        pass
    assert frame is not None and struct.unpack("!H", frame[1][:2])[0] == 1011, frame
    assert time.monotonic() - t0 < 5
    assert _frame(sock, buf) is None  # then the socket closes
    sock.close()
    # a client that closes first gets its code echoed, then the socket closes; the stream goes on
    sock, buf = _ws_open(url, f"/v1/streams/{info['id']}/ws")
    assert _frame(sock, buf) is not None
    sock.sendall(_masked(0x8, struct.pack("!H", 1000) + b"bye"))
    while (frame := _frame(sock, buf)) is not None and frame[0] != 0x8:
        pass
    assert frame is not None and frame[1][:2] == struct.pack("!H", 1000), frame
    assert _frame(sock, buf) is None
    sock.close()
    wait_until(lambda: metric(url, "tokenfan_subscribers", {"transport": "ws"}) == 0, what="ws released")
    assert httpx.get(url + f"/v1/streams/{info['id']}").json()["state"] == "running"
    httpx.delete(url + f"/v1/streams/{info['id']}")


# -- a uvicorn the shim does not know: the port is off, subscribers stay in their ASGI call -----------------------

UNKNOWN_UVICORN = {  # a sitecustomize run before the gateway: what changes in the uvicorn it imports
    "another-version": "import uvicorn\nuvicorn.__version__ = '0.99.0'\n",
    "a-member-gone": "from uvicorn.protocols.websockets import websockets_sansio_impl as m\n"
                     "del m.WebSocketsSansIOProtocol.stop_keepalive\n",
}


@pytest.mark.parametrize("change", sorted(UNKNOWN_UVICORN))
def test_on_a_uvicorn_the_shim_does_not_know_the_gateway_says_so_and_serves_fan_out_in_call(
        change: str, ipc_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(UNKNOWN_UVICORN[change])
    address = f"ipc://{ipc_dir / f'unknown-uvicorn-{change}.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-tokens-per-s", "200",
                          name=f"engine-unknown-{change}")
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    try:
        proc, url = start_gateway(address, "--log-level", "info", env={"PYTHONPATH": path},
                                  name=f"gateway-unknown-{change}")
    except BaseException:
        engine.stop()
        raise
    try:
        errors = [line for line in proc.log().splitlines() if "ERROR tokenfan.server: uvicorn shim" in line]
        assert errors and ("uvicorn 0.99.0 is not a version" in errors[0] if change == "another-version"
                           else "WebSocketsSansIOProtocol has no stop_keepalive" in errors[0]), proc.log()[-2000:]
        info = _stream(url, 20)
        with httpx.stream("GET", f"{url}/v1/streams/{info['id']}/events", timeout=30) as r:
            text = "".join(r.iter_text())
        assert r.status_code == 200 and "connection" not in r.headers  # in its ASGI call: not detached
        ids = [int(line[4:]) for line in text.splitlines() if line.startswith("id: ")]
        assert ids and ids == sorted(set(ids)), ids  # a lagging reader's content events may be merged
        assert '"finish_reason":"length"' in text and text.endswith("data: [DONE]\n\n"), text[-300:]
    finally:
        stop_all([proc, engine])
