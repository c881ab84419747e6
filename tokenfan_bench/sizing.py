"""``tokenfan bench sizing``: what one listed stream, one subscriber, one background response and one event
cost in a gateway's memory and in Redis (docs/operations.md's sizing figures).

Two gateways with ``--broker`` on one ``redis-server`` (loopback, no persistence), each on its own synthetic
engine:

- *idle*: an engine whose first token comes after ``--idle-ttft-s``, so every stream stays running with no
  event while it is measured: the gateway's resident memory (``VmRSS``) before and after ``--streams`` listed
  streams, ``--subscribers`` SSE subscribers of one stream (raw sockets, one connection each) and
  ``--responses`` background responses, each divided by its count; Redis's ``used_memory`` per listed stream.
- *events*: a fast engine; after a warm batch of ``--long``-token streams, two batches of ``--streams-events``
  finished streams, of ``--short`` and ``--long`` tokens each, held for their retention (``--stream-ttl``): the
  gateway's memory and Redis's per stream and per event by the line through the two batches
  (bytes = streams × (per stream + tokens × per event)).

Resident memory moves with the allocator's arenas, so each gateway figure is a growth over a count large enough
that an arena's worth (a few hundred KB) is a small part of it, and its fixed part per finished stream is not
resolved (the JSON has it; it came out negative); Redis's ``used_memory`` is its own exact accounting. Writes ``OUT/sizing.json`` and ``OUT/summary.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tokenfan_bench.report import run_outputs
from tokenfan_bench.servers.processes import (
    SPAWN_GATEWAY_ARGS,
    Proc,
    free_port,
    spawn,
    stop_all,
    wait_healthy,
)


def rss_bytes(pid: int) -> int:
    """The process's resident set size (``/proc/<pid>/status`` ``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def redis_used(port: int) -> int:
    """Redis's ``used_memory`` (the dataset and its overhead, not the allocator's slack)."""
    out = subprocess.run(["redis-cli", "-p", str(port), "info", "memory"], capture_output=True, text=True,
                         check=True, timeout=10).stdout
    return next(int(line.split(":")[1]) for line in out.splitlines() if line.startswith("used_memory:"))


async def _settle(pid: int) -> int:
    """The gateway's RSS once it stopped moving (two reads 0.3 s apart within 64 KB)."""
    last = rss_bytes(pid)
    for _ in range(20):
        await asyncio.sleep(0.3)
        now = rss_bytes(pid)
        if abs(now - last) < 65536:
            return now
        last = now
    return last


async def _streams(c: httpx.AsyncClient, url: str, n: int, tokens: int) -> list[str]:
    async def one(i: int) -> str:
        r = await c.post(url + "/v1/streams", json={"messages": [{"role": "user", "content": f"river {i}"}],
                                                    "max_tokens": tokens})
        if not r.is_success:
            raise RuntimeError(f"POST /v1/streams answered {r.status_code}: {r.text}")
        return str(r.json()["id"])
    out: list[str] = []
    for start in range(0, n, 50):  # 50 at a time: the client's own connections stay few
        out += await asyncio.gather(*(one(i) for i in range(start, min(n, start + 50))))
    return out


async def _responses(c: httpx.AsyncClient, url: str, n: int) -> None:
    async def one(i: int) -> None:
        r = await c.post(url + "/v1/responses", json={"input": f"river {i}", "background": True,
                                                      "max_output_tokens": 64})
        if not r.is_success:
            raise RuntimeError(f"POST /v1/responses answered {r.status_code}: {r.text}")
    for start in range(0, n, 50):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + 50))))


def _subscribe(port: int, stream_id: str, n: int) -> list[socket.socket]:
    """``n`` raw SSE subscriptions of one stream, each past its response head."""
    socks: list[socket.socket] = []
    request = (f"GET /v1/streams/{stream_id}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               "Accept: text/event-stream\r\n\r\n").encode()
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(request)
        socks.append(s)
    for s in socks:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                raise RuntimeError("a subscription closed before its head")
            head += chunk
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"a subscription was refused: {head[:80]!r}")
    return socks


async def _wait_finished(c: httpx.AsyncClient, url: str, ids: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for sid in ids:
        while True:
            status = (await c.get(f"{url}/v1/streams/{sid}")).json().get("status")
            if status not in ("running", "queued", "in_progress"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"stream {sid} still {status} after {timeout} s")
            await asyncio.sleep(0.2)


def _gateway(tmp: Path, logs: Path, name: str, redis_port: int, db: int, engine_args: list[str],
             ttl: float) -> tuple[list[Proc], str, int]:
    address = f"ipc://{tmp / (name + '.sock')}"
    port = free_port()
    engine = spawn(["-m", "engine_worker", "--engine", "synthetic", "--address", address, "--log-level", "WARNING",
                    "--max-queue", "100000",
                    *engine_args], logs / f"engine-{name}.log")
    args = [a for a in SPAWN_GATEWAY_ARGS]
    args[args.index("--stream-ttl") + 1] = str(ttl)
    gateway = spawn(["-m", "tokenfan.cli", "gateway", "--engine", address, "--host", "127.0.0.1", "--port",
                     str(port), "--log-level", "warning", "--broker", f"redis://127.0.0.1:{redis_port}/{db}",
                     "--max-subscribers", "100000", *args], logs / f"gateway-{name}.log")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, [engine, gateway], 90.0)
    return [engine, gateway], url, port


async def _idle_phase(url: str, port: int, pid: int, redis_port: int, a: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
        await _streams(c, url, 20, 8)  # warm: every code path of a listed stream imported and run once
        await asyncio.sleep(1.0)
        base, rbase = await _settle(pid), redis_used(redis_port)
        ids = await _streams(c, url, a.streams, 1000)
        after_streams, rstreams = await _settle(pid), redis_used(redis_port)
        socks = await asyncio.to_thread(_subscribe, port, ids[0], a.subscribers)
        after_subs = await _settle(pid)
        await _responses(c, url, a.responses)
        after_resp = await _settle(pid)
        for s in socks:
            s.close()
        return {"streams": a.streams, "subscribers": a.subscribers, "responses": a.responses,
                "gateway_rss_base_bytes": base,
                "gateway_bytes_per_running_stream": (after_streams - base) / a.streams,
                "gateway_bytes_per_subscriber": (after_subs - after_streams) / a.subscribers,
                "gateway_bytes_per_background_response": (after_resp - after_subs) / a.responses,
                "redis_bytes_per_running_stream": (rstreams - rbase) / a.streams}


async def _events_phase(url: str, pid: int, redis_port: int, a: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
        # warm: one batch of long streams first, so the transient memory of delivering a batch (buffers,
        # the allocator's arenas) is already there and what follows grows by what is retained
        await _wait_finished(c, url, await _streams(c, url, a.streams_events, a.long), 120 + a.long)
        await asyncio.sleep(1.0)
        points = []
        for tokens in (a.short, a.long):
            g0, r0 = await _settle(pid), redis_used(redis_port)
            ids = await _streams(c, url, a.streams_events, tokens)
            await _wait_finished(c, url, ids, 120 + tokens)
            g1, r1 = await _settle(pid), redis_used(redis_port)
            points.append((tokens, (g1 - g0) / a.streams_events, (r1 - r0) / a.streams_events))
    (t0, g0s, r0s), (t1, g1s, r1s) = points
    g_event, r_event = (g1s - g0s) / (t1 - t0), (r1s - r0s) / (t1 - t0)
    return {"streams": a.streams_events, "tokens": [t0, t1],
            "gateway_bytes_per_finished_stream": [g0s, g1s], "redis_bytes_per_finished_stream": [r0s, r1s],
            "gateway_bytes_per_event": g_event, "gateway_bytes_per_stream_fixed": g0s - t0 * g_event,
            "redis_bytes_per_event": r_event, "redis_bytes_per_stream_fixed": r0s - t0 * r_event}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan bench sizing", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=1000, help="running listed streams of the idle phase")
    ap.add_argument("--subscribers", type=int, default=2000, help="SSE subscribers of one stream (idle phase)")
    ap.add_argument("--responses", type=int, default=500, help="background responses (idle phase)")
    ap.add_argument("--idle-ttft-s", type=float, default=600.0, help="the idle engine's time to first token")
    ap.add_argument("--streams-events", type=int, default=200, help="finished streams per batch (events phase)")
    ap.add_argument("--short", type=int, default=50, help="tokens of each stream of the first batch")
    ap.add_argument("--long", type=int, default=400, help="tokens of each stream of the second batch")
    ap.add_argument("--tokens-per-s", type=float, default=400.0, help="the events phase's engine rate per stream")
    ap.add_argument("--stream-ttl", type=float, default=600.0, help="retention of finished streams (both phases)")
    ap.add_argument("--out", type=Path, default=Path("bench-results/sizing"))
    return ap


def _summary(r: dict[str, Any]) -> str:
    i, e = r["idle"], r["events"]
    kb = 1024.0
    rows = [("gateway, per running listed stream", i["gateway_bytes_per_running_stream"]),
            ("gateway, per SSE subscriber", i["gateway_bytes_per_subscriber"]),
            ("gateway, per background response", i["gateway_bytes_per_background_response"]),
            (f"gateway, per retained finished stream of {e['tokens'][0]} tokens", e["gateway_bytes_per_finished_stream"][0]),
            (f"gateway, per retained finished stream of {e['tokens'][1]} tokens", e["gateway_bytes_per_finished_stream"][1]),
            ("gateway, per retained event (the slope between the two)", e["gateway_bytes_per_event"]),
            ("Redis, per running listed stream", i["redis_bytes_per_running_stream"]),
            (f"Redis, per finished stream of {e['tokens'][0]} tokens", e["redis_bytes_per_finished_stream"][0]),
            (f"Redis, per finished stream of {e['tokens'][1]} tokens", e["redis_bytes_per_finished_stream"][1]),
            ("Redis, per event", e["redis_bytes_per_event"]),
            ("Redis, per finished stream (fixed part)", e["redis_bytes_per_stream_fixed"])]
    lines = [f"# tokenfan bench sizing ({r['meta']['date']}, {r['meta']['machine']})", "",
             f"`{r['meta']['command']}`", "", "| what | KB |", "|---|---|"]
    lines += [f"| {name} | {value / kb:.2f} |" for name, value in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    logs = a.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="tokenfan-sizing-") as d:
        tmp = Path(d)
        rport = free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):
                if subprocess.run(["redis-cli", "-p", str(rport), "ping"], capture_output=True,
                                  check=False).returncode == 0:
                    break
                time.sleep(0.1)
            idle_procs, idle_url, idle_port = _gateway(
                tmp, logs, "idle", rport, 0, ["--synthetic-ttft-ms", str(a.idle_ttft_s * 1000)], a.stream_ttl)
            procs += idle_procs
            idle = asyncio.run(_idle_phase(idle_url, idle_port, idle_procs[1].pid, rport, a))
            stop_all(reversed(idle_procs))
            subprocess.run(["redis-cli", "-p", str(rport), "flushall"], capture_output=True, check=True)
            ev_procs, ev_url, _ = _gateway(tmp, logs, "events", rport, 0,
                                           ["--synthetic-ttft-ms", "5", "--synthetic-tokens-per-s",
                                            str(a.tokens_per_s)], a.stream_ttl)
            procs += ev_procs
            events = asyncio.run(_events_phase(ev_url, ev_procs[1].pid, rport, a))
        finally:
            stop_all(reversed(procs))
            redis.kill()
            redis.wait()
    result = {"idle": idle, "events": events,
              "meta": {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
                       "python": platform.python_version(), "load": run_outputs.load(),
                       "command": "tokenfan bench sizing " + " ".join(argv), "cpus": os.cpu_count()}}
    (a.out / "sizing.json").write_text(json.dumps(result, indent=2) + "\n")
    summary = _summary(result)
    (a.out / "summary.md").write_text(summary)
    print(summary)
    return 0
