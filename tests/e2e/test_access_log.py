"""One JSON access-log line per request, with a request id the engine's log carries too."""

from __future__ import annotations

import json

import httpx

from tests.e2e.helpers import wait_until
from tests.procs import spawn, start_engine
from tokenfan_bench.servers.processes import free_port, wait_healthy


def test_request_id_links_the_access_log_and_the_engine_log(ipc_dir) -> None:  # type: ignore[no-untyped-def]
    address = f"ipc://{ipc_dir / 'accesslog.sock'}"
    engine = start_engine(address, "--engine", "synthetic", name="engine-accesslog")
    port = free_port()
    gw = spawn(["-m", "tokenfan.cli", "gateway", "--engine", address, "--port", str(port), "--log-level", "info"],
               "gateway-accesslog-info")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, gw, 30)
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"X-Request-ID": "req-abc-123"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "req-abc-123"
        generation = r.json()["id"]
        auto = httpx.get(url + "/v1/models").headers["x-request-id"]
        assert len(auto) == 32
        wait_until(lambda: "req-abc-123" in gw.log() and "trace=req-abc-123" in engine.log(), what="log lines")
        lines = [json.loads(line.split("tokenfan.access: ", 1)[1]) for line in gw.log().splitlines()
                 if "tokenfan.access: " in line]
        entry = next(e for e in lines if e["request_id"] == "req-abc-123")
        assert entry["path"] == "/v1/completions" and entry["status"] == 200 and entry["generation_id"] == generation
        assert f"accepted {generation} trace=req-abc-123" in engine.log()
        assert f"finished {generation} trace=req-abc-123 reason=length completion_tokens=2" in engine.log()
    finally:
        gw.stop()
        engine.stop()
