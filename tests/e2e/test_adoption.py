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
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from gateway.scaleout.workers import WORKER_INDEX_ENV, worker_socket
from tests.e2e.helpers import metric, wait_until
from tests.e2e.test_broker import RedisServer, redis_server  # noqa: F401  (the fixture)
from tests.procs import NO_CLIENT_LIMITS, Proc, spawn, start_engine, start_gateway, stop_all, wait_healthy
from tests.system import require
from tokenfan_bench.servers.processes import children, engine_child, free_port

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


async def sse_reader(c: httpx.AsyncClient, urls: list[str], sid: str, reader: Reader, started: asyncio.Event,
                     fold: Callable[[Reader, int, dict[str, Any]], None] = fold) -> None:
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


Controls = tuple[dict[int, str], dict[int, dict[str, Any]]]


def controls(url: str, chats: list[dict[str, Any]], responses: list[dict[str, Any]]) -> Controls:
    """The text of each chat body and the whole answer of each Responses body, run uninterrupted (all at once)."""
    async def run() -> Controls:
        async with httpx.AsyncClient(timeout=60) as c:
            return await acontrols(c, url, chats, responses)

    return asyncio.run(run())


async def acontrols(c: httpx.AsyncClient, url: str, chats: list[dict[str, Any]],
                    responses: list[dict[str, Any]]) -> Controls:
    """:func:`controls` on a client of the caller's: a scenario runs them on the gateway that lives on, beside
    its own streams (the synthetic engine's text depends on the prompt and the seed alone)."""
    chat = [c.post(url + "/v1/chat/completions", json={k: v for k, v in b.items() if k != "stream_options"})
            for b in chats]
    rs = await asyncio.gather(*chat, *(c.post(url + "/v1/responses", json=b) for b in responses))
    return ({i: r.json()["choices"][0]["message"]["content"] for i, r in enumerate(rs[:len(chats)])},
            {i: r.json() for i, r in enumerate(rs[len(chats):])})


def replicas(ipc_dir: Path, url: str, names: str, engine_args: tuple[str, ...] = ENGINE_ARGS,
             timeout: float = 30.0) -> tuple[Proc, list[tuple[Proc, str]]]:
    """One engine and a gateway replica per letter of ``names``, all on the broker at ``url``."""
    address = f"ipc://{ipc_dir / f'adopt-{names}.sock'}"
    engine = start_engine(address, *engine_args, name=f"engine-adopt-{names}")
    gateways = [start_gateway(address, "--broker", url, *LEASE, *NO_CLIENT_LIMITS, name=f"gateway-adopt-{k}",
                              timeout=timeout) for k in names]
    return engine, gateways


RESPONSE_END = ("response.completed", "response.incomplete", "error", "response.failed")


async def responses_reader(c: httpx.AsyncClient, urls: list[str], rid: str, got: list[dict[str, Any]],
                           started: asyncio.Event) -> None:
    """A background response read as the SDKs do (``GET /v1/responses/{id}?stream=true``): a dropped
    connection resumes with ``starting_after`` (here: on the next URL, a live replica)."""
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
                        if ev["type"] in RESPONSE_END:
                            return
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError):
            pass
        url = urls[-1]
        await asyncio.sleep(0.2)


def check_responses(seen: dict[str, list[dict[str, Any]]], want: dict[int, dict[str, Any]]) -> None:
    """Every Responses reader (``<i>/<where>``): each event once, the normal end, the control's text and usage."""
    for name, events in seen.items():
        control_ = want[int(name.split("/")[0])]
        text_ = "".join(part["text"] for item in control_["output"] for part in item.get("content", []))
        assert [e["sequence_number"] for e in events] == list(range(len(events))), name
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), (name, events[-1])
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == text_, (name, text, text_)
        assert events[-1]["response"]["usage"]["output_tokens"] == control_["usage"]["output_tokens"], name


BROWSER_READERS = """({ids, per}) => {
  window.readers = {};
  for (const [i, id] of ids) for (let k = 0; k < per; k++) {
    const r = window.readers[`${i}/browser-${k}`] = {seqs: [], text: "", ended: false, errors: [], opens: 0};
    const es = new EventSource(`/v1/streams/${id}/events`);
    es.onopen = () => { r.opens++; };
    es.onmessage = (e) => {
      if (e.data === "[DONE]") { r.ended = true; es.close(); return; }
      r.seqs.push(Number(e.lastEventId));
      for (const c of JSON.parse(e.data).choices || []) r.text += (c.delta && c.delta.content) || "";
    };
    es.addEventListener("error", (e) => { if (e.data !== undefined) { r.errors.push(e.data); es.close(); } });
  }
}"""


def test_ten_listed_streams_of_a_killed_replica_are_adopted_and_fifty_readers_get_every_event_once(
        ipc_dir: Path, redis_server: RedisServer, tmp_path: Path) -> None:  # noqa: F811
    """Replicas A and B on one engine and Redis, nginx in front of both (``deploy/nginx/tokenfan.conf``, both
    upstreams): 7 fan-out chat streams and 3 background responses created on A, 50 readers: SSE and
    WebSocket on B, SSE on A (reconnecting to B with ``Last-Event-ID`` when A dies), Responses readers on A
    and B (``starting_after``), and 14 EventSources in Chromium through nginx (spread over A and B; when A
    dies nginx sends their reconnects to B). A is killed with SIGKILL once every reader has its first events."""
    from playwright.async_api import async_playwright

    from gateway.http.certs import generate
    from tests.e2e.browser_fixtures import CHROMIUM, CHROMIUM_ARGS
    from tests.e2e.test_nginx import NGINX
    from tokenfan_bench.network.nginx import main_conf, site_conf

    require(CHROMIUM)
    require(NGINX)
    chats, responses, tokens = 7, 3, 100  # 5 s each at 20 tokens/s
    engine, gateways = replicas(ipc_dir, redis_server.url, "ab")
    (gw_a, url_a), (gw_b, url_b) = gateways
    generate(tmp_path / "tls")
    port = free_port()
    both = f"{url_a.removeprefix('http://')}; server {url_b.removeprefix('http://')}"  # nginx: two upstream servers
    (tmp_path / "tokenfan.conf").write_text(site_conf(port, both, tmp_path / "tls"))
    (tmp_path / "nginx.conf").write_text(main_conf(tmp_path, logs=True))
    nginx = subprocess.Popen([NGINX, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e",
                              str(tmp_path / "error.log")], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    proxy = f"https://localhost:{port}"
    chat_bodies = [body(i, max_tokens=tokens, stream_options={"include_usage": True}) for i in range(chats)]
    response_bodies = [{"input": f"tell me about rivers {i}", "max_output_tokens": tokens,
                        "metadata": {"seed": str(i)}} for i in range(responses)]
    try:
        async def scenario() -> tuple[dict[str, Reader], dict[str, list[dict[str, Any]]], Controls]:
            readers: dict[str, Reader] = {}
            seen: dict[str, list[dict[str, Any]]] = {}
            async with httpx.AsyncClient(timeout=60) as c, async_playwright() as pw:
                want = asyncio.ensure_future(acontrols(c, url_b, chat_bodies, response_bodies))
                browser = await pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                                   args=[*CHROMIUM_ARGS, "--ignore-certificate-errors"])
                page = await (await browser.new_context(ignore_https_errors=True)).new_page()
                await page.goto(proxy + "/")
                ids = []
                for b in chat_bodies:
                    r = await c.post(url_a + "/v1/streams", json=b)
                    assert r.status_code == 201, r.text
                    ids.append(r.json()["id"])
                rids = []
                for b in response_bodies:
                    r = await c.post(url_a + "/v1/responses", json={**b, "background": True, "store": True})
                    assert r.status_code == 200, r.text
                    rids.append(r.json()["id"])
                await page.evaluate(BROWSER_READERS, {"ids": list(enumerate(ids)), "per": 2})
                jobs, started = [], []
                for i, sid in enumerate(ids):
                    for where, urls in (("a", [url_a, url_b]), ("b", [url_b])):
                        reader = readers[f"{i}/sse-{where}"] = Reader()
                        ev = asyncio.Event()
                        started.append(ev)
                        jobs.append(sse_reader(c, urls, sid, reader, ev))
                    ws = readers[f"{i}/ws-b"] = Reader()
                    jobs.append(ws_reader(url_b, sid, ws))
                for i, rid in enumerate(rids):
                    for where, urls in (("a0", [url_a, url_b]), ("a1", [url_a, url_b]), ("b0", [url_b]),
                                        ("b1", [url_b]), ("b2", [url_b])):
                        got = seen[f"{i}/{where}"] = []
                        ev = asyncio.Event()
                        started.append(ev)
                        jobs.append(responses_reader(c, urls, rid, got, ev))
                await page.wait_for_function("Object.values(window.readers).every((r) => r.seqs.length >= 3)",
                                             timeout=30_000)
                await until_killed(jobs, started, lambda: os.kill(gw_a.popen.pid, signal.SIGKILL))
                await page.wait_for_function(
                    "Object.values(window.readers).every((r) => r.ended || r.errors.length)", timeout=60_000)
                for name, r in (await page.evaluate("window.readers")).items():
                    readers[name] = Reader(seqs=r["seqs"], text=r["text"], ended=r["ended"], errors=r["errors"],
                                           reconnects=r["opens"] - 1)
                await browser.close()
                return readers, seen, await want

        readers, seen, (texts, answers) = asyncio.run(scenario())
        assert len(readers) + len(seen) == 50
        check(readers, texts)
        check_responses(seen, answers)
        assert sum(r.reconnects for name, r in readers.items() if "sse-a" in name) >= chats
        assert sum(r.reconnects for name, r in readers.items() if "browser" in name) >= 1  # some were on A
        assert metric(url_b, "tokenfan_adoptions_total", {"outcome": "adopted"}) == chats + responses
        assert metric(url_b, "tokenfan_adoption_gap_seconds_count") == chats + responses
        assert "adopted stream" in gw_b.log()
    finally:
        nginx.terminate()
        nginx.wait(10)
        stop_all([engine, *(g for g, _ in gateways)])


def test_two_replicas_racing_to_adopt_exactly_one_continues_each_stream(
        ipc_dir: Path, redis_server: RedisServer) -> None:  # noqa: F811
    n = 4
    engine, gateways = replicas(ipc_dir, redis_server.url, "xyz")
    (gw_x, url_x), (_, url_y), (_, url_z) = gateways
    try:
        async def scenario() -> tuple[dict[str, Reader], Controls]:
            readers: dict[str, Reader] = {}
            async with httpx.AsyncClient(timeout=60) as c:
                bodies = [body(10 + i) for i in range(n)]
                want = asyncio.ensure_future(acontrols(c, url_y, bodies, []))
                jobs, started = [], []
                for i, b in enumerate(bodies):
                    r = await c.post(url_x + "/v1/streams", json=b)
                    sid = r.json()["id"]
                    for where, url in (("y", url_y), ("z", url_z)):
                        reader = readers[f"{i}/{where}"] = Reader()
                        ev = asyncio.Event()
                        started.append(ev)
                        jobs.append(sse_reader(c, [url], sid, reader, ev))
                await until_killed(jobs, started, lambda: os.kill(gw_x.popen.pid, signal.SIGKILL))
                return readers, await want

        readers, (texts, _) = asyncio.run(scenario())
        check(readers, texts)
        adopted = [metric(u, "tokenfan_adoptions_total", {"outcome": "adopted"}) for u in (url_y, url_z)]
        elsewhere = [metric(u, "tokenfan_adoptions_total", {"outcome": "elsewhere"}) for u in (url_y, url_z)]
        assert sum(adopted) == n and sum(elsewhere) <= n, (adopted, elsewhere)
    finally:
        stop_all([engine, *(g for g, _ in gateways)])


def test_sigterm_hands_the_streams_over_and_exits_at_once(ipc_dir: Path, redis_server: RedisServer) -> None:  # noqa: F811
    """A rolling restart: SIGTERM the owner while its streams need nearly 4 s more. It exits within 2 s; its
    readers, reconnecting to B, and B's readers get every event once, the normal end, the control text."""
    n, tokens = 3, 400  # 4 s at 100 tokens/s: well over the 2 s A gets to exit
    engine, gateways = replicas(ipc_dir, redis_server.url, "st", ("--engine", "synthetic", "--synthetic-tokens-per-s",
                                                                  "100", "--synthetic-ttft-ms", "5"))
    (gw_a, url_a), (_, url_b) = gateways
    exit_s: list[float] = []
    try:
        async def scenario() -> tuple[dict[str, Reader], Controls]:
            readers: dict[str, Reader] = {}
            async with httpx.AsyncClient(timeout=60) as c:
                bodies = [{**body(20 + i), "max_tokens": tokens} for i in range(n)]
                want = asyncio.ensure_future(acontrols(c, url_b, bodies, []))
                jobs, started = [], []
                for i, b in enumerate(bodies):
                    r = await c.post(url_a + "/v1/streams", json=b)
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
                return readers, await want

        readers, (texts, _) = asyncio.run(scenario())
        assert exit_s[0] < 2.0, exit_s

        check(readers, texts)
        assert metric(url_b, "tokenfan_adoptions_total", {"outcome": "adopted"}) == n
        assert "handed 3 listed streams over" in gw_a.log()
    finally:
        stop_all([engine, *(g for g, _ in gateways)])


def _worker_pid(server: Proc, index: int) -> int:
    """The pid of gateway worker ``index`` of a ``--workers`` server."""
    (pid,) = [c.pid for c in children(server.popen.pid) if c.has_env(WORKER_INDEX_ENV, str(index))]
    return pid


@pytest.mark.parametrize("broker", [False, True], ids=["peers", "broker"])
def test_the_owning_worker_of_a_workers_server_is_killed_and_its_streams_go_on(
        redis_server: RedisServer, broker: bool) -> None:  # noqa: F811
    """``tokenfan serve --workers 2`` (the workers alone: worker 1 holds a standby of each stream; or with
    ``--broker``): 4 fan-out streams and a background response created on worker 0 (its private socket),
    read on the public port (the kernel spreads the readers over both workers); worker 0 is killed. The
    engine and worker 1 live on, worker 0 is started again, the readers reconnect to the same port: each
    gets every event once and the control text; worker 1 adopted the 5 streams."""
    chats, port = 4, free_port()
    url = f"http://127.0.0.1:{port}"
    scaleout = ("--broker", redis_server.url, *LEASE) if broker else ("--broker-lease-interval", "0.2")
    server = spawn(["-m", "tokenfan.cli", "serve", *ENGINE_ARGS, "--workers", "2", *scaleout, *NO_CLIENT_LIMITS,
                    "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"], "serve-adopt-workers")
    request = {"input": "tell me about rivers", "max_output_tokens": TOKENS, "metadata": {"seed": "1"}}
    try:
        wait_healthy(url, server, 60)
        wait_until(lambda: httpx.get(url + "/health").json()["workers"]["ready"] == 2, timeout=60,
                   what="both workers serving")
        engine_pid, worker0 = server_children(server)
        owner = httpx.AsyncHTTPTransport(uds=str(worker_socket(port, 0)))

        async def scenario() -> tuple[dict[str, Reader], dict[str, list[dict[str, Any]]]]:
            readers: dict[str, Reader] = {}
            seen: dict[str, list[dict[str, Any]]] = {}
            async with httpx.AsyncClient(timeout=60) as c, httpx.AsyncClient(transport=owner, timeout=60) as w0:
                ids = []
                for i in range(chats):
                    r = await w0.post("http://worker/v1/streams", json=body(30 + i))
                    assert r.status_code == 201, r.text
                    ids.append(r.json()["id"])
                r = await w0.post("http://worker/v1/responses", json={**request, "background": True, "store": True})
                rid = r.json()["id"]
                jobs, started = [], []
                for i, sid in enumerate(ids):
                    for k in range(3):
                        reader = readers[f"{i}/sse-{k}"] = Reader()
                        ev = asyncio.Event()
                        started.append(ev)
                        jobs.append(sse_reader(c, [url], sid, reader, ev))
                for k in range(3):
                    got = seen[f"0/{k}"] = []
                    ev = asyncio.Event()
                    started.append(ev)
                    jobs.append(responses_reader(c, [url], rid, got, ev))
                await until_killed(jobs, started, lambda: os.kill(worker0, signal.SIGKILL))
            return readers, seen

        readers, seen = asyncio.run(scenario())
        texts, answers = controls(url, [body(30 + i) for i in range(chats)], [request])
        check(readers, texts)
        check_responses(seen, answers)
        wait_until(lambda: _worker_pid(server, 0) != worker0, timeout=30, what="worker 0 started again")
        assert server_children(server)[0] == engine_pid  # the engine lived on
        assert metric(url, "tokenfan_adoptions_total", {"outcome": "adopted"}) == chats + 1  # merged over workers
        assert "gateway worker 0 exited with -9; restarting" in server.log()
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def server_children(server: Proc) -> tuple[int, int]:
    """(the engine's pid, worker 0's pid) under a ``tokenfan serve --workers`` process."""
    return engine_child(server.popen.pid), _worker_pid(server, 0)


def test_sigterm_with_nobody_to_hand_over_to_drains_the_streams_here(
        ipc_dir: Path, redis_server: RedisServer) -> None:  # noqa: F811
    """``--handover`` with no other gateway serving: SIGTERM drains the listed streams (they end normally
    within ``--shutdown-grace``) instead of handing them to nobody."""
    engine, [(gw, url)] = replicas(ipc_dir, redis_server.url, "l")
    try:
        async def scenario() -> Reader:
            async with httpx.AsyncClient(timeout=60) as c:
                sid = (await c.post(url + "/v1/streams", json=body(40))).json()["id"]
                reader, ev = Reader(), asyncio.Event()
                job = asyncio.ensure_future(sse_reader(c, [url], sid, reader, ev))
                await asyncio.wait_for(ev.wait(), 30)
                gw.popen.send_signal(signal.SIGTERM)
                await asyncio.wait_for(job, 30)
                return reader

        reader = asyncio.run(scenario())
        assert gw.popen.wait(30) == 0
        assert reader.ended and not reader.errors and reader.seqs == list(range(len(reader.seqs)))
        assert len(reader.text) > 0 and "handed" not in gw.log()
    finally:
        stop_all([engine, gw])


def test_an_orphan_nobody_adopts_is_aborted_in_the_engine_at_the_end_of_the_grace(ipc_dir: Path) -> None:
    """No broker, no sibling: gateway A's listed stream cannot be adopted. A killed, the engine keeps it for
    ``--gateway-grace`` (1 s here) and then aborts it: gateway B, on the same engine, sees it run nothing."""
    address = f"ipc://{ipc_dir / 'adopt-orphan.sock'}"
    engine = start_engine(address, *ENGINE_ARGS, "--gateway-grace", "1", name="engine-adopt-orphan")
    (gw_a, url_a), (gw_b, url_b) = (start_gateway(address, name=f"gateway-orphan-{k}") for k in "ab")
    try:
        r = httpx.post(url_a + "/v1/streams", json=body(50, max_tokens=2000))  # 100 s of tokens
        assert r.status_code == 201, r.text

        def running() -> int:
            return int(httpx.get(url_b + "/health").json()["engine"]["running"])

        wait_until(lambda: running() == 1, timeout=10, what="the engine runs A's stream")
        os.kill(gw_a.popen.pid, signal.SIGKILL)
        wait_until(lambda: running() == 0, timeout=10, what="the orphan aborted")
        assert "aborting 1 requests" in engine.log()
    finally:
        stop_all([engine, gw_a, gw_b])
