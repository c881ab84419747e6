"""The browser arm: headless Chromium (Playwright, Debian's ``/usr/bin/chromium``) reads fan-out streams
with the browser's own ``EventSource`` (``es``), a streamed ``fetch`` (``fetch``) and ``WebSocket``
(``ws``) from a page served by the gateway at ``url`` (a shaping-proxy route or nginx, so the page's own
connections take the run's path). The page code is ``web/js/bencharm.js``.

``separate=True`` (what ``tokenfan bench report`` runs) gives each stream to one arm, as a page reads a
stream with one API, and compares the arms' medians (unpaired); otherwise every arm reads every stream
(paired per token). Two APIs reading the same token in one browser act on each other, so paired figures
are not the transports' own. Measured on the calibration (lan, ``--inject-delay ws:2`` against
``ws:0``, 4 slots × 5 rounds, two runs each, 2026-11-24): paired, EventSource's median delivery was
2.78 / 2.54 ms on the delayed gateway, where the WebSocket copy of a token arrived after it, and 3.39 / 3.17
ms on the placebo, where the WebSocket copy arrived ~1.5 ms before it, so the difference-in-differences
read 2.43 / 2.48 ms for a 2.08 ms delay (the report's browser calibration missed in 4 profiles of 5 by
0.3-0.5 ms); on separate streams EventSource read 2.82 / 2.31 ms and 2.81 / 2.46 ms on the two gateways
and the difference-in-differences 2.23 / 2.13 ms.

Clock alignment: receive times are the page's ``performance.timeOrigin + performance.now()``; the
offset to the server's clock (``time.time_ns()`` on this machine) is measured over CDP, not over the
shaped path: the bench reads the page clock between two readings of its own and keeps the tightest of
:data:`CLOCK_PINGS` round trips (offset ± half of it, reported). Paired differences do not depend on it.

Chromium's CPU is the whole browser process tree's (``psutil``) over the run, per received event.
The result has the shape of a socket run (:func:`tokenfan_bench.report.run_outputs.run_result`), transports
named ``browser-es``, ``browser-fetch``, ``browser-ws``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from tokenfan_bench.clients.workers import Plan
from tokenfan_bench.report.run_outputs import run_result
from tokenfan_bench.runner import Run, scrape
from tokenfan_bench.stats.metrics import ArmSamples

BROWSER_ARMS = ("es", "fetch", "ws", "wt")  # wt: WebTransport to the gateway's --http3-port (run_browser's wt)
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
CLOCK_PINGS = 20


def clock_offset_ms(page: Any) -> tuple[float, float]:
    """Server clock − page clock (ms) and its uncertainty (half the tightest round trip)."""
    best: tuple[float, float] | None = None
    for _ in range(CLOCK_PINGS):
        t0 = time.time_ns() / 1e6
        page_ms = page.evaluate("performance.timeOrigin + performance.now()")
        t1 = time.time_ns() / 1e6
        if best is None or t1 - t0 < best[1]:
            best = ((t0 + t1) / 2 - page_ms, t1 - t0)
    assert best is not None
    return best[0], best[1] / 2


def _tree_cpu(pid: int) -> float:
    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in (root, *root.children(recursive=True)):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    return total


def samples(records: list[dict[str, Any]], arm: int, transport: str, offset_ms: float) -> ArmSamples:
    """One arm's subscriber records from the page as :class:`ArmSamples` (times on the server clock)."""
    recs = [r for r in records if r["arm"] == arm]
    rows = [(r["stream"], *row) for r in recs for row in r["rows"]]
    a = ArmSamples(transport)
    if rows:
        m = np.array([[s, seq, emit, sent, recv, deltas, content] for s, seq, emit, sent, recv, deltas, content
                      in rows], dtype=np.float64)
        a.stream, a.seq = m[:, 0].astype(np.int64), m[:, 1].astype(np.int64)
        a.emit_ns, a.sent_ns = m[:, 2].astype(np.int64), m[:, 3].astype(np.int64)
        a.recv_ns = np.round((m[:, 4] + offset_ms) * 1e6).astype(np.int64)
        a.deltas, a.content = m[:, 5].astype(np.int64), m[:, 6] > 0
    a.sub_stream = np.array([r["stream"] for r in recs], np.int64)
    a.post_ns = np.array([round((r["postMs"] + offset_ms) * 1e6) for r in recs], np.int64)
    a.connected_ns = np.array([round((r["openMs"] + offset_ms) * 1e6) if r["openMs"] is not None else 2**62
                               for r in recs], np.int64)
    a.ok = np.array([r["error"] is None for r in recs], bool)
    a.errors = [str(r["error"]) for r in recs if r["error"] is not None]
    counts = [len(r["rows"]) for r in recs]
    a.live = a.emit_ns >= np.repeat(a.connected_ns, counts) if rows else np.zeros(0, bool)
    return a


def run_browser(url: str, arms: tuple[str, ...], *, streams: int, rounds: int, max_tokens: int,
                metrics_url: str | None = None, timeout_s: float = 60.0, ramp: float = 0.5, n_boot: int = 1000,
                seed: int = 0, ws_origins: tuple[str, ...] = (), browser: Any = None, separate: bool = False,
                mark_jitter: Callable[[Iterable[ArmSamples]], None] | None = None,
                wt: dict[str, str] | None = None) -> dict[str, Any]:
    """One browser run against the gateway (or proxy) at ``url``: a bench result dictionary, plus the
    clock offset, its uncertainty and whether every arm received the same text for the same seed (the
    streams of a round share one). ``ws_origins``: stream slot ``i`` opens its WebSockets to
    ``ws_origins[i]`` (the gateway must allow those origins). ``separate``: each stream read by one arm
    (module docstring). ``browser``: a Chromium from :func:`chromium` to run in (a fresh context);
    default: launch one. ``mark_jitter``: the run's shaping path
    (:meth:`tokenfan_bench.network.paths.Paths.mark_jitter`), so unpaired differences drop its known jitter.
    ``wt``: ``{"url": "https://HOST:PORT/v1/wt", "hash": SHA-256 hex of its certificate}`` for the ``wt`` arm
    (the browser must be a :func:`chromium` with ``quic=True``)."""
    bad = [a for a in arms if a not in BROWSER_ARMS]
    if bad or len(arms) < 2:
        raise ValueError(f"browser arms: 2 or more of {', '.join(BROWSER_ARMS)}; got {arms}")
    if "wt" in arms and not wt:
        raise ValueError("the wt browser arm needs wt={'url': ..., 'hash': ...} (the gateway's --http3-port)")
    metrics_url = metrics_url or url
    with contextlib.ExitStack() as stack:
        if browser is None:
            browser = stack.enter_context(chromium(quic="wt" in arms))
        context = browser.new_context(ignore_https_errors=True)
        try:
            page = context.new_page()
            page.goto(url.rstrip("/") + "/ab", wait_until="load")
            offset_ms, uncertainty_ms = clock_offset_ms(page)
            cfg = {"arms": list(arms), "streams": streams, "rounds": rounds, "maxTokens": max_tokens,
                   "timeoutMs": int(timeout_s * 1000), "ramp": ramp, "wsOrigins": list(ws_origins),
                   "separate": separate, "wt": wt}
            pid = _browser_pid(browser)
            cpu0_server, _ = scrape(metrics_url)
            cpu0, t0 = _tree_cpu(pid), time.time()
            records = page.evaluate("async (cfg) => (await import('/web/js/bencharm.js')).run(cfg)", cfg)
            cpu1, wall = _tree_cpu(pid), time.time() - t0
            cpu1_server, _ = scrape(metrics_url)
        finally:
            context.close()
    transports = tuple(f"browser-{a}" for a in arms)
    plan = Plan(url=url, transports=transports, streams=streams, max_tokens=max_tokens, duration=None,
                separate=separate, client="browser")
    arm_samples = {name: samples(records, k, t, offset_ms) for k, (name, t) in enumerate(zip(plan.arms, transports))}
    if mark_jitter is not None:
        mark_jitter(arm_samples.values())
    run = Run(plan=plan, workers=1, arms=arm_samples, wall_s=wall,
              cpu_s=(cpu1_server - cpu0_server) if cpu0_server is not None and cpu1_server is not None else None,
              sent={}, client_cpu_s=cpu1 - cpu0)
    result = run_result(run, n_boot=n_boot, seed=seed)
    texts: dict[int, set[str]] = {}
    for r in records:
        if r["error"] is None:
            texts.setdefault(r["seed"], set()).add(r["text"])
    result["browser"] = {"clock_offset_ms": offset_ms, "clock_uncertainty_ms": uncertainty_ms,
                         "texts_identical": all(len(t) == 1 for t in texts.values()) and bool(texts),
                         "chromium": str(CHROMIUM), "rounds": rounds,
                         "separate_streams": separate}
    result["_run"] = run
    return result


@contextlib.contextmanager
def chromium(quic: bool = False) -> Iterator[Any]:
    """Headless Debian Chromium under Playwright, closed on exit (one launch for many runs). QUIC is off
    unless ``quic`` (WebTransport needs it; the page's own connections stay HTTP/2 either way: the gateway
    advertises no HTTP/3 on its TCP port)."""
    from playwright.sync_api import sync_playwright

    args = [a for a in CHROMIUM_ARGS if not (quic and a == "--disable-quic")]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=args, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def _browser_pid(browser: Any) -> int:
    """The Chromium main process (Playwright does not expose it: the newest chromium child of ours)."""
    me = psutil.Process()
    kids = [p for p in me.children(recursive=True) if "chrom" in p.name().lower()]
    return min(kids, key=lambda p: p.create_time()).pid if kids else me.pid
