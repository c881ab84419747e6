"""``tokenfan bench pass``: the Python cost of the gateway's one pass per engine step, in-process.

The real classes of the token path (``Generation`` → ``ChatRenderer`` or ``ResponseRenderer`` → ``Stream.publish``
→ ``Reader.write_now`` → ``HttpConn``/``WsConn`` → ``Step.flush``), readers parked and caught up as in steady state, driven by
engine steps of one ``Delta`` per generation, with transports that take the bytes and do nothing: no
socket, no event-loop wake-up, no engine. What is left is the interpreter's work per delivered event,
the part of ``tokenfan bench cpu``'s figure that the gateway's code decides (the rest is the kernel's
socket write, which the raw floor pays too). Process CPU time, so another process's load changes it little.

Modes as in ``tokenfan bench cpu``: ``a`` POST SSE (one connection per generation), ``b`` fan-out
(``--readers`` SSE readers per stream), ``c`` ``/v1/ws`` (every generation on one socket), ``d`` Responses SSE
(a stored response per connection, as ``POST /v1/responses`` makes it; its events are
``response.output_text.delta`` in steady state).
Output: ``DIR/results.json`` and ``DIR/summary.md`` (also printed): median and percentiles of µs per
event over ``--repeats`` runs of ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from uvicorn.protocols.http.flow_control import FlowControl

from engine_worker import protocol as p
from gateway.api.chat_render import ChatRenderer
from gateway.api.chat_request import ChunkBuilder
from gateway.api.openai.framing import FANOUT_SSE, OPENAI_SSE, MuxWs
from gateway.api.responses.events import ResponseEvents
from gateway.api.responses.render import ResponseRenderer
from gateway.api.responses.stream import RESPONSES_SSE
from gateway.core.backpressure import SlowConsumerPolicy
from gateway.core.conn import HttpConn, WsConn
from gateway.core.delivery import Reader, ReaderMeter
from gateway.core.follow import Watchdog, follow
from gateway.core.framing import Framing
from gateway.core.generation import Generation, Renderer
from gateway.core.metrics import HotCounter, TransportMetrics
from gateway.core.server_port import SERVER_KEY
from gateway.core.step import Step
from gateway.core.streams import Event, Stream
from gateway.http.uvicorn_shim import UvicornPort
from tokenfan_bench.report import run_outputs
from tokenfan_bench.stats.metrics import summary_plain

MODES = {"a": "POST SSE", "b": "fan-out SSE", "c": "/v1/ws", "d": "Responses SSE"}


class NullTransport:
    """A transport that is always writable and counts what it is given."""

    def __init__(self) -> None:
        self.writes = 0
        self.bytes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.bytes += len(data)

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0


class HttpCycle:
    """What uvicorn's httptools request cycle shows :class:`HttpConn` (its transport, its flow control,
    chunked encoding); ``send`` is the ASGI path a reader's own loop takes, chunked like uvicorn's."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.flow = FlowControl(transport)
        self.chunked_encoding = True

    async def send(self, message: dict[str, Any]) -> None:
        body = message.get("body", b"")
        self.transport.write(b"%x\r\n%b\r\n" % (len(body), body) if body else b"")


class WsProto:
    """What uvicorn's sans-I/O WebSocket protocol shows :class:`WsConn`; its ASGI ``send`` must not be
    reached by a caught-up reader."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.writable = asyncio.Event()
        self.writable.set()
        self.close_sent = False
        self.conn = _NoCompression()

    async def send(self, message: dict[str, Any]) -> None:
        raise AssertionError("the one-pass path must not go through ASGI send")


class _NoCompression:
    """The websockets protocol's ``extensions``, as without permessage-deflate."""

    extensions: tuple[()] = ()


# the gateway's own port to uvicorn's objects (gateway/http/uvicorn_shim.py), over the stand-ins above
SCOPE: dict[str, Any] = {SERVER_KEY: UvicornPort(HttpCycle, WsProto)}


class _Handle:
    """What a generation reads of its request handle: ``attach`` when it starts, ``rejoined`` per step."""

    rejoined = False

    def attach(self, generation: Generation) -> None:
        self.generation = generation


async def run_mode(mode: str, generations: int, readers: int, steps: int, repeats: int) -> dict[str, Any]:
    """µs of process CPU per delivered event, per repeat, for one mode."""
    clock: Callable[[], tuple[float, int]] = lambda: (time.monotonic(), time.time_ns())
    metrics, tokens = TransportMetrics(), HotCounter()
    transports: list[NullTransport] = []
    ws = WsConn(SCOPE, WsProto(t := NullTransport()).send, 1.0)
    transports.append(t)
    gens: list[Generation] = []
    tasks: list[asyncio.Task[int]] = []
    per_stream = readers if mode == "b" else 1
    for i in range(generations):
        rid = f"resp_{i}" if mode == "d" else f"chatcmpl-{i}"
        stream = Stream(rid, "responses" if mode == "d" else "chat.completions", "m", listed=mode in ("b", "d"))
        gen = Generation(stream, _Handle(), _renderer(mode, rid), tokens)  # type: ignore[arg-type]
        gen.start()
        gens.append(gen)
        for _ in range(per_stream):
            framing: Framing
            conn: HttpConn | WsConn
            if mode == "c":
                conn, framing = ws, MuxWs(rid)
            else:
                transports.append(t := NullTransport())
                conn = HttpConn(SCOPE, HttpCycle(t).send, 1.0)
                framing = {"b": FANOUT_SSE, "d": RESPONSES_SSE}.get(mode, OPENAI_SSE)
            reader = Reader(framing, conn, ReaderMeter(metrics, 0.0), clock=clock)

            async def write(batch: list[Event], reader: Reader = reader) -> None:
                await reader.write(batch)

            tasks.append(asyncio.create_task(follow(stream, framing.transport, -1, write, SlowConsumerPolicy(),
                                                    Watchdog(3600.0, None), reader=reader)))
    await asyncio.sleep(0.05)  # every reader parked at the tail, as in steady state
    seq = 0

    def run(n: int) -> None:
        nonlocal seq
        for _ in range(n):
            step = Step(*clock())
            emit = step.wall_ns
            for gen in gens:
                gen.on_delta(p.Delta(gen.stream.id, seq, " token", 1, emit, token_ids=[seq]), step)
            step.flush()
            seq += 1

    run(5)  # the role chunks, a response's first item, the first writes
    writes = sum(t.writes for t in transports)
    out: list[float] = []
    for _ in range(repeats):
        before, chunks = time.process_time(), metrics.chunks.value
        run(steps)
        events = metrics.chunks.value - chunks
        out.append((time.process_time() - before) / events * 1e6)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"name": MODES[mode], "generations": generations, "readers": per_stream,
            "events_per_repeat": generations * per_stream * steps,
            "writes_per_step": (sum(t.writes for t in transports) - writes) / (repeats * steps or 1),
            "us_per_event": summary_plain(np.array(out)), "runs": out}


def _renderer(mode: str, rid: str) -> Renderer:
    """What renders a generation's events: a stored response's (mode d) or the chat chunks."""
    if mode == "d":
        return ResponseRenderer(ResponseEvents(rid, "m"))
    return ChatRenderer(ChunkBuilder("chat.completions", rid, "m", include_usage=False))


def summary_md(results: dict[str, Any]) -> str:
    meta = results["meta"]
    m = meta["machine"]
    lines = ["# tokenfan bench pass", "", f"`{' '.join(meta['command'])}`", "",
             (f"{m['cpus']} CPUs ({m['cpu_model']}), {m['platform']}; load {meta['load']} at start; {meta['time']}. "
             "Process CPU µs per delivered event of the gateway's one pass, in-process, no-op transports."), "",
             "| mode | generations × readers | writes per step | µs/event p50 | p90 | min |", "|---|---|---|---|---|---|"]
    for key, r in results["modes"].items():
        s = r["us_per_event"]
        lines.append(f"| {key} {r['name']} | {r['generations']} × {r['readers']} | {r['writes_per_step']:.0f} "
                     f"| {s['p50']:.2f} | {s['p90']:.2f} | {min(r['runs']):.2f} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan bench pass", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="a,b,c", help="comma-separated: a (POST SSE), b (fan-out SSE), c (/v1/ws), d (Responses SSE)")
    ap.add_argument("--generations", type=int, default=100, help="generations of modes a, c and d (default 100)")
    ap.add_argument("--streams", type=int, default=10, help="fan-out streams of mode b (default 10)")
    ap.add_argument("--readers", type=int, default=20, help="SSE readers per stream in mode b (default 20)")
    ap.add_argument("--steps", type=int, default=200, help="engine steps per repeat (default 200)")
    ap.add_argument("--repeats", type=int, default=9, help="repeats per mode (default 9)")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default bench-results/pass-<time>)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    ns = parser().parse_args(argv)
    modes = [m for m in ns.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES]:
        parser().error(f"unknown mode(s) {bad}; choose from {sorted(MODES)}")
    out = ns.out or Path("bench-results") / time.strftime("pass-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"meta": run_outputs.meta(["pass", *argv], 0), "modes": {}}
    for mode in modes:
        generations = ns.streams if mode == "b" else ns.generations
        results["modes"][mode] = asyncio.run(run_mode(mode, generations, ns.readers, ns.steps, ns.repeats))
    text = summary_md(results)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "summary.md").write_text(text)
    print(text)
    print(f"wrote {out / 'results.json'} and {out / 'summary.md'}")
    return 0
