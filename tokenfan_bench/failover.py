"""``tokenfan bench failover``: the gap a client sees when an engine or a gateway dies mid-stream.

Three scenarios, real processes, one run each (or all):

- ``engine``: two engines behind one gateway (synthetic, or vLLM with ``--model``); N streamed chat
  completions; the engine serving about half of them is killed with SIGKILL. Every stream continues on the
  other engine (docs/failures.md, migration). The gap of a migrated stream: its last token before the kill to
  its first after, at the client.
- ``gateway``: two gateway replicas sharing a ``redis-server`` (``--broker``), one synthetic engine; N fan-out
  streams created on replica A, one SSE reader each on B; A is killed with SIGKILL. B adopts them. The gap:
  each reader's last event before the kill to its first after.
- ``workers``: ``tokenfan serve --workers 2`` on a synthetic engine, no broker; N fan-out streams created on
  worker 0, one SSE reader each on worker 1 (its private socket); worker 0 is killed with SIGKILL. Worker 1
  adopts them from its standby mirrors. The gap as for ``gateway``.

Every stream must end normally with nothing lost (checked: the number of tokens); the JSON holds each gap and
the summary their median, p90 and max, with the hardware and the exact command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tokenfan_bench.servers.processes import Proc, children, free_port, spawn, stop_all, wait_healthy


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan bench failover", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=("engine", "gateway", "workers", "all"), default="all")
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams")
    ap.add_argument("--tokens", type=int, default=120, help="max_tokens of each stream")
    ap.add_argument("--tokens-per-s", type=float, default=20.0, help="synthetic engine pace per stream")
    ap.add_argument("--model", type=Path, default=None,
                    help="engine scenario on vLLM with this model directory (default: synthetic engines)")
    ap.add_argument("--out", type=Path, default=Path("bench-results/failover"))
    return ap


async def _read(c: httpx.AsyncClient, method: str, url: str, body: dict[str, Any] | None, arrivals: list[float],
                started: asyncio.Event, headers: dict[str, str] | None = None) -> bool:
    """Read one SSE stream, stamping each content event; True if it ended normally (``[DONE]``)."""
    async with c.stream(method, url, json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return True
            if line.startswith("event: error"):
                return False
            if line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                arrivals.append(time.monotonic())
                if len(arrivals) == 3:
                    started.set()
    return False


def _gaps(arrivals: list[list[float]], killed: float) -> list[float]:
    """Per stream: the last arrival before the kill to the first after (streams that ended before it: none)."""
    out = []
    for a in arrivals:
        before = [t for t in a if t <= killed]
        after = [t for t in a if t > killed]
        if before and after:
            out.append(after[0] - before[-1])
    return out


async def _drive(streams: int, make: Any, victim: int, transport: httpx.AsyncBaseTransport | None = None
                 ) -> tuple[list[bool], list[list[float]], float]:
    """Open the streams (``make(client, i, arrivals, started)``), SIGKILL the process group ``victim`` once
    each has tokens."""
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    started = [asyncio.Event() for _ in range(streams)]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams + 4),
                                 transport=transport) as c:
        jobs = asyncio.gather(*[await make(c, i, arrivals[i], started[i]) for i in range(streams)])
        for ev in started:
            await ev.wait()
        killed = time.monotonic()
        os.killpg(victim, signal.SIGKILL)  # its process group (vLLM's EngineCore too), as a container dies
        ended = await jobs
    return list(ended), arrivals, killed


def _engine(args: argparse.Namespace, tmp: Path, logs: Path) -> dict[str, Any]:
    addresses = [f"ipc://{tmp / f'e{k}.sock'}" for k in range(2)]
    backend = (["--engine", "vllm", "--model", str(args.model), "--max-model-len", "1024"] if args.model else
               ["--engine", "synthetic", "--synthetic-tokens-per-s", str(args.tokens_per_s)])
    engines = [spawn(["-m", "engine_worker", "--engine-address", a, *backend, "--log-level", "warning"],
                     logs / f"engine-{k}.log") for k, a in enumerate(addresses)]
    port = free_port()
    gateway = spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", ",".join(addresses), "--port", str(port),
                     "--heartbeat-timeout", "30", "--max-generations-per-client", "0", "--log-level", "warning"],
                    logs / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [gateway, *engines], 600)
        while not all(e["healthy"] for e in httpx.get(url + "/health").json()["engines"]):
            time.sleep(0.2)

        async def make(c: httpx.AsyncClient, i: int, arrivals: list[float], started: asyncio.Event) -> Any:
            return _read(c, "POST", url + "/v1/chat/completions", {
                "messages": [{"role": "user", "content": f"river {i}"}], "max_tokens": args.tokens,
                "temperature": 0, "stream": True}, arrivals, started)

        ended, arrivals, killed = asyncio.run(_drive(args.streams, make, engines[0].pid))
        metrics = httpx.get(url + "/metrics").text
    finally:
        stop_all([gateway, *engines])
    return {"scenario": "engine", "backend": "vllm" if args.model else "synthetic", "streams": args.streams,
            "ended_normally": sum(ended), "gaps_s": _gaps(arrivals, killed),
            "migrations": [line for line in metrics.splitlines() if line.startswith("tokenfan_migrations_total")]}


def _gateway(args: argparse.Namespace, tmp: Path, logs: Path) -> dict[str, Any]:
    redis_port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    address = f"ipc://{tmp / 'g.sock'}"
    engine = spawn(["-m", "engine_worker", "--engine-address", address, "--engine", "synthetic",
                    "--synthetic-tokens-per-s", str(args.tokens_per_s), "--log-level", "warning"], logs / "engine.log")
    gateways: list[Proc] = []
    urls = []
    try:
        for k in "ab":
            port = free_port()
            gateways.append(spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", address, "--port", str(port),
                                   "--broker", f"redis://127.0.0.1:{redis_port}/0", "--max-generations-per-client",
                                   "0", "--max-subscriptions-per-client", "0", "--log-level", "warning"],
                                  logs / f"gateway-{k}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        for u, g in zip(urls, gateways, strict=True):
            wait_healthy(u, [g, engine], 60)

        async def make(c: httpx.AsyncClient, i: int, arrivals: list[float], started: asyncio.Event) -> Any:
            r = await c.post(urls[0] + "/v1/streams", json={
                "messages": [{"role": "user", "content": f"river {i}"}], "max_tokens": args.tokens, "seed": i})
            return _read(c, "GET", f"{urls[1]}/v1/streams/{r.json()['id']}/events", None, arrivals, started)

        ended, arrivals, killed = asyncio.run(_drive(args.streams, make, gateways[0].pid))
        metrics = httpx.get(urls[1] + "/metrics").text
    finally:
        stop_all([*gateways, engine])
        redis.terminate()
        redis.wait(10)
    return {"scenario": "gateway", "backend": "synthetic", "streams": args.streams, "ended_normally": sum(ended),
            "gaps_s": _gaps(arrivals, killed),
            "adoptions": [line for line in metrics.splitlines() if line.startswith("tokenfan_adoptions_total")]}


def _workers(args: argparse.Namespace, tmp: Path, logs: Path) -> dict[str, Any]:
    from gateway.scaleout.workers import WORKER_INDEX_ENV, worker_socket

    port = free_port()
    server = spawn(["-m", "tokenfan.cli", "serve", "--engine", "synthetic", "--synthetic-tokens-per-s",
                    str(args.tokens_per_s), "--workers", "2", "--port", str(port), "--max-generations-per-client",
                    "0", "--max-subscriptions-per-client", "0", "--log-level", "warning"], logs / "serve-workers.log")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [server], 60)
        while httpx.get(f"http://127.0.0.1:{port}/health").json()["workers"]["ready"] < 2:  # both, not the first
            time.sleep(0.05)
        worker0 = next(c.pid for c in children(server.pid) if c.has_env(WORKER_INDEX_ENV, "0"))
        owner, reader = (httpx.AsyncHTTPTransport(uds=str(worker_socket(port, k))) for k in (0, 1))

        async def make(c: httpx.AsyncClient, i: int, arrivals: list[float], started: asyncio.Event) -> Any:
            async with httpx.AsyncClient(transport=owner) as w0:
                r = await w0.post("http://worker/v1/streams", json={
                    "messages": [{"role": "user", "content": f"river {i}"}], "max_tokens": args.tokens, "seed": i})
            return _read(c, "GET", f"http://worker/v1/streams/{r.json()['id']}/events", None, arrivals, started)

        ended, arrivals, killed = asyncio.run(_drive(args.streams, make, worker0, reader))
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(worker_socket(port, 1)))) as c:
            metrics = c.get("http://worker/metrics").text
    finally:
        stop_all([server])
    return {"scenario": "workers", "backend": "synthetic", "streams": args.streams, "ended_normally": sum(ended),
            "gaps_s": _gaps(arrivals, killed),
            "adoptions": [line for line in metrics.splitlines() if line.startswith("tokenfan_adoptions_total")]}


def _summary(results: list[dict[str, Any]], command: str) -> str:
    lines = ["# tokenfan bench failover", "", f"`{command}`", "",
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "", "| scenario | backend | streams | ended normally | gaps measured | gap median | p90 | max |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        g = np.array(r["gaps_s"]) * 1000
        stats = (f"{np.median(g):.0f} ms | {np.percentile(g, 90):.0f} ms | {g.max():.0f} ms" if len(g)
                 else "- | - | -")
        lines.append(f"| {r['scenario']} | {r['backend']} | {r['streams']} | {r['ended_normally']} | {len(g)} | "
                     f"{stats} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.scenario in ("gateway", "all") and shutil.which("redis-server") is None:
        print("the gateway scenario needs redis-server (make test-deps installs it)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="tokenfan-failover-") as d:
        tmp = Path(d)
        if args.scenario in ("engine", "all"):
            results.append(_engine(args, tmp, args.out / "logs"))
        if args.scenario in ("gateway", "all"):
            results.append(_gateway(args, tmp, args.out / "logs"))
        if args.scenario in ("workers", "all"):
            results.append(_workers(args, tmp, args.out / "logs"))
    command = "tokenfan bench failover " + " ".join(argv)
    (args.out / "results.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    summary = _summary(results, command)
    (args.out / "summary.md").write_text(summary)
    print(summary)
    return 0 if all(r["ended_normally"] == r["streams"] for r in results) else 1
