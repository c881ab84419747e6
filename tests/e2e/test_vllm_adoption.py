"""Adoption on vLLM: listed streams of vLLM's OpenAI layer survive their gateway's SIGKILL, exactly.

On the session's vLLM engine (the tiny random-weight Llama): two gateway replicas and a real
``redis-server`` (``--broker``), or ``tokenfan gateway --workers 2`` (the workers' own standbys). Fan-out streams with a JSON schema (a grammar), with logprobs and penalties, and with two
choices (``n`` = 2, logprobs), and a background response with a JSON schema, are created on replica A (worker
0's private socket) and read on A (the public port); A (worker 0) is killed with SIGKILL mid-stream. Each
reader goes on at B (the public port again) with ``Last-Event-ID`` (the background response with
``starting_after``), B (worker 1) adopts each stream from its log (in Redis; in its standby) and the engine
continues it, the grammar advanced over what was delivered: every reader
gets each event once and the uninterrupted control's text of every choice, logprobs, finish and usage.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.scaleout.workers import worker_socket
from tests.e2e.helpers import metric, wait_until
from tests.e2e.test_adoption import LEASE, _worker_pid, responses_reader, sse_reader, until_killed
from tests.e2e.test_broker import RedisServer, redis_server  # noqa: F401  (the fixture)
from tests.e2e.test_migration import Answer
from tests.e2e.test_resume_parsers import PartsReader, fold_parts
from tests.e2e.test_vllm_migration import CHAT, check_vllm, control_answer, openai_body, responses_json
from tests.procs import NO_CLIENT_LIMITS, Proc, spawn, start_gateway, stop_all, wait_healthy
from tests.system import require
from tokenfan_bench.servers.processes import free_port

pytestmark = pytest.mark.vllm

KINDS = ("json", "penalties", "n2")


@dataclass
class Gateways:
    """Where the streams are created (``owner`` over ``transport``), read (``urls``, in turn) and killed."""

    owner: str
    transport: httpx.AsyncBaseTransport | None
    urls: list[str]
    kill: Callable[[], None]
    survivor: str
    settle: Callable[[], None] | None = None


@contextmanager
def gateways(kind: str, address: str, broker_url: str) -> Iterator[Gateways]:
    if kind == "replicas":
        require("redis-server")
        procs, urls = [], []
        try:
            for k in "ab":
                proc, url = start_gateway(address, "--broker", broker_url, *LEASE, *NO_CLIENT_LIMITS,
                                          name=f"gateway-vllm-adopt-{k}", timeout=300)
                procs.append(proc)
                urls.append(url)
            yield Gateways(urls[0], None, urls, lambda: os.kill(procs[0].popen.pid, signal.SIGKILL), urls[1])
        finally:
            stop_all(procs)
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", address, "--workers", "2",
                    "--broker-lease-interval", "0.2", *NO_CLIENT_LIMITS, "--host", "127.0.0.1", "--port", str(port),
                    "--log-level", "warning"], "gateway-vllm-adopt-workers")

    def both_serving() -> None:
        wait_until(lambda: httpx.get(url + "/health").json()["workers"]["ready"] == 2, timeout=60,
                   what="both workers serving")

    try:
        wait_healthy(url, server, 300)
        both_serving()
        worker0 = _worker_pid(server, 0)
        yield Gateways("http://worker", httpx.AsyncHTTPTransport(uds=str(worker_socket(port, 0))), [url],
                       lambda: os.kill(worker0, signal.SIGKILL), url, both_serving)
    finally:
        assert server.stop() == 0, server.log()[-3000:]


@pytest.mark.parametrize("kind", ["replicas", "workers"])
def test_json_logprobs_and_n2_streams_of_a_killed_gateway_are_adopted_exactly(
        vllm_engine: tuple[str, Proc], vllm_gateway_url: str, redis_server: RedisServer,  # noqa: F811
        kind: str) -> None:
    address, _ = vllm_engine
    with gateways(kind, address, redis_server.url) as where:
        bodies = {name: openai_body(name, 20 + i, max_tokens=400) for i, name in enumerate(KINDS)}
        background = {**responses_json(30), "max_output_tokens": 400}
        events: list[dict[str, Any]] = []

        async def scenario() -> dict[str, PartsReader]:
            readers: dict[str, PartsReader] = {}
            async with httpx.AsyncClient(timeout=120) as c, \
                    httpx.AsyncClient(transport=where.transport, timeout=120) as owner:
                jobs, started = [], []
                for name, body in bodies.items():
                    r = await owner.post(where.owner + "/v1/streams", json=body)
                    assert r.status_code == 201, r.text
                    reader = readers[name] = PartsReader()
                    started.append(asyncio.Event())
                    jobs.append(sse_reader(c, where.urls, r.json()["id"], reader, started[-1], fold_parts))
                r = await owner.post(where.owner + "/v1/responses",
                                     json={**background, "background": True, "store": True})
                assert r.status_code == 200, r.text
                started.append(asyncio.Event())
                jobs.append(responses_reader(c, where.urls, r.json()["id"], events, started[-1]))
                await until_killed(jobs, started, where.kill)
            return readers

        readers = asyncio.run(scenario())
        for name, reader in readers.items():
            assert not reader.errors and reader.ended, (name, reader.errors)
            assert reader.seqs == list(range(len(reader.seqs))), (name, reader.seqs)  # each event once
            if kind == "replicas":  # (behind one port, the kernel may have given a reader to worker 1)
                assert reader.reconnects >= 1, name  # it was read on A, then on B
        expected = {name: control_answer(httpx.post(vllm_gateway_url + CHAT, json=body, timeout=120).json())
                    for name, body in bodies.items()}
        check_vllm({name: r.answer for name, r in readers.items()}, expected)
        assert expected["penalties"].logprobs and expected["n2"].others[1], expected
        # the background response: each event once, and the control's JSON
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        got = Answer()
        for ev in events:
            got.fold_event(ev)
        want = control_answer(httpx.post(vllm_gateway_url + "/v1/responses", json=background, timeout=120).json())
        assert (got.text, got.finish, got.usage) == (want.text, want.finish, want.usage), (got, want)
        assert got.text.startswith('{"name":"'), got.text
        # every stream was in flight on A (worker 0) at the kill, and B (worker 1) adopted it
        if where.settle is not None:
            where.settle()  # worker 0 serves again: the metric merges both workers'
        assert metric(where.survivor, "tokenfan_adoptions_total", {"outcome": "adopted"}) == len(bodies) + 1
