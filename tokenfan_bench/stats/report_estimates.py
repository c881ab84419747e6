"""What ``tokenfan bench report`` estimates beyond the per-arm metrics and the delivery difference, and how
it reads an interval (pure: samples and dictionaries in, numbers and words out).

Estimators: the TTFT difference and the p99 inter-token-gap difference of two arms, stalls, and the
calibration's difference-in-differences against a placebo gateway. Readings: which arm is lower
(:func:`verdict`), an interval that holds 0, equivalence within a margin, a calibration recovered against the
delay the gateway applied (:func:`applied_delay`, from its injected-delay histogram).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenfan_bench.stats.ab_difference import difference_boots
from tokenfan_bench.stats.metrics import ArmSamples, itl_ns

# A gap this much longer than the stream's median gap (and at least STALL_MIN_MS) is a stall.
STALL_FACTOR, STALL_MIN_MS = 5.0, 250.0

# The browser calibration's placebo sleeps this long before each WebSocket write, and its delayed gateway
# this plus --inject-ms, so both arms' writes leave the gateway off the engine's step. With a placebo of
# 0 (the write inside the step, when the gateway, the proxy and Chromium are awake) against a delayed write
# (alone, after the machine went idle), Chromium read the 2 ms as 0.1-0.15 ms more than the gateway slept:
# every process on the way wakes cold (lan, six pairs, 2026-11-24: 2.19-2.39 ms for ~2.14). With ws:1
# against ws:3, four pairs read +2.04 [1.94, 2.16] ms for 2.01 (per pair 1.91-2.16).
PLACEBO_MS = 1.0


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


def median_gap(a: ArmSamples) -> float:
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
    :func:`tokenfan_bench.stats.ab_difference.difference_boots` (paired per token, or per arm on separate streams), averaged
    over run pairs ``((cal A, cal B), (placebo A, placebo B))``, with a 95% interval from the average of
    independent stream-cluster bootstraps of every run.

    Averaged pair by pair, not pooled: a run moves both of its arms together (the browser measured on lan:
    each arm's median delivery moved by up to ±0.6 ms from run to run, the DiD of six pairs 2.19-2.39 ms),
    and that cancels inside each run's B − A, where pooled medians would carry it.

    For arms whose difference is not 0 without a delay (Chromium's EventSource and WebSocket are not), the
    injected delay is what the delayed gateway adds to the placebo's difference: same server path, a sleep
    shorter by the injected delay (:data:`PLACEBO_MS`: both writes off the engine's step). That holds
    only if the arms do not act on each other; the browser's do when they read the same tokens
    (:mod:`tokenfan_bench.clients.browser`), so its runs give each stream to one arm (``paired=False``)."""
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


def calibration_difference(r: dict[str, Any]) -> dict[str, Any]:
    """The calibration's difference: the browser's is the difference-in-differences against its placebo."""
    return r.get("did_ms") or r["diffs_ms"]["B-A"]
