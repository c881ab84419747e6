"""Run one bench measurement: client worker processes against one server, plus the server's
``/metrics`` before and after (CPU seconds, chunks sent)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from tokenfan_bench.clients.workers import Plan, worker_main
from tokenfan_bench.stats.metrics import ArmSamples

CPU_SECONDS = "process_cpu_seconds_total"
CHUNKS_SENT = "tokenfan_chunks_sent_total"


@dataclass
class Run:
    plan: Plan
    workers: int
    arms: dict[str, ArmSamples]
    wall_s: float  # first scheduled start -> last chunk received
    cpu_s: float | None  # server process CPU seconds during the run (None: no /metrics)
    sent: dict[str, float]  # chunks the server reports written, by transport
    client_cpu_s: float = 0.0  # CPU of all client workers from the common start to their last event


def scrape(url: str) -> tuple[float | None, dict[str, float]]:
    """:func:`server_counters` of the server at ``url`` now; ``(None, {})`` when it is unreachable or has no
    ``/metrics``."""
    try:
        resp = httpx.get(url + "/metrics", timeout=5.0, trust_env=False, verify=False)
    except httpx.HTTPError:
        return None, {}
    return server_counters(resp.text) if resp.status_code == 200 else (None, {})


def server_counters(text: str) -> tuple[float | None, dict[str, float]]:
    """The server's CPU seconds (:data:`CPU_SECONDS`; None when absent) and chunks written by transport
    (:data:`CHUNKS_SENT`) in a ``/metrics`` text; ``(None, {})`` for a text that is not one."""
    cpu: float | None = None
    sent: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == CPU_SECONDS and not s.labels:
                    cpu = s.value
                elif s.name == CHUNKS_SENT and "transport" in s.labels:
                    sent[s.labels["transport"]] = s.value
    except ValueError:  # some other page (an HTML page, JSON): no metrics here
        return None, {}
    return cpu, sent


def run_clients(plan: Plan, workers: int, desc: str = "bench", progress_bar: bool = True,
                on_start: Callable[[], object] | None = None, on_end: Callable[[], object] | None = None) -> Run:
    """Run ``plan`` split over ``workers`` processes; returns the merged samples. ``on_start`` is called
    once every worker has warmed up, ``on_end`` once every worker has finished (e.g. to reset and read the
    shaping proxy's byte counters)."""
    ctx = mp.get_context("spawn")  # a clean interpreter: no inherited event loop, threads or sockets
    progress, start_at, go = ctx.Value("i", 0), ctx.Value("d", 0.0), ctx.Event()
    ready, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=worker_main, args=(replace(plan, workers=workers, worker=w), progress, ready, go,
                                                   start_at, results), name=f"bench-client-{w}", daemon=True)
             for w in range(workers)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=120)
        cpu0, sent0 = scrape(plan.metrics_url or plan.url)
        if on_start is not None:
            on_start()
        start_at.value = time.time() + 0.2
        go.set()
        got, client_cpu = _collect(procs, results, progress, plan, desc, progress_bar)
        cpu1, sent1 = scrape(plan.metrics_url or plan.url)
        if on_end is not None:
            on_end()
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    arms = {arm: ArmSamples.concat(t, [got[w][arm] for w in sorted(got)])
            for arm, t in zip(plan.arms, plan.transports)}
    last = max((int(a.recv_ns.max()) for a in arms.values() if a.recv_ns.size), default=int(start_at.value * 1e9))
    return Run(plan=plan, workers=workers, arms=arms, wall_s=max(1e-9, last / 1e9 - start_at.value),
               cpu_s=(cpu1 - cpu0) if cpu0 is not None and cpu1 is not None else None,
               sent={t: sent1.get(t, 0.0) - sent0.get(t, 0.0) for t in sent1}, client_cpu_s=client_cpu)


def _collect(procs: Sequence[mp.process.BaseProcess], results: mp.queues.Queue, progress: mp.sharedctypes.Synchronized,
             plan: Plan, desc: str, progress_bar: bool) -> tuple[dict[int, dict[str, ArmSamples]], float]:
    got: dict[int, dict[str, ArmSamples]] = {}
    cpu = 0.0
    duration = plan.duration
    bar = tqdm(total=round(duration) if duration is not None else plan.streams, desc=desc,
               unit="s" if duration is not None else "stream", disable=not progress_bar, leave=False,
               dynamic_ncols=True)
    t0 = time.monotonic()
    with bar:
        while len(got) < len(procs):
            try:
                w, samples, used = results.get(timeout=0.25)  # drain before join: big results block an exit
                got[w] = samples
                cpu += used
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"bench client {dead[0].name} exited with {dead[0].exitcode}")
            done = progress.value
            bar.n = min(bar.total, int(time.monotonic() - t0)) if duration is not None else min(done, plan.streams)
            bar.set_postfix_str(f"{done} streams done", refresh=False)
            bar.refresh()
    return got, cpu
