"""Client-side helpers for e2e tests: SSE parsing and metric scraping with real clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.core import sse
from tests.procs import engine_and_gateway
from tokenfan_bench.servers.processes import Proc, children, engine_child


def sse_events(text: str) -> list[dict[str, str]]:
    """An SSE body's events (the gateway's decoder, :func:`gateway.core.sse.decode`; comments and data-less
    blocks such as ``retry:`` are not events)."""
    return [event_dict(ev) for ev in sse.decode(text)]


def event_dict(ev: sse.SseEvent) -> dict[str, str]:
    """``{"event", "data"[, "id"]}`` of a decoded event."""
    return {"event": ev.event, "data": ev.data.decode(), **({"id": ev.id} if ev.id is not None else {})}


def chunk_text(chunk: dict) -> str:
    if not chunk.get("choices"):
        return ""
    c = chunk["choices"][0]
    return c["delta"].get("content") or "" if "delta" in c else c.get("text") or ""


def sample(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of the sample ``name`` with exactly ``labels`` in a ``/metrics`` text, or None."""
    want = labels or {}
    return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == name and s.labels == want), None)


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """:func:`sample` of the gateway at ``url`` (http or https) now; 0 when absent."""
    value = sample(httpx.get(url + "/metrics", verify=False, timeout=5).text, name, labels)
    return 0.0 if value is None else value


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 5.0, what: str = "condition") -> None:
    """:func:`wait_until` inside an event loop: a blocking poll would stall the clients the test runs there."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def listening(url: str) -> bool:
    """Whether the server at ``url`` answers ``/health`` at all (whatever the status: it serves HTTP)."""
    try:
        httpx.get(url + "/health", timeout=5)
        return True
    except httpx.HTTPError:
        return False


def one_of_runs(run: Callable[[int], str | None], what: str, tries: int = 3) -> None:
    """``run(i)`` (it asserts what must hold on every run and returns what a check that needs a quiet
    moment missed, or None) up to ``tries`` times until one run misses nothing; else fail with ``what`` and
    every miss."""
    misses = []
    for i in range(tries):
        miss = run(i)
        if miss is None:
            return
        misses.append(miss)
    raise AssertionError(f"{what}: {misses}")


T = TypeVar("T")


def with_applied_delay(url: str, transport: str, run: Callable[[], T]) -> tuple[T, dict[str, float]]:
    """``run()``'s result and what the gateway's ``--inject-delay`` applied to ``transport`` meanwhile (the
    sleeps it timed, :func:`~tokenfan_bench.stats.report_estimates.applied_delay`): an ``asyncio.sleep`` lasts
    longer on a busy machine, and a bench must recover the delay that was applied."""
    from tokenfan_bench.stats.report_estimates import applied_delay, injected_sleeps

    before = injected_sleeps(httpx.get(url + "/metrics").text, transport)
    result = run()
    return result, applied_delay(injected_sleeps(httpx.get(url + "/metrics").text, transport) - before)


def engine_load(url: str) -> tuple[int, int]:
    eng = httpx.get(url + "/health").json()["engine"]
    return eng["running"], eng["waiting"]


def data_json(ev: dict[str, str]) -> dict:
    return json.loads(ev["data"])


@contextlib.contextmanager
def fat_gateway(ipc_dir: Path, name: str) -> Iterator[str]:
    """An engine emitting 2,000-character tokens at 1,000/s (~2 MB/s per stream) behind a gateway with a
    1 s send timeout: a client that stops reading fills every buffer on the way (the kernel alone may
    hold 4 MB per socket) within seconds, long before a multi-thousand-token stream ends."""
    with engine_and_gateway(f"ipc://{ipc_dir / f'{name}.sock'}",
                            ("--engine", "synthetic", "--synthetic-tokens-per-s", "1000", "--synthetic-token-chars",
                             "2000", "--max-model-len", "20000"),
                            ("--send-timeout", "1", "--max-tokens-cap", "20000"), name=name) as url:
        yield url


def stalled_client(url: str, request: bytes) -> socket.socket:
    """A raw HTTP client with a 2 KB receive window that sends ``request`` and then never reads."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect((host, int(port)))
    sock.sendall(request)
    return sock


# -- the Responses API through the openai SDK ----------------------------------------------------------------

TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})


def until_terminal(conn: Any, lanes: int = 1) -> list[Any]:
    """Events of a ``responses.connect()`` socket up to the terminal event of each of ``lanes`` responses."""
    events, done = [], 0
    for ev in conn:
        events.append(ev)
        if ev.type in TERMINAL:
            done += 1
            if done == lanes:
                return events
    raise AssertionError("socket closed before the terminal event")


def drop_inside_the_call(stream: Any) -> list[Any]:
    """A streamed response's events up to its first function-call arguments delta, then the connection drops."""
    seen = []
    for ev in stream:
        seen.append(ev)
        if ev.type == "response.function_call_arguments.delta":
            break
    stream.close()
    return seen


def in_flight_traces(engine_log: str) -> set[str]:
    """The trace ids (the clients' ``X-Request-ID``) of the requests in flight on an engine, from its log
    (:func:`in_flight`; ``accepted <id> trace=<trace>`` lines)."""
    accepted, finished = _accepted_and_finished(engine_log)
    return {trace for rid, trace in accepted.items() if rid not in finished}


def in_flight(engine_log: str) -> set[str]:
    """The requests an engine had accepted and not finished, from its log (``accepted <id>`` and
    ``finished <id>`` lines): what was in flight when it was killed."""
    accepted, finished = _accepted_and_finished(engine_log)
    return set(accepted) - finished


def _accepted_and_finished(engine_log: str) -> tuple[dict[str, str], set[str]]:
    """Each accepted request's trace id (``""`` when the line has none), and the finished requests."""
    accepted: dict[str, str] = {}
    finished: set[str] = set()
    for line in engine_log.splitlines():
        if " accepted " in line:
            rid, _, rest = line.split(" accepted ", 1)[1].partition(" trace=")
            rid = rid.split()[0]
            accepted[rid] = rest.split()[0] if rest else ""
        elif " finished " in line:
            finished.add(line.split(" finished ", 1)[1].split()[0])
    return accepted, finished


def engine_core(serve: Proc) -> int:
    """The pid of vLLM's EngineCore process under ``tokenfan serve``'s engine worker."""
    found, todo = [], [engine_child(serve.popen.pid)]
    while todo:
        for c in children(todo.pop()):
            todo.append(c.pid)
            if c.argv and c.argv[0].startswith(b"VLLM::EngineCore"):
                found.append(c.pid)
    (pid,) = found
    return pid


def step_stopped(pid: int, seconds: float = 0.01) -> None:
    """Let a stopped (SIGSTOP) process run for ``seconds``, then stop it again."""
    os.kill(pid, signal.SIGCONT)
    time.sleep(seconds)
    os.kill(pid, signal.SIGSTOP)
