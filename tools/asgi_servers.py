"""Measure ASGI servers (uvicorn, Hypercorn, Granian) under the gateway's fan-out hot path.

One synthetic engine; per server and wire, one gateway process running the same app, then
``--streams`` fan-out streams with ``--subscribers`` subscribers each over one wire:

- ``h1``: SSE over cleartext HTTP/1.1, one connection per subscriber;
- ``ws``: ``/v1/streams/{id}/ws`` over cleartext HTTP/1.1;
- ``tls-h1``: SSE over TLS, ALPN ``http/1.1``;
- ``tls-h2``: SSE over TLS, ALPN ``h2``, ``--h2-streams`` subscribers multiplexed per connection
  (a browser page holding several EventSources);
- ``tls-ws``: ``/v1/streams/{id}/ws`` over TLS (HTTP/1.1 upgrade).

Reported per run, over the window after every subscriber has joined: gateway CPU per delivered event
(``/proc/PID/stat`` utime+stime of the gateway process, all its threads) and delivery latency
(client receive − the engine's ``emit_ns``) p50/p99. The clients are lean on purpose (raw asyncio
reads, the ``h2`` state machine, a regex for ``emit_ns``) so they take as little of the shared CPU
as possible.

    python tools/asgi_servers.py run --servers uvicorn,hypercorn,granian --wires h1,ws,tls-h1,tls-h2,tls-ws
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
EMIT = re.compile(rb'"emit_ns":(\d+)')
TICK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------- server side

def serve(ns: argparse.Namespace) -> None:
    """One gateway under ``--server``; uvicorn and Granian run as ``gateway/http/server.py`` configures them."""
    import uvloop

    from gateway.config import GatewayConfig
    from gateway.core.streams import Retention
    from gateway.http.app import create_app
    from gateway.http.server import run_granian
    from gateway.http.uvicorn_shim import protocol_class, server_port

    tls = (Path(ns.certfile), Path(ns.keyfile)) if ns.certfile else (None, None)
    config = GatewayConfig(host="127.0.0.1", port=ns.port, engine_address=ns.engine, log_level="WARNING",
                           retention=Retention(finished_ttl=5.0), ssl_certfile=tls[0], ssl_keyfile=tls[1])
    app = create_app(config, server=server_port() if ns.server == "uvicorn" else None)  # RawSend included
    if ns.server == "uvicorn":  # what run_uvicorn starts, plus TLS (which tokenfan gives to Granian)
        import uvicorn

        kw: dict[str, Any] = {"ssl_certfile": ns.certfile, "ssl_keyfile": ns.keyfile} if ns.certfile else {}
        uvicorn.run(app, host="127.0.0.1", port=ns.port, log_level="warning", access_log=False,
                    http=protocol_class(config.http_header_timeout, config.http_body_timeout), **kw)
    elif ns.server == "hypercorn":
        from hypercorn.asyncio import serve as hserve
        from hypercorn.config import Config

        hc = Config()
        hc.bind = [f"127.0.0.1:{ns.port}"]
        hc.accesslog = None
        hc.loglevel = "WARNING"
        if ns.certfile:
            hc.certfile, hc.keyfile = ns.certfile, ns.keyfile
        uvloop.run(hserve(app, hc))  # type: ignore[arg-type]
    elif ns.server == "granian":  # cleartext too, for the comparison; tokenfan uses it for TLS only
        if ns.certfile:
            run_granian(app, config)
        else:
            from granian.constants import Interfaces
            from granian.server.embed import Server

            server = Server(app, address="127.0.0.1", port=ns.port, interface=Interfaces.ASGI, backlog=2048,
                            log_enabled=False)

            async def main() -> None:
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, server.stop)
                await server.serve()

            uvloop.run(main())
    else:
        raise SystemExit(f"unknown server {ns.server}")


# ---------------------------------------------------------------------------------------------- client side

class Samples:
    def __init__(self) -> None:
        self.lat_ns: list[int] = []
        self.events = 0
        self.recording = False
        self.errors = 0
        self.joined = 0  # subscribers whose response (or WebSocket handshake) arrived
        self.connecting = asyncio.Semaphore(10)

    def feed(self, data: bytes, recv_ns: int) -> None:
        for m in EMIT.finditer(data):
            self.events += 1
            if self.recording:
                self.lat_ns.append(recv_ns - int(m.group(1)))


def _ctx(alpn: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols([alpn])
    return ctx


async def sse_h1(port: int, path: str, samples: Samples, tls: bool) -> None:
    async with samples.connecting:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=_ctx("http/1.1") if tls else None)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nAccept: text/event-stream\r\n\r\n".encode())
        head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        samples.errors += 1
        return
    buf = b""
    samples.joined += 1
    while True:
        data = await reader.read(65536)
        if not data:
            break
        now = time.time_ns()
        buf += data
        cut = buf.rfind(b"\n\n")
        if cut >= 0:
            samples.feed(buf[:cut], now)
            if b"data: [DONE]" in buf[:cut]:
                break
            buf = buf[cut + 2:]
    writer.close()


async def sse_h2(port: int, paths: list[str], samples: Samples) -> None:
    import h2.config
    import h2.connection
    import h2.events

    async with samples.connecting:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=_ctx("h2"))
    if writer.get_extra_info("ssl_object").selected_alpn_protocol() != "h2":
        raise RuntimeError("server did not negotiate h2")
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.initiate_connection()
    conn.increment_flow_control_window(1 << 24)
    bufs: dict[int, bytes] = {}
    for path in paths:
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "GET"), (":path", path), (":scheme", "https"),
                                (":authority", "localhost"), ("accept", "text/event-stream")], end_stream=True)
        bufs[sid] = b""
    writer.write(conn.data_to_send())
    open_streams = set(bufs)
    samples.joined += len(paths)
    while open_streams:
        data = await reader.read(65536)
        if not data:
            break
        now = time.time_ns()
        for ev in conn.receive_data(data):
            if isinstance(ev, h2.events.DataReceived):
                conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                buf = bufs[ev.stream_id] + ev.data
                cut = buf.rfind(b"\n\n")
                if cut >= 0:
                    samples.feed(buf[:cut], now)
                    buf = buf[cut + 2:]
                bufs[ev.stream_id] = buf
            elif isinstance(ev, h2.events.ResponseReceived):
                if dict(ev.headers).get(":status") != "200":  # type: ignore[call-overload]  # str: header_encoding
                    samples.errors += 1
            elif isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
                open_streams.discard(ev.stream_id)
        out = conn.data_to_send()
        if out:
            writer.write(out)
    writer.close()


async def ws_client(port: int, path: str, samples: Samples, tls: bool) -> None:
    from websockets.asyncio.client import connect

    scheme = "wss" if tls else "ws"
    async with samples.connecting:
        ws = await connect(f"{scheme}://127.0.0.1:{port}{path}", ssl=_ctx("http/1.1") if tls else None,
                           compression=None, max_size=None, open_timeout=60)
    async with ws:
        samples.joined += 1
        async for msg in ws:
            now = time.time_ns()
            data = msg if isinstance(msg, bytes) else msg.encode()
            samples.feed(data, now)
            if b'"type":"done"' in data or b'"type":"error"' in data:
                break


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


async def load(url: str, port: int, pid: int, wire: str, ns: argparse.Namespace) -> dict[str, Any]:
    tls = wire.startswith("tls")
    body = {"endpoint": "completions", "prompt": "hi", "max_tokens": min(1800, int(ns.rate * (ns.duration + ns.warmup + 60)))}
    async with httpx.AsyncClient(base_url=url, verify=False, timeout=10) as http:
        streams = []
        for _ in range(ns.streams):
            r = await http.post("/v1/streams", json=body)
            r.raise_for_status()
            streams.append(r.json())
    samples = Samples()
    samples.connecting = asyncio.Semaphore(10)  # a few handshakes at a time (this client shares 2 cores)
    tasks: list[asyncio.Task[None]] = []
    for s in streams:
        events, ws_path = s["events_url"], s["ws_url"]
        events = events if events.startswith("/") else httpx.URL(events).raw_path.decode()
        ws_path = ws_path if ws_path.startswith("/") else httpx.URL(ws_path).raw_path.decode()
        if wire in ("h1", "tls-h1"):
            tasks += [asyncio.create_task(sse_h1(port, events, samples, tls)) for _ in range(ns.subscribers)]
        elif wire in ("ws", "tls-ws"):
            tasks += [asyncio.create_task(ws_client(port, ws_path, samples, tls)) for _ in range(ns.subscribers)]
        elif wire == "tls-h2":
            per = [events] * ns.subscribers
            for i in range(0, len(per), ns.h2_streams):
                tasks.append(asyncio.create_task(sse_h2(port, per[i:i + ns.h2_streams], samples)))
    total = ns.streams * ns.subscribers
    loop = asyncio.get_running_loop()
    join_by = loop.time() + 60
    def failures() -> list[BaseException]:
        return [e for t in tasks if t.done() and not t.cancelled() and (e := t.exception()) is not None]

    while samples.joined + len(failures()) < total and loop.time() < join_by:
        await asyncio.sleep(0.1)
    failed = failures()
    if samples.joined < total or failed:
        print(f"{wire}: {samples.joined}/{total} joined; failures: {failed[:3]}", file=sys.stderr)
    await asyncio.sleep(ns.warmup)
    samples.recording = True
    ev0, c0, t0 = samples.events, cpu_ticks(pid), time.monotonic()
    await asyncio.sleep(ns.duration)
    ev1, c1, t1 = samples.events, cpu_ticks(pid), time.monotonic()
    samples.recording = False
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    lat = sorted(samples.lat_ns)
    events = ev1 - ev0
    cpu_s = (c1 - c0) / TICK

    def q(p: float) -> float | None:
        return lat[min(len(lat) - 1, int(p * len(lat)))] / 1e6 if lat else None

    return {"wire": wire, "events": events, "events_per_s": events / (t1 - t0), "gateway_cpu_s": cpu_s,
            "gateway_cpu_util": cpu_s / (t1 - t0), "cpu_us_per_event": cpu_s / events * 1e6 if events else None,
            "p50_ms": q(0.5), "p99_ms": q(0.99), "errors": samples.errors + total - samples.joined,
            "expected_events_per_s": ns.streams * ns.subscribers * ns.rate}


SUPPORTS = {"uvicorn": {"h1", "ws", "tls-h1", "tls-ws"},
            "hypercorn": {"h1", "ws", "tls-h1", "tls-h2", "tls-ws"},
            "granian": {"h1", "ws", "tls-h1", "tls-h2", "tls-ws"}}


def run(ns: argparse.Namespace) -> None:
    from gateway.http.certs import generate
    from tests.procs import free_port

    tmp = Path(tempfile.mkdtemp(prefix="asgi-servers-"))
    cert, key = generate(tmp / "certs")
    address = f"ipc://{tmp}/engine.sock"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(tmp / "engine.log", "wb") as out:
        engine = subprocess.Popen([sys.executable, "-m", "engine_worker", "--engine", "synthetic", "--address",
                                   address, "--synthetic-tokens-per-s", str(ns.rate), "--synthetic-ttft-ms", "20",
                                   "--max-queue", "100000"], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    results: list[dict[str, Any]] = []
    try:
        for wire, server in [(w, s) for _ in range(ns.rounds) for w in ns.wires.split(",")
                             for s in ns.servers.split(",")]:  # servers interleaved per wire
            if wire not in SUPPORTS[server]:
                continue
            tls = wire.startswith("tls")
            port = free_port()
            args = [sys.executable, __file__, "serve", "--server", server, "--port", str(port),
                    "--engine", address]
            if tls:
                args += ["--certfile", str(cert), "--keyfile", str(key)]
            log = tmp / f"{server}-{wire}.log"
            with open(log, "wb") as out:
                gw = subprocess.Popen(args, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
            url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
            try:
                deadline = time.monotonic() + 30
                while True:
                    try:
                        if httpx.get(url + "/health", verify=False, timeout=1).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline or gw.poll() is not None:
                        raise RuntimeError(f"{server} did not start:\n{log.read_text()[-3000:]}")
                    time.sleep(0.2)
                res = asyncio.run(load(url, port, gw.pid, wire, ns)) if not ns.uvloop else __import__(
                    "uvloop").run(load(url, port, gw.pid, wire, ns))
            finally:
                gw.send_signal(signal.SIGTERM)
                try:
                    gw.wait(20)
                except subprocess.TimeoutExpired:
                    gw.kill()
                    gw.wait()
            res["server"] = server
            res["loadavg"] = os.getloadavg()
            results.append(res)
            print(json.dumps(res), flush=True)
            time.sleep(2)
    finally:
        engine.terminate()
        engine.wait(10)
    if ns.out:
        Path(ns.out).write_text(json.dumps(results, indent=1))
    print("\n| server | wire | events/s (offered) | gateway CPU | µs CPU / event | p50 ms | p99 ms | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['server']} | {r['wire']} | {r['events_per_s']:.0f} ({r['expected_events_per_s']:.0f}) | "
              f"{100 * r['gateway_cpu_util']:.0f}% | {r['cpu_us_per_event'] or 0:.1f} | {r['p50_ms'] or 0:.2f} | "
              f"{r['p99_ms'] or 0:.2f} | {r['errors']} |")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--server", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--engine", required=True)
    s.add_argument("--certfile")
    s.add_argument("--keyfile")
    r = sub.add_parser("run")
    r.add_argument("--servers", default="uvicorn,hypercorn,granian")
    r.add_argument("--wires", default="h1,ws,tls-h1,tls-h2,tls-ws")
    r.add_argument("--streams", type=int, default=20)
    r.add_argument("--subscribers", type=int, default=10, help="per stream")
    r.add_argument("--h2-streams", type=int, default=10, help="SSE subscribers per HTTP/2 connection")
    r.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream")
    r.add_argument("--duration", type=float, default=15.0)
    r.add_argument("--warmup", type=float, default=3.0)
    r.add_argument("--rounds", type=int, default=1)
    r.add_argument("--uvloop", action="store_true", help="run the clients on uvloop")
    r.add_argument("--out")
    return p


def main() -> None:
    ns = parser().parse_args()
    serve(ns) if ns.cmd == "serve" else run(ns)


if __name__ == "__main__":
    main()
