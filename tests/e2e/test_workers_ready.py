"""``tokenfan serve --workers 2``: once ``/health`` first answers 200, every request succeeds, whichever worker
the kernel hands its connection to (cold starts, repeated; and after the engine restarts under both)."""

from __future__ import annotations

import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import pytest

from gateway.scaleout.workers import worker_socket
from tests.e2e.helpers import wait_until
from tests.procs import spawn, start_engine
from tokenfan_bench.servers.processes import Proc, engine_child, free_port

REQUESTS = 24


def _serve(port: int, name: str) -> Proc:
    return spawn(["-m", "tokenfan.cli", "serve", "--engine", "synthetic", "--workers", "2", "--host", "127.0.0.1",
                  "--port", str(port), "--log-level", "warning"], name)


def _first_200(url: str, proc: Proc, timeout: float = 90.0) -> float:
    """Poll /health on fresh connections (any worker) until the first 200; returns when it came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.popen.poll() is None, proc.log()[-3000:]
        try:
            with httpx.Client(timeout=2) as c:
                if c.get(url + "/health").status_code == 200:
                    return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"no /health 200 within {timeout} s:\n{proc.log()[-3000:]}")


def _every_request_succeeds(url: str) -> list[int]:
    """Chat completions on fresh connections, so SO_REUSEPORT spreads them over both workers."""
    statuses = []
    for _ in range(REQUESTS):
        with httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            r = c.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 2})
            statuses.append(r.status_code)
    return statuses


def _cold_start(attempt: int) -> None:
    port = free_port()
    proc = _serve(port, f"serve-workers-cold-{attempt}")
    try:
        _first_200(f"http://127.0.0.1:{port}", proc)
        statuses = _every_request_succeeds(f"http://127.0.0.1:{port}")
        assert statuses == [200] * REQUESTS, (attempt, statuses)
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        assert health["workers"]["configured"] == 2
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


def test_every_request_after_the_first_health_200_succeeds_from_a_cold_start() -> None:
    """Three cold starts side by side (each its own server, engine and port)."""
    with ThreadPoolExecutor(3) as pool:
        for done in [pool.submit(_cold_start, attempt) for attempt in range(3)]:
            done.result()


def test_a_worker_takes_no_connections_on_the_shared_port_until_its_engine_link_is_up(ipc_dir: Path) -> None:
    address = f"ipc://{ipc_dir / 'late-engine.sock'}"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", address, "--workers", "2", "--host",
                  "127.0.0.1", "--port", str(port), "--log-level", "warning"], "gateway-workers-late-engine")
    engine = None
    try:
        for k in (0, 1):  # a worker serves its private socket at once, the shared port only with its engine
            wait_until(partial(answers, worker_socket(port, k)), timeout=60, what=f"worker {k}'s private socket")
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")  # nobody listens: a load balancer sees the port closed, not a 503
        engine = start_engine(address, "--engine", "synthetic", name="engine-late")
        _first_200(url, proc)
        assert _every_request_succeeds(url) == [200] * REQUESTS
    finally:
        proc.stop()
        if engine is not None:
            engine.stop()


def answers(path: Path) -> bool:
    """Whether a worker's private Unix socket answers HTTP (whatever the status: it runs)."""
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path))) as c:
            c.get("http://worker/health", timeout=2)
            return True
    except httpx.HTTPError:
        return False


def test_after_the_engine_restarts_health_is_200_only_when_both_workers_can_serve() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(port, "serve-workers-restart")
    try:
        _first_200(url, proc)
        assert _every_request_succeeds(url) == [200] * REQUESTS
        os.kill(engine_child(proc.popen.pid), signal.SIGKILL)  # the supervisor restarts it; both workers' links drop
        time.sleep(0.5)
        _first_200(url, proc)
        statuses = _every_request_succeeds(url)
        assert statuses == [200] * REQUESTS, statuses
    finally:
        proc.stop()


def test_a_workers_server_whose_port_is_taken_exits_with_an_error_instead_of_restarting() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _serve(port, "serve-workers-port-taken")
        code = proc.wait(60)
    assert code == 1, proc.log()[-3000:]
    assert "cannot listen on 127.0.0.1" in proc.log() and "restarting in" not in proc.log()
