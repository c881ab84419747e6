"""``--workers 2`` without a broker: a SIGKILLed worker's sampled listed streams read as one answer everywhere.

``tokenfan gateway --workers 2`` on the engine of the session's ``tokenfan serve`` (vLLM, the tiny model):
worker 1 keeps the standby of every listed stream of worker 0, and worker 0's readers see an event only once
the standby acknowledged it (docs/failures.md, ``workers-kill``). Sampled streams (temperature 1: an adopter
continues with a new sample, so an adopter whose log is shorter than what a reader saw writes another answer
after it) are created on worker 0 and read on worker 0 and on worker 1 (their private sockets); worker 0's relay
to the standby lags on purpose (``--relay-delay``, diagnostic: every write to the standby waits first), the
engine steps on until each reader has its first events and a little more, and worker 0 is killed. Worker 0's
readers go on at worker 1 with ``Last-Event-ID``, worker 1 adopts every stream, and a reader that starts after
the kill reads each from its first event: every reader of a stream gets each event once, the normal end and
the same answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.scaleout.workers import worker_socket
from tests.conftest import VllmBoot
from tests.e2e.helpers import engine_core, metric, step_stopped, wait_until
from tests.e2e.test_adoption import _worker_pid
from tests.e2e.test_workers_standby import restarted
from tests.procs import NO_CLIENT_LIMITS, spawn, wait_healthy
from tokenfan_bench.servers.processes import free_port

pytestmark = pytest.mark.vllm

NO_THINKING: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": False}}


def bodies() -> list[tuple[str, dict[str, Any]]]:
    """Two chat streams (vLLM's OpenAI layer, on this engine's parsers) and two completions (the plain path),
    sampled, 300 tokens each."""
    common = {"max_tokens": 300, "temperature": 1.0, "ignore_eos": True}
    chats = [{"messages": [{"role": "user", "content": f"pond {i}"}], **NO_THINKING, **common} for i in range(2)]
    completions = [{"endpoint": "completions", "prompt": f"brook {i}", **common} for i in range(2)]
    return [("chat", b) for b in chats] + [("completions", b) for b in completions]


@dataclass
class Reader:
    """One reader of a stream: where it reads (its next place after a dropped connection), what it got."""

    places: list[tuple[httpx.AsyncClient, str]]
    seqs: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    ended: bool = False
    errors: list[str] = field(default_factory=list)
    reconnects: int = 0

    def fold(self, seq: int, chunk: dict[str, Any]) -> None:
        self.seqs.append(seq)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            self.text += choice.get("text") or delta.get("content") or ""
            self.text += delta.get("reasoning_content") or delta.get("reasoning") or ""
            self.finish = choice.get("finish_reason") or self.finish


async def read(sid: str, reader: Reader, started: asyncio.Event) -> None:
    """EventSource's behaviour: read; when the connection drops without an end, reconnect (at the next
    place) with Last-Event-ID."""
    k = 0
    while not reader.ended and not reader.errors:
        c, base = reader.places[k]
        headers = {"Last-Event-ID": str(reader.seqs[-1])} if reader.seqs else {}
        try:
            async with c.stream("GET", f"{base}/v1/streams/{sid}/events", headers=headers) as r:
                assert r.status_code == 200, (r.status_code, await r.aread())
                event: dict[str, str] = {}
                async for line in r.aiter_lines():
                    if line:
                        key, _, value = line.partition(": ")
                        event[key] = value
                        continue
                    if event.get("event") == "error":
                        reader.errors.append(event["data"])
                    elif event.get("data") == "[DONE]":
                        reader.ended = True
                    elif "id" in event:
                        reader.fold(int(event["id"]), json.loads(event["data"]))
                        if len(reader.seqs) >= 3:
                            started.set()
                    event = {}
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError):
            pass
        if not reader.ended and not reader.errors:
            reader.reconnects += 1
            k = min(k + 1, len(reader.places) - 1)
            await asyncio.sleep(0.2)


def test_a_killed_workers_sampled_streams_read_as_one_answer_on_every_worker(
        parser_gateway: str, vllm_boot: VllmBoot, ipc_dir: Path) -> None:
    core = engine_core(vllm_boot.get("parser_gateway")[0])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # --standby-timeout: far beyond any stall of a loaded machine (the standby is never given up here)
    server = spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", f"ipc://{ipc_dir / 'parser.sock'}",
                    "--workers", "2", "--broker-lease-interval", "0.2", "--relay-delay", "0.15",
                    "--standby-timeout", "60", *NO_CLIENT_LIMITS, "--host", "127.0.0.1", "--port", str(port),
                    "--log-level", "warning"], "gateway-workers-kill")
    try:
        wait_healthy(url, server, 300)
        wait_until(lambda: httpx.get(url + "/health").json()["workers"]["ready"] == 2, timeout=60,
                   what="both workers serving")
        worker0 = _worker_pid(server, 0)

        async def scenario() -> dict[str, list[Reader]]:
            readers: dict[str, list[Reader]] = {}
            w0 = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(worker_socket(port, 0))), timeout=120)
            w1 = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(worker_socket(port, 1))), timeout=120)
            public = httpx.AsyncClient(timeout=120)
            # vLLM's EngineCore stopped (SIGSTOP) and let run 10 ms at a time: every stream is in flight at the kill
            os.kill(core, signal.SIGSTOP)
            try:
                made = await asyncio.gather(*(w0.post("http://w/v1/streams", json={**b, "endpoint": b.get(
                    "endpoint", "chat.completions")}) for _, b in bodies()))
                ids = []
                for r in made:
                    assert r.status_code == 201, r.text
                    ids.append(r.json()["id"])
                jobs, started = [], []
                for sid in ids:
                    mine = readers[sid] = [Reader([(w0, "http://w"), (w1, "http://w")]) for _ in range(2)] + \
                        [Reader([(w1, "http://w")]) for _ in range(2)]
                    for reader in mine:
                        started.append(asyncio.Event())
                        jobs.append(read(sid, reader, started[-1]))
                reading = asyncio.gather(*jobs)
                deadline = time.monotonic() + 120
                while not all(ev.is_set() for ev in started):
                    assert time.monotonic() < deadline, [ev.is_set() for ev in started]
                    step_stopped(core)
                    await asyncio.sleep(0.05)
                for _ in range(10):  # events the lagging relay has not written to the standby yet
                    step_stopped(core)
                    await asyncio.sleep(0.01)
                os.kill(worker0, signal.SIGKILL)
                os.kill(core, signal.SIGCONT)
                late = []
                for sid in ids:  # after the kill, from the first event, on the public port
                    reader = Reader([(public, url)])
                    readers[sid].append(reader)
                    late.append(read(sid, reader, asyncio.Event()))
                await asyncio.wait_for(asyncio.gather(reading, *late), 180)
            finally:
                os.kill(core, signal.SIGCONT)
                for c in (w0, w1, public):
                    await c.aclose()
            return readers

        readers = asyncio.run(scenario())
        for sid, mine in readers.items():
            for k, reader in enumerate(mine):
                assert not reader.errors and reader.ended, (sid, k, reader.errors)
                assert reader.seqs == list(range(len(reader.seqs))), (sid, k, reader.seqs)  # each event once
                assert reader.finish == "length" and reader.text, (sid, k, reader.finish)
            answers = {reader.text for reader in mine}
            assert len(answers) == 1, (sid, [(r.reconnects, len(r.seqs), r.text[:200]) for r in mine])
            assert sum(r.reconnects for r in mine[:2]) >= 2, sid  # worker 0's readers went on at worker 1
        wait_until(lambda: restarted(server, worker0), timeout=30, what="worker 0 started again")
        wait_until(lambda: httpx.get(url + "/health").json()["workers"]["ready"] == 2, timeout=60,
                   what="both workers serving")
        assert metric(url, "tokenfan_adoptions_total", {"outcome": "adopted"}) == len(readers)
        assert "its standby confirmed nothing" not in server.log()  # (the adopted streams may have none: worker
        # 0 was restarting)
    finally:
        assert server.stop() == 0, server.log()[-3000:]
