"""``tokenfan bench durable``: what durable delivery costs a listed stream's readers (docs/failures.md).

With ``--broker`` an event of a listed stream reaches its readers only once Redis holds it (a reader never
reads what an adopter would not), and, where the primary has replicas, once they acknowledged it (``WAIT``,
``--broker-replicas``). Five arms on one synthetic engine, run in turn (A B C D E E D C B A, so a drift of the
machine falls on every arm alike): a gateway without a broker (``memory``), one with Redis on loopback
(``redis``), one whose Redis is behind a 1 ms round trip (``redis-1ms``, the bench's shaping proxy:
:mod:`tokenfan_bench.network.shaping_proxy`), one whose Redis primary has a replica on loopback (``replica``),
and one whose primary and its replica's link to it are both behind 1 ms (``replica-1ms``). Each arm: ``--streams`` fan-out streams at ``--tokens-per-s``,
one SSE reader each; the delivery latency of every event is its arrival (the wall clock) minus the engine's
emit time in its ``tokenfan`` object. Reported per arm: p50, p90, p99 and p99.9, and each arm's median over
``memory``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tokenfan_bench.network.shaping_proxy import Shaper, parse_profile
from tokenfan_bench.servers.processes import free_port, spawn, stop_all, wait_healthy

ARMS = ("memory", "redis", "redis-1ms", "replica", "replica-1ms")


async def _arm(url: str, streams: int, tokens: int) -> list[float]:
    """Latencies (ms) of every content event of ``streams`` fan-out streams read over SSE at ``url``."""
    out: list[float] = []

    async def one(c: httpx.AsyncClient, i: int) -> None:
        r = await c.post(url + "/v1/streams", json={"messages": [{"role": "user", "content": f"river {i}"}],
                                                    "max_tokens": tokens, "stream": True})
        r.raise_for_status()
        async with c.stream("GET", f"{url}/v1/streams/{r.json()['id']}/events") as resp:
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    return
                if line.startswith("data: {"):
                    now = time.time_ns()
                    emit = (json.loads(line[6:]).get("tokenfan") or {}).get("emit_ns")
                    if emit:
                        out.append((now - emit) / 1e6)

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=2 * streams + 4)) as c:
        await asyncio.gather(*(one(c, i) for i in range(streams)))
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan bench durable", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=100, help="max_tokens of each stream")
    ap.add_argument("--tokens-per-s", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of A B C D E E D C B A")
    ap.add_argument("--out", type=Path, default=Path("bench-results/durable"))
    return ap


def _redis(tmp: Path, name: str, port: int, *extra: str) -> subprocess.Popen[bytes]:
    (tmp / name).mkdir()
    return subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", str(tmp / name), "--repl-diskless-sync-delay", "0", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _online(port: int) -> int:
    info = subprocess.run(["redis-cli", "-p", str(port), "info", "replication"], capture_output=True, text=True,
                          check=False).stdout
    return info.count("state=online")


def _waits(port: int) -> int:
    """How many ``WAIT`` the Redis at ``port`` ran: each replica arm's pipelines wait, the others' do not."""
    stats = subprocess.run(["redis-cli", "-p", str(port), "info", "commandstats"], capture_output=True, text=True,
                           check=False).stdout
    line = next((x for x in stats.splitlines() if x.startswith("cmdstat_wait:")), "")
    return int(line.split("calls=")[1].split(",")[0]) if line else 0


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    lat: dict[str, list[float]] = {a: [] for a in ARMS}
    with tempfile.TemporaryDirectory(prefix="tokenfan-durable-") as d:
        tmp = Path(d)
        rport, p_lo, p_far = free_port(), free_port(), free_port()  # alone; primaries of the two replicas
        servers = [_redis(tmp, "alone", rport), _redis(tmp, "primary-lo", p_lo), _redis(tmp, "primary-far", p_far)]
        # routes: redis-1ms's Redis; replica-1ms's primary, for its gateway and for its replica's link
        shaper = Shaper(parse_profile("rtt=1ms"), [f"redis://127.0.0.1:{p}" for p in (rport, p_far, p_far)])
        servers += [_redis(tmp, "replica-lo", free_port(), "--replicaof", "127.0.0.1", str(p_lo)),
                    _redis(tmp, "replica-far", free_port(), "--replicaof", "127.0.0.1", str(shaper.ports[2]))]
        address = f"ipc://{tmp / 'engine.sock'}"
        procs = [spawn(["-m", "engine_worker", "--engine-address", address, "--engine", "synthetic",
                        "--synthetic-tokens-per-s", str(args.tokens_per_s), "--log-level", "warning"],
                       logs / "engine.log")]
        urls = {}
        try:
            brokers = {"memory": [], "redis": ["--broker", f"redis://127.0.0.1:{rport}/0"],
                       "redis-1ms": ["--broker", f"redis://127.0.0.1:{shaper.ports[0]}/0"],
                       "replica": ["--broker", f"redis://127.0.0.1:{p_lo}/0"],
                       "replica-1ms": ["--broker", f"redis://127.0.0.1:{shaper.ports[1]}/0"]}
            deadline = time.monotonic() + 30
            while _online(p_lo) < 1 or _online(p_far) < 1:  # each gateway reads its primary's replicas at start
                if time.monotonic() > deadline:
                    raise RuntimeError("the replicas never came online")
                time.sleep(0.05)
            for arm in ARMS:
                port = free_port()
                procs.append(spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", address, "--port", str(port),
                                    *brokers[arm], "--max-generations-per-client", "0",
                                    "--max-subscriptions-per-client", "0", "--log-level", "warning"],
                                   logs / f"gateway-{arm}.log"))
                urls[arm] = f"http://127.0.0.1:{port}"
                wait_healthy(urls[arm], [procs[-1], procs[0]], 120)
            probe = shaper.probe()
            for _ in range(args.rounds):
                for arm in (*ARMS, *reversed(ARMS)):
                    lat[arm] += asyncio.run(_arm(urls[arm], args.streams, args.tokens))
            waits = {"redis": _waits(rport), "replica": _waits(p_lo), "replica-1ms": _waits(p_far)}
        finally:
            stop_all(procs)
            shaper.close()
            for server in servers:
                server.terminate()
                server.wait(10)
    command = "tokenfan bench durable " + " ".join(argv)
    results: dict[str, Any] = {"command": command, "redis_path_probe": probe, "waits": waits, "arms": {}}
    base = float(np.median(lat["memory"])) if lat["memory"] else 0.0
    lines = ["# tokenfan bench durable", "", f"`{command}`", "",
             (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; the 1 ms path measured "
              f"{probe['rtt_ms']:.2f} ms RTT (median of its pings)"), "",
             "| arm | events | p50 | p90 | p99 | p99.9 | median over memory |", "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        v = np.array(lat[arm])
        q = {p: float(np.percentile(v, p)) for p in (50, 90, 99, 99.9)} if len(v) else {}
        results["arms"][arm] = {"events": len(v), "ms": q}
        if q:
            lines.append(f"| {arm} | {len(v)} | {q[50]:.2f} ms | {q[90]:.2f} ms | {q[99]:.2f} ms | {q[99.9]:.2f} ms | "
                         f"{q[50] - base:+.2f} ms |")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    summary = "\n".join(lines) + "\n"
    (args.out / "summary.md").write_text(summary)
    print(summary)
    return 0 if all(results["arms"][a]["events"] for a in ARMS) else 1
