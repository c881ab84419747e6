"""``--workers 2``: two gateway processes on one port; a reader on either worker follows any stream."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
import websockets

from tests.e2e.helpers import chunk_text, sse_events
from tests.procs import start_gateway
from tokenfan_bench.servers.processes import Proc


@pytest.fixture(scope="module")
def two_workers(synthetic_engine: str) -> Iterator[tuple[Proc, str]]:
    proc, url = start_gateway(synthetic_engine, "--workers", "2", name="gateway-workers")
    # start_gateway saw one worker healthy; wait for both (fresh connections land on either).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:
            if _metric(c.get(url + "/metrics").text, "tokenfan_workers") == 2 and \
                    all(c.get(url + "/health").status_code == 200 for _ in range(20)):
                break
        time.sleep(0.2)
    yield proc, url
    proc.stop()


def _metric(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_every_reader_on_either_worker_gets_the_whole_stream(two_workers: tuple[Proc, str]) -> None:
    _, url = two_workers
    created = [httpx.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "x", "max_tokens": 40,
                                                     "ignore_eos": True}).json() for _ in range(6)]

    async def sse(info: dict) -> str:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            r = await c.get(info["events_url"])
        return "".join(chunk_text(json.loads(e["data"])) for e in sse_events(r.text) if "id" in e)

    async def ws(info: dict) -> str:
        text = ""
        async with websockets.connect(info["ws_url"] + "?after=-1") as sock:
            async for raw in sock:
                msg = json.loads(raw)
                if msg["type"] == "chunk":
                    text += chunk_text(msg["data"])
        return text

    async def main() -> list[list[str]]:
        # Each reader opens its own connection, so the kernel spreads them over both workers.
        return [await asyncio.gather(*(sse(i) for _ in range(4)), *(ws(i) for _ in range(4))) for i in created]

    for texts in asyncio.run(main()):
        assert len(set(texts)) == 1 and len(texts[0]) > 0
    # Both workers served, and one scrape merges them.
    metrics = httpx.get(url + "/metrics").text
    assert _metric(metrics, "tokenfan_workers") == 2
    # every reader got chunks (a reader that joins after its stream ended may get the log merged into fewer,
    # larger chunks, so the count is not 40 per reader: 1,881 of 1,920 in one run)
    assert _metric(metrics, "tokenfan_chunks_sent_total") >= 6 * 8


def test_a_delete_on_either_worker_cancels_the_generation(two_workers: tuple[Proc, str]) -> None:
    _, url = two_workers
    for _ in range(4):  # whichever worker each request lands on
        info = httpx.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "x", "max_tokens": 2000,
                                                     "ignore_eos": True}).json()
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:
            r = c.delete(f"{url}/v1/streams/{info['id']}")
            assert r.status_code == 200 and r.json()["deleted"] is True
            state = c.get(f"{url}/v1/streams/{info['id']}").json()["state"]
        assert state == "cancelled"


def test_the_internal_routes_are_not_on_the_public_port(two_workers: tuple[Proc, str]) -> None:
    _, url = two_workers
    info = httpx.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "x", "max_tokens": 3}).json()
    for _ in range(4):
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:
            assert c.get(f"{url}/internal/streams/{info['id']}").status_code == 404
            assert c.get(f"{url}/internal/metrics").status_code == 404
            assert c.get(f"{url}/internal/transcripts/{info['id']}").status_code == 404


def test_previous_response_id_resolves_on_either_worker(two_workers: tuple[Proc, str]) -> None:
    """Each continuation goes out on a fresh connection, so SO_REUSEPORT spreads them over both workers."""
    _, url = two_workers
    first = httpx.post(url + "/v1/responses", json={"input": "one", "max_output_tokens": 3}, timeout=30).json()
    for _ in range(8):
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:
            r = c.post(url + "/v1/responses", timeout=30,
                       json={"input": "two", "previous_response_id": first["id"], "max_output_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["input_tokens"] > first["usage"]["input_tokens"]


def test_a_ui_chat_answer_running_on_one_worker_resumes_on_the_other(two_workers: tuple[Proc, str]) -> None:
    """``POST /api/chat`` on worker 0, ``GET /api/chat/{id}/stream`` (useChat's resume) on worker 1: the same
    parts, from the first, to the end."""
    from gateway.scaleout.workers import worker_socket

    _, url = two_workers
    port = int(url.rsplit(":", 1)[1])
    clients = [httpx.Client(transport=httpx.HTTPTransport(uds=str(worker_socket(port, k))), timeout=30)
               for k in (0, 1)]
    body = {"id": "workers-chat", "max_tokens": 60, "messages": [
        {"id": "u1", "role": "user", "parts": [{"type": "text", "text": "hello"}]}]}

    def parts(lines: Iterator[str]) -> list[dict]:
        out = []
        for line in lines:
            if line.startswith("data: {"):
                out.append(json.loads(line[6:]))
        return out

    try:
        with clients[0].stream("POST", "http://w/api/chat", json=body) as posted:
            assert posted.status_code == 200
            lines = posted.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            with clients[1].stream("GET", "http://w/api/chat/workers-chat/stream") as resumed:
                assert resumed.status_code == 200, resumed.read()
                other = parts(resumed.iter_lines())
            own = [json.loads(first[6:]), *parts(lines)]
        assert other == own and own[-1]["type"] == "finish"
        assert "".join(p.get("delta", "") for p in own if p["type"] == "text-delta")
    finally:
        for c in clients:
            c.close()
