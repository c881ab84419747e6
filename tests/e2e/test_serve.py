"""`tokenfan serve` as a user runs it: engine child + gateway, clean stop, engine crash and recovery."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import websockets

from tests.e2e.helpers import sse_events, wait_until
from tests.procs import spawn
from tokenfan_bench.servers.processes import Proc, engine_child, free_port, wait_healthy


@pytest.fixture()
def serve(ipc_dir):  # type: ignore[no-untyped-def]
    port = free_port()
    proc = spawn(["-m", "tokenfan.cli", "serve", "--engine", "synthetic", "--port", str(port),
                  "--synthetic-tokens-per-s", "20", "--migration-limit", "0", "--heartbeat-interval", "0.2", "--heartbeat-timeout", "0.8",
                  "--engine-address", f"ipc://{ipc_dir / f'serve-{port}.sock'}"], "serve")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 30)
    yield proc, url
    proc.stop()


def engine_pid(proc: Proc) -> int:
    return engine_child(proc.popen.pid)


def test_sigterm_stops_gateway_and_engine(serve) -> None:  # type: ignore[no-untyped-def]
    proc, _url = serve
    child = engine_pid(proc)
    os.kill(proc.popen.pid, signal.SIGTERM)
    # uvicorn re-raises the signal after its graceful shutdown, the conventional exit status.
    assert proc.popen.wait(20) in (0, -signal.SIGTERM)
    log = proc.log()
    assert "engine worker stopped" in log and "Application shutdown complete" in log
    wait_until(lambda: not os.path.exists(f"/proc/{child}") or "zombie" in Path(f"/proc/{child}/status").read_text().lower(),
               timeout=10, what="engine child gone")


def test_engine_killed_mid_stream_errors_clients_then_service_recovers(serve) -> None:  # type: ignore[no-untyped-def]
    proc, url = serve
    info = httpx.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "x", "max_tokens": 1000}).json()
    outcome: dict[str, str] = {}

    async def sse_post() -> None:
        async with httpx.AsyncClient(timeout=30) as c, \
                c.stream("POST", url + "/v1/completions", json={"prompt": "x", "max_tokens": 1000, "stream": True}) as r:
            body = (await r.aread()).decode()
        outcome["post"] = next(e for e in sse_events(body) if e.get("event") == "error")["data"]

    async def ws_sub() -> None:
        async with websockets.connect(info["ws_url"]) as ws:
            try:
                async for raw in ws:
                    msg = json.loads(raw)
                    if msg["type"] == "error":
                        outcome["ws"] = msg["error"]["code"]
            except websockets.ConnectionClosedError as exc:
                assert exc.rcvd is not None and exc.rcvd.code == 1011

    async def sse_sub() -> None:
        async with httpx.AsyncClient(timeout=30) as c, c.stream("GET", info["events_url"]) as r:
            body = (await r.aread()).decode()
        outcome["stream"] = next(e for e in sse_events(body) if e.get("event") == "error")["data"]

    async def main() -> float:
        clients = asyncio.gather(sse_post(), ws_sub(), sse_sub())
        await asyncio.sleep(0.7)
        os.kill(engine_pid(proc), signal.SIGKILL)
        t0 = time.monotonic()
        await asyncio.wait_for(clients, 10)
        return time.monotonic() - t0

    asyncio.run(main())
    assert set(outcome) == {"post", "ws", "stream"}
    assert "engine_unavailable" in outcome["post"] and outcome["ws"] == "engine_unavailable"
    assert "engine_unavailable" in outcome["stream"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    if r.status_code == 503:
        assert r.headers["retry-after"] and r.json()["error"]["code"] == "engine_unavailable"
    wait_until(lambda: httpx.get(url + "/health").status_code == 200, timeout=30, what="engine restarted")
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_sigterm_with_open_streams_ends_them_explicitly_within_the_deadline(synthetic_engine: str) -> None:
    from tests.procs import start_gateway

    proc, url = start_gateway(synthetic_engine, "--shutdown-grace", "1", name="gateway-shutdown")
    info = httpx.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "x", "max_tokens": 1500}).json()
    finished = httpx.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "x", "max_tokens": 3}).json()
    bodies: dict[str, str] = {}

    async def sse(name: str, events_url: str) -> None:
        async with httpx.AsyncClient(timeout=30) as c, c.stream("GET", events_url) as r:
            bodies[name] = (await r.aread()).decode()

    async def ws() -> None:
        async with websockets.connect(info["ws_url"]) as sock:
            try:
                async for raw in sock:
                    if json.loads(raw)["type"] == "error":
                        bodies["ws"] = raw if isinstance(raw, str) else raw.decode()
            except websockets.ConnectionClosedError as exc:
                bodies["ws"] = bodies.get("ws", "") + f" closed {exc.rcvd.code if exc.rcvd else None}"

    async def main() -> float:
        clients = asyncio.gather(sse("long", info["events_url"]), sse("short", finished["events_url"]), ws())
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        os.kill(proc.popen.pid, signal.SIGTERM)
        await asyncio.wait_for(clients, 10)
        return time.monotonic() - t0

    elapsed = asyncio.run(main())
    assert proc.popen.wait(10) in (0, -signal.SIGTERM)
    assert elapsed < 4, "streams must end at the deadline (1 s), not hang"
    assert bodies["short"].endswith("data: [DONE]\n\n")  # finished normally during the grace period
    assert "server_shutdown" in bodies["long"] and "event: error" in bodies["long"]
    # WebSocket subscribers get the grace period too, then the error message and close 1011
    assert "server_shutdown" in bodies["ws"] and bodies["ws"].endswith("closed 1011")
