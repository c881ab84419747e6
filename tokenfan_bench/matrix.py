"""``tokenfan bench report``: the A/B answer under real conditions, as one docs-ready markdown report.

One command runs a matrix on synthetic engines it starts itself (token rate and TTFT fixed, so every
difference is the path's and the transport's):

- per network profile (:mod:`tokenfan_bench.netem`), through the shaping proxy, against a TLS gateway
  (Granian: HTTP/2 by ALPN): the fan-out arms ``sse, sse, ws, sse-h2`` on the same streams (paired;
  arms A and B are the A/A pair; sse-h2 multiplexes K subscribers per connection) at each concurrency
  level; the Responses arms ``resp-sse, resp-sse, resp-ws`` (unpaired, A/A included); the calibration
  ``sse, ws`` against a second gateway whose WebSocket writes sleep ``--inject-ms``; and the browser
  arm (:mod:`tokenfan_bench.browser_arm`: ``es, es, fetch, ws`` plus its calibration ``es, ws``);
- per ``--via-profiles`` profile, against a plain gateway: ``sse`` and ``ws`` each straight, through
  nginx with the shipped config and through the buffering variant (:mod:`tokenfan_bench.via`), all six
  on the same streams, so "what nginx costs" is a paired difference with an interval, and "no damage"
  an equivalence test (:func:`equivalent`) against ``--equivalence-ms``;
- per profile, CPU: one single-transport run per transport, ``--cpu-repeats`` times (server CPU per
  delivered token from ``/metrics``, client CPU per received event), and bytes on the wire per token
  from the proxy's per-arm counters (with a deflate estimate on the plaintext routes).

Every run has at least ``--min-streams`` (:data:`tokenfan_bench.stats.MIN_CLUSTERS`) streams (each slot
runs enough rounds), so its interval comes from the stream-cluster bootstrap: with ten streams the token bootstrap
took ~175 token pairs as independent, and a 3g A/A read -0.027 ms [-0.043, -0.011].

Differences come with 95% bootstrap intervals over streams: delivery latency as ``tokenfan bench``
(paired per token), TTFT paired per stream, p99 inter-token gap as a difference of pooled p99s. A
difference whose interval holds 0 is reported as "no difference resolved".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenfan_bench import procs, report
from tokenfan_bench.clients import Plan
from tokenfan_bench.netem import PROFILES, Profile, parse_profile
from tokenfan_bench.paths import Paths, open_paths
from tokenfan_bench.runner import Run, run_clients
from tokenfan_bench.stats import (
    MIN_CLUSTERS,
    ArmSamples,
    difference_boots,
    itl_ns,
    median_difference,
)

FANOUT = ("sse", "sse", "ws", "sse-h2")
RESPONSES = ("resp-sse", "resp-sse", "resp-ws")
CALIBRATION = ("sse", "ws")
BROWSER = ("es", "es", "fetch", "ws")
BROWSER_CAL = ("es", "ws")
VIA = ("sse", "sse@nginx", "sse@nginx-buffering", "ws", "ws@nginx", "ws@nginx-buffering")
CPU_TRANSPORTS = ("sse", "ws", "sse-h2", "resp-sse", "resp-ws")
# A gap this much longer than the stream's median gap (and at least STALL_MIN_MS) is a stall.
STALL_FACTOR, STALL_MIN_MS = 5.0, 250.0


# -- statistics beyond tokenfan_bench.stats (pure) ----------------------------------------------


def ttft_by_stream(a: ArmSamples) -> dict[int, int]:
    """Stream -> TTFT (ns): request start to this subscriber's first content event."""
    post = dict(zip(a.sub_stream.tolist(), a.post_ns.tolist()))
    out: dict[int, int] = {}
    for s, t in zip(a.stream[a.content].tolist(), a.recv_ns[a.content].tolist()):
        if s not in out:
            out[s] = t - post[s]
    return out


def _interval(boots: np.ndarray) -> list[float]:
    lo, hi = np.percentile(boots, [2.5, 97.5]) if boots.size and np.isfinite(boots).all() else (np.nan, np.nan)
    return [float(lo), float(hi)]


def ttft_difference(a: ArmSamples, b: ArmSamples, *, paired: bool, n_boot: int, seed: int) -> dict[str, Any]:
    """Median TTFT B − A (ms) with a bootstrap 95% interval over streams: paired per stream when both
    arms read the same streams, else the difference of the medians."""
    rng = np.random.default_rng(seed)
    ta, tb = ttft_by_stream(a), ttft_by_stream(b)
    if paired:
        d = np.array([tb[s] - ta[s] for s in ta if s in tb], np.float64) / 1e6
        if not d.size:
            return {"median": None, "ci95": [None, None], "n": 0}
        boots = np.median(d[rng.integers(0, d.size, (n_boot, d.size))], axis=1)
        return {"median": float(np.median(d)), "ci95": _interval(boots), "n": int(d.size), "paired": True}
    xa, xb = np.array(list(ta.values()), np.float64) / 1e6, np.array(list(tb.values()), np.float64) / 1e6
    if not xa.size or not xb.size:
        return {"median": None, "ci95": [None, None], "n": 0}
    boots = (np.median(xb[rng.integers(0, xb.size, (n_boot, xb.size))], axis=1)
             - np.median(xa[rng.integers(0, xa.size, (n_boot, xa.size))], axis=1))
    return {"median": float(np.median(xb) - np.median(xa)), "ci95": _interval(boots),
            "n": int(min(xa.size, xb.size)), "paired": False}


def gaps_by_stream(a: ArmSamples) -> dict[int, np.ndarray]:
    """Stream -> its subscriber's gaps between successive content events (ns)."""
    s, t = a.stream[a.content], a.recv_ns[a.content]
    out: dict[int, np.ndarray] = {}
    if not s.size:
        return out
    cut = np.flatnonzero(s[1:] != s[:-1]) + 1
    for ids, times in zip(np.split(s, cut), np.split(t, cut)):
        out[int(ids[0])] = np.diff(times)
    return out


def gap_p99_difference(a: ArmSamples, b: ArmSamples, *, n_boot: int, seed: int) -> dict[str, Any]:
    """p99 of the pooled inter-token gaps, B − A (ms), with a 95% interval from resampling streams: the
    same resampled streams for both arms when they read the same ones, each arm's own otherwise."""
    rng = np.random.default_rng(seed)
    ga, gb = gaps_by_stream(a), gaps_by_stream(b)
    common = sorted(set(ga) & set(gb))
    ids_a, ids_b = (common, common) if common else (sorted(ga), sorted(gb))
    if not ids_a or not ids_b:
        return {"median": None, "ci95": [None, None], "n": 0}
    pa, pb = [ga[i] for i in ids_a], [gb[i] for i in ids_b]

    def p99(parts: list[np.ndarray], pick: np.ndarray) -> float:
        return float(np.percentile(np.concatenate([parts[i] for i in pick]), 99))

    point = (p99(pb, np.arange(len(pb))) - p99(pa, np.arange(len(pa)))) / 1e6
    boots = np.empty(n_boot)
    for k in range(n_boot):
        pick_a = rng.integers(0, len(pa), len(pa))
        pick_b = pick_a if common else rng.integers(0, len(pb), len(pb))
        boots[k] = (p99(pb, pick_b) - p99(pa, pick_a)) / 1e6
    return {"median": point, "ci95": _interval(boots), "n": min(len(pa), len(pb)), "paired": bool(common)}


def stalls(a: ArmSamples) -> dict[str, Any]:
    """Gaps longer than STALL_FACTOR × the stream's median gap and STALL_MIN_MS, per 1000 gaps."""
    count = total = 0
    longest = 0.0
    for g in gaps_by_stream(a).values():
        if g.size < 3:
            continue
        limit = max(STALL_FACTOR * float(np.median(g)), STALL_MIN_MS * 1e6)
        count += int((g > limit).sum())
        total += g.size
        longest = max(longest, float(g.max()) / 1e6)
    return {"stalls": count, "gaps": total, "per_1000": 1000 * count / total if total else None,
            "longest_gap_ms": longest}


def _median_gap(a: ArmSamples) -> float:
    g = itl_ns(a)
    return float(np.median(g)) / 1e6 if g.size else float("nan")


def verdict(diff: dict[str, Any], a: str, b: str) -> str:
    """Which of two arms is lower (better) on a B − A difference, or that its interval holds 0."""
    lo, hi = diff["ci95"]
    if diff.get("median") is None or lo is None or hi is None or not (np.isfinite(lo) and np.isfinite(hi)):
        return "not measured"
    if lo > 0:
        return f"{a} lower"
    if hi < 0:
        return f"{b} lower"
    return "no difference resolved"


# EXPECTED: what each calibration should read of the sleeps the delayed gateway timed in its runs
# (:func:`applied_delay`). The sleeps are skewed (uvloop's millisecond timers end some early, a busy loop
# wakes some late), and a median moved by a skewed delay moves by the delay's median when the rest of the
# difference is narrow and by its mean when it is wide: the socket calibration is paired per token (the
# path's jitter cancels), so it expects the median sleep; the browser's is a difference of unpaired
# medians that carry the browser's own noise (about 1 ms per token once the path's known jitter is
# removed), so it expects the mean sleep minus the placebo's.
#
# How far a calibration's interval may miss that and still count as recovered. Not a clock's resolution
# (the /ab page is cross-origin isolated: performance.now() moves in 5 µs; the proxy's and the clients'
# clocks are finer) but the model's slack: between those two limits the target lies between the sleeps'
# median and mean, at most 0.06 ms apart (either way) in the twelve calibrations of six runs of
# tests/e2e/test_bench_report.py. In a lan,3g matrix (docs/benchmarks.md) the socket calibration read
# +2.171 [2.141, 2.219] for a median sleep of 2.165 ms, and +2.217 [2.198, 2.233] for 2.154.
RESOLUTION_MS = 0.1


def recovered(diff: dict[str, Any], expected_ms: float, resolution_ms: float = RESOLUTION_MS) -> bool:
    """The calibration is recovered when its 95% interval excludes 0 and comes within ``resolution_ms``
    of ``expected_ms``, the delay the gateway really applied (:func:`applied_delay`)."""
    lo, hi = diff["ci95"]
    if lo is None or hi is None or not (np.isfinite(lo) and np.isfinite(hi)):
        return False
    return bool(lo > 0 and lo - resolution_ms <= expected_ms <= hi + resolution_ms)


@dataclass(frozen=True)
class Sleeps:
    """The gateway's :data:`gateway.core.metrics.INJECTED_DELAY` histogram for one transport: cumulative
    ``(upper bound s, count)`` buckets, the sum of the sleeps (s) and their count."""

    buckets: tuple[tuple[float, float], ...] = ()
    sum_s: float = 0.0
    count: float = 0.0

    def __sub__(self, before: Sleeps) -> Sleeps:
        """The sleeps between two scrapes (a gateway without the flag, or no scrape: none)."""
        old = dict(before.buckets)
        return Sleeps(tuple((le, n - old.get(le, 0.0)) for le, n in self.buckets),
                      self.sum_s - before.sum_s, self.count - before.count)


def injected_sleeps(metrics_text: str, transport: str = "ws") -> Sleeps:
    """The injected-delay histogram of ``transport`` in a ``/metrics`` text (empty when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.core.metrics import INJECTED_DELAY

    buckets: list[tuple[float, float]] = []
    total = count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name != INJECTED_DELAY:
            continue
        for sample in family.samples:
            if sample.labels.get("transport") != transport:
                continue
            if sample.name.endswith("_bucket"):
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_count"):
                count = sample.value
    return Sleeps(tuple(sorted(buckets)), total, count)


def scrape_sleeps(url: str, transport: str = "ws") -> Sleeps:
    """:func:`injected_sleeps` of the gateway at ``url`` now."""
    import httpx

    return injected_sleeps(httpx.get(url + "/metrics", timeout=5.0, trust_env=False, verify=False).text, transport)


def applied_delay(sleeps: Sleeps) -> dict[str, float]:
    """What a gateway's ``--inject-delay`` applied over some runs (the difference of two scrapes): the mean
    and median sleep in ms (0 when it slept none, e.g. a gateway started without the flag) and their count.
    The median is interpolated in its bucket, as Prometheus's ``histogram_quantile`` does."""
    if sleeps.count <= 0:
        return {"mean_ms": 0.0, "median_ms": 0.0, "n": 0}
    half, below, lower = sleeps.count / 2, 0.0, None
    median = sleeps.buckets[-1][0] if sleeps.buckets else float("nan")
    for le, n in sleeps.buckets:
        if n >= half:
            if not np.isfinite(le):
                median = lower if lower is not None else float("nan")
            elif lower is None or n == below:
                median = le
            else:
                median = lower + (le - lower) * (half - below) / (n - below)
            break
        below, lower = n, le
    return {"mean_ms": sleeps.sum_s / sleeps.count * 1e3, "median_ms": median * 1e3, "n": int(sleeps.count)}


def equivalent(diff: dict[str, Any], margin_ms: float) -> bool:
    """Two one-sided tests: the difference is within ``±margin_ms`` when its 95% interval lies inside
    (each one-sided test at 2.5%, more conservative than TOST's usual 90% interval)."""
    lo, hi = diff["ci95"]
    if diff.get("median") is None or lo is None or hi is None or not (np.isfinite(lo) and np.isfinite(hi)):
        return False
    return bool(-margin_ms <= lo and hi <= margin_ms)


Pair = tuple[tuple[ArmSamples, ArmSamples], tuple[ArmSamples, ArmSamples]]


def difference_in_differences(pairs: list[Pair], *, paired: bool, n_boot: int, seed: int) -> dict[str, Any]:
    """(B − A on the delayed gateway) − (B − A on the placebo gateway), each B − A as
    :func:`tokenfan_bench.stats.difference_boots` (paired per token, or per arm on separate streams), averaged
    over run pairs ``((cal A, cal B), (placebo A, placebo B))``, with a 95% interval from the average of
    independent stream-cluster bootstraps of every run.

    Averaged pair by pair, not pooled: a run moves both of its arms together (the browser measured on lan:
    each arm's median delivery moved by up to ±0.6 ms from run to run, the DiD of six pairs 2.19-2.39 ms),
    and that cancels inside each run's B − A, where pooled medians would carry it.

    For arms whose difference is not 0 without a delay (Chromium's EventSource and WebSocket are not), the
    injected delay is what the delayed gateway adds to the placebo's difference: same server path, a sleep
    shorter by the injected delay (:data:`PLACEBO_MS`: both writes off the engine's step). That holds
    only if the arms do not act on each other; the browser's do when they read the same tokens
    (:mod:`tokenfan_bench.browser_arm`), so its runs give each stream to one arm (``paired=False``)."""
    rng = np.random.default_rng(seed)
    runs = [[difference_boots(a, b, paired=paired, n_boot=n_boot, rng=rng) for a, b in pair] for pair in pairs]
    if not runs or not all(np.isfinite(d["median"]) for pair in runs for d in pair):
        return {"median": None, "ci95": [None, None], "n": 0}
    per_pair = [(d1["median"] - d0["median"]) / 1e6 for d1, d0 in runs]
    boots = np.mean([d1["boots"] - d0["boots"] for d1, d0 in runs], axis=0)
    return {"median": float(np.mean(per_pair)), "ci95": [x / 1e6 for x in _interval(boots)],
            "n": sum(min(d1["n"], d0["n"]) for d1, d0 in runs),
            "streams": sum(min(d1["streams"], d0["streams"]) for d1, d0 in runs), "method": runs[0][0]["method"],
            "pairs": len(runs), "per_pair_ms": per_pair,
            "cal_ms": float(np.mean([d1["median"] for d1, _ in runs])) / 1e6,
            "placebo_ms": float(np.mean([d0["median"] for _, d0 in runs])) / 1e6}


def contains_zero(diff: dict[str, Any]) -> bool:
    lo, hi = diff["ci95"]
    return bool(lo is not None and hi is not None and lo <= 0 <= hi)


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
        from tokenfan_bench.paths import split_arm

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
        result = report.run_result(run, n_boot=self.s.n_boot, seed=self.s.seed)
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
                      "gap_p50_ms": _median_gap(run.arms[k]), "straight_gap_p50_ms": _median_gap(ref)}
            out[k]["buffers"] = bool(out[k]["gap_p50_ms"] < out[k]["straight_gap_p50_ms"] / 4)
            out[k]["no_damage"] = (not out[k]["buffers"]
                                   and equivalent(out[k]["delivery_ms"], self.s.equivalence_ms))
        return out

    def browser(self, p: Paths, gateway: str, arms: tuple[str, ...], tag: str) -> dict[str, Any]:
        """A browser run: the page from the first route of ``p``, each stream slot's WebSockets to a route
        of its own (:func:`_browser_routes`). Each stream is read by one arm (the arms act on each other
        when they read the same tokens: :mod:`tokenfan_bench.browser_arm`), and each arm reads at least
        ``min_streams`` streams (slots run enough rounds), so every interval is a stream-cluster one."""
        from tokenfan_bench.browser_arm import run_browser

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
                from tokenfan_bench.browser_arm import chromium

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


# The browser calibration's placebo sleeps this long before each WebSocket write, and its delayed gateway
# this plus --inject-ms, so both arms' writes leave the gateway off the engine's step. With a placebo of
# 0 (the write inside the step, when the gateway, the proxy and Chromium are awake) against a delayed write
# (alone, after the machine went idle), Chromium read the 2 ms as 0.1-0.15 ms more than the gateway slept:
# every process on the way wakes cold (lan, six pairs, 2026-11-24: 2.19-2.39 ms for ~2.14). With ws:1
# against ws:3, four pairs read +2.04 [1.94, 2.16] ms for 2.01 (per pair 1.91-2.16).
PLACEBO_MS = 1.0


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
            futures = [pool.submit(procs.spawn_synthetic, s.rate, s.ttft_ms, logs, a) for a in args]
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
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("docs/ab-report.md"), help="the markdown report")
    ap.add_argument("--plots", type=Path, default=None, help="plot directory (default: beside --out, its stem)")
    ap.add_argument("--data", type=Path, default=None, help="raw results and logs (default bench-results/report-<time>)")
    return ap


def _profiles(text: str) -> list[Profile]:
    sep = ";" if ";" in text or "=" in text else ","
    return [parse_profile(p.strip()) for p in text.split(sep) if p.strip()]


def main(argv: list[str]) -> int:
    from tokenfan_bench.report_md import write_report

    ns = parser().parse_args(argv)
    data = ns.data or Path("bench-results") / time.strftime("report-%Y%m%d-%H%M%S")
    data.mkdir(parents=True, exist_ok=True)
    s = Settings(profiles=_profiles(ns.profiles), via_profiles=_profiles(ns.via_profiles) if ns.via_profiles else [],
                 levels=[int(x) for x in ns.levels.split(",")], max_tokens=ns.max_tokens, rate=ns.rate,
                 ttft_ms=ns.ttft_ms, inject_ms=ns.inject_ms, equivalence_ms=ns.equivalence_ms, min_streams=ns.min_streams, ramp=ns.ramp, h2_k=ns.h2_k,
                 browser=not ns.no_browser, browser_streams=ns.browser_streams, browser_rounds=ns.browser_rounds,
                 cpu_repeats=ns.cpu_repeats, browser_cal_runs=ns.browser_cal_runs, n_boot=ns.bootstrap, seed=ns.seed,
                 data=data)
    t0 = time.monotonic()
    meta = report.meta(["report", *argv], ns.seed)  # time and load when the matrix starts
    matrix = Matrix(s)
    results = matrix.run()
    results["meta"] = {**meta, "matrix_s": time.monotonic() - t0,
                       "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    report.write_json(data / "results.json", results)
    plots = ns.plots or ns.out.with_suffix("")
    write_report(results, matrix.runs, ns.out, plots)
    print(f"wrote {ns.out}, plots in {plots}, raw results in {data / 'results.json'} "
          f"({results['meta']['matrix_s']:.0f} s)", file=sys.stderr)
    return 0
