"""Subscriber worker processes: create fan-out streams, subscribe every arm to them, and record every
chunk with its receive time (``time.time_ns()``).

Two clients (``Plan.client``): ``fast`` (:mod:`.fast`: asyncio protocols, picows, a minimal
HTTP/2 client; a few µs of CPU per event) and ``python`` (:mod:`.httpx_websockets`: httpx and websockets,
~190 µs per event). Both record through :mod:`.recorder`.

A run is split over worker processes (:func:`worker_main`); each owns a share of the concurrency
slots and returns its raw samples and the CPU time it used during the run, which the parent adds up.
A slot runs streams back to back (closed loop, like ``vllm bench serve --max-concurrency``) until
``duration`` has passed, or once. Slot start times are spread uniformly over ``ramp`` seconds so the
synthetic engine's per-stream token clocks are not all in phase.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import orjson

from tokenfan_bench.clients.recorder import Recorder, to_samples
from tokenfan_bench.clients.responses import RESPONSES_TRANSPORTS, ResponseRecorder, ResponsesClient
from tokenfan_bench.stats.metrics import ArmSamples

QUIC_TRANSPORTS = ("sse-h3", "wt")  # to the gateway's --http3-port (tokenfan_bench/clients/quic.py)
TRANSPORTS = ("sse", "ws", "sse-h2", "ws-h2", *QUIC_TRANSPORTS, *RESPONSES_TRANSPORTS)  # resp-*: unpaired
CLIENTS = ("fast", "python")


WARMUP_SLOTS = 64  # warm-up streams at most (see Worker._warmup)


def arm_names(n: int) -> tuple[str, ...]:
    """``A``, ``B``, ``C``… for ``n`` arms."""
    return tuple(string.ascii_uppercase[:n])


@dataclass(frozen=True)
class Plan:
    """What one worker runs (picklable: it crosses the process boundary)."""

    url: str
    transports: tuple[str, ...]  # one per arm: A, B, (C…)
    streams: int  # concurrency slots in the whole run
    max_tokens: int
    duration: float | None  # None: each slot runs ``rounds`` streams, one after another
    separate: bool  # one stream per arm instead of one stream watched by every arm
    endpoint: str = "chat.completions"
    ramp: float = 1.0
    seed: int = 0
    start_at: float = 0.0  # epoch seconds; all workers start together
    timeout: float = 120.0
    workers: int = 1
    worker: int = 0
    client: str = "fast"
    cafile: str | None = None  # verify https/wss against this CA (default: not verified)
    h2_streams_per_connection: int = 1
    body: dict[str, Any] = field(default_factory=dict)
    # Per arm, the base URL its subscriptions go to (a shaping-proxy route, nginx…); empty: ``url``.
    arm_urls: tuple[str, ...] = ()
    metrics_url: str = ""  # where the server's /metrics is scraped (default ``url``)
    rounds: int = 1  # streams per slot, one after another, when ``duration`` is None

    @property
    def arms(self) -> tuple[str, ...]:
        return arm_names(len(self.transports))

    def arm_url(self, arm: str) -> str:
        return self.arm_urls[self.arms.index(arm)] if self.arm_urls else self.url


def rebase(info: dict[str, Any], base: str) -> dict[str, Any]:
    """A stream's ``events_url``/``ws_url`` moved to ``base`` (scheme, host and port; ws/wss follow)."""
    from urllib.parse import urlsplit

    b = urlsplit(base)
    out = dict(info)
    for key, scheme in (("events_url", b.scheme), ("ws_url", "wss" if b.scheme == "https" else "ws")):
        if key in info:
            out[key] = urlsplit(info[key])._replace(scheme=scheme, netloc=b.netloc).geturl()
    return out


class Backend(Protocol):
    """One client implementation, living in one worker's event loop."""

    @property
    def name(self) -> str: ...

    @property
    def errors(self) -> tuple[type[Exception], ...]:
        """What a failed subscription may raise (besides TimeoutError)."""

    @property
    def transports(self) -> tuple[str, ...]: ...

    async def post(self, url: str, body: bytes) -> tuple[int, bytes]: ...

    async def subscribe(self, transport: str, info: dict[str, Any], rec: Recorder) -> None: ...

    async def aclose(self) -> None: ...


def make_backend(plan: Plan, slots: int) -> Backend:
    if plan.client == "python":
        from tokenfan_bench.clients.httpx_websockets import PythonBackend

        backend: Backend = PythonBackend(slots, plan.timeout, plan.cafile)
    else:
        from tokenfan_bench.clients.fast_backend import FastBackend

        backend = FastBackend(plan.cafile, plan.h2_streams_per_connection)
    missing = [t for t in plan.transports if t not in backend.transports and t not in RESPONSES_TRANSPORTS]
    if missing:
        raise ValueError(f"--client {plan.client} has no {', '.join(missing)} arm")
    return backend


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
        self.recs: dict[str, list[Recorder]] = {arm: [] for arm in plan.arms}
        self._ids = itertools.count()
        self._last_order: list[str] | None = None  # see _order
        self.backend: Backend | None = None
        self.responses: dict[str, ResponsesClient] = {}  # the resp-sse / resp-ws arms, by base URL
        self._errors: tuple[type[Exception], ...] = (TimeoutError,)

    def _next_stream(self) -> int:
        return self.plan.worker + self.plan.workers * next(self._ids)

    async def _create(self, stream: int) -> tuple[int, dict[str, Any] | None, str | None]:
        assert self.backend is not None
        post_ns = time.time_ns()
        try:
            async with asyncio.timeout(self.plan.timeout):
                status, body = await self.backend.post(self.plan.url + "/v1/streams", stream_body(self.plan, stream))
        except self._errors as exc:
            return post_ns, None, f"POST /v1/streams: {type(exc).__name__}: {exc}"[:300]
        if status != 201:
            return post_ns, None, f"POST /v1/streams: HTTP {status} {body[:200]!r}"
        return post_ns, orjson.loads(body), None

    async def _subscribe(self, transport: str, info: dict[str, Any], rec: Recorder) -> None:
        assert self.backend is not None
        try:
            async with asyncio.timeout(self.plan.timeout):
                await self.backend.subscribe(transport, info, rec)
        except self._errors as exc:
            rec.fail(f"{transport}: {type(exc).__name__}: {exc}"[:300])

    async def _watch(self, arms: tuple[str, ...]) -> None:
        """Create one stream and subscribe ``arms`` to it, in random order."""
        transports = dict(zip(self.plan.arms, self.plan.transports))
        if any(transports[arm] in RESPONSES_TRANSPORTS for arm in arms):  # no shared stream: one each
            await asyncio.gather(*(self._respond(arm, transports[arm]) for arm in arms))
            return
        stream = self._next_stream()
        post_ns, info, err = await self._create(stream)
        recs = {arm: Recorder(stream, post_ns) for arm in arms}
        for arm, rec in recs.items():
            self.recs[arm].append(rec)
            if err:
                rec.fail(err)
        if info is None:
            return
        order = self._order(arms)
        infos = {arm: rebase(info, self.plan.arm_url(arm)) if self.plan.arm_urls else info for arm in arms}
        await asyncio.gather(*(self._subscribe(transports[arm], infos[arm], recs[arm]) for arm in order))

    def _order(self, arms: tuple[str, ...]) -> list[str]:
        """The order in which ``arms`` subscribe to the next stream: a random permutation, then its
        reverse for the stream after, and so on.

        The gateway registers a stream's subscribers in arrival order and writes every event to them in
        that order (rotated by ``seq`` within a transport: with three SSE subscribers the rotation has
        period 3, which the even/odd pairing of :func:`tokenfan_bench.stats.metrics.order_balanced_differences`
        does not cancel). A random order per stream only balances who is written first on average; over
        ten streams one order can dominate and an A/A pair then reads a few tens of µs apart. Reversing
        every other permutation puts each pair of arms in each order equally often, exactly."""
        if self._last_order is not None and sorted(self._last_order) == sorted(arms):
            order, self._last_order = self._last_order[::-1], None
            return order
        order = list(arms)
        self.rng.shuffle(order)
        self._last_order = order
        return list(order)

    async def _respond(self, arm: str, transport: str) -> None:
        """An arm's own response (``resp-sse``/``resp-ws``, :mod:`.responses`); for a plain
        transport, its own fan-out stream."""
        if transport not in RESPONSES_TRANSPORTS:
            await self._watch((arm,))
            return
        client = self.responses[self.plan.arm_url(arm)]
        rec = ResponseRecorder(self._next_stream(), time.time_ns())
        self.recs[arm].append(rec)
        try:
            async with asyncio.timeout(self.plan.timeout):
                await client.respond(transport, self.plan.max_tokens, rec)
        except self._errors as exc:
            rec.fail(f"{transport}: {type(exc).__name__}: {exc}"[:300])

    async def _slot(self, end: float | None) -> None:
        await _sleep_until(self.plan.start_at + self.plan.ramp * self.rng.random())
        rounds = self.plan.rounds
        while True:
            if self.plan.separate:
                await asyncio.gather(*(self._watch((arm,)) for arm in self.plan.arms))
            else:
                await self._watch(self.plan.arms)
            if self.progress is not None:
                with self.progress.get_lock():
                    self.progress.value += 1
            rounds -= 1
            if (end is None and rounds <= 0) or (end is not None and time.time() >= end):
                return

    async def _warmup(self, slots: int) -> None:
        """Short streams first, one per slot (up to :data:`WARMUP_SLOTS`), so connection pools hold a
        connection per slot and the server's first-request paths are warm: otherwise only the first few
        slots reuse a connection and the others pay a handshake (one RTT more over TLS) in their TTFT.
        Their samples are dropped."""
        real = self.plan
        self.plan = replace(real, max_tokens=min(real.max_tokens, 4))
        try:
            await asyncio.gather(*(self._watch(real.arms) for _ in range(min(WARMUP_SLOTS, slots))))
        finally:
            self.plan = real
            self.recs = {arm: [] for arm in real.arms}

    async def run(self, wait_for_start: Callable[[], float] | None = None) -> tuple[dict[str, ArmSamples], float]:
        """Warm up, then (``wait_for_start`` blocks until every worker is ready and returns the
        common start time) run every slot. Returns the samples per arm and the CPU seconds this
        process used from the start to the end of the run."""
        p = self.plan
        slots = len(range(p.worker, p.streams, p.workers))
        self.backend = make_backend(p, slots)
        self._errors = (*self.backend.errors, TimeoutError)
        for arm, t in zip(p.arms, p.transports):
            if t in RESPONSES_TRANSPORTS and p.arm_url(arm) not in self.responses:
                self.responses[p.arm_url(arm)] = ResponsesClient(p.arm_url(arm), p.client, p.cafile)
        try:
            await self._warmup(slots)
            if wait_for_start is not None:
                self.plan = p = replace(p, start_at=wait_for_start())
            cpu0 = time.process_time()
            end = p.start_at + p.duration if p.duration else None
            await asyncio.gather(*(self._slot(end) for _ in range(slots)))
            cpu = time.process_time() - cpu0
        finally:
            await self.backend.aclose()
            for client in self.responses.values():
                client.close()
        return {arm: to_samples(t, self.recs[arm]) for arm, t in zip(p.arms, p.transports)}, cpu


async def _sleep_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        await asyncio.sleep(delay)


def worker_main(plan: Plan, progress: Any, ready: Any, go: Any, start_at: Any, results: Any) -> None:
    """Process entry point: warm up, report ready, wait for the common start time, run the plan,
    put ``(worker, samples, CPU seconds used during the run)`` on ``results``."""
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run

    def wait_for_start() -> float:
        ready.put(plan.worker)
        go.wait()  # blocks this worker's loop on purpose: nothing of the run has started yet
        return float(start_at.value)

    samples, cpu = runner(Worker(plan, progress).run(wait_for_start))
    results.put((plan.worker, samples, cpu))
