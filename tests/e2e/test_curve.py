"""CURVE on a tcp:// engine link: only gateways holding an authorized key get through."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import time

import httpx

from tests.e2e.helpers import listening, wait_until
from tests.procs import ROOT, spawn, start_engine, start_gateway
from tokenfan_bench.servers.processes import free_port


def test_curve_admits_authorized_gateways_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "tokenfan.cli", "keys", str(keys)], check=True, cwd=ROOT)
    assert (keys / "engine.key_secret").stat().st_mode & 0o077 == 0
    intruder = tmp_path / "intruder"
    subprocess.run([sys.executable, "-m", "tokenfan.cli", "keys", str(intruder)], check=True, cwd=ROOT)
    shutil.copy(keys / "engine.key", intruder / "engine.key")  # knows the engine, but is not authorized

    address = f"tcp://127.0.0.1:{free_port()}"
    engine = start_engine(address, "--engine", "synthetic", "--curve-dir", str(keys), name="engine-curve")
    try:
        good, url = start_gateway(address, "--curve-dir", str(keys), name="gateway-curve")
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        good.stop()
        for name, extra in (("plain", []), ("intruder", ["--curve-dir", str(intruder)])):
            port = free_port()
            proc = spawn(["-m", "tokenfan.cli", "gateway", "--engine", address, "--port", str(port),
                          "--log-level", "warning", *extra], f"gateway-{name}")
            try:
                # serving HTTP first (beside a second pytest worker the start took more than 3 s), then long
                # enough for many heartbeats, had the link worked
                url = f"http://127.0.0.1:{port}"
                wait_until(functools.partial(listening, url), timeout=60, what=f"the {name} gateway to serve HTTP")
                time.sleep(3)
                r = httpx.get(url + "/health")
                assert r.status_code == 503, name
            finally:
                proc.stop()
    finally:
        engine.stop()
