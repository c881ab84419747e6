"""The shipped rules and dashboard against a real Prometheus (Debian's, started here with a 1 s scrape and
evaluation interval) scraping live gateways: two replicas on a Redis broker over two synthetic engines, and a gateway
whose engine writes 2 MB/s per stream for a reader that stops reading. Under a load that makes every failure the
dashboard shows (an owner gateway killed and its listed stream adopted, a reader resuming, a refusal, a slow reader
cut, an engine killed mid-stream and its requests migrated), every query of every panel returns data, the failure
panels a non-zero value, and the killed engine fires ``TokenfanEngineDown`` within its ``for:`` (30 s, as shipped)
plus a scrape and an evaluation."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.helpers import fat_gateway, in_flight, metric, stalled_client, wait_until
from tests.e2e.test_adoption import LEASE
from tests.e2e.test_broker import RedisServer
from tests.procs import NO_CLIENT_LIMITS, Proc, start_engine, start_gateway, stop_all
from tests.system import require
from tokenfan_bench.servers.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "tokenfan-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "tokenfan-dashboard.json"
ENGINE_ARGS = ("--engine", "synthetic", "--synthetic-tokens-per-s", "25", "--synthetic-ttft-ms", "5")
# what Grafana puts in for the dashboard's variables: every job and instance, a window that holds the load's events
VARIABLES = {"$job": ".*", "$instance": ".*", "$__rate_interval": "1m"}
# panels that must show a non-zero value after the load (the failures it made), by title
FAILURES = {"Migrations by outcome", "Migration gap", "Adoptions by outcome", "Adoption gap", "Refusals by reason",
            "Resumes by transport", "Slow readers cut"}


class Prometheus:
    """``prometheus`` on a loopback port, scraping ``targets`` every second and evaluating the shipped rules."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
                  "rule_files": [str(RULES)],
                  "scrape_configs": [{"job_name": "tokenfan", "static_configs": [{"targets": targets}]}]}
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [require("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address={self.url.removeprefix('http://')}",
             "--log.level=warn"], stdout=self.log, stderr=subprocess.STDOUT)
        wait_until(self.ready, 30, "prometheus ready")

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10).json()
        assert r["status"] == "success", (expr, r)
        return r["data"]["result"]  # type: ignore[no-any-return]

    def alerts(self) -> list[dict[str, Any]]:
        return httpx.get(self.url + "/api/v1/alerts", timeout=10).json()["data"]["alerts"]  # type: ignore[no-any-return]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)
        self.log.close()


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel's every target, with the dashboard's variables filled in."""
    out = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            out.append((panel["title"], expr))
    return out


@pytest.fixture
def fleet(tmp_path: Path, ipc_dir: Path) -> Iterator[dict[str, Any]]:
    """Redis, two synthetic engines, gateways ``a`` (the owner that is killed) and ``b`` on both engines and the
    broker, a ``fat`` gateway for the slow reader, and Prometheus scraping the three gateways."""
    require("redis-server")
    redis = RedisServer(tmp_path)
    redis.start()
    procs: list[Proc] = []
    stack = contextlib.ExitStack()
    try:
        addresses = [f"ipc://{ipc_dir / f'prom-{k}.sock'}" for k in range(2)]
        engines = [start_engine(a, *ENGINE_ARGS, name=f"engine-prom-{k}") for k, a in enumerate(addresses)]
        procs += engines
        gateways = {}
        for name, extra in (("a", NO_CLIENT_LIMITS), ("b", (*NO_CLIENT_LIMITS, "--max-subscribers", "1"))):
            proc, url = start_gateway(",".join(addresses), "--broker", redis.url, *LEASE, "--heartbeat-timeout", "30",
                                      *extra, name=f"gateway-prom-{name}")
            procs.append(proc)
            gateways[name] = (proc, url)
        fat = stack.enter_context(fat_gateway(ipc_dir, "prom-fat"))
        for _, url in gateways.values():
            wait_until(lambda url=url: all(e["healthy"] for e in httpx.get(url + "/health").json()["engines"]), 30,
                       "both engines")
        prometheus = Prometheus(tmp_path, [u.removeprefix("http://") for u in (gateways["a"][1], gateways["b"][1], fat)])
        # its first scrape comes after the target discovery's first update (up to 5 s): the load starts once every
        # gateway was scraped twice, so each counter has a sample from before it
        wait_until(lambda: len(prometheus.query("count_over_time(up[1m]) >= 2")) == 3, 30, "every gateway scraped")
        try:
            yield {"engines": engines, "addresses": addresses, "gateways": gateways, "fat": fat,
                   "prometheus": prometheus}
        finally:
            prometheus.stop()
    finally:
        stack.close()
        stop_all(procs)
        if redis.proc is not None:
            redis.kill()


def chat(max_tokens: int) -> dict[str, Any]:
    return {"model": "synthetic", "messages": [{"role": "user", "content": "rivers"}], "max_tokens": max_tokens,
            "stream": True}


def read_all(url: str, headers: dict[str, str] | None = None) -> str:
    return httpx.get(url, headers=headers or {}, timeout=60).text


def slow_reader(fat: str) -> None:
    """A reader that stops reading on the fat gateway, until it is cut."""
    body = json.dumps(chat(19_000)).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))
    sock = stalled_client(fat, request)
    try:
        wait_until(lambda: metric(fat, "tokenfan_readers_cut_total", {"transport": "sse"}) > 0, 30,
                   "the stalled reader cut")
    finally:
        sock.close()


def test_every_dashboard_panel_returns_data_and_a_killed_engine_fires_engine_down_within_its_for(
        fleet: dict[str, Any]) -> None:
    prom: Prometheus = fleet["prometheus"]
    (a_proc, a), (_, b) = fleet["gateways"]["a"], fleet["gateways"]["b"]
    cut = threading.Thread(target=slow_reader, args=(fleet["fat"],))
    cut.start()
    # an owner killed with a listed stream in flight: the replica adopts it (its reader, on b, reads to the end)
    sid = httpx.post(a + "/v1/streams", json=chat(60), timeout=30).json()["id"]
    adopted: dict[str, str] = {}
    reader = threading.Thread(target=lambda: adopted.update(text=read_all(f"{b}/v1/streams/{sid}/events")))
    reader.start()
    time.sleep(0.8)
    os.kill(a_proc.popen.pid, signal.SIGKILL)
    reader.join(60)
    assert "data: [DONE]" in adopted["text"]
    wait_until(lambda: metric(b, "tokenfan_adoptions_total", {"outcome": "adopted"}) >= 1, 20, "the adoption")
    # a reader resumes; a second reader of a one-reader stream is refused
    own = httpx.post(b + "/v1/streams", json=chat(6), timeout=30).json()["id"]
    events = f"{b}/v1/streams/{own}/events"
    assert "data: [DONE]" in read_all(events)
    assert "id: 3" not in read_all(events, {"Last-Event-ID": "3"}) and metric(b, "tokenfan_resumes_total",
                                                                              {"transport": "sse"}) >= 1
    busy = httpx.post(b + "/v1/streams", json=chat(60), timeout=30).json()["id"]
    with httpx.stream("GET", f"{b}/v1/streams/{busy}/events", timeout=30) as first:
        assert first.status_code == 200
        assert httpx.get(f"{b}/v1/streams/{busy}/events", timeout=30).status_code == 429
        first.read()  # to its end: the engines are idle again
    # an engine killed under two streams: what it ran continues on the other
    results: list[str] = []
    streams = [threading.Thread(target=lambda: results.append(httpx.post(
        b + "/v1/chat/completions", json=chat(60), timeout=60).text)) for _ in range(2)]
    engines: list[Proc] = fleet["engines"]
    # the killed owner's request, aborted by its engine once its connection dropped, logs no end: not these two
    before = [in_flight(e.log()) for e in engines]

    def new_in_flight(k: int) -> set[str]:
        return in_flight(engines[k].log()) - before[k]

    for t in streams:
        t.start()
    wait_until(lambda: sum(len(new_in_flight(k)) for k in range(len(engines))) == 2, 10, "both streams accepted")
    k = next(k for k in range(len(engines)) if new_in_flight(k))  # the least-loaded routing may pick one for both
    time.sleep(0.5)
    os.killpg(engines[k].popen.pid, signal.SIGKILL)
    killed = time.monotonic()
    for t in streams:
        t.join(60)
    assert len(results) == 2 and all(r.strip().endswith("data: [DONE]") and "event: error" not in r for r in results)
    assert metric(b, "tokenfan_migrations_total", {"outcome": "continued"}) >= 1
    cut.join(60)
    wait_until(lambda: bool(prom.query('tokenfan_migrations_total{outcome="continued"} > 0')), 10,
               "prometheus scraped the migration")

    # every panel's query returns data; the failures the load made are non-zero
    empty, zero = [], []
    for title, expr in panel_queries():
        values = [float(s["value"][1]) for s in prom.query(expr)]
        if not [v for v in values if not math.isnan(v)]:
            empty.append((title, expr))
        elif title in FAILURES and not any(v > 0 for v in values):
            zero.append((title, expr))
    assert not empty, f"panels without data: {empty}"
    assert not zero, f"failure panels at zero after the failures: {zero}"

    # the engine-down alert: pending at once, firing after its for: (30 s), within a scrape and an evaluation more
    def state() -> str:
        return next((al["state"] for al in prom.alerts() if al["labels"]["alertname"] == "TokenfanEngineDown"
                     and al["labels"]["engine"] == fleet["addresses"][k]), "inactive")

    wait_until(lambda: state() == "pending", 10, "TokenfanEngineDown pending")
    wait_until(lambda: state() == "firing", 45, "TokenfanEngineDown firing")
    fired = time.monotonic() - killed
    assert 30 <= fired <= 30 + 5, fired
    firing = {al["labels"]["alertname"] for al in prom.alerts() if al["state"] == "firing"}
    assert "TokenfanGatewayDown" in firing  # gateway a, killed before the engine
    assert "TokenfanNoEngineReady" not in firing  # b still has an engine
