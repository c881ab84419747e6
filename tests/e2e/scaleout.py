"""Two gateways on one engine, one of which the adoption tests kill: replicas on a broker, or the workers
of ``tokenfan gateway --workers 2``."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

from gateway.scaleout.workers import worker_socket
from tests.e2e.helpers import wait_until
from tests.e2e.test_adoption import LEASE, _worker_pid
from tests.procs import NO_CLIENT_LIMITS, Proc, spawn, start_gateway, stop_all, wait_healthy
from tests.system import require
from tokenfan_bench.servers.processes import free_port


@dataclass
class Scaleout:
    """Where the listed streams are created (``owner``, over ``transport``), read (``urls``: a reader whose
    connection drops goes on at the next one, as behind a load balancer), whose death is ``kill``, and which
    gateway survives; ``settle`` waits until the survivor's metrics count every adoption."""

    owner: str
    transport: httpx.AsyncBaseTransport | None
    urls: list[str]
    kill: Callable[[], None]
    survivor: str
    settle: Callable[[], None] | None = None


@contextmanager
def scaleout(kind: str, address: str, broker_url: str, name: str) -> Iterator[Scaleout]:
    """``replicas``: two ``tokenfan gateway`` replicas on the engine at ``address`` and the redis broker at
    ``broker_url`` (A owns, A is killed); ``workers``: ``tokenfan gateway --workers 2`` on it (the workers'
    own standbys; worker 0 owns, over its private socket, and is killed)."""
    if kind == "replicas":
        require("redis-server")
        procs: list[Proc] = []
        urls: list[str] = []
        try:
            for k in "ab":
                proc, url = start_gateway(address, "--broker", broker_url, *LEASE, *NO_CLIENT_LIMITS,
                                          name=f"gateway-{name}-{k}", timeout=300)
                procs.append(proc)
                urls.append(url)
            yield Scaleout(urls[0], None, urls, lambda: os.kill(procs[0].popen.pid, signal.SIGKILL), urls[1])
        finally:
            stop_all(procs)
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", address, "--workers", "2",
                    "--broker-lease-interval", "0.2", *NO_CLIENT_LIMITS, "--host", "127.0.0.1", "--port", str(port),
                    "--log-level", "warning"], f"gateway-{name}-workers")

    def both_serving() -> None:
        wait_until(lambda: httpx.get(url + "/health").json()["workers"]["ready"] == 2, timeout=60,
                   what="both workers serving")

    try:
        wait_healthy(url, server, 300)
        both_serving()
        worker0 = _worker_pid(server, 0)
        yield Scaleout("http://worker", httpx.AsyncHTTPTransport(uds=str(worker_socket(port, 0))), [url],
                       lambda: os.kill(worker0, signal.SIGKILL), url, both_serving)
    finally:
        assert server.stop() == 0, server.log()[-3000:]
