"""``--workers 2`` without a broker: the standby that does not answer, or dies (docs/failures.md, ``--workers``).

A listed stream's events reach worker 0's readers once worker 1's standby acknowledged them. A standby that
confirms nothing for ``--standby-timeout`` (worker 1 stopped with SIGSTOP), or whose relay closes (worker 1
killed), is given up: worker 0's readers read on to the normal end, and the stream can no longer be adopted, so
worker 0's death afterwards ends its readers with ``owner_lost``, never with another answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from gateway.scaleout.workers import worker_socket
from tests.e2e.helpers import metric, until, wait_until
from tests.e2e.test_adoption import ENGINE_ARGS, _worker_pid, body, controls
from tests.procs import NO_CLIENT_LIMITS, Proc, spawn, wait_healthy
from tokenfan_bench.servers.processes import free_port


@contextmanager
def serve_workers(name: str, workers: int = 2) -> Iterator[tuple[Proc, int]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = spawn(["-m", "tokenfan.cli", "serve", *ENGINE_ARGS, "--workers", str(workers), "--broker-lease-interval", "0.2",
                    "--standby-timeout", "0.5", *NO_CLIENT_LIMITS, "--host", "127.0.0.1", "--port", str(port),
                    "--log-level", "warning"], name)
    try:
        wait_healthy(url, server, 60)
        wait_until(lambda: httpx.get(url + "/health").json()["workers"]["ready"] == workers, timeout=60,
                   what="every worker serving")
        yield server, port
    finally:
        assert server.stop() == 0, server.log()[-3000:]


def restarted(server: Proc, worker0: int) -> bool:
    """Whether worker 0 runs again, as another process than ``worker0``."""
    try:
        return _worker_pid(server, 0) != worker0
    except ValueError:  # (none: it is being started again)
        return False


class Reader:
    """One SSE reader of a stream on worker 0's socket, then (its connection dropped) on worker 1's."""

    def __init__(self, sid: str, port: int, places: tuple[int, ...] = (0, 1)) -> None:
        self.sid, self.port, self.places = sid, port, places
        self.seqs: list[int] = []
        self.text = ""
        self.ended = False
        self.errors: list[dict[str, Any]] = []

    async def run(self) -> None:
        for k in self.places:
            headers = {"Last-Event-ID": str(self.seqs[-1])} if self.seqs else {}
            transport = httpx.AsyncHTTPTransport(uds=str(worker_socket(self.port, k)))
            try:
                async with httpx.AsyncClient(transport=transport, timeout=60) as c, \
                        c.stream("GET", f"http://w/v1/streams/{self.sid}/events", headers=headers) as r:
                    event: dict[str, str] = {}
                    async for line in r.aiter_lines():
                        if line:
                            key, _, value = line.partition(": ")
                            event[key] = value
                            continue
                        if event.get("event") == "error":
                            self.errors.append(json.loads(event["data"]))
                        elif event.get("data") == "[DONE]":
                            self.ended = True
                        elif "id" in event:
                            self.seqs.append(int(event["id"]))
                            for choice in json.loads(event["data"]).get("choices") or []:
                                self.text += choice.get("delta", {}).get("content") or ""
                        event = {}
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError):
                pass
            if self.ended or self.errors:
                return


async def start(port: int, n: int, first: int, places: tuple[tuple[int, ...], ...] = ((0, 1),)
                ) -> tuple[list[Reader], asyncio.Future[Any]]:
    """``n`` listed chat streams created on worker 0 and a reader each at each of ``places`` (by default on
    worker 0, then worker 1), once every reader has events."""
    transport = httpx.AsyncHTTPTransport(uds=str(worker_socket(port, 0)))
    async with httpx.AsyncClient(transport=transport, timeout=30) as c:
        made = [await c.post("http://w/v1/streams", json=body(first + i)) for i in range(n)]
    assert all(r.status_code == 201 for r in made), [r.text for r in made]
    readers = [Reader(r.json()["id"], port, where) for r in made for where in places]
    reading = asyncio.gather(*(r.run() for r in readers))
    await until(_true(lambda: all(len(r.seqs) >= 3 for r in readers)), 30, "every reader's first events")
    return readers, reading


def _true(pred: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return pred()
    return check


def test_a_stopped_standby_is_given_up_and_its_owners_death_then_ends_the_stream_owner_lost() -> None:
    with serve_workers("serve-standby-stopped") as (server, port):
        worker0, worker1 = _worker_pid(server, 0), _worker_pid(server, 1)

        async def scenario() -> list[Reader]:
            readers, reading = await start(port, 2, 60)
            os.kill(worker1, signal.SIGSTOP)
            try:
                await until(_true(lambda: server.log().count("its standby confirmed nothing") == 2), 30,
                            "both standbys given up")
                had = [len(r.seqs) for r in readers]
                # the held events were released, and the stream goes on ungated
                await until(_true(lambda: all(len(r.seqs) > h + 3 for r, h in zip(readers, had, strict=True))), 30,
                            "the readers reading on")
            finally:
                os.kill(worker1, signal.SIGCONT)
            os.kill(worker0, signal.SIGKILL)
            await asyncio.wait_for(reading, 60)
            return readers

        readers = asyncio.run(scenario())
        for r in readers:
            assert not r.ended and [e["error"]["code"] for e in r.errors] == ["owner_lost"], (r.ended, r.errors)
            assert r.seqs == list(range(len(r.seqs))) and len(r.seqs) > 3
        wait_until(lambda: restarted(server, worker0), timeout=30, what="worker 0 started again")
        url = f"http://127.0.0.1:{port}"
        assert metric(url, "tokenfan_adoptions_total", {"outcome": "refused"}) == 2
        assert metric(url, "tokenfan_adoptions_total", {"outcome": "adopted"}) == 0
        assert "its owner had given its standby up" in server.log()


def test_a_killed_standby_is_given_up_at_once_and_the_owners_readers_read_to_the_end() -> None:
    with serve_workers("serve-standby-killed") as (server, port):
        worker1 = _worker_pid(server, 1)

        async def scenario() -> list[Reader]:
            readers, reading = await start(port, 2, 70)
            os.kill(worker1, signal.SIGKILL)
            await asyncio.wait_for(reading, 60)
            return readers

        readers = asyncio.run(scenario())
        texts, _ = controls(f"http://127.0.0.1:{port}", [body(70 + i) for i in range(2)], [])
        for i, r in enumerate(readers):
            assert r.ended and not r.errors, r.errors
            assert r.seqs == list(range(len(r.seqs))) and r.text == texts[i]
        assert server.log().count("its standby's relay closed") == 2
        assert "its standby confirmed nothing" not in server.log()


def test_of_three_workers_only_the_standby_adopts_and_the_third_reads_the_adopter() -> None:
    """``--workers 3``: worker 1 keeps worker 0's standbys; a reader on worker 2 reads a mirror that may hold
    less than worker 1's readers saw, so worker 2 never adopts: it reads on from worker 1."""
    with serve_workers("serve-standby-three", workers=3) as (server, port):
        worker0 = _worker_pid(server, 0)

        async def scenario() -> list[Reader]:
            readers, reading = await start(port, 2, 80, places=((0, 1), (2,), (1,)))
            os.kill(worker0, signal.SIGKILL)
            await asyncio.wait_for(reading, 60)
            return readers

        readers = asyncio.run(scenario())
        texts, _ = controls(f"http://127.0.0.1:{port}", [body(80 + i) for i in range(2)], [])
        for i, r in enumerate(readers):
            assert r.ended and not r.errors, (r.places, r.errors)
            assert r.seqs == list(range(len(r.seqs))) and r.text == texts[i // 3], r.places
        wait_until(lambda: restarted(server, worker0), timeout=30, what="worker 0 started again")
        url = f"http://127.0.0.1:{port}"
        assert metric(url, "tokenfan_adoptions_total", {"outcome": "adopted"}) == 2
        assert metric(url, "tokenfan_adoptions_total", {"outcome": "refused"}) == 0
