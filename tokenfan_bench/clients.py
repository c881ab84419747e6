"""Subscriber clients: create fan-out streams, subscribe over SSE (httpx) and WebSocket
(``websockets``), and record every chunk with its receive time (``time.time_ns()``).

A run is split over worker processes (:func:`worker_main`); each owns a share of the concurrency
slots and returns its raw samples, which the parent concatenates. A slot runs streams back to back
(closed loop, like ``vllm bench serve --max-concurrency``) until ``duration`` has passed, or once.
Slot start times are spread uniformly over ``ramp`` seconds so the synthetic engine's per-stream
token clocks are not all in phase.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import numpy as np
import orjson
import websockets
from websockets.asyncio.client import connect as ws_connect

from tokenfan_bench.stats import ArmSamples
from tokenfan_bench.wire import SseDecoder, chunk_sample

ARMS = ("A", "B")
RECV_ERRORS = (httpx.HTTPError, websockets.exceptions.WebSocketException, OSError, TimeoutError,
               orjson.JSONDecodeError, KeyError, TypeError)


@dataclass(frozen=True)
class Plan:
    """What one worker runs (picklable: it crosses the process boundary)."""

    url: str
    transports: tuple[str, str]  # arm A, arm B
    streams: int  # concurrency slots in the whole run
    max_tokens: int
    duration: float | None  # None: each slot runs one stream
    separate: bool  # one stream per arm instead of one stream watched by both arms
    endpoint: str = "chat.completions"
    ramp: float = 1.0
    seed: int = 0
    start_at: float = 0.0  # epoch seconds; all workers start together
    timeout: float = 120.0
    workers: int = 1
    worker: int = 0
    body: dict[str, Any] = field(default_factory=dict)


class Recorder:
    """Everything one subscriber saw."""

    __slots__ = ("connected_ns", "content", "deltas", "done", "emit", "error", "post_ns", "recv", "sent", "seq",
                 "stream")

    def __init__(self, stream: int, post_ns: int) -> None:
        self.stream, self.post_ns, self.connected_ns = stream, post_ns, 0
        self.done = False
        self.error: str | None = None
        self.seq: list[int] = []
        self.recv: list[int] = []
        self.emit: list[int] = []
        self.sent: list[int] = []
        self.deltas: list[int] = []
        self.content: list[bool] = []

    def add(self, recv_ns: int, chunk: dict[str, Any]) -> None:
        s = chunk_sample(chunk)
        self.seq.append(s.seq)
        self.recv.append(recv_ns)
        self.emit.append(s.emit_ns)
        self.sent.append(s.sent_ns)
        self.deltas.append(s.deltas)
        self.content.append(s.content)

    def fail(self, why: str) -> None:
        if self.error is None:
            self.error = why


def to_samples(transport: str, recs: list[Recorder]) -> ArmSamples:
    a = ArmSamples(transport)
    n = [len(r.seq) for r in recs]
    a.stream = np.repeat(np.array([r.stream for r in recs], np.int64), n)
    a.seq = np.fromiter(itertools.chain.from_iterable(r.seq for r in recs), np.int64)
    a.recv_ns = np.fromiter(itertools.chain.from_iterable(r.recv for r in recs), np.int64)
    a.emit_ns = np.fromiter(itertools.chain.from_iterable(r.emit for r in recs), np.int64)
    a.sent_ns = np.fromiter(itertools.chain.from_iterable(r.sent for r in recs), np.int64)
    a.deltas = np.fromiter(itertools.chain.from_iterable(r.deltas for r in recs), np.int64)
    a.content = np.fromiter(itertools.chain.from_iterable(r.content for r in recs), bool)
    a.sub_stream = np.array([r.stream for r in recs], np.int64)
    a.post_ns = np.array([r.post_ns for r in recs], np.int64)
    a.connected_ns = np.array([r.connected_ns for r in recs], np.int64)
    a.live = a.emit_ns >= np.repeat(a.connected_ns, n)
    lost = np.array([(r.seq[-1] + 1 - sum(r.deltas)) if r.seq else 0 for r in recs], np.int64)
    a.ok = np.array([r.done and r.error is None for r in recs], bool) & (lost == 0)
    a.errors = [r.error for r in recs if r.error] + [f"lost {k} events" for k in lost if k]
    return a


# -- subscribers ------------------------------------------------------------------------------


async def _let_others_stamp() -> None:
    """Yield once between taking a receive time and parsing.

    When several subscribers' data arrive in one event-loop iteration, their coroutines resume one
    after the other; without this, the second one's timestamp would include the first one's
    parsing, a fixed per-stream order bias between two subscribers of the same stream.
    """
    await asyncio.sleep(0)


async def subscribe_sse(http: httpx.AsyncClient, url: str, rec: Recorder) -> None:
    async with http.stream("GET", url, headers={"Accept": "text/event-stream"}) as r:
        rec.connected_ns = time.time_ns()
        if r.status_code != 200:
            rec.fail(f"SSE HTTP {r.status_code}")
            return
        dec = SseDecoder()
        async for data in r.aiter_raw():
            t = time.time_ns()  # before parsing: every event completed by this read arrived now
            await _let_others_stamp()
            for ev in dec.feed(data):
                if ev.data == b"[DONE]":
                    rec.done = True
                elif ev.event == "message":
                    rec.add(t, orjson.loads(ev.data))
                else:  # "error", or "end" (cancelled): the stream did not finish normally
                    rec.fail(f"SSE event {ev.event}: {ev.data[:200]!r}")
    if not rec.done:
        rec.fail("SSE closed before [DONE]")


async def subscribe_ws(url: str, rec: Recorder) -> None:
    async with ws_connect(url, compression=None, max_size=None, ping_interval=None, proxy=None,
                          open_timeout=30, close_timeout=2) as ws:
        rec.connected_ns = time.time_ns()
        async for raw in ws:
            t = time.time_ns()
            await _let_others_stamp()
            msg = orjson.loads(raw)
            kind = msg["type"]
            if kind == "chunk":
                rec.add(t, msg["data"])
            elif kind == "done" and "reason" not in msg:
                rec.done = True
            else:
                rec.fail(f"WS {kind}: {str(msg)[:200]}")
    if not rec.done:
        rec.fail("WS closed before done")


async def subscribe(http: httpx.AsyncClient, info: dict[str, Any], transport: str, rec: Recorder,
                    timeout: float) -> None:
    try:
        async with asyncio.timeout(timeout):
            if transport == "sse":
                await subscribe_sse(http, info["events_url"], rec)
            else:
                await subscribe_ws(info["ws_url"], rec)
    except RECV_ERRORS as exc:
        rec.fail(f"{transport}: {type(exc).__name__}: {exc}"[:300])


# -- one worker -------------------------------------------------------------------------------


def stream_body(plan: Plan, stream: int) -> bytes:
    body: dict[str, Any] = {"endpoint": plan.endpoint, "max_tokens": plan.max_tokens, "ignore_eos": True,
                            "seed": stream % 1_000_003}
    if plan.endpoint == "chat.completions":
        body["messages"] = [{"role": "user", "content": "tokenfan bench"}]
    else:
        body["prompt"] = "tokenfan bench"
    body.update(plan.body)
    return orjson.dumps(body)


class Worker:
    def __init__(self, plan: Plan, progress: Any = None) -> None:
        self.plan = plan
        self.progress = progress
        self.rng = random.Random(plan.seed * 7919 + plan.worker)
        self.recs: dict[str, list[Recorder]] = {arm: [] for arm in ARMS}
        self._ids = itertools.count()

    def _next_stream(self) -> int:
        return self.plan.worker + self.plan.workers * next(self._ids)

    async def _create(self, http: httpx.AsyncClient, stream: int) -> tuple[int, dict[str, Any] | None, str | None]:
        post_ns = time.time_ns()
        try:
            r = await http.post(self.plan.url + "/v1/streams", content=stream_body(self.plan, stream),
                                headers={"Content-Type": "application/json"})
        except httpx.HTTPError as exc:
            return post_ns, None, f"POST /v1/streams: {type(exc).__name__}: {exc}"
        if r.status_code != 201:
            return post_ns, None, f"POST /v1/streams: HTTP {r.status_code} {r.text[:200]}"
        return post_ns, r.json(), None

    async def _watch(self, http: httpx.AsyncClient, arms: tuple[str, ...]) -> None:
        """Create one stream and subscribe ``arms`` to it, in random order."""
        stream = self._next_stream()
        post_ns, info, err = await self._create(http, stream)
        recs = {arm: Recorder(stream, post_ns) for arm in arms}
        for arm, rec in recs.items():
            self.recs[arm].append(rec)
            if err:
                rec.fail(err)
        if info is None:
            return
        order = list(arms)
        self.rng.shuffle(order)  # neither arm systematically connects (and is registered) first
        tasks = [asyncio.create_task(subscribe(http, info, self.plan.transports[ARMS.index(arm)], recs[arm],
                                               self.plan.timeout)) for arm in order]
        await asyncio.gather(*tasks)

    async def _slot(self, http: httpx.AsyncClient, end: float | None) -> None:
        await _sleep_until(self.plan.start_at + self.plan.ramp * self.rng.random())
        while True:
            if self.plan.separate:
                await asyncio.gather(*(self._watch(http, (arm,)) for arm in ARMS))
            else:
                await self._watch(http, ARMS)
            if self.progress is not None:
                with self.progress.get_lock():
                    self.progress.value += 1
            if end is None or time.time() >= end:
                return

    async def _warmup(self, http: httpx.AsyncClient, slots: int) -> None:
        """A few short streams first, so connection pools and the server's first-request paths are
        warm; their samples are dropped."""
        real = self.plan
        self.plan = replace(real, max_tokens=min(real.max_tokens, 4))
        try:
            await asyncio.gather(*(self._watch(http, ARMS) for _ in range(min(4, slots))))
        finally:
            self.plan = real
            self.recs = {arm: [] for arm in ARMS}

    async def run(self, wait_for_start: Callable[[], float] | None = None) -> dict[str, ArmSamples]:
        """Warm up, then (``wait_for_start`` blocks until every worker is ready and returns the
        common start time) run every slot."""
        p = self.plan
        slots = len(range(p.worker, p.streams, p.workers))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=4 * slots + 8)
        async with httpx.AsyncClient(limits=limits, trust_env=False,
                                     timeout=httpx.Timeout(p.timeout, connect=30.0)) as http:
            await self._warmup(http, slots)
            if wait_for_start is not None:
                self.plan = p = replace(p, start_at=wait_for_start())
            end = p.start_at + p.duration if p.duration else None
            await asyncio.gather(*(self._slot(http, end) for _ in range(slots)))
        return {arm: to_samples(p.transports[i], self.recs[arm]) for i, arm in enumerate(ARMS)}


async def _sleep_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        await asyncio.sleep(delay)


def worker_main(plan: Plan, progress: Any, ready: Any, go: Any, start_at: Any, results: Any) -> None:
    """Process entry point: warm up, report ready, wait for the common start time, run the plan,
    put ``(worker, samples, CPU seconds used)`` on ``results``."""
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run

    def wait_for_start() -> float:
        ready.put(plan.worker)
        go.wait()  # blocks this worker's loop on purpose: nothing of the run has started yet
        return float(start_at.value)

    samples = runner(Worker(plan, progress).run(wait_for_start))
    results.put((plan.worker, samples, time.process_time()))
