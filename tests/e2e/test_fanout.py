"""Fan-out streams end to end: real gateway and engine processes, real httpx/websockets/socket clients."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Iterator

import httpx
import pytest
import websockets

from tests.e2e.helpers import chunk_text, fat_gateway, metric, sse_events, stalled_client, until, wait_until
from tests.procs import NO_CLIENT_LIMITS, engine_and_gateway, start_gateway


def create(url: str, max_tokens: int, endpoint: str = "completions", **extra: object) -> dict:
    body = {"endpoint": endpoint, "max_tokens": max_tokens, **extra}
    if endpoint == "completions":
        body.setdefault("prompt", "fan out")
    else:
        body.setdefault("messages", [{"role": "user", "content": "fan out"}])
    r = httpx.post(url + "/v1/streams", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def full_text(url: str, sid: str) -> tuple[str, int]:
    """Text and last seq of a finished stream, read by a fresh subscriber from the start."""
    events = [e for e in sse_events(httpx.get(f"{url}/v1/streams/{sid}/events", timeout=30).text) if "id" in e]
    return "".join(chunk_text(json.loads(e["data"])) for e in events), int(events[-1]["id"])


@pytest.fixture(scope="module")
def slow_engine_gateway(ipc_dir) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """An engine at 40 tokens/s, so streams last long enough to join, leave and resume mid-way."""
    with engine_and_gateway(f"ipc://{ipc_dir / 'fanout-40.sock'}",
                            ("--engine", "synthetic", "--synthetic-tokens-per-s", "40", "--synthetic-ttft-ms", "50"),
                            ("--send-timeout", "1", "--keepalive-interval", "0.5"), name="fanout") as url:
        yield url


class Subscriber:
    """Joins, reads a random number of events, drops the connection, resumes, until the end."""

    def __init__(self, url: str, sid: str, transport: str, rng: random.Random) -> None:
        self.url, self.sid, self.transport, self.rng = url, sid, transport, rng
        self.last = -1
        self.text = ""
        self.seqs: list[int] = []
        self.connections = 0

    def take(self, seq: int, chunk: dict) -> None:
        assert seq > self.last, f"{self.transport}: seq {seq} after {self.last} (duplicate or reorder)"
        self.seqs.append(seq)
        self.last = seq
        self.text += chunk_text(chunk)

    async def run(self) -> None:
        await asyncio.sleep(self.rng.uniform(0, 1.5))
        done = False
        while not done:
            self.connections += 1
            budget = self.rng.choice([1, 3, 10, 10_000])
            done = await (self.sse(budget) if self.transport == "sse" else self.ws(budget))
            if not done:
                await asyncio.sleep(self.rng.uniform(0, 0.3))

    async def sse(self, budget: int) -> bool:
        headers = {"Last-Event-ID": str(self.last)} if self.last >= 0 else {}
        async with httpx.AsyncClient(timeout=30) as client, \
                client.stream("GET", f"{self.url}/v1/streams/{self.sid}/events", headers=headers) as r:
                if r.status_code == 204:
                    return True
                assert r.status_code == 200
                buf = ""
                async for piece in r.aiter_text():
                    buf += piece
                    while "\n\n" in buf:
                        block, buf = buf.split("\n\n", 1)
                        ev = sse_events(block + "\n\n")
                        if not ev:
                            continue
                        if ev[0].get("data") == "[DONE]":
                            return True
                        if "id" in ev[0]:
                            self.take(int(ev[0]["id"]), json.loads(ev[0]["data"]))
                            budget -= 1
                            if budget == 0:
                                return False  # drop the connection mid-stream
        return False

    async def ws(self, budget: int) -> bool:
        url = f"{self.url.replace('http', 'ws')}/v1/streams/{self.sid}/ws?after={self.last}"
        # max_queue=None: a subscriber that drops mid-replay leaves unread frames; with the client's own
        # flow control (16 messages) websockets stops reading, never sees the gateway's close reply (sent at
        # once: checked with a raw socket) and waits close_timeout on every drop.
        async with websockets.connect(url, close_timeout=2, max_queue=None) as ws:
            async for raw in ws:
                msg = json.loads(raw)
                if msg["type"] == "done":
                    return True
                assert msg["type"] == "chunk", msg
                self.take(msg["seq"], msg["data"])
                budget -= 1
                if budget == 0:
                    return False
        return False


def test_random_join_drop_resume_over_both_transports_loses_and_repeats_nothing(slow_engine_gateway: str) -> None:
    url = slow_engine_gateway
    seed = int(os.environ.get("TOKENFAN_TEST_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    info = create(url, max_tokens=120, endpoint="chat.completions")
    subs = [Subscriber(url, info["id"], rng.choice(["sse", "ws"]), random.Random(rng.random())) for _ in range(40)]

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(s.run() for s in subs)), 120)

    asyncio.run(main())
    expected, last_seq = full_text(url, info["id"])
    assert expected and last_seq > 10
    for s in subs:
        assert s.text == expected, f"seed={seed} {s.transport} text differs"
        assert s.last == last_seq, f"seed={seed}"
    assert sum(s.connections for s in subs) > len(subs), "the test should have exercised resumes"
    assert {s.transport for s in subs} == {"sse", "ws"}


def test_a_thousand_subscribers_on_one_stream_all_get_the_full_text(ipc_dir) -> None:  # type: ignore[no-untyped-def]
    # Its own gateway with the default keep-alive: one Python client process cannot read 1,000 sockets
    # at 40 events/s each in real time, and the shared fixture's 1 s WebSocket ping timeout would
    # (rightly) drop connections whose client stops answering pings for that long.
    with engine_and_gateway(f"ipc://{ipc_dir / 'fanout-wide.sock'}",
                            ("--engine", "synthetic", "--synthetic-tokens-per-s", "40", "--synthetic-ttft-ms", "50"),
                            ("--send-timeout", "10", *NO_CLIENT_LIMITS), name="wide") as url:
        _thousand_subscribers(url)


def _thousand_subscribers(url: str) -> None:
    info = create(url, max_tokens=60)
    got: dict[str, list[str]] = {"sse": [], "ws": []}

    async def sse_sub(client: httpx.AsyncClient) -> None:
        async with client.stream("GET", info["events_url"]) as r:
            body = (await r.aread()).decode()
        got["sse"].append("".join(chunk_text(json.loads(e["data"])) for e in sse_events(body) if "id" in e))

    async def ws_sub() -> None:
        text = ""
        async with websockets.connect(info["ws_url"], open_timeout=60) as ws:
            async for raw in ws:
                msg = json.loads(raw)
                if msg["type"] == "chunk":
                    text += chunk_text(msg["data"])
        got["ws"].append(text)

    async def main() -> None:
        limits = httpx.Limits(max_connections=600, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            await asyncio.wait_for(asyncio.gather(*(sse_sub(client) for _ in range(500)),
                                                  *(ws_sub() for _ in range(500))), 120)

    asyncio.run(main())
    expected, _ = full_text(url, info["id"])
    assert len(got["sse"]) == 500 and len(got["ws"]) == 500
    assert all(t == expected for t in got["sse"] + got["ws"])


def test_a_stalled_subscriber_is_cut_without_growing_memory_or_delaying_others(ipc_dir) -> None:  # type: ignore[no-untyped-def]
    with fat_gateway(ipc_dir, "fat") as url:
        _stalled_subscriber_case(url)


def _stalled_subscriber_case(url: str) -> None:
    info = create(url, max_tokens=6000, endpoint="completions")  # 12 MB over 6 s
    errors_before = metric(url, "tokenfan_errors_total", {"class": "network"})
    rss_before = metric(url, "process_resident_memory_bytes")
    stalled = stalled_client(url, f"GET /v1/streams/{info['id']}/events HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    try:
        t0 = time.monotonic()
        text, last = full_text(url, info["id"])  # a healthy reader follows the whole live stream
        assert last >= 100 and len(text) >= 6000 * 2000
        # The healthy reader finished at the engine's pace even though the stalled one never read.
        assert time.monotonic() - t0 < 6000 / 1000 + 10
        wait_until(lambda: metric(url, "tokenfan_errors_total", {"class": "network"}) > errors_before,
                   timeout=10, what="stalled subscriber closed as slow")
        assert metric(url, "process_resident_memory_bytes") - rss_before < 50 << 20
    finally:
        stalled.close()
    # The stalled client can resume where it was cut off and still get everything.
    resumed = sse_events(httpx.get(info["events_url"], headers={"Last-Event-ID": "-1"}, timeout=30).text)
    assert "".join(chunk_text(json.loads(e["data"])) for e in resumed if "id" in e) == text


def test_delete_cancels_the_generation_and_ends_every_subscriber(slow_engine_gateway: str) -> None:
    url = slow_engine_gateway
    info = create(url, max_tokens=1000)
    endings: list[str] = []

    async def sse_sub() -> None:
        async with httpx.AsyncClient(timeout=30) as c, c.stream("GET", info["events_url"]) as r:
            body = (await r.aread()).decode()
        ev = [e for e in sse_events(body) if e.get("event") == "end"]
        endings.append(json.loads(ev[0]["data"])["reason"])

    async def ws_sub() -> None:
        async with websockets.connect(info["ws_url"]) as ws:
            async for raw in ws:
                msg = json.loads(raw)
                if msg["type"] != "chunk":
                    endings.append(msg.get("reason", msg["type"]))
            assert ws.close_code == 1000

    async def main() -> None:
        subs = asyncio.gather(sse_sub(), ws_sub(), sse_sub(), ws_sub())
        async with httpx.AsyncClient() as c:
            async def subscribed() -> bool:
                return (await c.get(f"{url}/v1/streams/{info['id']}")).json()["subscribers"] == 4

            await until(subscribed, timeout=10, what="the 4 subscribers")
            r = await c.delete(f"{url}/v1/streams/{info['id']}")
            assert r.status_code == 200 and r.json()["state"] == "cancelled"
        await asyncio.wait_for(subs, 10)

    asyncio.run(main())
    assert endings == ["cancelled"] * 4
    assert httpx.get(f"{url}/v1/streams/{info['id']}").json()["state"] == "cancelled"


def test_keepalive_comments_flow_before_the_first_token(ipc_dir) -> None:  # type: ignore[no-untyped-def]
    with engine_and_gateway(f"ipc://{ipc_dir / 'slow-ttft.sock'}", ("--engine", "synthetic", "--synthetic-ttft-ms",
                            "1500"), ("--keepalive-interval", "0.3"), name="ttft") as url:
        info = create(url, max_tokens=2)
        with httpx.stream("GET", info["events_url"]) as r:
            assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
            body = r.read().decode()
        assert body.count(": keep-alive") >= 2 and "retry: " in body and body.endswith("data: [DONE]\n\n")


def test_unknown_and_expired_streams(ipc_dir, synthetic_engine: str) -> None:  # type: ignore[no-untyped-def]
    gw, url = start_gateway(synthetic_engine, "--stream-ttl", "0.2", name="gateway-ttl")
    try:
        info = create(url, max_tokens=3)
        full_text(url, info["id"])
        wait_until(lambda: httpx.get(f"{url}/v1/streams/{info['id']}").status_code == 410, what="--stream-ttl")
        for path in ("/events", "", "/ws"):
            if path == "/ws":
                async def ws_err() -> tuple[dict, int | None]:
                    async with websockets.connect(info["ws_url"]) as ws:
                        msg = json.loads(await ws.recv())
                        await ws.wait_closed()
                        return msg, ws.close_code
                msg, code = asyncio.run(ws_err())
                assert msg["error"]["code"] == "stream_expired" and code == 4410
                continue
            r = httpx.get(f"{url}/v1/streams/{info['id']}{path}")
            assert r.status_code == 410 and r.json()["error"]["code"] == "stream_expired"
        r = httpx.get(f"{url}/v1/streams/nope/events")
        assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
        r = httpx.get(f"{url}/v1/streams/{info['id']}/events", headers={"Last-Event-ID": "abc"})
        assert r.status_code in (400, 410)
    finally:
        gw.stop()
