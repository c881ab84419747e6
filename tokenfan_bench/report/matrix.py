"""``tokenfan bench report``: the A/B answer under real conditions, as one docs-ready markdown report.

One command runs a matrix on synthetic engines it starts itself (token rate and TTFT fixed, so every
difference is the path's and the transport's):

- per network profile (:mod:`tokenfan_bench.network.shaping_proxy`), through the shaping proxy, against a TLS gateway
  (Granian: HTTP/2 by ALPN): the fan-out arms ``sse, sse, ws, sse-h2`` on the same streams (paired;
  arms A and B are the A/A pair; sse-h2 multiplexes K subscribers per connection) at each concurrency
  level; the Responses arms ``resp-sse, resp-sse, resp-ws`` (unpaired, A/A included); the calibration
  ``sse, ws`` against a second gateway whose WebSocket writes sleep ``--inject-ms``; and the browser
  arm (:mod:`tokenfan_bench.clients.browser`: ``es, es, fetch, ws`` plus its calibration ``es, ws``);
- per ``--via-profiles`` profile, against a plain gateway: ``sse`` and ``ws`` each straight, through
  nginx with the shipped config and through the buffering variant (:mod:`tokenfan_bench.network.nginx`), all six
  on the same streams, so "what nginx costs" is a paired difference with an interval, and "no damage"
  an equivalence test (:func:`equivalent`) against ``--equivalence-ms``;
- per profile, CPU: one single-transport run per transport, ``--cpu-repeats`` times (server CPU per
  delivered token from ``/metrics``, client CPU per received event), and bytes on the wire per token
  from the proxy's per-arm counters (with a deflate estimate on the plaintext routes).

Every run has at least ``--min-streams`` (:data:`tokenfan_bench.stats.ab_difference.MIN_CLUSTERS`) streams (each slot
runs enough rounds), so its interval comes from the stream-cluster bootstrap: with ten streams the token bootstrap
took ~175 token pairs as independent, and a 3g A/A read -0.027 ms [-0.043, -0.011].

Differences come with 95% bootstrap intervals over streams: delivery latency as ``tokenfan bench``
(paired per token), TTFT paired per stream, p99 inter-token gap as a difference of pooled p99s. A
difference whose interval holds 0 is reported as "no difference resolved".
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenfan_bench.clients.workers import Plan
from tokenfan_bench.network.paths import Paths, open_paths
from tokenfan_bench.network.shaping_proxy import PROFILES, Profile, parse_profile
from tokenfan_bench.report import run_outputs
from tokenfan_bench.report.markdown import write_report
from tokenfan_bench.runner import Run, run_clients
from tokenfan_bench.servers import processes
from tokenfan_bench.stats.ab_difference import MIN_CLUSTERS, median_difference
from tokenfan_bench.stats.metrics import itl_ns
from tokenfan_bench.stats.report_estimates import (
    PLACEBO_MS,
    Pair,
    Sleeps,
    applied_delay,
    difference_in_differences,
    equivalent,
    gap_p99_difference,
    injected_sleeps,
    median_gap,
    stalls,
    ttft_difference,
)

FANOUT = ("sse", "sse", "ws", "sse-h2")
RESPONSES = ("resp-sse", "resp-sse", "resp-ws")
CALIBRATION = ("sse", "ws")
BROWSER = ("es", "es", "fetch", "ws")
BROWSER_CAL = ("es", "ws")
VIA = ("sse", "sse@nginx", "sse@nginx-buffering", "ws", "ws@nginx", "ws@nginx-buffering")
CPU_TRANSPORTS = ("sse", "ws", "sse-h2", "resp-sse", "resp-ws")


def scrape_sleeps(url: str, transport: str = "ws") -> Sleeps:
    """:func:`injected_sleeps` of the gateway at ``url`` now."""
    import httpx

    return injected_sleeps(httpx.get(url + "/metrics", timeout=5.0, trust_env=False, verify=False).text, transport)



# -- the runs -------------------------------------------------------------------------------------


@dataclass
class Settings:
    profiles: list[Profile]
    via_profiles: list[Profile]
    levels: list[int]
    max_tokens: int
    rate: float
    ttft_ms: float
    inject_ms: float
    equivalence_ms: float
    min_streams: int
    ramp: float
    h2_k: int
    browser: bool
    browser_streams: int
    browser_rounds: int
    cpu_repeats: int
    n_boot: int
    seed: int
    data: Path
    browser_cal_runs: int = 2  # calibration + placebo run pairs (see Matrix.browser_calibration)


class Matrix:
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.logs = s.data / "logs"
        self.rows: list[dict[str, Any]] = []
        self.runs: dict[str, Run] = {}
        self.chromium: Any = None  # one Chromium for every browser run (see run)

    def measure(self, paths: Paths | None, gateway: str, arms: tuple[str, ...], streams: int, tag: str,
                h2_k: int = 1, rounds: int | None = None) -> dict[str, Any]:
        """One socket run; ``rounds`` streams per slot (default: enough for ``min_streams`` streams)."""
        from tokenfan_bench.network.paths import split_arm

        transports = tuple(split_arm(a)[0] for a in arms)
        separate = any(t.startswith("resp-") for t in transports)
        plan = Plan(url=paths.post_url if paths else gateway, transports=transports, streams=streams,
                    max_tokens=self.s.max_tokens, duration=None, separate=separate, ramp=self.s.ramp, seed=self.s.seed,
                    timeout=120.0, h2_streams_per_connection=h2_k, arm_urls=paths.arm_urls if paths else (),
                    metrics_url=gateway, rounds=rounds or -(-self.s.min_streams // streams))
        workers = 1
        run = run_clients(plan, workers, tag, False, paths.start_counting if paths else None,
                          paths.stop_counting if paths else None)
        if paths:
            paths.mark_jitter(run.arms.values())
        result = run_outputs.run_result(run, n_boot=self.s.n_boot, seed=self.s.seed)
        wire = paths.wire(result) if paths else None
        if wire:
            result["wire"] = wire
        self._extras(run, result)
        self.runs[tag] = run
        print(f"{tag}: {_brief(result)}", file=sys.stderr, flush=True)
        return result

    def _extras(self, run: Run, result: dict[str, Any]) -> None:
        a = run.arms["A"]
        paired = not run.plan.separate
        result["ttft_diffs_ms"] = {f"{k}-A": ttft_difference(a, v, paired=paired, n_boot=self.s.n_boot,
                                                             seed=self.s.seed)
                                   for k, v in run.arms.items() if k != "A"}
        result["gap_p99_diffs_ms"] = {f"{k}-A": gap_p99_difference(a, v, n_boot=min(self.s.n_boot, 400),
                                                                   seed=self.s.seed)
                                      for k, v in run.arms.items() if k != "A"}
        result["stalls"] = {k: stalls(v) for k, v in run.arms.items()}
        result["gap_p99_ms"] = {k: (float(np.percentile(itl_ns(v), 99)) / 1e6 if itl_ns(v).size else None)
                                for k, v in run.arms.items()}

    def vs_straight(self, run: Run) -> dict[str, Any]:
        """Each proxied arm against the straight arm of its transport, paired on the same streams."""
        straight = {t: k for k, t in zip(run.plan.arms, VIA) if "@" not in t}
        out: dict[str, Any] = {}
        for k, spec in zip(run.plan.arms, VIA):
            transport, _, via = spec.partition("@")
            if not via:
                continue
            ref = run.arms[straight[transport]]
            out[k] = {"transport": transport, "via": via, "straight_arm": straight[transport],
                      "ttft_ms": ttft_difference(ref, run.arms[k], paired=True, n_boot=self.s.n_boot,
                                                 seed=self.s.seed),
                      "delivery_ms": median_difference(ref, run.arms[k], paired=True, n_boot=self.s.n_boot,
                                                       seed=self.s.seed),
                      "gap_p50_ms": median_gap(run.arms[k]), "straight_gap_p50_ms": median_gap(ref)}
            out[k]["buffers"] = bool(out[k]["gap_p50_ms"] < out[k]["straight_gap_p50_ms"] / 4)
            out[k]["no_damage"] = (not out[k]["buffers"]
                                   and equivalent(out[k]["delivery_ms"], self.s.equivalence_ms))
        return out

    def browser(self, p: Paths, gateway: str, arms: tuple[str, ...], tag: str) -> dict[str, Any]:
        """A browser run: the page from the first route of ``p``, each stream slot's WebSockets to a route
        of its own (:func:`_browser_routes`). Each stream is read by one arm (the arms act on each other
        when they read the same tokens: :mod:`tokenfan_bench.clients.browser`), and each arm reads at least
        ``min_streams`` streams (slots run enough rounds), so every interval is a stream-cluster one."""
        from tokenfan_bench.clients.browser import run_browser

        streams = self.s.browser_streams
        rounds = max(self.s.browser_rounds, -(-self.s.min_streams * len(arms) // streams))
        result = run_browser(p.arm_urls[0], arms, streams=streams, rounds=rounds, ws_origins=p.arm_urls[1:],
                             max_tokens=self.s.max_tokens, metrics_url=gateway, ramp=self.s.ramp / 2,
                             n_boot=self.s.n_boot, seed=self.s.seed, browser=self.chromium, separate=True,
                             mark_jitter=p.mark_jitter)
        run = result.pop("_run")
        self._extras(run, result)
        self.runs[tag] = run
        print(f"{tag}: {_brief(result)}", file=sys.stderr, flush=True)
        return result

    def browser_calibration(self, profile: Profile, cal: str, placebo: str, res: dict[str, Any]) -> None:
        """The browser's difference-in-differences: ``es, ws`` on the delayed gateway, then on the placebo,
        ``browser_cal_runs`` pairs, averaged pair by pair (:func:`difference_in_differences`). Its arms read
        separate streams, so each pair's interval is wider than a paired one (3g, one pair: ±0.26 ms with
        the path's known jitter removed, ±3.1 ms with it)."""
        s, name = self.s, profile.name
        pairs: list[Pair] = []
        before = scrape_sleeps(cal), scrape_sleeps(placebo)
        for k in range(max(1, s.browser_cal_runs)):
            tags = [f"{name} browser {what}" + (f" #{k + 1}" if k else "") for what in ("calibration", "placebo")]
            for gateway, tag, key in ((cal, tags[0], "browser_calibration"), (placebo, tags[1], "browser_placebo")):
                with open_paths(gateway, _browser_routes(s), profile, self.logs, s.seed + k, probe=False) as p:
                    result = self.browser(p, gateway, BROWSER_CAL, tag)
                res.setdefault(key, result)  # the first pair's tables; the DiD averages every pair
            c, z = self.runs[tags[0]], self.runs[tags[1]]
            pairs.append(((c.arms["A"], c.arms["B"]), (z.arms["A"], z.arms["B"])))
        did = difference_in_differences(pairs, paired=False, n_boot=s.n_boot, seed=s.seed)
        applied = applied_delay(scrape_sleeps(cal) - before[0])
        applied_placebo = applied_delay(scrape_sleeps(placebo) - before[1])
        res["browser_calibration"].update(did_ms=did, applied=applied, applied_placebo=applied_placebo,
                                          expected_ms=applied["mean_ms"] - applied_placebo["mean_ms"])  # EXPECTED

    def run(self) -> dict[str, Any]:
        s = self.s
        out: dict[str, Any] = {"settings": {k: (v if not isinstance(v, (Path, list)) else str(v))
                                            for k, v in vars(s).items()},
                               "profiles": {}, "via": {}, "cpu": {}}
        out["settings"]["profiles"] = [p.name for p in s.profiles]
        out["settings"]["via_profiles"] = [p.name for p in s.via_profiles]
        out["settings"]["browser_placebo_ms"] = PLACEBO_MS
        with gateways(s, self.logs) as g, contextlib.ExitStack() as stack:
            if s.browser:
                from tokenfan_bench.clients.browser import chromium

                self.chromium = stack.enter_context(chromium())
            for profile in s.profiles:
                out["profiles"][profile.name] = self.profile(profile, g, out=out)
            for profile in s.via_profiles:
                with open_paths(g.plain, tuple(_via(a) for a in VIA), profile, self.logs, s.seed) as p:
                    r = self.measure(p, g.plain, VIA, s.levels[0], f"{profile.name} via")
                    out["via"][profile.name] = {"network": p.info, "run": r,
                                                "vs_straight": self.vs_straight(self.runs[f"{profile.name} via"])}
        return out

    def profile(self, profile: Profile, g: Gateways, *, out: dict[str, Any]) -> dict[str, Any]:
        s, tls, cal = self.s, g.tls, g.cal
        res: dict[str, Any] = {"levels": {}}
        with open_paths(tls, ("direct",) * len(FANOUT), profile, self.logs, s.seed) as p:
            res["network"] = p.info
            for n in s.levels:
                res["levels"][str(n)] = self.measure(p, tls, FANOUT, n, f"{profile.name} fan-out N={n}",
                                                     h2_k=min(s.h2_k, n))
        with open_paths(tls, ("direct",) * len(RESPONSES), profile, self.logs, s.seed, probe=False) as p:
            res["responses"] = self.measure(p, tls, RESPONSES, s.levels[0], f"{profile.name} responses")
        before = scrape_sleeps(cal)
        with open_paths(cal, ("direct",) * 2, profile, self.logs, s.seed, probe=False) as p:
            res["calibration"] = self.measure(p, cal, CALIBRATION, s.levels[0], f"{profile.name} calibration")
        applied = applied_delay(scrape_sleeps(cal) - before)
        res["calibration"].update(applied=applied, expected_ms=applied["median_ms"])  # see EXPECTED
        if s.browser:
            self.browser_calibration(profile, g.browser_cal, g.placebo, res)
            with open_paths(tls, _browser_routes(s), profile, self.logs, s.seed, probe=False) as p:
                res["browser"] = self.browser(p, tls, BROWSER, f"{profile.name} browser")
        with open_paths(tls, ("direct",) * 2, profile, self.logs, s.seed, probe=False) as p:
            out["cpu"][profile.name] = {"runs": {
                t: [self.measure(p, tls, (t, t), s.levels[0], f"{profile.name} cpu {t} #{r}", rounds=1)
                    for r in range(s.cpu_repeats)] for t in CPU_TRANSPORTS}}
        return res


def _via(arm: str) -> str:
    return arm.partition("@")[2] or "direct"


def _browser_routes(s: Settings) -> tuple[str, ...]:
    """The page's route, then one route (its own port) per stream slot for the slot's WebSockets.

    Chromium lets one WebSocket per IP address and port be in its opening handshake at a time (RFC 6455
    4.1); with every slot on one port, a 3g run opened its sockets 2.7-4.5 s after their streams' POST,
    after the streams had ended. One port per slot is what a page talking to as many hosts would get."""
    return ("direct",) * (1 + s.browser_streams)




@dataclass(frozen=True)
class Gateways:
    """The report's gateways (URLs), each on its own synthetic engine."""

    tls: str  # the one every arm is measured on
    cal: str  # WebSocket writes sleep --inject-ms (the socket calibration, paired against its SSE)
    browser_cal: str  # WebSocket writes sleep PLACEBO_MS + --inject-ms (the browser's calibration)
    placebo: str  # WebSocket writes sleep PLACEBO_MS (the browser's placebo)
    plain: str  # plain HTTP, behind nginx


@contextlib.contextmanager
def gateways(s: Settings, logs: Path) -> Iterator[Gateways]:
    """Start the report's gateways (:class:`Gateways`) together; stop them afterwards."""
    from gateway.http.certs import generate

    with tempfile.TemporaryDirectory(prefix="tokenfan-report-") as tmp, contextlib.ExitStack() as stack:
        cert, key = generate(Path(tmp) / "tls")
        # The browser arm's WebSockets go to other ports of the shaping proxy than its page: other origins.
        tls_args = [f"--ssl-certfile={cert}", f"--ssl-keyfile={key}", "--allowed-origins=*"]
        sleeps = (s.inject_ms, PLACEBO_MS + s.inject_ms, PLACEBO_MS)
        args = [tls_args, *([*tls_args, f"--inject-delay=ws:{ms:g}"] for ms in sleeps), []]
        with ThreadPoolExecutor(len(args)) as pool:  # started together: each waits seconds for its imports
            futures = [pool.submit(processes.spawn_synthetic, s.rate, s.ttft_ms, logs, a) for a in args]
        failed = [e for e in (f.exception() for f in futures) if e is not None]
        for f in futures:
            if f.exception() is None:
                stack.enter_context(f.result())
        if failed:
            raise failed[0]
        yield Gateways(*(f.result().url for f in futures))


def _brief(r: dict[str, Any]) -> str:
    arms = " ".join(f"{k}={a['transport']} p50 {a['delivery_ms']['p50'] or 0:.1f} ms err {a['errors']}"
                    for k, a in r["arms"].items())
    return arms + " | " + " ".join(f"{k} {d['median']:+.3f}" for k, d in r["diffs_ms"].items())


# -- command line ---------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan bench report", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--profiles", default=",".join(PROFILES), help="network profiles (names or custom forms, ';'-"
                    "separated when custom), default every named one")
    ap.add_argument("--via-profiles", default="lan,4g", help="profiles of the nginx comparison (default lan,4g)")
    ap.add_argument("--levels", default="10,40", help="concurrent streams per run (default 10,40)")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per stream (default 48)")
    ap.add_argument("--rate", type=float, default=20.0, help="synthetic tokens/s per stream (default 20)")
    ap.add_argument("--ttft-ms", type=float, default=20.0, help="synthetic engine TTFT (default 20)")
    ap.add_argument("--inject-ms", type=float, default=2.0, help="calibration delay on WebSocket writes (default 2)")
    ap.add_argument("--equivalence-ms", type=float, default=16.7,
                    help="the margin within which a proxied path does no damage (default 16.7: one 60 Hz frame)")
    ap.add_argument("--min-streams", type=int, default=MIN_CLUSTERS,
                    help=f"streams per run at least, slots running several in turn (default {MIN_CLUSTERS}: the "
                    "stream-cluster bootstrap's minimum)")
    ap.add_argument("--h2-streams-per-connection", type=int, default=8, dest="h2_k", metavar="K")
    ap.add_argument("--ramp", type=float, default=1.0,
                    help="seconds over which a run's slots start (default 1; the browser's: half of it)")
    ap.add_argument("--no-browser", action="store_true", help="skip the Chromium arm")
    ap.add_argument("--browser-streams", type=int, default=8,
                    help="concurrent streams in the browser's page (default 8), each read by one arm")
    ap.add_argument("--browser-rounds", type=int, default=1,
                    help="streams each browser slot runs in turn at least (default 1; more when an arm would read "
                    "fewer than --min-streams)")
    ap.add_argument("--browser-calibration-runs", type=int, default=2, dest="browser_cal_runs",
                    help="the browser calibration's delayed + placebo run pairs (default 2), averaged pair by pair")
    ap.add_argument("--cpu-repeats", type=int, default=2, help="single-transport CPU runs per transport and "
                    "profile (default 2)")
    ap.add_argument("--loss", default="0%,0.5%,2%,5%,2%-burst", metavar="LEVELS",
                    help="loss levels of the packet-loss section (tokenfan_bench/report/loss.py): PERCENT%% random "
                    "(iptables) or PERCENT%%-burst[/PACKETS]; 'none' skips it (it needs root, ip, iptables)")
    ap.add_argument("--loss-base", default=None, metavar="PROFILE",
                    help="the path under the loss levels (default rtt=60ms,jitter=5ms,down=20mbit,up=5mbit)")
    ap.add_argument("--loss-streams", type=int, default=10, help="concurrent streams of each loss run (default 10)")
    ap.add_argument("--no-loss-browser", action="store_true",
                    help="the packet-loss section without its Chromium run (EventSource, WebSocket, WebTransport on "
                    "the /ab page, in the client namespace; also off with --no-browser)")
    ap.add_argument("--loss-only", action="store_true",
                    help="run only the packet-loss section and put it into --out in place of its previous one")
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None,
                    help="the markdown report (default bench-results/report-<time>/ab-report.md); never a file "
                         "git tracks: write elsewhere and copy it over on purpose")
    ap.add_argument("--plots", type=Path, default=None, help="plot directory (default: beside --out, its stem)")
    ap.add_argument("--data", type=Path, default=None, help="raw results and logs (default: --out's folder)")
    return ap


def _profiles(text: str) -> list[Profile]:
    sep = ";" if ";" in text or "=" in text else ","
    return [parse_profile(p.strip()) for p in text.split(sep) if p.strip()]


def tracked(paths: list[Path]) -> list[Path]:
    """Those of ``paths`` (files, or folders: anything under them) that git tracks in the repository they are
    in; none outside a repository or without git."""
    out = []
    for path in paths:
        where = path.resolve().parent if not path.is_dir() else path.resolve()
        while not where.exists():
            where = where.parent
        try:
            listed = subprocess.run(["git", "-C", str(where), "ls-files", "--", str(path.resolve())],
                                    check=False, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if listed.returncode == 0 and listed.stdout.strip():
            out.append(path)
    return out


def _run_loss(ns: argparse.Namespace, s: Settings) -> dict[str, Any]:
    """The packet-loss section's results, or why it could not run here (shown in the report)."""
    from tokenfan_bench.network.lossy import available, parse_loss
    from tokenfan_bench.report.loss import DEFAULT_BASE, LossSettings, run_loss

    why = available()
    if why:
        return {"error": why}
    ls = LossSettings(levels=[parse_loss(x) for x in ns.loss.split(",") if x.strip()],
                      base=ns.loss_base or DEFAULT_BASE, streams=ns.loss_streams, k=s.h2_k, max_tokens=s.max_tokens,
                      rate=s.rate, ttft_ms=s.ttft_ms, inject_ms=s.inject_ms, min_streams=s.min_streams, ramp=s.ramp,
                      n_boot=s.n_boot, seed=s.seed, logs=s.data / "logs", browser=s.browser and not ns.no_loss_browser,
                      browser_streams=s.browser_streams)
    return run_loss(ls)


def _loss_only(ns: argparse.Namespace, s: Settings, data: Path, meta: dict[str, Any], t0: float) -> int:
    from tokenfan_bench.report.loss import write_section

    results = {"loss": _run_loss(ns, s), "meta": meta}
    results["meta"]["loss_s"] = time.monotonic() - t0
    results["meta"]["load_after"] = run_outputs.load()
    run_outputs.write_json(data / "results-loss.json", results)
    m = results["meta"]
    # the section says when it was made: the report's header dates the rest
    made = (f"This section: `tokenfan {' '.join(m['command'][1:])}` at {m['time']} in {m['loss_s']:.0f} s, load "
            f"{m['load']} before and {m['load_after']} after (the rest of the report is the run its header names).")
    write_section(results["loss"], ns.out, made)
    print(f"wrote the loss section into {ns.out}, raw results in {data / 'results-loss.json'} "
          f"({results['meta']['loss_s']:.0f} s)", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    ap = parser()
    ns = ap.parse_args(argv)
    folder = Path("bench-results") / time.strftime("report-%Y%m%d-%H%M%S")
    ns.out = ns.out or folder / "ab-report.md"
    data = ns.data or ns.out.parent
    clash = tracked([ns.out, ns.plots or ns.out.with_suffix("")])
    if clash:
        ap.error(f"{', '.join(map(str, clash))}: tracked by git; the report never writes over a tracked file. "
                 "Give --out a new path (the default is a new folder under bench-results/) and copy the result "
                 "over on purpose.")
    data.mkdir(parents=True, exist_ok=True)
    s = Settings(profiles=_profiles(ns.profiles), via_profiles=_profiles(ns.via_profiles) if ns.via_profiles else [],
                 levels=[int(x) for x in ns.levels.split(",")], max_tokens=ns.max_tokens, rate=ns.rate,
                 ttft_ms=ns.ttft_ms, inject_ms=ns.inject_ms, equivalence_ms=ns.equivalence_ms, min_streams=ns.min_streams, ramp=ns.ramp, h2_k=ns.h2_k,
                 browser=not ns.no_browser, browser_streams=ns.browser_streams, browser_rounds=ns.browser_rounds,
                 cpu_repeats=ns.cpu_repeats, browser_cal_runs=ns.browser_cal_runs, n_boot=ns.bootstrap, seed=ns.seed,
                 data=data)
    t0 = time.monotonic()
    meta = run_outputs.meta(["report", *argv], ns.seed)  # time and load when the matrix starts
    if ns.loss_only:
        return _loss_only(ns, s, data, meta, t0)
    matrix = Matrix(s)
    results = matrix.run()
    if ns.loss != "none":
        results["loss"] = _run_loss(ns, s)
    results["meta"] = {**meta, "matrix_s": time.monotonic() - t0,
                       "load_after": run_outputs.load()}
    run_outputs.write_json(data / "results.json", results)
    plots = ns.plots or ns.out.with_suffix("")
    write_report(results, matrix.runs, ns.out, plots)
    if "loss" in results:
        from tokenfan_bench.report.loss import write_section

        write_section(results["loss"], ns.out)
    print(f"wrote {ns.out}, plots in {plots}, raw results in {data / 'results.json'} "
          f"({results['meta']['matrix_s']:.0f} s)", file=sys.stderr)
    return 0
