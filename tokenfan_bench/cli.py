"""``tokenfan bench``: A/B benchmark of the gateway's fan-out transports.

One run: ``--streams N`` concurrent fan-out streams on ``--url``; by default every stream is watched
by one subscriber per arm (``--arms sse,ws``), so both arms see the same tokens from the same
gateway on the same clock and their latencies can be paired per token. ``sse,sse`` / ``ws,ws`` are
A/A runs (the interval must contain 0). ``--separate-streams`` gives each arm its own streams.

Sweep: ``--sweep 1,10,100`` repeats the run per concurrency level; ``--rates 10,20,50`` repeats the
sweep per synthetic token rate. A running engine's rate cannot be changed from outside, so several
rates need ``--spawn``: the bench starts one synthetic engine + gateway per rate (subprocesses) and
stops it afterwards. Without ``--spawn`` a single ``--rates`` value only labels the engine at
``--url`` (and paces the raw floor).

Floor: ``--baseline raw`` repeats the (last) run against :mod:`tokenfan_bench.servers.raw_floor`.

Limits: before it runs, the bench reads the gateway's limits from ``/health`` and stops (exit 2) naming the
flags to lift when the run would not fit (``--fit-limits``: run fewer streams instead). A run in which any
subscription failed prints its errors instead of figures and exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenfan_bench import limits
from tokenfan_bench.clients.responses import RESPONSES_TRANSPORTS
from tokenfan_bench.clients.workers import CLIENTS, QUIC_TRANSPORTS, TRANSPORTS, Plan
from tokenfan_bench.network import shaping_proxy
from tokenfan_bench.network.paths import VIAS, Paths, open_paths, split_arm
from tokenfan_bench.report import run_outputs
from tokenfan_bench.runner import Run, run_clients
from tokenfan_bench.servers import processes
from tokenfan_bench.stats.metrics import saturation_point


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _arms(s: str) -> tuple[str, ...]:
    parts = tuple(x.strip() for x in s.split(","))
    try:
        transports = [split_arm(p)[0] for p in parts]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not 2 <= len(parts) <= 6 or any(t not in TRANSPORTS for t in transports):
        raise argparse.ArgumentTypeError(f"--arms wants 2 to 6 of {'|'.join(TRANSPORTS)}, each optionally "
                                         f"@{'|@'.join(VIAS)}, e.g. sse,ws or sse,sse@nginx; got {s!r}")
    return parts


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--url", help="gateway base URL, e.g. http://127.0.0.1:8000 (or use --spawn)")
    ap.add_argument("--arms", type=_arms, default=("sse", "ws"),
                    help="one transport per arm A,B(,C…): sse (HTTP/1.1), ws, sse-h2, ws-h2 (RFC 8441), sse-h3 (SSE over "
                         "HTTP/3), wt (WebTransport; both to --h3-url); default sse,ws; "
                         "resp-sse, resp-ws: the Responses API over SSE / WebSocket mode, one response per "
                         "subscriber (implies --separate-streams); TRANSPORT@VIA routes one arm another way "
                         "(e.g. sse,sse@nginx)")
    ap.add_argument("--net", type=_profile, default=None, metavar="PROFILE",
                    help=f"shape every arm's connections: {', '.join(shaping_proxy.PROFILES)}, none (count bytes only) or "
                         "rtt=80ms,jitter=10ms,down=5mbit,up=1mbit,stall=0.5%%/300ms (tokenfan_bench/network/shaping_proxy.py)")
    ap.add_argument("--via", choices=VIAS, default="direct",
                    help="what sits in front of the gateway for every arm: nothing, nginx with "
                         "deploy/nginx/tokenfan.conf, or a buffering variant of it (tokenfan_bench/network/nginx.py)")
    ap.add_argument("--client", choices=CLIENTS, default="fast",
                    help="fast: asyncio protocols + picows + a minimal HTTP/2 client (default); "
                         "python: httpx + websockets")
    ap.add_argument("--cafile", default=None,
                    help="CA file to verify https/wss (default: TLS is not verified, e.g. `tokenfan certs`)")
    ap.add_argument("--h2-streams-per-connection", type=int, default=1, metavar="K",
                    help="HTTP/2 arms: subscribers multiplexed on one connection (default 1: one connection each, "
                         "like the other arms; a browser puts all of a page's streams on one)")
    ap.add_argument("--h3-url", default=None, metavar="URL",
                    help="where the sse-h3 and wt arms connect: https://HOST:PORT of the gateway's --http3-port "
                         "(with --spawn: set up by the bench)")
    ap.add_argument("--streams", type=int, default=10, help="concurrent streams (default 10)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (default 64)")
    ap.add_argument("--duration", type=float, default=None,
                    help="seconds: each slot restarts streams until then (default: one stream per slot)")
    ap.add_argument("--sweep", type=_ints, default=None, help="concurrency levels, e.g. 1,10,100,1000")
    ap.add_argument("--rates", type=_floats, default=None,
                    help="synthetic tokens/s per stream, e.g. 10,20,50 (several need --spawn)")
    ap.add_argument("--spawn", action="store_true",
                    help="start a synthetic engine + gateway per rate instead of using --url")
    ap.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for spawned gateways, e.g. --gateway-arg=--inject-delay=ws:1")
    ap.add_argument("--ttft-ms", type=float, default=20.0, help="TTFT of spawned engines and the raw floor")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default bench-results/<time>)")
    ap.add_argument("--separate-streams", action="store_true", help="separate streams per arm (unpaired)")
    ap.add_argument("--baseline", choices=["raw"], default=None, help="also measure the raw floor server")
    ap.add_argument("--seed", type=int, default=0, help="seed of start offsets, arm order and bootstrap")
    ap.add_argument("--endpoint", choices=["chat.completions", "completions"], default="chat.completions")
    ap.add_argument("--workers", type=int, default=None,
                    help="client processes (default: one per 5000 subscribers with the fast client, "
                         "per 1000 with the python one, at most CPUs/2)")
    ap.add_argument("--ramp", type=float, default=1.0, help="seconds over which stream starts are spread")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one subscription may take")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--threshold-ms", type=float, default=50.0, help="p99 delivery latency defining saturation")
    ap.add_argument("--wait-ready", type=float, default=60.0, metavar="S",
                    help="seconds to wait for the gateway at --url to answer /health with 200 (default 60: it may "
                         "still be starting)")
    ap.add_argument("--fit-limits", action="store_true",
                    help="when the run would pass a limit of the gateway (from its /health), run the most streams "
                         "that fit instead of stopping")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def _profile(s: str) -> shaping_proxy.Profile:
    try:
        return shaping_proxy.parse_profile(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Bench:
    def __init__(self, ns: argparse.Namespace, argv: list[str], checked: list[int] | None = None) -> None:
        self.ns = ns
        self.checked = checked  # --url: the levels fit_levels() allowed, checked before anything was created
        self.vias = tuple(split_arm(a)[1] or ns.via for a in ns.arms)
        ns.arms = tuple(split_arm(a)[0] for a in ns.arms)
        self.paths: Paths | None = None
        self.out: Path = ns.out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
        self.out.mkdir(parents=True, exist_ok=True)
        self.meta = run_outputs.meta(argv, ns.seed)
        self.h3_url: str | None = ns.h3_url

    def plan(self, url: str, streams: int, arms: tuple[str, ...] | None = None) -> Plan:
        ns = self.ns
        arms = arms or ns.arms
        separate = ns.separate_streams or any(t in RESPONSES_TRANSPORTS for t in arms)  # a response is one client's
        routed = self.paths if arms == ns.arms else None  # the raw floor is measured directly
        arm_urls = routed.arm_urls if routed else ()
        if not routed and any(t in QUIC_TRANSPORTS for t in arms):
            assert self.h3_url is not None
            arm_urls = tuple(self.h3_url if t in QUIC_TRANSPORTS else url.rstrip("/") for t in arms)
        return Plan(url=routed.post_url if routed else url.rstrip("/"),
                    arm_urls=arm_urls, metrics_url=url.rstrip("/"), transports=arms, streams=streams, max_tokens=ns.max_tokens,
                    duration=ns.duration, separate=separate, endpoint=ns.endpoint, ramp=ns.ramp,
                    seed=ns.seed, timeout=ns.timeout, client=ns.client, cafile=ns.cafile,
                    h2_streams_per_connection=ns.h2_streams_per_connection)

    def workers(self, streams: int) -> int:
        if self.ns.workers:
            return self.ns.workers
        per_worker = 1000 if self.ns.client == "python" else 5000  # subscribers one client process keeps up with
        subscribers = len(self.ns.arms) * streams
        return max(1, min((os.cpu_count() or 2) // 2, -(-subscribers // per_worker)))

    def measure(self, url: str, streams: int, desc: str,
                arms: tuple[str, ...] | None = None) -> tuple[Run, dict[str, Any]]:
        routed = self.paths if arms is None else None
        run = run_clients(self.plan(url, streams, arms), self.workers(streams), desc, not self.ns.no_progress,
                          routed.start_counting if routed else None, routed.stop_counting if routed else None)
        if routed:
            routed.mark_jitter(run.arms.values())
        result = run_outputs.run_result(run, n_boot=self.ns.bootstrap, seed=self.ns.seed)
        wire = routed.wire(result) if routed else None
        if wire is not None:
            result["wire"] = wire
        return run, result

    @contextlib.contextmanager
    def routes(self, url: str) -> Iterator[str]:
        """``--via`` and ``--net`` around the gateway at ``url`` (nothing to do without either)."""
        if self.ns.net is None and set(self.vias) == {"direct"}:
            yield url
            return
        with open_paths(url, self.vias, self.ns.net, self.out / "logs", self.ns.seed) as p:
            self.paths = p
            try:
                yield url
            finally:
                self.paths = None

    @contextlib.contextmanager
    def target(self, rate: float | None) -> Iterator[str]:
        if not self.ns.spawn:
            yield self.ns.url
            return
        extra: list[str] = []
        if any(t in QUIC_TRANSPORTS for t in self.ns.arms):  # a listener for the QUIC arms
            from tokenfan_bench.clients.quic import h3_gateway_args

            extra, self.h3_url = h3_gateway_args(self.out / "tls")
        with processes.spawn_synthetic(rate or 20.0, self.ns.ttft_ms, self.out / "logs",
                                       [*self.ns.gateway_arg, *extra]) as s:
            yield s.url

    def run(self) -> dict[str, Any]:
        ns = self.ns
        rates: list[float | None] = list(ns.rates) if ns.rates else [None]
        levels = ns.sweep or [ns.streams]
        rows: list[dict[str, Any]] = []
        network: dict[str, Any] | None = None
        last: tuple[Run, dict[str, Any]] | None = None
        for rate in rates:
            with self.target(rate) as url, self.routes(url):
                levels = self.checked if self.checked and not ns.spawn else fit_levels(ns, url)
                if self.paths is not None:
                    network = self.paths.info
                for n in levels:
                    desc = f"{'/'.join(ns.arms)} N={n}" + (f" @{rate:g} tok/s" if rate else "")
                    last = self.measure(url, n, desc)
                    rows.append({"tokens_per_s": rate, **last[1]})
                    print(f"{desc}: {_brief(last[1])}", file=sys.stderr)
        assert last is not None
        run, results = last
        results = {"meta": {**self.meta, "url": ns.url, "spawn": ns.spawn, "tokens_per_s": rates[-1]}, **results}
        if network is not None:
            results["network"] = network
        run_outputs.plot_cdf(run, self.out / "latency_cdf.png", f"delivery latency, N={run.plan.streams}")
        if ns.sweep or len(rates) > 1:
            results["sweep"] = rows
            results["saturation_threshold_ms"] = ns.threshold_ms
            results["saturation"] = {
                f"{r:g}" if r else "unknown": {
                    t: saturation_point([x["streams"] for x in rows if x["tokens_per_s"] == r],
                                        [_p99(x, t) for x in rows if x["tokens_per_s"] == r], ns.threshold_ms)
                    for t in dict.fromkeys(ns.arms)}
                for r in rates}
            run_outputs.plot_sweep(results, self.out / "p99_vs_concurrency.png")
        if ns.baseline == "raw":
            rate = rates[-1] or _observed_rate(results)
            with processes.spawn_raw(rate, ns.ttft_ms, self.out / "logs") as raw:
                raw_run, raw_res = self.measure(raw.url, run.plan.streams, f"raw floor N={run.plan.streams}",
                                                raw_arms(ns.arms))
            results["baseline"] = run_outputs.baseline_result(results, raw_res, rate)
            run_outputs.plot_cdf(raw_run, self.out / "latency_cdf_raw.png", f"raw floor, N={run.plan.streams}")
        errors = run_outputs.run_errors(results)
        if errors is not None:
            results = {"errors": errors, **run_outputs.withhold(results)}
        run_outputs.write_json(self.out / "results.json", results)
        (self.out / "summary.md").write_text(run_outputs.summary_md(results))
        return results


def fit_levels(ns: argparse.Namespace, url: str) -> list[int]:
    """The concurrency levels to run against ``url``, checked against its limits (see
    :mod:`tokenfan_bench.limits`): raises :class:`DoesNotFit` when one would pass a limit, unless
    ``--fit-limits`` lowers it."""
    levels = ns.sweep or [ns.streams]
    try:
        known = limits.read(url, cafile=ns.cafile, wait=ns.wait_ready)
    except limits.LimitsUnknown as exc:
        raise DoesNotFit(f"tokenfan bench: {exc}") from None
    if known is None:
        print(f"tokenfan bench: {url}/health does not give its limits; the run is not checked against them",
              file=sys.stderr)
        return levels
    arms, separate, worst = tuple(split_arm(a)[0] for a in ns.arms), ns.separate_streams, max(levels)
    fit = limits.largest_fit(arms, worst, separate, ns.max_tokens, known)
    problems = limits.over(limits.need(arms, worst, separate, ns.max_tokens), known)
    if not problems:
        return levels
    if not ns.fit_limits or fit == 0:
        raise DoesNotFit(limits.refusal(url, problems, worst, fit))
    fitted = list(dict.fromkeys(min(n, fit) for n in levels))
    print(f"tokenfan bench: --fit-limits: {worst} streams would pass {', '.join(p[0] for p in problems)} of "
          f"{url}; running {','.join(map(str, fitted))} instead", file=sys.stderr)
    return fitted


class DoesNotFit(RuntimeError):
    """The run would pass a limit of its gateway (or the gateway's limits cannot be read): it is not started."""


def raw_arms(arms: tuple[str, ...]) -> tuple[str, ...]:
    """The run's arms the raw floor serves (HTTP/1.1 only), at least two."""
    h1 = tuple(t for t in arms if t in ("sse", "ws")) or ("sse", "ws")
    return h1 if len(h1) >= 2 else h1 * 2


def _p99(row: dict[str, Any], transport: str) -> float | None:
    vals = [a["delivery_ms"]["p99"] for a in row["arms"].values() if a["transport"] == transport]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def _observed_rate(results: dict[str, Any]) -> float:
    """Tokens/s of the engine behind --url, from the run itself (median per-stream rate)."""
    p50 = results["arms"]["A"]["tokens_per_s"]["p50"]
    return round(p50, 1) if p50 else 20.0


def _brief(r: dict[str, Any]) -> str:
    if run_outputs.run_errors(r) is not None:
        return "; ".join(f"{a['transport']}: {a['errors']} of {a['subscribers']} subscriptions failed"
                         for a in r["arms"].values()) + " (figures withheld)"
    parts = [f"{a['transport']} p50/p99 {a['delivery_ms']['p50'] or 0:.2f}/{a['delivery_ms']['p99'] or 0:.2f} ms"
             f" err {a['errors']}" for a in r["arms"].values()]
    return "; ".join(parts) + f"; diff {r['diff_ms']['median']:+.3f} ms"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["failover"]:  # the gap a client sees when an engine or a gateway dies (failover.py)
        from tokenfan_bench.failover import main as failover_main

        return failover_main(argv[1:])
    if argv[:1] == ["durable"]:  # the latency cost of durable delivery of listed streams (durable.py)
        from tokenfan_bench.durable import main as durable_main

        return durable_main(argv[1:])
    if argv[:1] == ["sizing"]:  # memory per stream, subscriber, response and event, gateway and Redis (sizing.py)
        from tokenfan_bench.sizing import main as sizing_main

        return sizing_main(argv[1:])
    if argv[:1] == ["partitions"]:  # real network partitions against sampled listed streams (partitions.py)
        from tokenfan_bench.partitions import main as partitions_main

        return partitions_main(argv[1:])
    if argv[:1] == ["vs-vllm"]:  # tokenfan serve against vllm serve (tokenfan_bench/vs_vllm.py)
        from tokenfan_bench.vs_vllm import main as vs_vllm_main

        return vs_vllm_main(argv[1:])
    if argv[:1] == ["fanout"]:  # thousands of subscribers of one stream: spread, CPU and memory beside the floor
        from tokenfan_bench.fanout import main as fanout_main

        return fanout_main(argv[1:])
    if argv[:1] == ["capacity"]:  # tokens/s per gateway process and core within a p99 bound, beside the floor
        from tokenfan_bench.cpu.capacity import main as capacity_main

        return capacity_main(argv[1:])
    if argv[:1] == ["cpu"]:  # gateway CPU per delivered token, steady state, beside the raw floor
        from tokenfan_bench.cpu.gateway_cost import main as cpu_main

        return cpu_main(argv[1:])
    if argv[:1] == ["pass"]:  # the Python cost of the gateway's one pass per engine step, in-process
        from tokenfan_bench.cpu.step_pass_cost import main as pass_main

        return pass_main(argv[1:])
    if argv[:1] == ["net"]:  # the /ab page through every network profile, for a person
        from tokenfan_bench.network.watch_pages import main as net_main

        return net_main(argv[1:])
    if argv[:1] == ["page-levels"]:  # where the browser's time goes per API (EventSource, fetch, WebSocket)
        from tokenfan_bench.page_levels import main as page_levels_main

        return page_levels_main(argv[1:])
    if argv[:1] == ["report"]:  # the matrix of profiles x arms x levels, as docs/ab-report.md
        from tokenfan_bench.report.matrix import main as report_main

        return report_main(argv[1:])
    ap = parser()
    ns = ap.parse_args(argv)
    if not ns.spawn and not ns.url:
        ap.error("give --url, or --spawn to start a synthetic engine + gateway")
    if ns.rates and len(ns.rates) > 1 and not ns.spawn:
        ap.error("several --rates need --spawn: the bench cannot change the token rate of the engine at --url")
    if ns.client != "fast" and any(t in RESPONSES_TRANSPORTS for t in ns.arms):
        ap.error("the resp-sse and resp-ws arms need --client fast")
    quic = any(split_arm(a)[0] in QUIC_TRANSPORTS for a in ns.arms)
    if quic and ns.client != "fast":
        ap.error("the sse-h3 and wt arms need --client fast")
    if quic and not ns.spawn and not ns.h3_url:
        ap.error("the sse-h3 and wt arms need --h3-url (the gateway's --http3-port), or --spawn")
    if quic and (ns.net is not None or any(split_arm(a)[1] for a in ns.arms) or ns.via != "direct"):
        ap.error("the shaping proxy and nginx carry TCP only: run the QUIC arms straight, or under loss and a "
                 "profile with `tokenfan bench report --loss` (network namespaces)")
    checked = None
    if not ns.spawn:  # before anything is created: a run that cannot fit stops here
        try:
            checked = fit_levels(ns, ns.url)
        except DoesNotFit as exc:
            print(exc, file=sys.stderr)
            return 2
    bench = Bench(ns, argv, checked)
    try:
        results = bench.run()
    except DoesNotFit as exc:
        print(exc, file=sys.stderr)
        return 2
    print(run_outputs.summary_md(results))
    print(f"\nwrote {bench.out / 'results.json'}, {bench.out / 'summary.md'} and plots", file=sys.stderr)
    if results.get("errors"):
        e = results["errors"]
        print(f"tokenfan bench: {e['failed']} of {e['subscribers']} subscriptions failed: no figures (exit 1)",
              file=sys.stderr)
        return 1
    return 0
