"""The Redis broker under faults, with a real ``redis-server`` on loopback.

Two layers:
- in-process: two or three :class:`Broker` + :class:`StreamHub` pairs (one per "replica") in one event
  loop, with Redis killed and restarted under them: quiet gaps, restarts without persistence, lost
  records, a dead owner, truthful cancels, eviction;
- end to end: real engine and gateway processes: the owning gateway killed, Redis down for 6 s, an
  8 s time to first token, and the scale-out basics (resume on another replica, DELETE, restart).

Assertions that depend on the routes (not on gateway/scaleout/broker.py) say so in a comment.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import websockets

from gateway.config import BrokerTimings
from gateway.core import sse
from gateway.core.streams import ChunkEvent, Retention, Stream, StreamHub
from gateway.errors import APIError
from gateway.scaleout import broker_codec as codec
from gateway.scaleout.broker import Broker
from tests.e2e.helpers import chunk_text, event_dict, sse_events, wait_until
from tests.procs import start_engine, start_gateway
from tests.system import require
from tokenfan_bench.servers.processes import Proc, free_port


@pytest.fixture(autouse=True, scope="module")
def _redis_server_installed() -> None:
    require("redis-server")


class RedisServer:
    """A ``redis-server`` without persistence that a test can kill and start again on the same port."""

    start_timeout = 10.0

    def __init__(self, workdir: Path, *args: str) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.args = args  # more redis-server options (``--maxmemory 4mb`` …)
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir), *self.args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self.ping, timeout=self.start_timeout, what="redis up")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def ping(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.terminate()
            server.proc.wait(10)


# -- in-process: brokers in one event loop ---------------------------------------------------------

FAST = BrokerTimings(op_timeout=0.5, block=0.5, backoff_max=0.3, lease_interval=0.2, lease_ttl=0.6,
                     cancel_timeout=2.0)


class Replica:
    """What one gateway holds for fan-out: a hub and its broker."""

    def __init__(self, url: str, *, idle: float = 5.0, ttl: float = 60.0, timings: BrokerTimings = FAST) -> None:
        self.hub = StreamHub(Retention(finished_ttl=ttl))
        self.broker = Broker(url, self.hub, idle_timeout=idle, local_cancel=self.cancel_local, timings=timings)

    def cancel_local(self, stream_id: str) -> bool:
        s = self.hub.streams.get(stream_id)
        if s is None or s.mirrored or s.finished or s.task is None or s.task.done():
            return False
        s.task.cancel()
        return True

    async def own(self) -> Stream:
        s = self.hub.create("completions", "m")
        await self.broker.created(s)
        return s

    def emit(self, s: Stream, *texts: str) -> None:
        for text in texts:
            self.broker.published(s, s.publish(ChunkEvent({"choices": [{"index": 0, "text": text}]}, 0, text, 1)))

    def end(self, s: Stream, state: Any = "done", error: APIError | None = None) -> None:
        s.finish(state, error)
        self.broker.ended(s)
        self.hub.mark_finished(s)


async def finished(s: Stream, timeout: float) -> Stream:
    deadline = time.monotonic() + timeout
    while not s.finished:
        assert time.monotonic() < deadline, f"stream {s.id} still {s.state} with {len(s.events)} events"
        await asyncio.sleep(0.02)
    return s


def texts(s: Stream) -> list[str]:
    return [e.text for e in s.events]


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_a_mirror_survives_quiet_gaps_longer_than_its_block_socket_and_idle_timeouts(
        redis_server: RedisServer) -> None:
    async def main() -> None:
        a, b = Replica(redis_server.url), Replica(redis_server.url, idle=1.0)
        await a.broker.start()
        await b.broker.start()
        s = await a.own()
        m = await b.broker.mirror(s.id)
        await asyncio.sleep(3.0)  # 6 blocks, 3 idle timeouts: the owner's lease says it is alive
        assert not m.finished
        a.emit(s, *[f"t{i}" for i in range(5)])
        a.end(s)
        await finished(m, 5)
        assert m.state == "done" and texts(m) == texts(s)
        await a.broker.close()
        await b.broker.close()

    run(main())


def test_a_stale_owners_writes_are_refused_by_their_epoch_and_it_gives_the_stream_up(
        redis_server: RedisServer) -> None:
    """Fencing: B takes the stream over from A's epoch (as an adoption does); exactly one claim of that epoch
    succeeds; A's next write is refused by Redis, never interleaved: A drops what Redis did not take (its
    readers never saw it) and forgets the stream."""
    async def main() -> None:
        a, b, c = Replica(redis_server.url), Replica(redis_server.url), Replica(redis_server.url)
        for r in (a, b, c):
            await r.broker.start()
        s = await a.own()
        s.gated = True
        a.emit(s, "x0", "x1")
        while len(s.events) < 2:  # committed: Redis holds them
            await asyncio.sleep(0.01)
        first = redis_server.client().xrange(codec.stream_key(s.id), count=1)[0][1]
        header = codec.decode(first)
        assert isinstance(header, codec.Header) and header.epoch == 1 and header.owner == a.broker.gateway_id
        taken, lost = Stream(s.id, "completions", "m"), Stream(s.id, "completions", "m")
        assert await b.broker.claim(taken, header) and taken.epoch == 2
        assert not await c.broker.claim(lost, header)  # one claim per epoch
        a.emit(s, "late")
        deadline = time.monotonic() + 5
        while s.id in a.hub.streams:
            assert time.monotonic() < deadline, "A never gave the stream up"
            await asyncio.sleep(0.01)
        assert s.state == "moved" and texts(s) == ["x0", "x1"] and s.pending == []
        records = [codec.decode(f) for _, f in redis_server.client().xrange(codec.stream_key(s.id))]
        assert [e.text for e in records if isinstance(e, codec.EventEntry)] == ["x0", "x1"]
        for r in (a, b, c):
            await r.broker.close()

    run(main())


def test_a_redis_restart_without_persistence_loses_nothing_and_new_work_gets_503_meanwhile(
        redis_server: RedisServer) -> None:
    async def main() -> None:
        a, b = Replica(redis_server.url), Replica(redis_server.url)
        await a.broker.start()
        await b.broker.start()
        s = await a.own()
        quiet = await a.own()  # no event before, during or right after the outage (a slow prefill)
        a.emit(s, *[f"a{i}" for i in range(10)])
        m = await b.broker.mirror(s.id)
        while len(m.events) < 10:
            await asyncio.sleep(0.02)

        redis_server.kill()
        a.emit(s, *[f"b{i}" for i in range(10)])  # the owner's readers are not affected
        for attempt in (a.broker.created(Stream("str-new", "completions", "m")), b.broker.mirror(quiet.id),
                        b.broker.cancel_remote(s.id)):
            with pytest.raises(APIError) as exc:
                await attempt
            assert exc.value.status == 503 and exc.value.code == "broker_unavailable"
            assert exc.value.retry_after
        await asyncio.sleep(1.5)
        redis_server.start()  # same port, empty

        a.emit(s, *[f"c{i}" for i in range(10)])
        a.end(s)
        await finished(m, 10)
        assert m.state == "done" and texts(m) == texts(s) and len(m.events) == 30

        c = Replica(redis_server.url)
        await c.broker.start()
        late = await c.broker.mirror(s.id)  # a mirror built after the restart gets everything too
        await finished(late, 5)
        assert late.state == "done" and texts(late) == texts(s)

        # The quiet stream was rewritten by its owner (lease lost -> repair), so it is found again.
        deadline = time.monotonic() + 5
        while True:
            try:
                mq = await c.broker.mirror(quiet.id)
                break
            except APIError as exc:
                assert exc.status == 404 and time.monotonic() < deadline
                await asyncio.sleep(0.1)
        a.emit(quiet, "x", "y")
        a.end(quiet)
        await finished(mq, 5)
        assert mq.state == "done" and texts(mq) == ["x", "y"]
        for r in (a, b, c):
            await r.broker.close()

    run(main())


def test_a_burst_beyond_max_pending_is_written_from_the_owners_log(redis_server: RedisServer) -> None:
    async def main() -> None:
        a = Replica(redis_server.url, timings=BrokerTimings(max_pending=4))
        b = Replica(redis_server.url)
        await a.broker.start()
        await b.broker.start()
        s = await a.own()
        a.emit(s, *[f"t{i}" for i in range(50)])
        a.end(s)
        m = await finished(await b.broker.mirror(s.id), 5)
        assert m.state == "done" and texts(m) == texts(s)
        await a.broker.close()
        await b.broker.close()

    run(main())


def test_missing_records_are_explicit_errors_never_a_normal_end(redis_server: RedisServer) -> None:
    r: Any = redis_server.client()
    ev = [codec.encode_event(i, {"choices": [{"index": 0, "text": str(i)}]}, str(i), None) for i in range(3)]
    header = codec.encode_header("completions", "m", "")
    r.xadd(codec.stream_key("str-headless"), ev[0])
    for f in (header, ev[0], ev[2]):
        r.xadd(codec.stream_key("str-hole"), f)
    for f in (header, ev[0], codec.encode_end("done", 3, None)):
        r.xadd(codec.stream_key("str-short"), f)
    for f in (header, ev[0], {b"something": b"else"}):
        r.xadd(codec.stream_key("str-garbage"), f)
    r.set(codec.known_key("str-expired"), b"1")

    async def main() -> None:
        b = Replica(redis_server.url)
        await b.broker.start()
        for sid, status, code in (("str-headless", 410, "stream_lost"), ("str-expired", 410, "stream_expired"),
                                  ("str-never", 404, "stream_not_found")):
            with pytest.raises(APIError) as exc:
                await b.broker.mirror(sid)
            assert (exc.value.status, exc.value.code) == (status, code)
        for sid in ("str-hole", "str-short", "str-garbage"):
            m = await finished(await b.broker.mirror(sid), 5)
            assert m.state == "error" and m.error is not None and m.error.code == "stream_lost", sid
            assert texts(m) == ["0"]
        await b.broker.close()

    run(main())


def test_a_dead_owner_ends_its_mirrors_with_owner_lost_and_later_readers_learn_it_at_once(
        redis_server: RedisServer) -> None:
    async def main() -> None:
        a, b, c = Replica(redis_server.url), Replica(redis_server.url, idle=0.5), Replica(redis_server.url, idle=30)
        for x in (a, b, c):
            await x.broker.start()
        s = await a.own()
        a.emit(s, "a", "b", "c")
        m = await b.broker.mirror(s.id)
        await a.broker.close()  # the owner is gone: no end, no lease
        await finished(m, 5)
        assert m.state == "error" and m.error is not None and m.error.code == "owner_lost" and len(m.events) == 3
        t0 = time.monotonic()
        later = await finished(await c.broker.mirror(s.id), 5)  # long idle timeout: the end is in Redis
        assert later.error is not None and later.error.code == "owner_lost" and texts(later) == ["a", "b", "c"]
        assert time.monotonic() - t0 < 5
        await b.broker.close()
        await c.broker.close()

    run(main())


def test_cancel_remote_is_true_only_when_the_owner_cancelled_even_after_a_redis_restart(
        redis_server: RedisServer) -> None:
    async def main() -> None:
        a, b = Replica(redis_server.url), Replica(redis_server.url)
        await a.broker.start()
        await b.broker.start()
        s = await a.own()
        s.task = asyncio.create_task(asyncio.sleep(3600))
        m = await b.broker.mirror(s.id)
        assert await b.broker.cancel_remote("str-nobody-has") is False
        redis_server.kill()
        await asyncio.sleep(0.5)
        redis_server.start()
        assert await b.broker.cancel_remote(s.id) is True  # the owner's listener resubscribed by itself
        await asyncio.sleep(0)
        assert s.task.cancelled()
        a.end(s, "cancelled")
        await finished(m, 5)
        assert m.state == "cancelled"
        assert await b.broker.cancel_remote(s.id) is False  # ended: nobody holds it any more
        await a.broker.close()
        await b.broker.close()

    run(main())


def test_every_mirror_exit_finishes_the_stream_so_eviction_goes_on(redis_server: RedisServer) -> None:
    async def main() -> None:
        a, b = Replica(redis_server.url), Replica(redis_server.url, ttl=0.1)
        await a.broker.start()
        await b.broker.start()
        s1, s2 = await a.own(), await a.own()
        m1, m2 = await b.broker.mirror(s1.id), await b.broker.mirror(s2.id)
        assert m1.task is not None and m2.task is not None
        m1.task.cancel()  # before its feed ever ran
        await asyncio.sleep(0.3)
        m2.task.cancel()  # while it waits in XREAD
        await asyncio.gather(m1.task, m2.task, return_exceptions=True)
        await asyncio.sleep(0)  # the done callbacks
        for m in (m1, m2):
            assert m.state == "error" and m.error is not None and m.error.code == "mirror_closed"
        await asyncio.sleep(0.2)
        b.hub.check_capacity()  # evicts what is due
        assert s1.id not in b.hub.streams and s2.id not in b.hub.streams
        await a.broker.close()
        await b.broker.close()

    run(main())


# -- end to end: engine and gateway processes ------------------------------------------------------


def stream_text(events: list[dict[str, str]]) -> tuple[str, list[int]]:
    evs = [e for e in events if "id" in e]
    return "".join(chunk_text(json.loads(e["data"])) for e in evs), [int(e["id"]) for e in evs]


async def sse_reader(url: str, out: list[dict[str, str]], timeout: float = 120) -> None:
    """Collect every SSE event of ``url`` into ``out`` until the response ends."""
    async with httpx.AsyncClient(timeout=timeout) as client, client.stream("GET", url) as r:
        assert r.status_code == 200, r.status_code
        decoder = sse.SseDecoder()
        async for data in r.aiter_bytes():
            out.extend(event_dict(ev) for ev in decoder.feed(data))


async def ws_reader(url: str, out: list[dict[str, Any]]) -> int | None:
    """Collect every WS message of ``url`` into ``out``; the close code (1006: no close frame)."""
    async with websockets.connect(url, open_timeout=10, close_timeout=5) as ws:
        try:
            async for msg in ws:
                out.append(json.loads(msg))
        except websockets.ConnectionClosedError:
            pass
        return ws.close_code


def ws_text(msgs: list[dict[str, Any]]) -> tuple[str, list[int]]:
    chunks = [m for m in msgs if m.get("type") == "chunk"]
    return "".join(chunk_text(m["data"]) for m in chunks), [m["seq"] for m in chunks]


def ws_url(http_url: str, sid: str, after: int | None = None) -> str:
    q = "" if after is None else f"?after={after}"
    return "ws" + http_url[4:] + f"/v1/streams/{sid}/ws{q}"


def sse_error_code(events: list[dict[str, str]]) -> str | None:
    last = events[-1] if events else {}
    return json.loads(last["data"])["error"]["code"] if last.get("event") == "error" else None


@pytest.fixture
def engine_addr(ipc_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, list[str]]]:
    """(address, extra engine args) holder: the test starts the engine itself via start()."""
    yield f"ipc://{ipc_dir / f'bk-{request.node.name[:40]}.sock'}", []


class Cluster:
    """One engine and two gateways on one Redis."""

    def __init__(self, ipc_dir: Path, name: str, redis_url: str, engine_args: list[str],
                 gateway_args: list[str]) -> None:
        self.addr = f"ipc://{ipc_dir / f'{name}.sock'}"
        self.name = name
        self.common = ["--broker", redis_url, "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2",
                       *gateway_args]
        self.procs: list[Proc] = []
        self.procs.append(start_engine(self.addr, "--engine", "synthetic", *engine_args, name=f"engine-{name}"))
        self.a, self.url_a = self.gateway("a")
        self.b, self.url_b = self.gateway("b")

    def gateway(self, tag: str) -> tuple[Proc, str]:
        proc, url = start_gateway(self.addr, *self.common, name=f"gateway-{self.name}-{tag}")
        self.procs.append(proc)
        return proc, url

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def create(url: str, max_tokens: int) -> dict[str, Any]:
    r = httpx.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "x", "max_tokens": max_tokens},
                   timeout=30)
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def full_text(url: str, sid: str) -> tuple[str, list[int], list[dict[str, str]]]:
    events = sse_events(httpx.get(f"{url}/v1/streams/{sid}/events", timeout=120).text)
    text, ids = stream_text(events)
    return text, ids, events


def test_when_the_owner_gateway_and_the_engine_die_mirrored_readers_get_owner_lost_within_the_lease(
        ipc_dir: Path, redis_server: RedisServer) -> None:
    """Nobody can adopt the stream (the one engine died with its gateway; tests/e2e/test_adoption.py has the
    case where a replica does): B's readers get ``owner_lost`` once the owner's lease expired, not after
    ``--broker-idle-timeout`` (60 s here) of silence."""
    c = Cluster(ipc_dir, "bk-kill", redis_server.url, ["--synthetic-tokens-per-s", "20"],
                ["--broker-idle-timeout", "60", "--stream-ttl", "1", "--migration-wait", "1"])
    try:
        sid = create(c.url_a, 400)["id"]  # 20 s of tokens
        sse: list[dict[str, str]] = []
        ws: list[dict[str, Any]] = []

        async def main() -> int | None:
            readers = [asyncio.create_task(sse_reader(f"{c.url_b}/v1/streams/{sid}/events", sse)),
                       asyncio.create_task(ws_reader(ws_url(c.url_b, sid), ws))]
            while len(stream_text(sse)[1]) < 5 or len(ws_text(ws)[1]) < 5:
                await asyncio.sleep(0.05)
            c.procs[0].stop(signal.SIGKILL)  # the engine
            c.a.stop(signal.SIGKILL)
            t0 = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*readers), 30)  # a hang guard, not a timing check
            print(f"\n[figure] owner and engine killed: B's SSE and WS readers got owner_lost "
                  f"{time.monotonic() - t0:.2f}s after SIGKILL (--broker-lease-ttl 2)")
            return readers[1].result()

        close_code = asyncio.run(main())
        assert sse_error_code(sse) == "owner_lost" and all(e.get("data") != "[DONE]" for e in sse)
        assert ws[-1]["type"] == "error" and ws[-1]["error"]["code"] == "owner_lost" and close_code == 1011
        assert stream_text(sse)[1] == list(range(len(stream_text(sse)[1])))
        # The failed mirror does not block eviction: past --stream-ttl the id answers 410 on B.
        wait_until(lambda: httpx.get(f"{c.url_b}/v1/streams/{sid}").status_code == 410, timeout=10,
                   what="the lost stream expired on B")
    finally:
        c.stop()


OUTAGE_S = 6  # longer than every broker clock the gateways run with (block, op timeout, lease TTL: 2 s)


def test_a_redis_outage_never_hangs_a_reader_nor_ends_a_stream_it_did_not_see_end(
        ipc_dir: Path, redis_server: RedisServer) -> None:
    c = Cluster(ipc_dir, "bk-outage", redis_server.url, ["--synthetic-tokens-per-s", "50"], [])
    try:
        short = create(c.url_a, 20)["id"]
        long_ = create(c.url_a, 2000)["id"]  # still running after the outage: cancelled from B then
        main_id = create(c.url_a, 500)["id"]  # 10 s of tokens: spans the outage
        sse: list[dict[str, str]] = []
        ws: list[dict[str, Any]] = []

        async def during_outage() -> None:
            # Subscribing on B to a stream B does not hold: 503 + Retry-After, never a 500 or an empty 200.
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.get(f"{c.url_b}/v1/streams/{short}/events")
            assert r.status_code == 503 and r.headers.get("retry-after")
            assert r.json()["error"]["code"] == "broker_unavailable"
            # WebSocket: an error message, then a real close frame (not an abnormal 1006).
            msgs: list[dict[str, Any]] = []
            code = await ws_reader(ws_url(c.url_b, short), msgs)
            assert msgs and msgs[-1]["type"] == "error" and msgs[-1]["error"]["code"] == "broker_unavailable"
            assert code is not None and code != 1006
            # Creating a stream: 503 broker_unavailable, not handed out unannounced.
            # [call site: create_stream maps Broker.created()'s APIError to the response]
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(f"{c.url_a}/v1/streams",
                                      json={"endpoint": "completions", "prompt": "x", "max_tokens": 3})
            assert r.status_code == 503 and r.json()["error"]["code"] == "broker_unavailable"
            assert r.headers.get("retry-after")

        async def main() -> int | None:
            readers = [asyncio.create_task(sse_reader(f"{c.url_b}/v1/streams/{main_id}/events", sse)),
                       asyncio.create_task(ws_reader(ws_url(c.url_b, main_id), ws))]
            while len(stream_text(sse)[1]) < 20 or len(ws_text(ws)[1]) < 20:
                await asyncio.sleep(0.05)
            redis_server.kill()
            t_kill = time.monotonic()
            await during_outage()
            assert not any(t.done() for t in readers), "a mirrored reader ended during the outage"
            await asyncio.sleep(OUTAGE_S - (time.monotonic() - t_kill))
            held = len(stream_text(sse)[1])
            redis_server.start()  # same port, empty: the owner rewrites its streams
            t_up = time.monotonic()
            while len(stream_text(sse)[1]) == held and not readers[0].done():
                await asyncio.sleep(0.01)
            resumed = time.monotonic() - t_up
            await asyncio.wait_for(asyncio.gather(*readers), 60)
            print(f"\n[figure] Redis down {OUTAGE_S} s: B's readers held {held} events, resumed {resumed:.2f}s after "
                  f"Redis was back, and completed ({len(stream_text(sse)[1])} events)")
            return readers[1].result()

        close_code = asyncio.run(main())
        want_text, want_ids, want = full_text(c.url_a, main_id)
        assert want[-1]["data"] == "[DONE]" and want_ids == list(range(len(want_ids)))
        assert stream_text(sse) == (want_text, want_ids) and sse[-1]["data"] == "[DONE]"
        assert ws_text(ws) == (want_text, want_ids) and ws[-1] == {"type": "done"} and close_code == 1000

        # A stream that finished before the outage is served by B after it (its owner rewrote it).
        text_a, ids_a, _ = full_text(c.url_a, short)
        wait_until(lambda: httpx.get(f"{c.url_b}/v1/streams/{short}").status_code == 200, timeout=10,
                   what="the owner rewrote its finished stream")
        text_b, ids_b, events_b = full_text(c.url_b, short)
        assert (text_b, ids_b) == (text_a, ids_a) and ids_a and events_b[-1]["data"] == "[DONE]"

        # DELETE from B after the restart reaches the owner (its cancel listener resubscribed).
        r = httpx.delete(f"{c.url_b}/v1/streams/{long_}", timeout=15)
        assert r.status_code == 200 and r.json()["state"] == "cancelled"
        assert r.json()["deleted"] is True  # [call site: DELETE answers `deleted: <cancel_remote result>`]
        assert httpx.get(f"{c.url_a}/v1/streams/{long_}").json()["state"] == "cancelled"
    finally:
        c.stop()


def test_an_8s_time_to_first_token_reaches_every_reader_on_the_mirroring_replica(
        ipc_dir: Path, redis_server: RedisServer) -> None:
    # --broker-idle-timeout 3 < 8 s: a quiet gap longer than the idle timeout is fine while the owner lives.
    c = Cluster(ipc_dir, "bk-ttft", redis_server.url, ["--synthetic-ttft-ms", "8000", "--synthetic-tokens-per-s",
                                                         "50"], ["--broker-idle-timeout", "3"])
    try:
        sid = create(c.url_a, 50)["id"]
        on_a: list[dict[str, str]] = []
        sse: list[dict[str, str]] = []
        late: list[dict[str, str]] = []
        ws: list[dict[str, Any]] = []

        async def main() -> int | None:
            readers = [asyncio.create_task(sse_reader(f"{c.url_a}/v1/streams/{sid}/events", on_a)),
                       asyncio.create_task(sse_reader(f"{c.url_b}/v1/streams/{sid}/events", sse)),
                       asyncio.create_task(ws_reader(ws_url(c.url_b, sid), ws))]
            t0 = time.monotonic()
            await asyncio.sleep(5)  # a late joiner in the middle of the gap
            readers.append(asyncio.create_task(sse_reader(f"{c.url_b}/v1/streams/{sid}/events", late)))
            first: dict[str, float] = {}
            while len(first) < 3 and not all(r.done() for r in readers):
                for name, evs in (("A", on_a), ("B", sse), ("B late", late)):
                    if name not in first and stream_text(evs)[1]:
                        first[name] = time.monotonic() - t0
                await asyncio.sleep(0.005)
            await asyncio.wait_for(asyncio.gather(*readers), 40)
            print("\n[figure] 8 s time to first token: first event " +
                  ", ".join(f"{k} {v:.2f}s" for k, v in first.items()) + " after the readers connected")
            return readers[2].result()

        close_code = asyncio.run(main())
        want = stream_text(on_a)
        # A's reader reached the end of the log (a loaded box may merge a lagging reader's events: count seqs)
        status = httpx.get(f"{c.url_a}/v1/streams/{sid}").json()
        assert status["state"] == "done" and want[1][-1] == status["events"] - 1 and on_a[-1]["data"] == "[DONE]"
        assert len(want[0]) > 100
        # every token on every reader (ids may differ where a lagging reader got events merged)
        for got in (stream_text(sse), stream_text(late), ws_text(ws)):
            assert got[0] == want[0] and got[1][-1] == want[1][-1]
        assert sse[-1]["data"] == "[DONE]" and late[-1]["data"] == "[DONE]"
        assert ws[-1] == {"type": "done"} and close_code == 1000
    finally:
        c.stop()


def test_two_engines_two_gateways_one_broker(ipc_dir: Path, redis_server: RedisServer) -> None:
    redis_url = redis_server.url
    engines_addr = [f"ipc://{ipc_dir / f'bk-{i}.sock'}" for i in range(2)]
    engines = [start_engine(a, "--engine", "synthetic", "--synthetic-tokens-per-s", "40", name=f"engine-bk{i}")
               for i, a in enumerate(engines_addr)]
    common = ["--engine-address", engines_addr[1], "--broker", redis_url, "--heartbeat-interval", "0.2",
              "--heartbeat-timeout", "0.8"]
    gw_a, url_a = start_gateway(engines_addr[0], *common, name="gateway-bk-a")
    gw_b, url_b = start_gateway(engines_addr[0], *common, name="gateway-bk-b")
    try:
        wait_until(lambda: all(e["healthy"] for e in httpx.get(url_a + "/health").json()["engines"]),
                   what="both engines up")
        streams = [create(url_a, 80) for _ in range(4)]
        assert sorted(e["in_flight"] for e in httpx.get(url_a + "/health").json()["engines"]) == [2, 2]

        # Read part of a stream on gateway A, drop, resume on gateway B: nothing lost or repeated.
        sid = streams[0]["id"]
        seen_text, seen_ids = "", list[int]()
        with httpx.stream("GET", f"{url_a}/v1/streams/{sid}/events") as r:
            buf = ""
            for line in r.iter_lines():
                buf += line + "\n"
                if line == "" and "id: " in buf:
                    t, ids = stream_text(sse_events(buf))
                    seen_text, seen_ids = seen_text + t, seen_ids + ids
                    buf = ""
                    if len(seen_ids) >= 10:
                        break
        rest = sse_events(httpx.get(f"{url_b}/v1/streams/{sid}/events", timeout=30,
                                    headers={"Last-Event-ID": str(seen_ids[-1])}).text)
        rest_text, rest_ids = stream_text(rest)
        assert rest_ids[0] == seen_ids[-1] + 1 and rest[-1]["data"] == "[DONE]"
        full, full_ids, _ = full_text(url_a, sid)
        assert seen_text + rest_text == full and seen_ids + rest_ids == full_ids

        # DELETE from B cancels A's generation.
        long = create(url_a, 1000)
        time.sleep(0.3)
        r = httpx.delete(f"{url_b}/v1/streams/{long['id']}", timeout=10)
        assert r.status_code == 200 and r.json()["state"] == "cancelled"
        assert httpx.get(f"{url_a}/v1/streams/{long['id']}").json()["state"] == "cancelled"

        # Gateway A restarts: its finished streams are still served, from Redis, by the new process.
        port_a = int(url_a.rsplit(":", 1)[1])
        gw_a.stop()
        gw_a, url_a = start_gateway(engines_addr[0], *common, name="gateway-bk-a2", port=port_a)
        again, again_ids, _ = full_text(url_a, sid)
        assert again == full and again_ids == full_ids
        assert httpx.get(f"{url_a}/v1/streams/str-never-existed/events").status_code == 404

        # Kill engine 0: new streams keep working on engine 1.
        engines[0].stop(signal.SIGKILL)
        wait_until(lambda: [e["healthy"] for e in httpx.get(url_b + "/health").json()["engines"]] == [False, True],
                   timeout=5, what="engine 0 seen down")
        for _ in range(3):
            s = create(url_b, 5)
            text, ids, _ = full_text(url_a, s["id"])
            assert text and ids == list(range(len(ids)))
    finally:
        for p in (gw_a, gw_b, *engines):
            p.stop()


def test_previous_response_id_continues_on_another_replica(synthetic_engine: str, redis_server: RedisServer) -> None:
    """A stored response run on gateway A is continued by `previous_response_id` on gateway B (HTTP and
    WebSocket mode); `store: false` stays on A; an unknown id is `previous_response_not_found` on both."""
    from websockets.sync.client import connect

    common = ["--broker", redis_server.url]
    gw_a, url_a = start_gateway(synthetic_engine, *common, name="gateway-resp-a")
    gw_b, url_b = start_gateway(synthetic_engine, *common, name="gateway-resp-b")
    try:
        first = httpx.post(url_a + "/v1/responses", json={"input": "one", "max_output_tokens": 4}, timeout=30).json()
        assert first["status"] == "incomplete" and first["output"]
        said = first["output"][0]["content"][0]["text"]

        def continue_on_b() -> httpx.Response:
            return httpx.post(url_b + "/v1/responses", timeout=30,
                              json={"input": "two", "previous_response_id": first["id"], "max_output_tokens": 2})

        wait_until(lambda: continue_on_b().status_code == 200, timeout=5, what="transcript in Redis")
        second = continue_on_b().json()
        # B's engine saw A's turn: the prompt holds "one", A's answer and "two" (synthetic: a token per word)
        assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + len(said.split())
        with connect(url_b.replace("http", "ws") + "/v1/responses") as ws:
            ws.send(json.dumps({"type": "response.create", "input": "three", "previous_response_id": first["id"],
                                "max_output_tokens": 2}))
            while (ev := json.loads(ws.recv(timeout=10)))["type"] not in ("response.incomplete", "error"):
                pass
            assert ev["type"] == "response.incomplete", ev

        private = httpx.post(url_a + "/v1/responses", timeout=30,
                             json={"input": "one", "store": False, "max_output_tokens": 2}).json()
        for url in (url_a, url_b):
            r = httpx.post(url + "/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
        r = httpx.post(url_b + "/v1/responses", json={"input": "x", "previous_response_id": private["id"]})
        assert r.status_code == 400, "store: false must not reach Redis"
    finally:
        gw_a.stop()
        gw_b.stop()
