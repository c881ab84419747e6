"""A Redis outage is not a fleet outage: real ``redis-server`` on loopback, real gateways (``--broker``) on the
synthetic engine.

- Redis hung (SIGSTOP) past the lease, then killed, then started again empty: ``/readyz`` sampled on both
  replicas never reads not-ready on both at once, ``/livez`` is always 200, unlisted requests (POST SSE, ``/v1/ws``,
  a foreground response) go on, new listed streams get 503 ``broker_unavailable`` with ``Retry-After``, and once
  Redis is back a new listed stream streams on every replica.
- A gateway started while Redis is down (refused) or hung: it starts, is ready, serves unlisted traffic, refuses
  listed streams, and serves them once Redis answers.
- A full Redis (``maxmemory`` with ``noeviction``): new listed streams get 503 ``broker_full``, unlisted requests
  go on, and once memory is freed listed streams work again.

Every wait is a poll for a condition with a generous deadline; no assertion is about time.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis
import websockets

from tests.e2e.helpers import sse_events, until, wait_until
from tests.e2e.test_broker import RedisServer
from tests.procs import NO_CLIENT_LIMITS, Proc, spawn, start_engine, stop_all
from tests.system import require
from tokenfan_bench.servers.processes import free_port

HANG_GUARD_S = 30  # a client timeout that only catches a hang; never a timing check


@pytest.fixture(autouse=True, scope="module")
def _redis_server_installed() -> None:
    require("redis-server")


class Redis(RedisServer):
    """A ``redis-server`` without persistence on a fixed port: started, stopped (SIGSTOP), killed, again."""

    start_timeout = 20.0

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def engine(ipc_dir: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    address = f"ipc://{ipc_dir / f'ro-{request.node.name[:30]}.sock'}"
    proc = start_engine(address, "--engine", "synthetic", "--synthetic-tokens-per-s", "200", name="engine-outage")
    try:
        yield address
    finally:
        proc.stop()


def start_gateway(address: str, broker_url: str, name: str) -> tuple[Proc, str]:
    """A gateway on ``broker_url``, waited for by its readiness (``/readyz``): it need not reach Redis to serve."""
    port = free_port()
    proc = spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", address, "--broker", broker_url,
                  "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *NO_CLIENT_LIMITS], name)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.popen.poll() is None, f"the gateway exited ({proc.popen.returncode}):\n{proc.log()[-3000:]}"
        try:
            return httpx.get(url + "/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, timeout=60, what=f"{name} ready")
    except BaseException:
        proc.stop()
        raise
    return proc, url


def broker(url: str) -> str:
    return str(httpx.get(url + "/health", timeout=10).json().get("broker"))


# -- the requests ----------------------------------------------------------------------------------------------


async def chat_sse(client: httpx.AsyncClient, url: str) -> bool:
    """A POST SSE chat completion (unlisted) ends with ``[DONE]``."""
    r = await client.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True})
    return r.status_code == 200 and sse_events(r.text)[-1]["data"] == "[DONE]"


async def ws_request(client: httpx.AsyncClient, url: str) -> bool:
    """One ``/v1/ws`` generation (unlisted) ends with ``done``."""
    async with websockets.connect("ws" + url[4:] + "/v1/ws", open_timeout=HANG_GUARD_S) as ws:
        await ws.send(json.dumps({"type": "request", "id": "r1", "endpoint": "chat.completions",
                                  "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}}))
        while True:
            msg = json.loads(await asyncio.wait_for(ws.recv(), HANG_GUARD_S))
            if msg["type"] in ("done", "error"):
                return bool(msg["type"] == "done")


async def foreground_response(client: httpx.AsyncClient, url: str) -> bool:
    """A streamed foreground response (stored: the default) ends with its terminal event (``incomplete``: the
    synthetic engine writes up to ``max_output_tokens``)."""
    r = await client.post(url + "/v1/responses", json={"input": "hi", "max_output_tokens": 6, "stream": True})
    return r.status_code == 200 and sse_events(r.text)[-1]["event"] in ("response.completed", "response.incomplete")


UNLISTED = {"chat_sse": chat_sse, "ws": ws_request, "response": foreground_response}


def listed_attempts(url: str) -> dict[str, httpx.Response]:
    """What creates a listed stream: ``POST /v1/streams``, a background response, the AI SDK's ``/api/chat``."""
    with httpx.Client(timeout=HANG_GUARD_S) as client:
        return {
            "streams": client.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "x",
                                                              "max_tokens": 5}),
            "background": client.post(url + "/v1/responses", json={"input": "x", "background": True,
                                                                   "max_output_tokens": 5}),
            "ui_chat": client.post(url + "/api/chat", json={
                "id": "chat-outage", "trigger": "submit-message", "messageId": None,
                "messages": [{"id": "m1", "role": "user", "parts": [{"type": "text", "text": "hi"}]}]}),
        }


def assert_refused(url: str, code: str) -> None:
    t0 = time.monotonic()
    for kind, r in listed_attempts(url).items():
        assert r.status_code == 503, (kind, r.status_code, r.text[:300])
        assert r.json()["error"]["code"] == code, (kind, r.text)
        assert float(r.headers["retry-after"]) > 0, kind
    print(f"\n[figure] {url}: three new listed streams refused ({code}) in {time.monotonic() - t0:.2f} s")


def listed_stream_on_every_replica(owner: str, urls: list[str]) -> None:
    """A fan-out stream created on ``owner`` reads to ``[DONE]`` on every replica."""
    r = httpx.post(owner + "/v1/streams", json={"endpoint": "completions", "prompt": "x", "max_tokens": 20},
                   timeout=HANG_GUARD_S)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    texts = []
    for url in urls:
        events = sse_events(httpx.get(f"{url}/v1/streams/{sid}/events", timeout=HANG_GUARD_S).text)
        assert events[-1]["data"] == "[DONE]", (url, events[-3:])
        texts.append([e["data"] for e in events if "id" in e])
    assert all(t == texts[0] and t for t in texts)


# -- the load and the probes, sampled --------------------------------------------------------------------------


@dataclass
class Watch:
    """Unlisted requests in a loop and both replicas' probes sampled, until :meth:`stop`."""

    urls: list[str]
    results: dict[str, list[bool]] = field(default_factory=lambda: {k: [] for k in UNLISTED})
    failures: list[str] = field(default_factory=list)
    ready: list[tuple[bool, ...]] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def stop(self) -> None:
        self._stop.set()

    def done(self) -> int:
        return sum(len(v) for v in self.results.values())

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=HANG_GUARD_S) as client:
            await asyncio.gather(self._probes(client), *(self._load(client, k) for k in UNLISTED))

    async def _load(self, client: httpx.AsyncClient, kind: str) -> None:
        i = 0
        while not self._stop.is_set():
            url = self.urls[i % len(self.urls)]
            i += 1
            try:
                ok = await UNLISTED[kind](client, url)
            except (httpx.HTTPError, websockets.WebSocketException, OSError, TimeoutError) as exc:
                ok = False
                self.failures.append(f"{kind} on {url}: {exc!r}")
            self.results[kind].append(ok)
            await asyncio.sleep(0.02)

    async def _probes(self, client: httpx.AsyncClient) -> None:
        async def status(url: str, path: str) -> int:
            try:
                return (await client.get(url + path, timeout=5)).status_code
            except httpx.HTTPError:
                return 0

        while not self._stop.is_set():
            ready = await asyncio.gather(*(status(u, "/readyz") for u in self.urls))
            live = await asyncio.gather(*(status(u, "/livez") for u in self.urls))
            self.ready.append(tuple(s == 200 for s in ready))
            self.live.extend(live)
            await asyncio.sleep(0.1)

    def check(self) -> None:
        total, ok = self.done(), sum(sum(v) for v in self.results.values())
        per_kind = {k: f"{sum(v)}/{len(v)}" for k, v in self.results.items()}
        print(f"\n[figure] unlisted requests during the outage: {ok}/{total} ended normally {per_kind}; "
              f"/readyz sampled {len(self.ready)} times on both replicas")
        assert all(self.results.values()), per_kind
        assert ok >= 0.99 * total, (per_kind, self.failures[:5])
        assert all(any(pair) for pair in self.ready), "both replicas read not-ready at once"
        assert all(s == 200 for s in self.live), sorted(set(self.live))


# -- the tests -------------------------------------------------------------------------------------------------


def test_redis_hung_then_down_takes_no_replica_out_of_service_and_refuses_only_new_listed_streams(
        engine: str, tmp_path: Path) -> None:
    """Redis is stopped (SIGSTOP: connections hang, nothing is refused) until both gateways' leases lapsed,
    then killed, then started again empty."""
    server = Redis(tmp_path)
    server.start()
    procs: list[Proc] = []
    try:
        urls = []
        for tag in "ab":
            proc, url = start_gateway(engine, server.url, f"gateway-outage-{tag}")
            procs.append(proc)
            urls.append(url)
        wait_until(lambda: all(broker(u) == "ok" for u in urls), timeout=30, what="both gateways on Redis")
        listed_stream_on_every_replica(urls[0], urls)

        async def main() -> Watch:
            watch = Watch(urls)
            load = asyncio.create_task(watch.run())
            await until(lambda: asyncio.sleep(0, watch.done() >= 6), timeout=60, what="unlisted load running")
            server.signal(signal.SIGSTOP)  # hung: every command waits
            await until(lambda: asyncio.to_thread(lambda: all(broker(u) == "unavailable" for u in urls)), timeout=60,
                        what="both gateways see the hung Redis")  # their leases went unconfirmed: fenced
            await asyncio.to_thread(lambda: [assert_refused(u, "broker_unavailable") for u in urls])
            hung = watch.done()
            await until(lambda: asyncio.sleep(0, watch.done() >= hung + 12), timeout=120,
                        what="unlisted requests served while Redis hangs")
            server.kill()  # down: connections refused
            await asyncio.to_thread(lambda: [assert_refused(u, "broker_unavailable") for u in urls])
            down = watch.done()
            await until(lambda: asyncio.sleep(0, watch.done() >= down + 12), timeout=120,
                        what="unlisted requests served while Redis is down")
            await asyncio.to_thread(server.start)  # same port, empty
            await until(lambda: asyncio.to_thread(lambda: all(broker(u) == "ok" for u in urls)), timeout=60,
                        what="both gateways back on Redis")
            back = watch.done()
            await until(lambda: asyncio.sleep(0, watch.done() >= back + 6), timeout=60, what="load after")
            watch.stop()
            await load
            return watch

        asyncio.run(main()).check()
        for owner in urls:  # a listed stream created after Redis is back streams on every replica
            listed_stream_on_every_replica(owner, urls)
    finally:
        stop_all(procs)
        server.stop()


@pytest.mark.parametrize("fault", ["down", "hung"])
def test_a_gateway_started_while_redis_is_away_is_ready_and_serves_listed_streams_once_it_is_back(
        engine: str, tmp_path: Path, fault: str) -> None:
    server = Redis(tmp_path)
    if fault == "hung":
        server.start()
        server.signal(signal.SIGSTOP)
    procs: list[Proc] = []
    try:
        proc, url = start_gateway(engine, server.url, f"gateway-late-{fault}")  # waits for /readyz 200
        procs.append(proc)
        assert httpx.get(url + "/livez").status_code == 200
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["broker"] == "unavailable", health.text

        async def unlisted() -> list[bool]:
            async with httpx.AsyncClient(timeout=HANG_GUARD_S) as client:
                return [await f(client, url) for f in UNLISTED.values()]

        assert asyncio.run(unlisted()) == [True] * len(UNLISTED)
        assert_refused(url, "broker_unavailable")
        if fault == "hung":
            server.signal(signal.SIGCONT)
        else:
            server.start()
        wait_until(lambda: broker(url) == "ok", timeout=60, what="the gateway on Redis")
        assert httpx.get(url + "/health").status_code == 200
        other, other_url = start_gateway(engine, server.url, f"gateway-late-{fault}-b")
        procs.append(other)
        listed_stream_on_every_replica(url, [url, other_url])
        listed_stream_on_every_replica(other_url, [url, other_url])
    finally:
        stop_all(procs)
        server.stop()


def test_a_full_redis_refuses_new_listed_streams_with_broker_full_and_unlisted_requests_go_on(
        engine: str, tmp_path: Path) -> None:
    """``maxmemory`` 4 MB with ``noeviction``, filled by another client until Redis refuses writes (OOM), then
    held there (``maxmemory`` lowered below what it holds); freed again at the end."""
    server = Redis(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    server.start()
    procs: list[Proc] = []
    try:
        urls = []
        for tag in "ab":
            proc, url = start_gateway(engine, server.url, f"gateway-full-{tag}")
            procs.append(proc)
            urls.append(url)
        wait_until(lambda: all(broker(u) == "ok" for u in urls), timeout=30, what="both gateways on Redis")
        filler = server.client()
        n = 0
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            while True:
                filler.set(f"filler:{n}", b"x" * 4096)
                n += 1
        # full, not at the brink (a lease key expiring would free room for the next write)
        used = int(filler.info("memory")["used_memory"])
        filler.config_set("maxmemory", used - 256 * 1024)
        wait_until(lambda: all(broker(u) == "full" for u in urls), timeout=60, what="both gateways see Redis full")
        for url in urls:
            assert_refused(url, "broker_full")
            assert httpx.get(url + "/readyz").status_code == 200 and httpx.get(url + "/livez").status_code == 200

        async def unlisted() -> list[bool]:
            async with httpx.AsyncClient(timeout=HANG_GUARD_S) as client:
                return [await f(client, u) for u in urls for f in UNLISTED.values()]

        assert asyncio.run(unlisted()) == [True] * len(UNLISTED) * len(urls)
        filler.delete(*(f"filler:{i}" for i in range(n)))
        filler.config_set("maxmemory", "4mb")
        wait_until(lambda: all(broker(u) == "ok" for u in urls), timeout=60, what="Redis takes writes again")
        for owner in urls:
            listed_stream_on_every_replica(owner, urls)
    finally:
        stop_all(procs)
        server.stop()


def test_the_engine_probe_asks_the_engine_itself(engine: str, ipc_dir: Path) -> None:
    """``tokenfan probe`` (the engine container's probe): 0 when the engine answers a ping over its socket
    (no gateway runs here, no Redis), 1 when nothing answers."""
    import sys

    def probe(address: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tokenfan.cli", "probe", address, "--timeout", "5"],
                              capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)

    wait_until(lambda: probe(engine).returncode == 0, timeout=60, what="the engine answers the probe")
    assert "synthetic" in probe(engine).stdout
    gone = probe(f"ipc://{ipc_dir / 'no-engine.sock'}")
    assert gone.returncode == 1 and "no answer" in gone.stderr
