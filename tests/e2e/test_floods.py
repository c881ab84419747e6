"""One hostile client cannot take the gateway from everyone else (the defaults, real sockets).

Each flood runs in its own process (``tests.e2e.flood``) from 127.0.0.1 while an ordinary client on another
address (127.0.0.2) asks for a streamed chat completion half a second into it: its first token must come
within 2 s of its request, the gateway's RSS must stay within +100 MB of what it was before the flood, and
every refused request of the flood must get its explicit error (the flood process checks each answer).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import httpx
import pytest

from tests.e2e.helpers import chunk_text, metric
from tests.procs import ROOT, start_engine, start_gateway
from tokenfan_bench.servers.processes import Proc

FIRST_TOKEN_S = 2.0
RSS_GROWTH = 100 << 20


@pytest.fixture(scope="module")
def defaults(ipc_dir: Path) -> Iterator[tuple[Proc, str]]:
    """A synthetic engine and a gateway, both with their default settings."""
    address = f"ipc://{ipc_dir / 'flood.sock'}"
    engine = start_engine(address, "--engine", "synthetic", name="engine-flood")
    try:
        gw, url = start_gateway(address, name="gateway-flood")
        try:
            yield gw, url
        finally:
            gw.stop()
    finally:
        engine.stop()


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class PeakRss:
    """The highest RSS of a process, sampled every 20 ms while the ``with`` block runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, rss(pid), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss(self.pid))

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def first_token_seconds(url: str) -> float:
    """An ordinary client on another address: seconds from its request to the first content token."""
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30) as client:
        t0 = time.monotonic()
        with client.stream("POST", url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {") and chunk_text(json.loads(line[6:])):
                    return time.monotonic() - t0
    raise AssertionError("no content token")


def run_flood(gw: Proc, url: str, mode: str, n: int) -> tuple[dict[str, Any], float, int]:
    """(the flood's summary, the ordinary client's first-token seconds, the gateway's RSS growth in bytes)."""
    base = rss(gw.popen.pid)
    with PeakRss(gw.popen.pid) as peak:
        flood = subprocess.Popen([sys.executable, "-m", "tests.e2e.flood", mode, url, str(n)], cwd=ROOT,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert flood.stdout is not None
            assert flood.stdout.readline().strip() == "start"
            time.sleep(0.5)
            ttft = first_token_seconds(url)
            summary = json.loads(flood.stdout.readline())
            assert flood.wait(60) == 0
        finally:
            if flood.poll() is None:
                flood.kill()
                flood.wait()
    print(f"{mode} flood of {n}: {summary}; first token {ttft * 1000:.0f} ms; RSS +{(peak.peak - base) >> 20} MB")
    return summary, ttft, peak.peak - base


def _warm(url: str) -> None:
    first_token_seconds(url)  # the first request imports and allocates what every later one reuses


def test_a_burst_of_3000_requests_on_one_websocket_leaves_others_served(defaults: tuple[Proc, str]) -> None:
    gw, url = defaults
    _warm(url)
    before = metric(url, "tokenfan_refusals_total", {"reason": "connection_queue_limit"})
    summary, ttft, growth = run_flood(gw, url, "ws", 3000)
    codes = summary["codes"]
    assert summary["bad"] == 0 and summary["unanswered"] == 0, summary
    assert sum(codes.values()) == 3000
    # 32 generate, 64 wait (--ws-max-in-flight, --ws-max-queued): each of the others is refused on its own
    assert codes["connection_queue_limit"] >= 3000 - 32 - 64, codes
    assert set(codes) <= {"connection_queue_limit", "done", "client_generation_limit", "fair_share_limit"}, codes
    assert metric(url, "tokenfan_refusals_total", {"reason": "connection_queue_limit"}) - before \
        == codes["connection_queue_limit"]
    assert ttft < FIRST_TOKEN_S and growth < RSS_GROWTH


def test_a_flood_of_event_source_subscriptions_from_one_address_leaves_others_served(
        defaults: tuple[Proc, str]) -> None:
    gw, url = defaults
    _warm(url)
    summary, ttft, growth = run_flood(gw, url, "sse", 3000)
    codes = summary["codes"]
    assert summary["bad"] == 0, summary
    assert sum(codes.values()) == 3000
    assert 0 < codes.get("subscribed", 0) <= 128, codes  # --max-subscriptions-per-client
    assert set(codes) <= {"subscribed", "client_subscription_limit", "client_connection_limit"}, codes
    assert ttft < FIRST_TOKEN_S and growth < RSS_GROWTH


def test_a_flood_of_new_websocket_connections_leaves_others_served(defaults: tuple[Proc, str]) -> None:
    gw, url = defaults
    _warm(url)
    summary, ttft, growth = run_flood(gw, url, "connect", 1000)
    codes = summary["codes"]
    assert summary["bad"] == 0, summary
    assert sum(codes.values()) == 1000
    assert 0 < codes.get("served", 0) <= 64, codes  # --max-generations-per-client
    assert set(codes) <= {"served", "client_connection_limit", "client_generation_limit", "fair_share_limit"}, codes
    assert codes.get("client_connection_limit", 0) >= 1000 - 256, codes  # --max-connections-per-client
    assert ttft < FIRST_TOKEN_S and growth < RSS_GROWTH
