"""Durable means replicated (``--broker-replicas``), and never splice: a real ``redis-server`` primary with one
replica that replicates through a link the test holds (:class:`tokenfan_bench.network.endpoint.Endpoint`: the
replica falls behind with its connection open), brokers in one event loop reaching Redis through one switchable
endpoint (a managed Redis endpoint), and a failover: the primary killed, the replica promoted, the endpoint
switched."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import websockets

from gateway.config import BrokerTimings
from gateway.scaleout import broker_codec as codec
from gateway.scaleout import redis_fence as fence
from gateway.scaleout.redis_replicas import online
from tests.e2e.helpers import sse_events, wait_until
from tests.e2e.test_broker import Replica, texts
from tests.procs import start_engine, start_gateway
from tests.system import require
from tokenfan_bench.network.endpoint import Endpoint
from tokenfan_bench.partitions import RedisProc

FAST = BrokerTimings(op_timeout=0.5, block=0.5, backoff_max=0.3, lease_interval=0.2, lease_ttl=0.6,
                     cancel_timeout=2.0, replica_timeout=0.2)


class Pair:
    """A primary, its replica (through a holdable link) and the endpoint the brokers reach Redis at."""

    def __init__(self, tmp: Path) -> None:
        self.primary = RedisProc(tmp / "primary", [], ["--repl-diskless-sync-delay", "0"])
        self.primary.start()
        self.link = Endpoint(self.primary.port)
        self.replica = RedisProc(tmp / "replica", [], ["--replicaof", "127.0.0.1", str(self.link.port)])
        self.replica.start()
        deadline = time.monotonic() + 30
        while self.primary.replicas_online() < 1:
            assert time.monotonic() < deadline, "the replica never came online"
            time.sleep(0.05)
        self.endpoint = Endpoint(self.primary.port)

    def fail_over(self) -> None:
        """The primary dies with what the held link held; the replica is promoted; the endpoint leads to it."""
        self.primary.stop()
        self.link.close()
        self.replica.cli("replicaof", "no", "one")
        self.endpoint.switch(self.replica.port)

    def stop(self) -> None:
        self.endpoint.close()
        self.link.close()
        self.replica.stop()
        self.primary.stop()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    require("redis-server")
    p = Pair(tmp_path)
    try:
        yield p
    finally:
        p.stop()


def log_seqs(port: int, stream_id: str) -> list[int]:
    """The seq of every event the Redis at ``port`` holds of the stream, in its order."""
    entries = redis.Redis(port=port).xrange(codec.stream_key(stream_id))
    return [e.seq for _, f in entries if isinstance(e := codec.decode(f), codec.EventEntry)]


def _with(t: BrokerTimings, **kw: Any) -> BrokerTimings:
    return dataclasses.replace(t, **kw)


async def until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def test_online_counts_the_replicas_that_can_acknowledge() -> None:
    assert online({"role": "master", "connected_slaves": 2, "slave0": {"state": "online"},
                   "slave1": {"state": "wait_bgsave"}}) == 1
    assert online({"role": "slave", "slave0": {"state": "online"}}) == 0
    assert online({"role": "master", "connected_slaves": 0}) == 0


def test_an_event_reaches_readers_only_once_the_replica_holds_it_and_waits_while_it_lags(pair: Pair) -> None:
    """auto: the primary has one replica online, so each pipeline waits for it; while the replication link is
    held, the owner's events stay pending (never shown) however long, and all of them reach readers once the
    replica acknowledges them."""
    async def main() -> None:
        a = Replica(pair.endpoint.url, timings=FAST)
        await a.broker.start()
        try:
            assert a.broker.replicas.needed == 1
            s = await a.own()
            s.gated = True  # as delivery.start makes every listed stream of a durable publisher
            a.emit(s, "one", "two")
            await until(lambda: len(s.events) == 2, 5, "the first events were never committed")
            pair.link.hold()
            a.emit(s, "three", "four")
            await asyncio.sleep(1.0)  # five WAIT timeouts
            assert texts(s) == ["one", "two"] and len(s.pending) == 2
            assert log_seqs(pair.primary.port, s.id) == [0, 1, 2, 3]  # in the primary, not yet replicated
            pair.link.hold(False)
            await until(lambda: len(s.events) == 4, 5, "the held events never reached readers")
            assert log_seqs(pair.replica.port, s.id) == [0, 1, 2, 3]
        finally:
            await a.broker.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_with_replicas_0_events_reach_readers_before_the_replica_holds_them(pair: Pair) -> None:
    """The setting that turns the wait off (and what the failover below rolls back)."""
    async def main() -> None:
        a = Replica(pair.endpoint.url, timings=_with(FAST, replicas=0))
        await a.broker.start()
        try:
            s = await a.own()
            s.gated = True  # as delivery.start makes every listed stream of a durable publisher
            pair.link.hold()
            a.emit(s, "one", "two")
            await until(lambda: len(s.events) == 2, 5, "replicas=0 still waited")
        finally:
            await a.broker.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_after_a_failover_to_a_replica_that_was_behind_the_owner_writes_back_what_it_lacks_before_anything_new(
        pair: Pair) -> None:
    """replicas=0 (the wait off, or a WAIT that lied): the promoted replica lacks the owner's last events. The
    owner's next append is refused there (it continues a log of another length) and the owner writes back
    what the store lacks first: the store's log is the owner's, seq after seq, never a hole or a splice."""
    async def main() -> None:
        a = Replica(pair.endpoint.url, timings=_with(FAST, replicas=0))
        await a.broker.start()
        try:
            s = await a.own()
            s.gated = True  # as delivery.start makes every listed stream of a durable publisher
            a.emit(s, "e0", "e1", "e2")
            await until(lambda: len(s.events) == 3 and log_seqs(pair.replica.port, s.id) == [0, 1, 2], 5,
                        "the replica never caught up")
            pair.link.hold()
            a.emit(s, "e3", "e4", "e5")
            await until(lambda: len(s.events) == 6, 5, "the events were never committed")
            pair.fail_over()
            assert log_seqs(pair.replica.port, s.id) == [0, 1, 2]  # rolled back
            a.emit(s, "e6")
            a.end(s)
            await until(lambda: s.sealed, 10, "the end never reached Redis")
            assert log_seqs(pair.replica.port, s.id) == list(range(7))
            entries = redis.Redis(port=pair.replica.port).xrange(codec.stream_key(s.id))
            end = codec.decode(entries[-1][1])
            assert isinstance(end, codec.EndEntry) and end.events == 7
        finally:
            await a.broker.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_fenced_append_is_refused_where_the_log_holds_another_count(pair: Pair) -> None:
    """The store-side rule: an append names the log it continues; on any other (shorter: lost records;
    longer: written twice) Redis writes nothing and says how many events it holds."""
    r = redis.Redis(port=pair.primary.port)
    f = fence.Fence(r)
    r.script_load(fence.APPEND)
    sid = "str-fence-after"
    key = codec.stream_key(sid)
    r.set(fence.epoch_key(sid), b"1")
    r.xadd(key, codec.encode_header("completions", "m", "gw", epoch=1))

    def append(after: int | None, *seqs: int) -> list[Any]:
        pipe = r.pipeline(transaction=False)
        f.append(pipe, sid, 1, [codec.encode_event(q, {}, str(q), None) for q in seqs], after=after)
        return list(pipe.execute()[0])

    assert fence.status(append(0, 0, 1)) == (fence.OK, 1)
    assert fence.status(append(3, 3)) == (fence.ELSEWHERE, 1) and fence.held(append(3, 3)) == 2  # a hole
    assert fence.held(append(1, 1)) == 2  # a repeat
    r.xadd(key, codec.encode_header("completions", "m", "gw2", epoch=1, at=2))  # an adopter's header last
    assert fence.status(append(2, 2)) == (fence.OK, 1)
    assert log_seqs(pair.primary.port, sid) == [0, 1, 2]
    assert codec.held([f for _, f in reversed(r.xrange(key))]) == 3


def test_a_redis_that_refuses_info_leaves_auto_waiting_for_none_and_says_so(
        pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    """An ACL without INFO (some managed Redis): the broker still serves; auto waits for no replica, and the log
    says to set --broker-replicas N."""
    r = redis.Redis(port=pair.primary.port)
    r.execute_command("ACL", "SETUSER", "tf", "on", ">pw", "~*", "&*", "+@all", "-info")

    async def main() -> None:
        a = Replica(f"redis://tf:pw@127.0.0.1:{pair.endpoint.port}/0", timings=FAST)
        await a.broker.start()
        try:
            assert a.broker.serving() and a.broker.replicas.needed == 0
            s = await a.own()
            s.gated = True
            a.emit(s, "one")
            await until(lambda: len(s.events) == 1, 5, "the event was never committed")
        finally:
            await a.broker.close()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert "set --broker-replicas N" in caplog.text


def test_when_the_store_lost_a_streams_epoch_no_adopter_claims_it_and_only_its_owner_writes_it_anew(
        pair: Pair) -> None:
    """The rule that keeps two owners apart when the promoted replica lacks the stream and its epoch (created
    while the replica was behind, replicas=0): a claim of the header's epoch fails (a missing epoch is never
    taken), the owner writes the stream anew with its epoch, and a second writer of it anew is refused."""
    async def main() -> None:
        a = Replica(pair.endpoint.url, timings=_with(FAST, replicas=0))
        b = Replica(pair.endpoint.url, timings=_with(FAST, replicas=0))
        await a.broker.start()
        await b.broker.start()
        try:
            pair.link.hold()
            s = await a.own()
            s.gated = True
            a.emit(s, "e0", "e1")
            await until(lambda: len(s.events) == 2, 5, "the events were never committed")
            header = codec.decode(redis.Redis(port=pair.primary.port).xrange(codec.stream_key(s.id))[0][1])
            assert isinstance(header, codec.Header) and header.epoch == 1
            pair.fail_over()
            r = redis.Redis(port=pair.replica.port)
            assert not r.exists(codec.stream_key(s.id)) and r.get(fence.epoch_key(s.id)) is None
            mirror = b.hub.create("completions", "m", s.id)
            mirror.mirrored = True
            assert not await b.broker.claim(mirror, header)  # no epoch to take: nobody adopts
            a.emit(s, "e2")
            await until(lambda: len(s.events) == 3 and log_seqs(pair.replica.port, s.id) == [0, 1, 2], 10,
                        "the owner never wrote its stream anew")
            assert r.get(fence.epoch_key(s.id)) == b"1"
            pipe = r.pipeline(transaction=False)
            b.broker.fence.append(pipe, s.id, 2, [codec.encode_header("completions", "m", "other", epoch=2)],
                                  create=True)
            assert fence.status((await asyncio.to_thread(pipe.execute))[0]) == (fence.FENCED, 1)
        finally:
            await a.broker.close()
            await b.broker.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_resume_point_past_what_the_stream_holds_is_stream_rolled_back_on_every_reader_route(
        ipc_dir: Path, pair: Pair) -> None:
    """A finished fan-out stream and background response (the synthetic engine): resuming at the end is the
    normal end (204, or nothing more); past it, a reader of events the log does not hold gets the error
    ``stream_rolled_back``: SSE ``event: error``, WebSocket error message and close 1011, a Responses error
    event; never the end of an answer it did not read."""
    address = f"ipc://{ipc_dir / 'rb.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-tokens-per-s", "200", name="engine-rb")
    gw, url = start_gateway(address, "--broker", pair.endpoint.url, name="gateway-rb")
    try:
        sid = httpx.post(url + "/v1/streams", json={"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 8}, timeout=30).json()["id"]
        events = sse_events(httpx.get(f"{url}/v1/streams/{sid}/events", timeout=30).text)
        last = max(int(e["id"]) for e in events if e.get("id"))
        assert httpx.get(f"{url}/v1/streams/{sid}/events", headers={"Last-Event-ID": str(last)}).status_code == 204
        past = sse_events(httpx.get(f"{url}/v1/streams/{sid}/events", timeout=30,
                                    headers={"Last-Event-ID": str(last + 5)}).text)
        assert past[-1]["event"] == "error" and json.loads(past[-1]["data"])["error"]["code"] == "stream_rolled_back"

        async def ws() -> tuple[dict[str, Any], int | None]:
            async with websockets.connect(f"{url.replace('http', 'ws')}/v1/streams/{sid}/ws?after={last + 5}") as w:
                msg = json.loads(await w.recv())
                with contextlib.suppress(websockets.ConnectionClosed):
                    await w.recv()
                return msg, w.close_code

        msg, code = asyncio.run(ws())
        assert msg["type"] == "error" and msg["error"]["code"] == "stream_rolled_back" and code == 1011

        rid = httpx.post(url + "/v1/responses", json={"input": "hi", "background": True, "store": True, "max_output_tokens": 8},
                         timeout=30).json()["id"]
        wait_until(lambda: httpx.get(f"{url}/v1/responses/{rid}").json()["status"] in ("completed", "incomplete"), 30, "done")
        seqs = [json.loads(e["data"])["sequence_number"] for e in
                sse_events(httpx.get(f"{url}/v1/responses/{rid}?stream=true", timeout=30).text) if e.get("data")]
        tail = sse_events(httpx.get(f"{url}/v1/responses/{rid}?stream=true&starting_after={max(seqs) + 5}",
                                    timeout=30).text)
        err = json.loads(tail[-1]["data"])
        assert err["type"] == "error" and err.get("code", (err.get("error") or {}).get("code")) == "stream_rolled_back"
    finally:
        gw.stop()
        engine.stop()
