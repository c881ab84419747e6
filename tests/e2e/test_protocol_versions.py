"""A rolling update that pairs a gateway and an engine of different wire-protocol versions (CHANGELOG.md) is
refused in the open: the gateway drops every frame of the other version, never marks the engine healthy
(``/health`` 503, requests get ``engine_unavailable``) and its log says which versions met and what to do."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from engine_worker import protocol
from tests.procs import spawn
from tokenfan_bench.servers.processes import free_port

OLD = protocol.PROTOCOL_VERSION - 1
# the real engine worker, its frames stamped with the previous protocol version
OLD_ENGINE = (f"import sys, engine_worker.protocol as p; p.MAGIC = b'tokenfan/{OLD}'; "
              "from engine_worker.__main__ import main; sys.exit(main(sys.argv[1:]))")


def test_a_gateway_refuses_an_engine_of_another_protocol_version(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path / 'engine.sock'}"
    engine = spawn(["-c", OLD_ENGINE, "--address", address, "--engine", "synthetic"], "engine-old-protocol")
    port = free_port()
    gateway = spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", address, "--port", str(port),
                     "--log-level", "warning"], "gateway-new-protocol")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while "tokenfan/" not in gateway.log() and time.monotonic() < deadline:
            time.sleep(0.3)
        log = gateway.log()
        assert f"the peer speaks wire protocol tokenfan/{OLD}, this process tokenfan/{protocol.PROTOCOL_VERSION}" \
            in log, log[-3000:]
        assert "same protocol version" in log
        health = _first_answer(url + "/health")
        assert health.status_code == 503 and health.json()["engines"][0]["healthy"] is False
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert engine.popen.poll() is None and gateway.popen.poll() is None  # both still up: refused, not crashed
    finally:
        gateway.stop()
        engine.stop()


def _first_answer(url: str, timeout: float = 30.0) -> httpx.Response:
    """The first answer of ``url`` (the gateway starts listening once its lifespan has begun)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return httpx.get(url, timeout=5)
        except httpx.ConnectError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
