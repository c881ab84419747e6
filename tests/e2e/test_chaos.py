"""Chaos: kill -9 the engine under 50 streams per transport. Every client gets an explicit error
within 2 s, none hangs, and `tokenfan serve` restarts the engine so service resumes by itself."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import websockets

from tests.e2e.helpers import sse_events, wait_until
from tests.procs import spawn
from tokenfan_bench.servers.processes import free_port, wait_healthy

PER_KIND = 25  # x2 kinds per transport = 50 SSE clients and 50 WebSocket clients


def test_engine_kill_under_load_errors_every_client_and_service_recovers(ipc_dir) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    proc = spawn(["-m", "tokenfan.cli", "serve", "--engine", "synthetic", "--port", str(port),
                  "--synthetic-tokens-per-s", "20", "--migration-limit", "0",
                  "--engine-address", f"ipc://{ipc_dir / 'chaos.sock'}",
                  "--max-generations-per-client", str(4 * PER_KIND)], "chaos")  # one address holds 75
    url = f"http://127.0.0.1:{port}"
    wsurl = url.replace("http", "ws")
    try:
        wait_healthy(url, proc, 30)
        errors: dict[str, list[float]] = {"sse": [], "ws": []}
        killed_at: list[float] = []
        long = {"prompt": "x", "max_tokens": 1500}

        def record(transport: str) -> None:
            errors[transport].append(time.monotonic() - killed_at[0])

        async def post_sse(c: httpx.AsyncClient) -> None:
            async with c.stream("POST", url + "/v1/completions", json={**long, "stream": True}) as r:
                body = (await r.aread()).decode()
            assert any(e.get("event") == "error" and "engine_unavailable" in e["data"] for e in sse_events(body)), \
                (r.status_code, body[-300:])
            record("sse")

        async def stream_sse(c: httpx.AsyncClient, events_url: str) -> None:
            async with c.stream("GET", events_url) as r:
                body = (await r.aread()).decode()
            assert any(e.get("event") == "error" and "engine_unavailable" in e["data"] for e in sse_events(body))
            record("sse")

        async def mux_ws() -> None:
            async with websockets.connect(wsurl + "/v1/ws") as ws:
                await ws.send(json.dumps({"type": "request", "id": "c", "endpoint": "completions", "body": long}))
                while True:
                    msg = json.loads(await ws.recv())
                    if msg["type"] == "error":
                        assert msg["error"]["code"] == "engine_unavailable"
                        record("ws")
                        return

        async def stream_ws(ws_url: str) -> None:
            async with websockets.connect(ws_url) as ws:
                try:
                    async for raw in ws:
                        msg = json.loads(raw)
                        if msg["type"] == "error":
                            assert msg["error"]["code"] == "engine_unavailable"
                            record("ws")
                except websockets.ConnectionClosedError as exc:
                    assert exc.rcvd is not None and exc.rcvd.code == 1011

        async def main() -> None:
            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(timeout=30, limits=limits) as c:
                streams = [(await c.post(url + "/v1/streams", json={**long, "endpoint": "completions"})).json()
                           for _ in range(PER_KIND)]
                clients = asyncio.gather(
                    *(post_sse(c) for _ in range(PER_KIND)), *(stream_sse(c, s["events_url"]) for s in streams),
                    *(mux_ws() for _ in range(PER_KIND)), *(stream_ws(s["ws_url"]) for s in streams))
                for _ in range(300):  # every generation streaming before the kill (not a fixed sleep: CI load)
                    engine = (await c.get(url + "/health")).json()["engine"]
                    if engine and engine["running"] >= 3 * PER_KIND:
                        break
                    await asyncio.sleep(0.1)
                children = Path(f"/proc/{proc.popen.pid}/task/{proc.popen.pid}/children").read_text().split()
                killed_at.append(time.monotonic())
                os.kill(int(children[0]), signal.SIGKILL)
                await asyncio.wait_for(clients, 15)

        asyncio.run(main())
        assert len(errors["sse"]) == 2 * PER_KIND and len(errors["ws"]) == 2 * PER_KIND
        worst = max(errors["sse"] + errors["ws"])
        assert worst < 2.0, f"slowest client learned of the crash after {worst:.2f}s"
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code in (200, 503)
        if r.status_code == 503:
            assert r.headers["retry-after"]
        wait_until(lambda: httpx.get(url + "/health").status_code == 200, timeout=30, what="engine restarted")
        assert httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        assert "restarting in" in proc.log()
    finally:
        proc.stop()
