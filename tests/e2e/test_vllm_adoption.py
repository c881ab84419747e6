"""Adoption on vLLM: listed streams of vLLM's OpenAI layer survive their gateway's SIGKILL, exactly.

Two gateway replicas on the session's vLLM engine (the tiny random-weight Llama) and a real ``redis-server``
(``--broker``). Fan-out streams with a JSON schema (a grammar), with logprobs and penalties, and with two
choices (``n`` = 2, logprobs), and a background response with a JSON schema, are created on replica A and
read on A; A is killed with SIGKILL mid-stream. Each reader goes on at B with ``Last-Event-ID`` (the
background response with ``starting_after``), B adopts each stream from its log in Redis (the engine steps
behind its events) and the engine continues it, the grammar advanced over what was delivered: every reader
gets each event once and the uninterrupted control's text of every choice, logprobs, finish and usage.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import httpx
import pytest

from tests.e2e.helpers import metric
from tests.e2e.test_adoption import LEASE, responses_reader, sse_reader, until_killed
from tests.e2e.test_broker import RedisServer, redis_server  # noqa: F401  (the fixture)
from tests.e2e.test_migration import Answer
from tests.e2e.test_resume_parsers import PartsReader, fold_parts
from tests.e2e.test_vllm_migration import CHAT, check_vllm, control_answer, openai_body, responses_json
from tests.procs import NO_CLIENT_LIMITS, Proc, start_gateway, stop_all
from tests.system import require

pytestmark = pytest.mark.vllm

KINDS = ("json", "penalties", "n2")


def test_json_logprobs_and_n2_streams_of_a_killed_replica_are_adopted_exactly(
        vllm_engine: tuple[str, Proc], vllm_gateway_url: str, redis_server: RedisServer) -> None:  # noqa: F811
    require("redis-server")
    address, _ = vllm_engine
    replicas: list[Proc] = []
    urls: list[str] = []
    try:
        for k in "ab":
            proc, url = start_gateway(address, "--broker", redis_server.url, *LEASE, *NO_CLIENT_LIMITS,
                                      name=f"gateway-vllm-adopt-{k}", timeout=300)
            replicas.append(proc)
            urls.append(url)
        url_a, url_b = urls
        bodies = {kind: openai_body(kind, 20 + i, max_tokens=400) for i, kind in enumerate(KINDS)}
        background = {**responses_json(30), "max_output_tokens": 400}
        events: list[dict[str, Any]] = []

        async def scenario() -> dict[str, PartsReader]:
            readers: dict[str, PartsReader] = {}
            async with httpx.AsyncClient(timeout=120) as c:
                jobs, started = [], []
                for kind, body in bodies.items():
                    r = await c.post(url_a + "/v1/streams", json=body)
                    assert r.status_code == 201, r.text
                    reader = readers[kind] = PartsReader()
                    started.append(asyncio.Event())
                    jobs.append(sse_reader(c, [url_a, url_b], r.json()["id"], reader, started[-1], fold_parts))
                r = await c.post(url_a + "/v1/responses", json={**background, "background": True, "store": True})
                assert r.status_code == 200, r.text
                started.append(asyncio.Event())
                jobs.append(responses_reader(c, [url_a, url_b], r.json()["id"], events, started[-1]))
                await until_killed(jobs, started, lambda: os.kill(replicas[0].popen.pid, signal.SIGKILL))
            return readers

        readers = asyncio.run(scenario())
        for kind, reader in readers.items():
            assert not reader.errors and reader.ended, (kind, reader.errors)
            assert reader.seqs == list(range(len(reader.seqs))), (kind, reader.seqs)  # each event once
            assert reader.reconnects >= 1, kind  # it was read on A, then on B
        expected = {kind: control_answer(httpx.post(vllm_gateway_url + CHAT, json=body, timeout=120).json())
                    for kind, body in bodies.items()}
        check_vllm({kind: r.answer for kind, r in readers.items()}, expected)
        assert expected["penalties"].logprobs and expected["n2"].others[1], expected
        # the background response: each event once, and the control's JSON
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        got = Answer()
        for ev in events:
            got.fold_event(ev)
        want = control_answer(httpx.post(vllm_gateway_url + "/v1/responses", json=background, timeout=120).json())
        assert (got.text, got.finish, got.usage) == (want.text, want.finish, want.usage), (got, want)
        assert got.text.startswith('{"name":"'), got.text
        # every stream was in flight on A at the kill, and B adopted it
        assert metric(url_b, "tokenfan_adoptions_total", {"outcome": "adopted"}) == len(bodies) + 1
    finally:
        stop_all(replicas)
