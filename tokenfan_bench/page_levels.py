"""``tokenfan bench page-levels``: where a token's time goes between the socket and the page's handler, per
browser API, in headless Chromium (Debian's ``/usr/bin/chromium`` under Playwright, as the report's browser
arm: :mod:`tokenfan_bench.clients.browser`).

One page (``web/js/levels.js``, loaded from the gateway's ``/ab`` page) reads every fan-out stream at once
with ``EventSource``, with ``fetch()`` + a ``ReadableStream`` reader of the same SSE URL (the lowest level
page code sees HTTP bytes at) and with ``WebSocket``, and stamps each token at each level
(:mod:`tokenfan_bench.stats.page_levels` has the estimators). ``es − fetch`` is EventSource's own cost,
``ws − fetch`` the transports' difference at the lowest level each API allows, ``ws − es`` what the A/B
report's browser arms compare.

Calibration (``--calibrate``): a constant per-API offset in the page's stamps would not move when a known
delay is put on one API's path, and a stamp that does not follow its API's arrival would. Two more
gateways, ``--inject-delay ws:P`` and ``ws:P+D`` (``P`` = the report's placebo, both writes off the engine
step), are read the same way; ``ws − fetch`` must move by the mean sleep the delayed gateway timed minus the
placebo's (its ``/metrics``), and ``es − fetch`` must not move at all (EventSource's stamp does not depend
on when the WebSocket copy of the token arrived).

``--http1`` serves the gateway without TLS, so EventSource and fetch use HTTP/1.1 (one connection each,
Chromium allows 6 per host: at most 3 streams at a time) instead of sharing one HTTP/2 connection: whether
the page's HTTP/2 connection is where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tokenfan_bench.report.run_outputs import load, meta
from tokenfan_bench.servers import processes
from tokenfan_bench.stats import page_levels as pl
from tokenfan_bench.stats.report_estimates import PLACEBO_MS, RESOLUTION_MS, applied_delay, recovered


def run_page(browser: Any, url: str, *, streams: int, rounds: int, max_tokens: int, timeout_s: float,
             n_boot: int, seed: int) -> dict[str, Any]:
    """One page-levels run against the gateway at ``url``: the tokens, every level's difference (with its
    bootstrap replicates, ``boots``) and the clock offset."""
    from tokenfan_bench.clients.browser import clock_offset_ms

    context = browser.new_context(ignore_https_errors=True)
    try:
        page = context.new_page()
        page.goto(url.rstrip("/") + "/ab", wait_until="load")
        offset_ms, uncertainty_ms = clock_offset_ms(page)
        cfg = {"streams": streams, "rounds": rounds, "maxTokens": max_tokens, "timeoutMs": int(timeout_s * 1000)}
        t0 = time.monotonic()
        out = page.evaluate("async (cfg) => (await import('/web/js/levels.js')).run(cfg)", cfg)
        wall = time.monotonic() - t0
    finally:
        context.close()
    records = out["records"]
    toks = pl.tokens(records, server_minus_page_ms=offset_ms + out["timeOriginMs"])
    errors = [f"{r['reader']} stream {r['stream']}: {r['error']}" for r in records if r["error"] is not None]
    return {"url": url, "tokens": len(toks), "dropped": toks.dropped, "errors": errors,
            "streams": len({r["stream"] for r in records}), "wall_s": round(wall, 2),
            "clock_offset_ms": offset_ms, "clock_uncertainty_ms": uncertainty_ms,
            "fetch_events_per_read": {"mean": float(toks.fetch_batch.mean()) if len(toks) else None,
                                      "max": int(toks.fetch_batch.max()) if len(toks) else None},
            "levels": pl.levels(toks, n_boot=n_boot, seed=seed)}


def _public(run: dict[str, Any]) -> dict[str, Any]:
    """A run without the bootstrap replicates (for the JSON)."""
    return {**run, "levels": {k: pl.summarise(v) for k, v in run["levels"].items()}}


def calibration(delayed: dict[str, Any], placebo: dict[str, Any], applied: dict[str, float],
                applied_placebo: dict[str, float]) -> dict[str, Any]:
    """How far the injected WebSocket delay moved each level, against what the gateways slept."""
    expected = applied["mean_ms"] - applied_placebo["mean_ms"]
    moved = {name: pl.shift(delayed["levels"][name], placebo["levels"][name])
             for name in ("ws − fetch", "es − fetch", "ws − es", "ws handler − ws timeStamp")}
    ws, es = moved["ws − fetch"], moved["es − fetch"]
    lo, hi = es["ci95"]
    return {"expected_ms": expected, "applied": applied, "applied_placebo": applied_placebo, "moved": moved,
            "ws_recovered": recovered(ws, expected),
            "es_unmoved": bool(lo - RESOLUTION_MS <= 0 <= hi + RESOLUTION_MS)}


# -- text ---------------------------------------------------------------------------------------------------

def _ci(d: dict[str, Any], nd: int = 3) -> str:
    lo, hi = d["ci95"]
    return f"{d['median']:+.{nd}f} [{lo:+.{nd}f}, {hi:+.{nd}f}]"


def levels_table(run: dict[str, Any]) -> list[str]:
    lines = ["| difference | median ms [95% CI] | p10 / p90 ms | token pairs (streams) | what it measures |",
             "| --- | --- | --- | --- | --- |"]
    for name, d in run["levels"].items():
        d = d if "ci95" in d else pl.summarise(d)
        lines.append(f"| {name} | {_ci(d)} | {d['p10']:+.3f} / {d['p90']:+.3f} | {d['n']} ({d['streams']}) | "
                     f"{d['what']} |")
    return lines


def summary_md(res: dict[str, Any]) -> str:
    m = res["meta"]
    head = (f"`{shlex.join(m['command'])}` at {m['time']}: {m['machine']['cpu_model']} × {m['machine']['cpus']}, "
            f"{res['chromium']}, load {m['load']} before and {res['load_after']} after.")
    lines = ["# Where the browser's time goes, per API", "", head, ""]
    for name, run in res["runs"].items():
        title = (f"## {name}: {run['tokens']} tokens read by all three readers, {run['streams']} streams "
                 f"({run['dropped']} tokens left out: missed or replayed; errors: {len(run['errors'])}); "
                 f"clock offset {run['clock_offset_ms']:+.3f} ± {run['clock_uncertainty_ms']:.3f} ms; "
                 f"SSE events per fetch read: mean {run['fetch_events_per_read']['mean']}")
        lines += [title, "", *levels_table(run), ""]
    cal = res.get("calibration")
    if cal:
        title = (f"## Calibration: WebSocket writes delayed {cal['expected_ms']:.3f} ms more than the placebo's "
                 f"(gateway-timed mean sleeps {cal['applied']['mean_ms']:.3f} − "
                 f"{cal['applied_placebo']['mean_ms']:.3f})")
        verdicts = (f"ws − fetch recovered the delay: {'✓' if cal['ws_recovered'] else '✗'}; "
                    f"es − fetch unmoved: {'✓' if cal['es_unmoved'] else '✗'}")
        lines += [title, "", "| difference | moved by ms [95% CI] |", "| --- | --- |",
                  *(f"| {name} | {_ci(d)} |" for name, d in cal["moved"].items()), "", verdicts, ""]
    return "\n".join(lines)


# -- command line -------------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan bench page-levels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=4, help="concurrent streams in the page (default 4)")
    ap.add_argument("--rounds", type=int, default=6, help="streams each slot reads in turn (default 6)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per stream (default 48)")
    ap.add_argument("--rate", type=float, default=20.0, help="synthetic tokens/s per stream (default 20)")
    ap.add_argument("--ttft-ms", type=float, default=300.0,
                    help="synthetic TTFT (default 300: every reader is open before the first token)")
    ap.add_argument("--http1", action="store_true", help="plain HTTP: EventSource and fetch on HTTP/1.1")
    ap.add_argument("--calibrate", action="store_true",
                    help=f"also read gateways with --inject-delay ws:{PLACEBO_MS:g} and ws:{PLACEBO_MS:g}+INJECT_MS")
    ap.add_argument("--inject-ms", type=float, default=2.0, help="the calibration's delay (default 2)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds one stream may take")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="output directory (default bench-results/page-levels-<time>)")
    return ap


@contextlib.contextmanager
def _gateways(ns: argparse.Namespace, logs: Path) -> Iterator[dict[str, str]]:
    """The measured gateway and, with ``--calibrate``, the placebo and the delayed one (name -> URL)."""
    from gateway.http.certs import generate

    with tempfile.TemporaryDirectory(prefix="tokenfan-levels-") as tmp, contextlib.ExitStack() as stack:
        base: list[str] = []
        if not ns.http1:
            cert, key = generate(Path(tmp) / "tls")
            base = [f"--ssl-certfile={cert}", f"--ssl-keyfile={key}"]
        wanted = {"measured": base}
        if ns.calibrate:
            wanted["placebo"] = [*base, f"--inject-delay=ws:{PLACEBO_MS:g}"]
            wanted["delayed"] = [*base, f"--inject-delay=ws:{PLACEBO_MS + ns.inject_ms:g}"]
        with ThreadPoolExecutor(len(wanted)) as pool:  # started together: each waits seconds for its imports
            futures = {name: pool.submit(processes.spawn_synthetic, ns.rate, ns.ttft_ms, logs, args)
                       for name, args in wanted.items()}
        for f in futures.values():
            if f.exception() is None:
                stack.enter_context(f.result())
        failed = [e for e in (f.exception() for f in futures.values()) if e is not None]
        if failed:
            raise failed[0]
        yield {name: f.result().url for name, f in futures.items()}


def _chromium_version() -> str:
    from tokenfan_bench.clients.browser import CHROMIUM

    try:
        out = subprocess.run([str(CHROMIUM), "--version"], check=False, capture_output=True, text=True, timeout=20).stdout
        return out.strip().splitlines()[-1] if out.strip() else str(CHROMIUM)
    except (OSError, subprocess.SubprocessError):
        return str(CHROMIUM)


def measure(ns: argparse.Namespace, argv: list[str], logs: Path) -> dict[str, Any]:
    """Every run of the command line ``ns``: the results dictionary (JSON-ready, no replicates)."""
    from tokenfan_bench.clients.browser import chromium
    from tokenfan_bench.report.matrix import scrape_sleeps

    res: dict[str, Any] = {"meta": meta(["page-levels", *argv], ns.seed), "chromium": _chromium_version(),
                           "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
                           "runs": {}}
    kw = {"streams": ns.streams, "rounds": ns.rounds, "max_tokens": ns.max_tokens, "timeout_s": ns.timeout,
          "n_boot": ns.bootstrap, "seed": ns.seed}
    with _gateways(ns, logs) as urls, chromium() as browser:
        runs = {}
        for name, url in urls.items():
            before = scrape_sleeps(url) if name != "measured" else None
            runs[name] = run_page(browser, url, **kw)
            if before is not None:
                runs[name]["applied"] = applied_delay(scrape_sleeps(url) - before)
    if ns.calibrate:
        res["calibration"] = calibration(runs["delayed"], runs["placebo"], runs["delayed"]["applied"],
                                         runs["placebo"]["applied"])
    res["runs"] = {name: _public(r) for name, r in runs.items()}
    res["load_after"] = load()
    return res


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    if ns.http1 and ns.streams > 3:
        parser().error("--http1: at most 3 streams (EventSource and fetch take 2 of Chromium's 6 connections per host)")
    out = ns.out or Path("bench-results") / time.strftime("page-levels-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    res = measure(ns, argv, out)
    (out / "results.json").write_text(json.dumps(res, indent=1, allow_nan=True))
    text = summary_md(res)
    (out / "summary.md").write_text(text)
    print(text)
    print(f"\nwrote {out / 'results.json'} and {out / 'summary.md'}", file=sys.stderr)
    return 0
