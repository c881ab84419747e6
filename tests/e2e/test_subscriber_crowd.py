"""A crowd of fan-out subscribers arriving at once, from raw sockets (half SSE, half WebSocket), on one gateway:
each replays the stream's history and follows it live; the gateway's loop goes on meanwhile (its engine link
sees no stall near its heartbeat timeout, no heartbeat is missed), and once they leave nothing of them is left
in the heap the gateway froze while they read (gateway/http/heap.py, gateway/core/turns.py)."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.helpers import wait_until
from tests.procs import Proc, start_engine, start_gateway, stop_all

CROWD = 1500
HISTORY = 300  # events each subscriber replays first
HEARTBEAT_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def gateway(ipc_dir: Path) -> Iterator[tuple[str, Proc]]:
    address = f"ipc://{ipc_dir / 'crowd.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-tokens-per-s", "50",
                          "--max-model-len", "1000000", name="engine-crowd")
    try:
        proc, url = start_gateway(address, "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--max-tokens-cap",
                                  "100000", "--max-subscribers", str(2 * CROWD),
                                  "--max-subscriptions-per-client", str(2 * CROWD),
                                  "--max-connections-per-client", str(4 * CROWD), name="gateway-crowd")
    except BaseException:
        engine.stop()
        raise
    try:
        yield url, proc
    finally:
        stop_all([proc, engine])


class _Subscriber(asyncio.Protocol):
    """Sends its request, then only notes its first event."""

    def __init__(self, request: bytes, first: asyncio.Future[None]) -> None:
        self.request, self.first = request, first
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if not self.first.done() and b'"seq"' in data:
            self.first.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.first.done():
            self.first.set_exception(ConnectionError("closed before its first event"))


def _request(stream_id: str, i: int) -> bytes:
    if i % 2 == 0:
        return f"GET /v1/streams/{stream_id}/events HTTP/1.1\r\nHost: t\r\nAccept: text/event-stream\r\n\r\n".encode()
    key = base64.b64encode(os.urandom(16)).decode()
    return (f"GET /v1/streams/{stream_id}/ws HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()


def crowd(url: str, stream_id: str, n: int) -> None:
    """``n`` subscribers connect at once; each gets its first event; then all leave."""
    host, port = url.removeprefix("http://").split(":")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        firsts = [loop.create_future() for _ in range(n)]
        conns = await asyncio.gather(*(loop.create_connection(lambda i=i: _Subscriber(_request(stream_id, i),  # type: ignore[misc]
                                                                                        firsts[i]), host, int(port))
                                       for i in range(n)))
        try:
            await asyncio.wait_for(asyncio.gather(*firsts), 300)
        finally:
            for transport, _ in conns:
                transport.close()

    asyncio.run(main())


def _health(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/health", timeout=60).json())


def _events(url: str, stream_id: str) -> int:
    return int(httpx.get(f"{url}/v1/streams/{stream_id}", timeout=60).json()["events"])


def test_a_crowd_subscribing_at_once_neither_stalls_the_gateway_nor_stays_in_its_heap(
        gateway: tuple[str, Proc]) -> None:
    url, _ = gateway
    r = httpx.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "x", "max_tokens": 100000,
                                              "ignore_eos": True})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    wait_until(lambda: _events(url, sid) >= HISTORY, 120, "the stream's history")

    def round_trip() -> tuple[int, int]:
        """A crowd joins and leaves; then, once the gateway thawed its heap (one full collection), the objects
        it holds (frozen and tracked) and the stream's events."""
        thaws = _health(url)["gc"]["thaws"]
        crowd(url, sid, CROWD)
        h = _health(url)
        (link,) = h["engines"]
        # The engine link's own reading of the loop: its heartbeat ticks' lateness. Generous: the link warns at
        # half its timeout, and a loop that starved for that long is what this guards against (10,000
        # subscribers of one stream once held it for seconds); a busy host alone stays far below.
        assert link["longest_loop_stall_s"] < HEARTBEAT_TIMEOUT / 2, link
        assert link["healthy"] and link["restarts"] == 0 and link["disconnects"] == 0, link
        wait_until(lambda: _health(url)["gc"]["thaws"] > thaws, 60, "the heap thawed once the crowd left")
        gc = _health(url)["gc"]
        return gc["frozen"] + gc["tracked"], _events(url, sid)

    held, events = round_trip()
    held2, events2 = round_trip()
    # What the second crowd left behind: the objects held after it, less the events the stream appended
    # meanwhile (an event and its frames: at most 3 objects). A reader holds about 50 tracked objects while it
    # reads; every reader's left behind would be 75,000. The bound (5 a reader) leaves room for caches filled
    # on the way (metrics' label children, logging), not for a reader's objects.
    assert held2 - held - 3 * (events2 - events) < 5 * CROWD, (held, held2, events, events2)
    httpx.delete(f"{url}/v1/streams/{sid}", timeout=60)
