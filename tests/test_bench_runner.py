"""tokenfan_bench.runner's reading of a server's ``/metrics``: the texts the gateway, its ``--workers`` merge and
the bench's raw floor server really serve, over a real loopback HTTP server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gateway.core.metrics import Metrics
from gateway.scaleout.peers import merge_metrics
from tokenfan_bench.runner import scrape, server_counters
from tokenfan_bench.servers.processes import free_port
from tokenfan_bench.servers.raw_floor import RawServer


def gateway_metrics(sse: int, ws: int) -> bytes:
    """A gateway's ``/metrics`` body after writing ``sse`` and ``ws`` chunks."""
    m = Metrics()
    m.hot.transports["sse"].chunks.inc(sse)
    m.hot.transports["ws"].chunks.inc(ws)
    return m.render()


class Served:
    """A loopback HTTP server answering ``/metrics`` with ``status`` and ``body``."""

    def __init__(self) -> None:
        self.status, self.body = 200, b""
        served = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                status, body = (served.status, served.body) if self.path == "/metrics" else (404, b"Not Found")
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


@pytest.fixture()
def served() -> Iterator[Served]:
    s = Served()
    thread = threading.Thread(target=s.httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield s
    finally:
        s.httpd.shutdown()
        s.httpd.server_close()
        thread.join()


def test_scrape_reads_the_gateways_cpu_seconds_and_chunks_sent_by_transport(served: Served) -> None:
    served.body = gateway_metrics(sse=3, ws=41)
    cpu, sent = scrape(served.url)
    assert sent == {"sse": 3.0, "ws": 41.0}
    assert cpu is not None and 0 < cpu <= time.process_time() + 0.01  # this process's, rounded to its ticks


def test_scrape_reads_the_sums_of_a_workers_merged_metrics(served: Served) -> None:
    one, two = gateway_metrics(sse=2, ws=5), gateway_metrics(sse=7, ws=0)
    served.body = merge_metrics([one.decode(), two.decode()])
    cpu, sent = scrape(served.url)
    cpu_one, cpu_two = server_counters(one.decode())[0], server_counters(two.decode())[0]
    assert sent == {"sse": 9.0, "ws": 5.0}
    assert cpu_one is not None and cpu_two is not None and cpu == pytest.approx(cpu_one + cpu_two)


def test_scrape_reads_the_raw_floor_servers_untyped_metrics(served: Served) -> None:
    raw = RawServer(tokens_per_s=10.0, ttft_ms=0.0, host="127.0.0.1", port=0)
    raw.sent.update(sse=12, ws=4)
    served.body = raw.metrics()
    cpu, sent = scrape(served.url)
    assert sent == {"sse": 12.0, "ws": 4.0}
    assert cpu is not None and cpu > 0


def test_a_server_without_metrics_or_without_these_two_scrapes_as_none_and_empty(served: Served) -> None:
    assert scrape(f"http://127.0.0.1:{free_port()}") == (None, {})  # nobody listens
    served.status, served.body = 404, b"{}"  # a stand-in without /metrics (tests/e2e/test_bench.py's h2_app)
    assert scrape(served.url) == (None, {})
    served.status, served.body = 200, b"<html><body>metrics</body></html>"
    assert scrape(served.url) == (None, {})
    m = Metrics()
    m.registry.unregister(m.hot)  # no tokenfan_chunks_sent_total
    served.body = m.render()
    cpu, sent = scrape(served.url)
    assert cpu is not None and sent == {}
    served.body = b'tokenfan_chunks_sent_total{transport="sse"} 5.0\n'  # no process_cpu_seconds_total
    assert scrape(served.url) == (None, {"sse": 5.0})
