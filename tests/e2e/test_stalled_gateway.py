"""A stalled gateway is not a dead engine, and a stalled gateway is not a dead gateway.

Two stalls, each longer than the gateway's ``--heartbeat-timeout`` and than the engine's ``--gateway-grace``:

- ``gateway``: the gateway process alone is stopped (SIGSTOP) while the engine keeps generating. The engine,
  whose ``ipc://`` connection to the gateway stays up, keeps the gateway's request running (before, it aborted
  it as "silent"); the gateway, run again, reads what waited in its socket.
- ``host``: the engine is stopped, then the gateway (as when the whole host is descheduled), and the gateway
  runs again first: no heartbeat waits in its socket, and its first tick comes seconds late. The time its loop
  did not run is not the engine's silence (before, that tick found the engine "missed heartbeats", aborted
  the request and continued it on the same engine).

Either way the stream ends with every token and ``[DONE]``: no loss, no migration, no abort.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.helpers import metric
from tests.procs import start_engine, start_gateway
from tokenfan_bench.servers.processes import Proc, stop_all

HEARTBEAT_TIMEOUT_S = 2.0
GATEWAY_GRACE_S = 1.0  # the engine's, its minimum
STOP_S = 5.0  # longer than both
# host: the engine stops this long before the gateway and runs again this long after it, so the gateway's silence
# outside its own stall (0.8 s) stays well within its heartbeat timeout
ENGINE_LEAD_S = 0.5
ENGINE_LAG_S = 0.3
MAX_TOKENS = 300  # at 40 tokens/s: still generating when the gateway stops and after it runs again


def stall(gw: Proc, engine: Proc, scenario: str) -> None:
    if scenario == "host":
        os.kill(engine.popen.pid, signal.SIGSTOP)
        time.sleep(ENGINE_LEAD_S)
    os.kill(gw.popen.pid, signal.SIGSTOP)
    try:
        time.sleep(STOP_S)
    finally:
        os.kill(gw.popen.pid, signal.SIGCONT)
        if scenario == "host":
            time.sleep(ENGINE_LAG_S)
            os.kill(engine.popen.pid, signal.SIGCONT)


@pytest.mark.parametrize("scenario", ["gateway", "host"])
def test_a_gateway_stopped_longer_than_its_heartbeat_timeout_keeps_its_stream_on_its_engine(
        ipc_dir: Path, scenario: str) -> None:
    address = f"ipc://{ipc_dir / f'stalled-{scenario}.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-tokens-per-s", "40",
                          "--synthetic-ttft-ms", "5", "--gateway-grace", str(GATEWAY_GRACE_S),
                          "--log-level", "info", name=f"engine-stalled-{scenario}")
    gw, url = start_gateway(address, "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
                            name=f"gateway-stalled-{scenario}")
    body = {"prompt": "x", "max_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
    data: list[str] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    data.append(line[6:])
                    break
            stall(gw, engine, scenario)
            deadline = time.monotonic() + 60  # a request the engine aborted would hang, kept alive by comments
            for line in lines:
                if line.startswith("data: "):
                    data.append(line[6:])
                assert time.monotonic() < deadline, f"no end after {len(data)} events"
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert not [c for c in chunks if "error" in c]
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == MAX_TOKENS
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        for outcome in ("continued", "refused", "timeout", "failed"):
            assert metric(url, "tokenfan_migrations_total", {"outcome": outcome}) == 0, outcome
        assert "stalled for" in gw.log()  # the stall was seen, and not counted as the engine's silence
        assert "missed heartbeats" not in gw.log() and "lost with engine" not in gw.log()
        engine_log = engine.log()
        assert "aborting" not in engine_log and "abort " not in engine_log
        assert "continuation" not in engine_log
        assert "reason=length" in engine_log
    finally:
        stop_all([gw, engine])
