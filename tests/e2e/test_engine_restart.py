"""Engine identity: kill -9 the engine and restart it at once on the same address, faster than
``--heartbeat-timeout`` (as systemd or a container runtime does). Every in-flight client, on POST SSE and
on ``/v1/ws``, gets an explicit ``engine_unavailable`` within 2 s; the old instance's requests stop
counting against ``--max-concurrent``; new requests succeed; ``/health`` names the new instance. Migration is
off here (``--migration-limit 0``): the explicit error is what a client gets when its request cannot be
continued (tests/e2e/test_migration.py has the default, where it continues).

Both layouts: a split engine + gateway (the test restarts the engine) and ``tokenfan serve`` (its
supervisor restarts it). ``--heartbeat-timeout 30`` makes sure the restart beats the heartbeat timeout,
so only the engine-identity path can tell the clients."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import websockets

from tests.e2e.helpers import sse_events, wait_until
from tests.procs import spawn, start_engine, start_gateway
from tokenfan_bench.servers.processes import Proc, engine_child, free_port, wait_healthy

PER_TRANSPORT = 10
LIMIT = 2 * PER_TRANSPORT  # --max-concurrent: exactly the in-flight clients
# one address holds every slot: fair admission (which would refuse it at 75 %) is not what this tests
GATEWAY_ARGS = ("--migration-limit", "0", "--heartbeat-timeout", "30", "--max-concurrent", str(LIMIT), "--fair-share-at", "0")
ENGINE_ARGS = ("--engine", "synthetic", "--synthetic-tokens-per-s", "20")
LONG = {"prompt": "x", "max_tokens": 1500, "ignore_eos": True}


def engine_status(url: str) -> dict:
    [engine] = httpx.get(url + "/health").json()["engines"]
    return engine


async def clients_see_the_restart(url: str, kill_and_restart: Callable[[], None]) -> list[float]:
    """Start the in-flight clients, kill the engine once each has a token; seconds from the kill until
    each client got its ``engine_unavailable``."""
    started = asyncio.Semaphore(0)
    killed_at: list[float] = []
    told: list[float] = []

    async def sse(c: httpx.AsyncClient) -> None:
        lines: list[str] = []
        async with c.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                lines.append(line)
                if line.startswith("data:") and len(lines) == 1:
                    started.release()
                if line == "event: error":
                    told.append(time.monotonic() - killed_at[0])
        errors = [json.loads(e["data"]) for e in sse_events("\n".join(lines) + "\n\n") if e.get("event") == "error"]
        assert [e["error"]["code"] for e in errors] == ["engine_unavailable"], lines[-3:]

    async def ws() -> None:
        async with websockets.connect(url.replace("http", "ws") + "/v1/ws") as sock:
            await sock.send(json.dumps({"type": "request", "id": "r", "endpoint": "completions", "body": LONG}))
            chunks = 0
            while True:
                msg = json.loads(await sock.recv())
                assert msg["type"] in ("chunk", "error"), msg
                if msg["type"] == "chunk":
                    chunks += 1
                    if chunks == 1:
                        started.release()
                    continue
                told.append(time.monotonic() - killed_at[0])
                assert msg["id"] == "r" and msg["error"]["code"] == "engine_unavailable", msg
                return

    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=4 * LIMIT)) as c:
        clients = asyncio.gather(*(sse(c) for _ in range(PER_TRANSPORT)), *(ws() for _ in range(PER_TRANSPORT)))
        for _ in range(LIMIT):
            await asyncio.wait_for(started.acquire(), 30)
        killed_at.append(time.monotonic())
        kill_and_restart()
        await asyncio.wait_for(clients, 20)  # before the fix: every client hung here
    return told


async def all_succeed(url: str, n: int) -> list[int]:
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=n)) as c:
        rs = await asyncio.gather(*(c.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
                                    for _ in range(n)))
    return [r.status_code for r in rs]


def check_recovered(url: str, old_id: str, told: list[float]) -> None:
    assert len(told) == LIMIT
    assert max(told) < 2.0, f"slowest client learned of the restart after {max(told):.2f}s"
    wait_until(lambda: httpx.get(url + "/health").status_code == 200
               and engine_status(url)["engine_id"] not in (None, old_id), timeout=30, what="the new instance")
    st = engine_status(url)
    assert st["restarts"] >= 1 and st["previous_engine_id"] == old_id and st["engine_changed_at"]
    assert httpx.get(url + "/health").json()["engine"]["id"] == st["engine_id"]
    # All LIMIT slots are free again: the dead instance's requests no longer count against --max-concurrent.
    assert asyncio.run(all_succeed(url, LIMIT)) == [200] * LIMIT
    assert engine_status(url)["in_flight"] == 0


def test_split_engine_killed_and_restarted_at_once_fails_every_client_and_recovers(ipc_dir: Path) -> None:
    address = f"ipc://{ipc_dir / 'restart-split.sock'}"
    engines: list[Proc] = [start_engine(address, *ENGINE_ARGS, name="engine-restart")]
    gateway: Proc | None = None
    try:
        gateway, url = start_gateway(address, *GATEWAY_ARGS, name="gateway-restart")
        old_id = engine_status(url)["engine_id"]

        def kill_and_restart() -> None:
            os.kill(engines[0].popen.pid, signal.SIGKILL)
            engines[0].popen.wait(5)
            engines.append(start_engine(address, *ENGINE_ARGS, name="engine-restart-2"))

        told = asyncio.run(clients_see_the_restart(url, kill_and_restart))
        check_recovered(url, old_id, told)
        assert "restarted" in gateway.log() or "dropped" in gateway.log()
    finally:
        if gateway is not None:
            gateway.stop()
        for e in engines:
            e.stop()


def test_serve_engine_killed_and_restarted_by_the_supervisor_fails_every_client_and_recovers(
        ipc_dir: Path) -> None:
    port = free_port()
    proc = spawn(["-m", "tokenfan.cli", "serve", *ENGINE_ARGS, *GATEWAY_ARGS, "--port", str(port),
                  "--log-level", "warning", "--engine-address", f"ipc://{ipc_dir / 'restart-serve.sock'}"],
                 "serve-restart")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 30)
        old_id = engine_status(url)["engine_id"]

        def kill() -> None:
            os.kill(engine_child(proc.popen.pid), signal.SIGKILL)

        told = asyncio.run(clients_see_the_restart(url, kill))
        check_recovered(url, old_id, told)
        assert "restarting in" in proc.log()
    finally:
        proc.stop()
