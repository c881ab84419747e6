"""A gateway that dies costs no reader its stream: another replica adopts its listed streams (docs/failures.md).

Real processes: one synthetic engine, gateway replicas sharing a real ``redis-server`` (``--broker``). Fan-out
streams are created on replica A and read on A and on B (SSE and WebSocket); A is killed with SIGKILL
mid-stream. A's readers reconnect to B with ``Last-Event-ID`` (what EventSource does when a load balancer
sends it elsewhere); every reader must get every event exactly once and the normal end, and the text must
equal an uninterrupted control run's. Two replicas racing to adopt: exactly one continues each stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.e2e.helpers import metric
from tests.e2e.test_broker import RedisServer, redis_server  # noqa: F401  (the fixture)
from tests.procs import NO_CLIENT_LIMITS, Proc, start_engine, start_gateway, stop_all
from tests.system import require

ENGINE_ARGS = ("--engine", "synthetic", "--synthetic-tokens-per-s", "20", "--synthetic-ttft-ms", "5")
TOKENS = 60  # 3 s per stream: the kill lands mid-stream
LEASE = ("--broker-lease-interval", "0.2", "--broker-lease-ttl", "0.8")


@pytest.fixture(autouse=True, scope="module")
def _redis_server_installed() -> None:
    require("redis-server")


@dataclass
class Reader:
    seqs: list[int] = field(default_factory=list)
    text: str = ""
    ended: bool = False
    errors: list[str] = field(default_factory=list)
    reconnects: int = 0


def body(i: int, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"river {i}"}], "max_tokens": TOKENS, "seed": i, **extra}


def fold(reader: Reader, seq: int, chunk: dict[str, Any]) -> None:
    reader.seqs.append(seq)
    for choice in chunk.get("choices") or []:
        reader.text += choice.get("delta", {}).get("content") or ""


async def sse_reader(c: httpx.AsyncClient, urls: list[str], sid: str, reader: Reader, started: asyncio.Event) -> None:
    """EventSource's behaviour: read; when the connection drops without an end, reconnect (here: to the next
    URL, as a load balancer would send it to a live replica) with Last-Event-ID."""
    url = urls[0]
    while not reader.ended:
        headers = {"Last-Event-ID": str(reader.seqs[-1])} if reader.seqs else {}
        try:
            async with c.stream("GET", f"{url}/v1/streams/{sid}/events", headers=headers) as r:
                if r.status_code == 204:
                    reader.ended = True
                    return
                assert r.status_code == 200, (r.status_code, await r.aread())
                event: dict[str, str] = {}
                async for line in r.aiter_lines():
                    if line.startswith(("id:", "data:", "event:")):
                        key, _, value = line.partition(": ")
                        event[key] = value
                        continue
                    if not event:
                        continue
                    if event.get("event") == "error":
                        reader.errors.append(event["data"])
                    elif event.get("data") == "[DONE]":
                        reader.ended = True
                    elif "id" in event:
                        fold(reader, int(event["id"]), json.loads(event["data"]))
                        if len(reader.seqs) == 3:
                            started.set()
                    event = {}
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError):
            pass
        if not reader.ended and not reader.errors:
            reader.reconnects += 1
            url = urls[-1]
            await asyncio.sleep(0.2)
        elif reader.errors:
            return


async def ws_reader(url: str, sid: str, reader: Reader) -> None:
    async with websockets.connect(f"{url.replace('http', 'ws')}/v1/streams/{sid}/ws") as sock:
        while True:
            msg = json.loads(await sock.recv())
            if msg["type"] == "chunk":
                fold(reader, msg["seq"], msg["data"])
            elif msg["type"] == "done":
                reader.ended = True
                return
            else:
                reader.errors.append(json.dumps(msg))
                return


async def until_killed(jobs: list[Any], started: list[asyncio.Event], kill: Any) -> None:
    """Run the readers, ``kill()`` once each has its first tokens, wait for every reader's end."""
    readers = asyncio.gather(*jobs)
    for ev in started:
        await asyncio.wait_for(ev.wait(), 30)
    kill()
    await asyncio.wait_for(readers, 60)


def check(readers: dict[str, Reader], expected: dict[int, str] | list[str]) -> None:
    """Every reader (named ``<stream>/<where>``): no error, the normal end, each event once, the control text."""
    for name, reader in readers.items():
        want = expected[int(name.split("/")[0])]
        assert not reader.errors and reader.ended, (name, reader.errors)
        assert reader.seqs == list(range(len(reader.seqs))), (name, reader.seqs)  # each event once
        assert reader.text == want, (name, reader.text, want)


def control(url: str, n: int) -> dict[int, str]:
    out = {}
    for i in range(n):
        obj = httpx.post(url + "/v1/chat/completions", json=body(i), timeout=30).json()
        out[i] = obj["choices"][0]["message"]["content"]
    return out


def replicas(ipc_dir: Path, url: str, names: str, engine_args: tuple[str, ...] = ENGINE_ARGS
             ) -> tuple[Proc, list[tuple[Proc, str]]]:
    address = f"ipc://{ipc_dir / f'adopt-{names}.sock'}"
    engine = start_engine(address, *engine_args, name=f"engine-adopt-{names}")
    gateways = [start_gateway(address, "--broker", url, *LEASE, *NO_CLIENT_LIMITS, name=f"gateway-adopt-{k}")
                for k in names]
    return engine, gateways


def test_a_killed_replicas_streams_are_adopted_and_every_reader_gets_every_event_once(
        ipc_dir: Path, redis_server: RedisServer) -> None:  # noqa: F811
    n = 5
    engine, gateways = replicas(ipc_dir, redis_server.url, "ab")
    (gw_a, url_a), (gw_b, url_b) = gateways
    try:
        async def scenario() -> dict[str, Reader]:
            readers: dict[str, Reader] = {}
            async with httpx.AsyncClient(timeout=60) as c:
                ids = []
                for i in range(n):
                    r = await c.post(url_a + "/v1/streams", json=body(i, stream_options={"include_usage": True}))
                    assert r.status_code == 201, r.text
                    ids.append(r.json()["id"])
                jobs, started = [], []
                for i, sid in enumerate(ids):
                    for where, urls in (("a", [url_a, url_b]), ("b", [url_b])):
                        reader = readers[f"{i}/sse-{where}"] = Reader()
                        ev = asyncio.Event()
                        started.append(ev)
                        jobs.append(sse_reader(c, urls, sid, reader, ev))
                    ws = readers[f"{i}/ws-b"] = Reader()
                    jobs.append(ws_reader(url_b, sid, ws))
                await until_killed(jobs, started, lambda: os.kill(gw_a.popen.pid, signal.SIGKILL))
            return readers

        readers = asyncio.run(scenario())
        check(readers, control(url_b, n))
        assert sum(r.reconnects for name, r in readers.items() if "sse-a" in name) >= n
        assert metric(url_b, "tokenfan_adoptions_total", {"outcome": "adopted"}) == n
        assert metric(url_b, "tokenfan_adoption_gap_seconds_count") == n
        assert "adopted stream" in gw_b.log()
    finally:
        stop_all([engine, *(g for g, _ in gateways)])


def test_two_replicas_racing_to_adopt_exactly_one_continues_each_stream(
        ipc_dir: Path, redis_server: RedisServer) -> None:  # noqa: F811
    n = 4
    engine, gateways = replicas(ipc_dir, redis_server.url, "xyz")
    (gw_x, url_x), (_, url_y), (_, url_z) = gateways
    try:
        async def scenario() -> dict[str, Reader]:
            readers: dict[str, Reader] = {}
            async with httpx.AsyncClient(timeout=60) as c:
                jobs, started = [], []
                for i in range(n):
                    r = await c.post(url_x + "/v1/streams", json=body(10 + i))
                    sid = r.json()["id"]
                    for where, url in (("y", url_y), ("z", url_z)):
                        reader = readers[f"{i}/{where}"] = Reader()
                        ev = asyncio.Event()
                        started.append(ev)
                        jobs.append(sse_reader(c, [url], sid, reader, ev))
                await until_killed(jobs, started, lambda: os.kill(gw_x.popen.pid, signal.SIGKILL))
            return readers

        readers = asyncio.run(scenario())
        check(readers, {i: httpx.post(url_y + "/v1/chat/completions", json=body(10 + i), timeout=30).json()
                    ["choices"][0]["message"]["content"] for i in range(n)})
        adopted = [metric(u, "tokenfan_adoptions_total", {"outcome": "adopted"}) for u in (url_y, url_z)]
        elsewhere = [metric(u, "tokenfan_adoptions_total", {"outcome": "elsewhere"}) for u in (url_y, url_z)]
        assert sum(adopted) == n and sum(elsewhere) <= n, (adopted, elsewhere)
    finally:
        stop_all([engine, *(g for g, _ in gateways)])


def test_sigterm_hands_the_streams_over_and_exits_at_once(ipc_dir: Path, redis_server: RedisServer) -> None:  # noqa: F811
    """A rolling restart: SIGTERM the owner while its streams need 10 s more. It exits within 2 s; its
    readers, reconnecting to B, and B's readers get every event once, the normal end, the control text."""
    n, tokens = 3, 600
    engine, gateways = replicas(ipc_dir, redis_server.url, "st", ("--engine", "synthetic", "--synthetic-tokens-per-s",
                                                                  "100", "--synthetic-ttft-ms", "5"))
    (gw_a, url_a), (_, url_b) = gateways
    exit_s: list[float] = []
    try:
        async def scenario() -> dict[str, Reader]:
            readers: dict[str, Reader] = {}
            async with httpx.AsyncClient(timeout=60) as c:
                jobs, started = [], []
                for i in range(n):
                    r = await c.post(url_a + "/v1/streams", json={**body(20 + i), "max_tokens": tokens})
                    sid = r.json()["id"]
                    for where, urls in (("a", [url_a, url_b]), ("b", [url_b])):
                        reader = readers[f"{i}/{where}"] = Reader()
                        ev = asyncio.Event()
                        started.append(ev)
                        jobs.append(sse_reader(c, urls, sid, reader, ev))
                all_ = asyncio.gather(*jobs)
                for ev in started:
                    await asyncio.wait_for(ev.wait(), 30)
                t0 = asyncio.get_running_loop().time()
                gw_a.popen.send_signal(signal.SIGTERM)
                await asyncio.get_running_loop().run_in_executor(None, gw_a.popen.wait, 10)
                exit_s.append(asyncio.get_running_loop().time() - t0)
                await asyncio.wait_for(all_, 60)
            return readers

        readers = asyncio.run(scenario())
        assert exit_s[0] < 2.0, exit_s

        async def controls() -> list[str]:
            async with httpx.AsyncClient(timeout=60) as c:
                rs = await asyncio.gather(*(c.post(url_b + "/v1/chat/completions",
                                                   json={**body(20 + i), "max_tokens": tokens}) for i in range(n)))
            return [r.json()["choices"][0]["message"]["content"] for r in rs]

        check(readers, asyncio.run(controls()))
        assert metric(url_b, "tokenfan_adoptions_total", {"outcome": "adopted"}) == n
        assert "handed 3 listed streams over" in gw_a.log()
    finally:
        stop_all([engine, *(g for g, _ in gateways)])


def test_a_background_response_is_adopted_and_every_reader_gets_every_event_once(
        ipc_dir: Path, redis_server: RedisServer) -> None:  # noqa: F811
    """A background response on A, read on A and on B (``GET /v1/responses/{id}?stream=true``); A killed: A's
    reader resumes on B with ``starting_after`` (as the SDKs do), both get every event once and
    ``response.completed``, the text equals an uninterrupted run's."""
    engine, gateways = replicas(ipc_dir, redis_server.url, "rs")
    (gw_a, url_a), (_, url_b) = gateways
    request = {"input": "tell me about rivers", "max_output_tokens": TOKENS, "metadata": {"seed": "1"}}
    try:
        async def read(c: httpx.AsyncClient, urls: list[str], rid: str, got: list[dict[str, Any]],
                       started: asyncio.Event) -> None:
            url = urls[0]
            while True:
                after = f"&starting_after={got[-1]['sequence_number']}" if got else ""
                try:
                    async with c.stream("GET", f"{url}/v1/responses/{rid}?stream=true{after}") as r:
                        assert r.status_code == 200, await r.aread()
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                ev = json.loads(line[6:])
                                got.append(ev)
                                if len(got) == 6:
                                    started.set()
                                if ev["type"] in ("response.completed", "response.incomplete", "error",
                                                  "response.failed"):
                                    return
                except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError):
                    pass
                url = urls[-1]
                await asyncio.sleep(0.2)

        async def scenario() -> dict[str, list[dict[str, Any]]]:
            seen: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
            async with httpx.AsyncClient(timeout=60) as c:
                r = await c.post(url_a + "/v1/responses", json={**request, "background": True, "store": True})
                rid = r.json()["id"]
                started = [asyncio.Event(), asyncio.Event()]
                jobs = asyncio.gather(read(c, [url_a, url_b], rid, seen["a"], started[0]),
                                      read(c, [url_b], rid, seen["b"], started[1]))
                for ev in started:
                    await asyncio.wait_for(ev.wait(), 30)
                os.kill(gw_a.popen.pid, signal.SIGKILL)
                await asyncio.wait_for(jobs, 60)
            return seen

        seen = asyncio.run(scenario())
        control = httpx.post(url_b + "/v1/responses", json=request, timeout=60).json()
        want = "".join(part["text"] for item in control["output"] for part in item.get("content", []))
        for name, events in seen.items():
            assert [e["sequence_number"] for e in events] == list(range(len(events))), name
            assert events[-1]["type"] in ("response.completed", "response.incomplete"), name
            text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
            assert text == want, (name, text, want)
            assert events[-1]["response"]["usage"]["output_tokens"] == control["usage"]["output_tokens"], name
        assert metric(url_b, "tokenfan_adoptions_total", {"outcome": "adopted"}) == 1
    finally:
        stop_all([engine, *(g for g, _ in gateways)])
