"""``tokenfan bench`` against a gateway's limits: the A/B command of docs/benchmarks.md stops at once against
a gateway started with the defaults, naming the flags to lift; ``--fit-limits`` runs what fits with every
stream delivered; a run whose subscriptions are refused reports the refusals instead of figures and exits 1."""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.procs import ROOT, start_gateway
from tokenfan_bench.cli import main as bench_main

QUICK = ["--max-tokens", "8", "--ramp", "0.2", "--no-progress", "--bootstrap", "200"]


def documented_ab_command() -> list[str]:
    """The first command of docs/benchmarks.md, the A/B run, as its arguments after ``tokenfan bench``."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    line = next(ln for ln in re.findall(r"```bash\n(.*?)```", text, re.DOTALL)[0].splitlines()
                if ln.startswith("tokenfan bench "))
    return shlex.split(line.split("#")[0])[2:]


@pytest.fixture(scope="module")
def small_limits_gateway(synthetic_engine: str) -> Iterator[str]:
    proc, url = start_gateway(synthetic_engine, "--max-generations-per-client", "4",
                              "--max-subscriptions-per-client", "8", name="gateway-bench-limits")
    yield url
    proc.stop()


def test_the_documented_ab_command_stops_at_once_against_a_default_gateway(
        gateway_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = documented_ab_command()
    assert "--url" in argv and "--streams" in argv
    argv[argv.index("--url") + 1] = gateway_url
    argv[argv.index("--out") + 1] = str(tmp_path / "out")
    t0 = time.monotonic()
    assert bench_main(argv) == 2
    assert time.monotonic() - t0 < 10  # before any stream, not after the run's --duration
    err = capsys.readouterr().err
    assert "--max-generations-per-client 0" in err and "--max-subscriptions-per-client 0" in err, err
    assert "at most --streams 64" in err, err
    assert not (tmp_path / "out").exists()


def test_fit_limits_runs_the_streams_that_fit_and_delivers_every_one(small_limits_gateway: str,
                                                                     tmp_path: Path) -> None:
    assert bench_main(["--url", small_limits_gateway, "--streams", "10", "--fit-limits", *QUICK,
                       "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["streams"] == 4 and "errors" not in r
    for arm in r["arms"].values():
        assert arm["subscribers"] == 4 and arm["errors"] == 0, arm  # every subscriber read its stream to the end
        assert arm["content_events"] > 0
    assert r["server"]["cpu_us_per_token"] is not None


def test_a_run_with_refused_subscriptions_reports_them_instead_of_figures(
        small_limits_gateway: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The run fits the limits, but another program of the same client holds every subscription."""
    with httpx.Client(base_url=small_limits_gateway, timeout=30) as client:
        info = client.post("/v1/streams", json={"endpoint": "completions", "prompt": "hold", "max_tokens": 2000,
                                                "ignore_eos": True}).json()
        holders = [client.stream("GET", info["events_url"]) for _ in range(8)]
        try:
            for h in holders:
                assert h.__enter__().status_code == 200
            code = bench_main(["--url", small_limits_gateway, "--arms", "sse,ws", "--streams", "1", *QUICK,
                               "--out", str(tmp_path)])
        finally:
            for h in holders:
                h.__exit__(None, None, None)
            client.delete(f"/v1/streams/{info['id']}")
    assert code == 1
    out = capsys.readouterr().out
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["errors"]["failed"] == r["errors"]["subscribers"] == 2
    assert r["errors"]["kinds"] == {"client_subscription_limit": 2}, r["errors"]
    assert r["diff_ms"]["median"] is None and r["server"]["cpu_us_per_token"] is None
    assert all(a["delivery_ms"]["p50"] is None for a in r["arms"].values())
    assert out.index("This run had errors") < out.index("| arm |")
    assert "µs CPU per delivered token" not in out and "median delivery latency B - A =" not in out
