"""``--broker`` on Redis as production runs it: a Sentinel-managed primary and a Redis Cluster, real Debian servers
on loopback (:mod:`tests.redis_topologies`), real gateways on a synthetic engine.

Each failover happens while a listed stream runs, and every reader must still get one answer: each event once,
in order, the normal end, the text of an uninterrupted control run. A reader that reads through the failover,
one that left before and resumes with ``Last-Event-ID`` after it, and one that starts after it from the first
event. The gateways are not restarted: streams created after the failover work, and so does a cancel across
gateways (pub/sub followed the new primary).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.scaleout import broker_codec as codec
from tests.e2e.helpers import metric
from tests.e2e.test_adoption import Reader, acontrols, body, check, fold, sse_reader
from tests.procs import NO_CLIENT_LIMITS, Proc, start_engine, start_gateway, stop_all
from tests.redis_topologies import Cluster, Node, redis_cluster, sentinel_group, tls_redis

ENGINE_ARGS = ("--engine", "synthetic", "--synthetic-tokens-per-s", "40", "--synthetic-ttft-ms", "5")
LONG = 400  # 10 s at 40 tokens/s: the stream outlasts a failover (the test checks it still runs after)
# a lease that outlives a failover (the sentinels' 1 s down-after plus an election): the owner is not taken
# for gone meanwhile, so the gateways follow the new primary without moving a stream (docs/deploy.md)
RIDE_OUT = ("--broker-lease-interval", "0.5", "--broker-lease-ttl", "10", "--broker-backoff-max", "0.5")
PASSWORD = "correct-horse"


async def create(c: httpx.AsyncClient, url: str, b: dict[str, Any], timeout: float = 30.0) -> str:
    """POST /v1/streams until it answers 201 (a 503 ``broker_unavailable`` while the gateway finds the new
    primary is the documented answer; retried as a client would, within ``timeout``)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        r = await c.post(url + "/v1/streams", json=b)
        if r.status_code == 201:
            return str(r.json()["id"])
        assert r.status_code == 503 and r.json()["error"]["code"] == "broker_unavailable", r.text
        assert asyncio.get_running_loop().time() < deadline, f"no 201 within {timeout}s: {r.text}"
        await asyncio.sleep(0.2)


async def read_some(c: httpx.AsyncClient, url: str, sid: str, reader: Reader, n: int) -> None:
    """Read the first ``n`` events, then leave (the reader resumes later with ``Last-Event-ID``)."""
    async with c.stream("GET", f"{url}/v1/streams/{sid}/events") as r:
        assert r.status_code == 200
        event: dict[str, str] = {}
        async for line in r.aiter_lines():
            if line.startswith(("id:", "data:", "event:")):
                key, _, value = line.partition(": ")
                event[key] = value
                continue
            if "id" in event and "data" in event:
                fold(reader, int(event["id"]), json.loads(event["data"]))
                if len(reader.seqs) >= n:
                    return
            event = {}


async def across_a_failover(c: httpx.AsyncClient, writer: str, urls: list[str],
                            fail_over: Callable[[list[str]], Any], n: int = 2, tokens: int = LONG
                            ) -> tuple[dict[str, Reader], list[dict[str, Any]]]:
    """``n`` long listed streams created on ``writer``, read on each of ``urls`` through ``fail_over(ids)``
    (run in a thread once every reader has its first events), by a reader that left before it and resumes
    after, and by one that starts after it. The readers (``<i>/<how>``) and the bodies, for the controls."""
    loop = asyncio.get_running_loop()
    bodies = [{**body(100 + i + tokens), "max_tokens": tokens} for i in range(n)]
    sids = [await create(c, writer, b) for b in bodies]
    readers: dict[str, Reader] = {}
    jobs: list[Awaitable[None]] = []
    started: list[asyncio.Event] = []
    for i, sid in enumerate(sids):
        for k, url in enumerate(urls):
            reader = readers[f"{i}/through-{k}"] = Reader()
            ev = asyncio.Event()
            started.append(ev)
            jobs.append(sse_reader(c, [url, urls[-1]], sid, reader, ev))
        await read_some(c, urls[-1], sid, readers.setdefault(f"{i}/resumes", Reader()), 3)
    running = asyncio.gather(*jobs)
    for ev in started:
        await asyncio.wait_for(ev.wait(), 30)
    await loop.run_in_executor(None, fail_over, sids)
    for sid in sids:  # the failover happened mid-stream (asked of the last URL: the writer may be the one killed)
        assert (await c.get(f"{urls[-1]}/v1/streams/{sid}")).json()["state"] == "running"
    after = []
    for i, sid in enumerate(sids):
        after.append(sse_reader(c, [urls[-1]], sid, readers[f"{i}/resumes"], asyncio.Event()))
        after.append(sse_reader(c, [urls[-1]], sid, readers.setdefault(f"{i}/after", Reader()), asyncio.Event()))
    await asyncio.wait_for(asyncio.gather(running, *after), 90)
    return readers, bodies


async def created_after(c: httpx.AsyncClient, writer: str, reader_url: str) -> tuple[Reader, dict[str, Any]]:
    """A short listed stream created on ``writer`` and read on ``reader_url`` to its end."""
    b = {**body(200), "max_tokens": 12}
    sid = await create(c, writer, b)
    reader = Reader()
    await asyncio.wait_for(sse_reader(c, [reader_url], sid, reader, asyncio.Event()), 60)
    return reader, b


async def cancel_across(c: httpx.AsyncClient, owner: str, other: str) -> None:
    """A stream created on ``owner``, cancelled by ``DELETE`` on ``other``: the owner confirms over pub/sub."""
    sid = await create(c, owner, {**body(300), "max_tokens": LONG})
    r = await c.delete(f"{other}/v1/streams/{sid}")
    assert r.status_code == 200 and r.json()["state"] == "cancelled", r.text

    async def ended() -> str:
        while (state := (await c.get(f"{owner}/v1/streams/{sid}")).json()["state"]) == "running":
            await asyncio.sleep(0.05)
        return str(state)
    assert await asyncio.wait_for(ended(), 10) == "cancelled"


def gateways(address: str, url: str, names: str, *extra: str, env: dict[str, str] | None = None
             ) -> list[tuple[Proc, str]]:
    return [start_gateway(address, "--broker", url, *extra, *NO_CLIENT_LIMITS, name=f"gateway-topo-{k}",
                          env=env, timeout=60) for k in names]


@pytest.mark.parametrize("kill", [True, False], ids=["sigkill", "sentinel-failover"])
def test_sentinel_failover_is_followed_without_a_restart_and_every_stream_reads_as_one_answer(
        ipc_dir: Path, tmp_path: Path, kill: bool) -> None:
    """A primary and a replica behind three sentinels (AUTH: the password comes from
    ``TOKENFAN_BROKER_PASSWORD``); gateway A owns the streams, B mirrors them. The primary is SIGKILLed (the
    sentinels elect a leader and promote the replica) or handed over by ``SENTINEL FAILOVER`` (the old primary
    becomes a replica that would still answer reads and subscriptions: the gateways must leave it)."""
    address = f"ipc://{ipc_dir / 'topo-sentinel.sock'}"
    with sentinel_group(tmp_path, password=PASSWORD) as group:
        engine = start_engine(address, *ENGINE_ARGS, name="engine-topo-sentinel")
        gws = gateways(address, group.url().replace(f":{PASSWORD}@", ""), "ab", *RIDE_OUT,
                       env={"TOKENFAN_BROKER_PASSWORD": PASSWORD})
        (_, a), (_, b) = gws
        try:
            async def scenario() -> tuple[dict[str, Reader], list[dict[str, Any]], dict[int, str]]:
                async with httpx.AsyncClient(timeout=60) as c:
                    before, b0 = await created_after(c, a, b)
                    readers, bodies = await across_a_failover(c, a, [a, b], lambda _: group.failover(kill=kill))
                    later, b1 = await created_after(c, a, b)
                    await cancel_across(c, a, b)
                    readers |= {f"{len(bodies)}/before": before, f"{len(bodies) + 1}/later": later}
                    texts, _ = await acontrols(c, b, [*bodies, b0, b1], [])
                    return readers, bodies, texts

            readers, _, texts = asyncio.run(scenario())
            check(readers, texts)
            for url in (a, b):  # nothing moved: the lease outlived the failover
                assert metric(url, "tokenfan_adoptions_total", {"outcome": "adopted"}) == 0
            assert httpx.get(a + "/health").status_code == 200 and httpx.get(b + "/health").status_code == 200
        finally:
            stop_all([engine, *(g for g, _ in gws)])


def test_cluster_streams_mirror_cancel_adopt_and_survive_a_primary_failover(ipc_dir: Path, tmp_path: Path) -> None:
    """Three primaries with a replica each; gateways A and B on ``redis+cluster://``. Listed streams created on
    A read on B (mirrors: XREAD on each stream's slot), a cancel on B reaches A (sharded pub/sub), the primary
    of a running stream's slot hands over to its replica (``CLUSTER FAILOVER``) and then another's is
    SIGKILLed (its replica is elected), and finally A is SIGKILLed mid-stream: B adopts its streams."""
    address = f"ipc://{ipc_dir / 'topo-cluster.sock'}"
    with redis_cluster(tmp_path) as cluster:
        engine = start_engine(address, *ENGINE_ARGS, name="engine-topo-cluster")
        gws = gateways(address, cluster.url(), "ab", "--broker-lease-interval", "0.2", "--broker-lease-ttl", "6",
                       "--broker-backoff-max", "0.5")
        (gw_a, a), (_, b) = gws
        try:
            async def scenario() -> tuple[dict[str, Reader], dict[int, str]]:
                async with httpx.AsyncClient(timeout=60) as c:
                    readers: dict[str, Reader] = {}
                    all_bodies: list[dict[str, Any]] = []

                    def add(part: dict[str, Reader], bodies: list[dict[str, Any]]) -> None:
                        for name, r in part.items():
                            i, how = name.split("/")
                            readers[f"{int(i) + len(all_bodies)}/{how}"] = r
                        all_bodies.extend(bodies)

                    first, b0 = await created_after(c, a, b)
                    add({"0/first": first}, [b0])
                    await cancel_across(c, a, b)
                    # coordinated failovers of the primaries of the stream's slot, the cancel channel's and A's
                    # presence channel's (the pub/sub must follow them, or a cancel or an adoption goes wrong)
                    part, bodies = await across_a_failover(
                        c, a, [a, b], lambda ids: fail_over_all(cluster, ids), n=1, tokens=2 * LONG)
                    add(part, bodies)
                    # a killed primary: its replica is elected
                    part, bodies = await across_a_failover(
                        c, a, [a, b], lambda ids: cluster.fail_over(primary_of(cluster, ids), kill=True), n=1)
                    add(part, bodies)
                    await cancel_across(c, a, b)
                    later, b1 = await created_after(c, a, b)
                    add({"0/later": later}, [b1])
                    # the owner gateway killed mid-stream: B adopts (its readers on A resume on B)
                    part, bodies = await across_a_failover(
                        c, a, [a, b], lambda _: os.kill(gw_a.popen.pid, signal.SIGKILL), n=2)
                    add(part, bodies)
                    texts, _ = await acontrols(c, b, all_bodies, [])
                    return readers, texts

            readers, texts = asyncio.run(scenario())
            check(readers, texts)
            assert metric(b, "tokenfan_adoptions_total", {"outcome": "adopted"}) == 2
        finally:
            stop_all([engine, *(g for g, _ in gws)])


def primary_of(cluster: Cluster, sids: list[str]) -> Node:
    """The primary that holds the first stream's keys (its slot)."""
    return cluster.primary_of(codec.stream_key(sids[0]))


def fail_over_all(cluster: Cluster, sids: list[str]) -> None:
    """``CLUSTER FAILOVER`` of each primary that holds the stream's slot, the cancel channel, or its owner's
    presence channel (the owner named by the stream's header)."""
    first: Any = cluster.client().xrange(codec.stream_key(sids[0]), count=1)
    entry = codec.decode(first[0][1])
    assert isinstance(entry, codec.Header)
    owner = entry.owner
    names = (codec.stream_key(sids[0]), codec.CANCEL_CHANNEL, codec.presence_channel(owner))
    for port in dict.fromkeys(cluster.primary_of(name).port for name in names):
        cluster.fail_over(cluster.node(port), kill=False)


def test_tls_and_an_acl_user_carry_mirrors_and_cancels(ipc_dir: Path, tmp_path: Path) -> None:
    """``rediss://tokenfan@host/0?ssl_ca_certs=...``: a Redis that speaks only TLS and admits only its ACL user,
    the password from ``TOKENFAN_BROKER_PASSWORD``; a stream created on A is read on B (XREAD over TLS) and
    cancelled from B (pub/sub over TLS)."""
    address = f"ipc://{ipc_dir / 'topo-tls.sock'}"
    with tls_redis(tmp_path) as server:
        engine = start_engine(address, *ENGINE_ARGS, name="engine-topo-tls")
        gws = gateways(address, server.url(), "ab", env={"TOKENFAN_BROKER_PASSWORD": server.password})
        (_, a), (_, b) = gws
        try:
            async def scenario() -> tuple[Reader, dict[int, str]]:
                async with httpx.AsyncClient(timeout=60) as c:
                    reader, b0 = await created_after(c, a, b)
                    await cancel_across(c, a, b)
                    texts, _ = await acontrols(c, b, [b0], [])
                    return reader, texts

            reader, texts = asyncio.run(scenario())
            check({"0/b": reader}, texts)
        finally:
            stop_all([engine, *(g for g, _ in gws)])
