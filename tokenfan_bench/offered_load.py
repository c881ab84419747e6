"""Equal offered load for ``tokenfan bench vs-vllm``: open-loop arrivals, the rate levels, the run order and
the latency table per rate (pure: numbers in, numbers out; no I/O).

At equal *concurrency* the faster server admits more prefills per second, which lengthens every decode step
of its batch: its ITL tail then measures its throughput as much as its front end. At an equal *request rate*
(open loop: a request is sent at its arrival time whether or not earlier ones finished) both servers get the
same work per second, so their TTFT and ITL compare the front ends at the same load. The levels are fractions
of the slower server's capacity (its best request throughput at equal concurrency in the same run), so
neither server is past saturation, where queueing would dominate every figure.

Arrivals are vLLM's own client's (``vllm bench serve --request-rate R --burstiness B --seed S``), which sends
the requests; :func:`arrival_times` is the same schedule, computed here to record and test it: intervals
drawn from a gamma distribution of shape ``B`` and mean ``1/R`` from NumPy's global generator seeded with
``S`` (``B`` = 1: a Poisson process), then scaled so the last arrival is at ``n/R``; ``fixed`` (``B`` = inf)
is one request every ``1/R`` s.

Latencies are from the first *content* chunk (TTFT¹, ITL¹: see ``vs_vllm.content_latencies``), whose
definition does not depend on when a server sends its role-only first chunk.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

ARRIVALS = {"poisson": 1.0, "fixed": math.inf}  # name -> vLLM's --burstiness
DEFAULT_FRACTIONS = (0.25, 0.5, 0.75)
QUANTILES = (50, 90, 99)
# Figures of one rate run, in the order of the summary table: (key, header).
RATE_METRICS = tuple((f"p{q}_content_{m}_ms", f"{label} p{q}") for m, label in (("ttft", "TTFT¹"), ("itl", "ITL¹"))
                     for q in QUANTILES)

T = TypeVar("T")


def arrival_times(rate: float, n: int, arrivals: str, seed: int) -> np.ndarray:
    """Send times (s from the first request's) of ``n`` requests at ``rate`` per second, as vLLM's client
    schedules them (module docstring): the first request's interval included, the last at ``n / rate``."""
    if rate <= 0 or n <= 0:
        raise ValueError(f"rate and n must be positive, got {rate} and {n}")
    burstiness = ARRIVALS[arrivals]
    if math.isinf(burstiness):
        return np.arange(1, n + 1) / rate
    np.random.seed(seed)  # vLLM's client draws from the global generator, seeded once
    gaps = np.array([np.random.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)) for _ in range(n)])
    times = np.cumsum(gaps)
    return times * ((n / rate) / times[-1])


def schedule_summary(times: np.ndarray) -> dict[str, float]:
    """What a schedule offers: its duration, mean rate and the coefficient of variation of its intervals
    (1 for Poisson arrivals, 0 for fixed ones)."""
    gaps = np.diff(np.concatenate([[0.0], times]))
    mean = float(gaps.mean())
    return {"requests": int(times.size), "duration_s": float(times[-1]), "mean_rate": float(times.size / times[-1]),
            "interval_cv": float(gaps.std() / mean) if mean else 0.0}


def capacity(concurrency_runs: Sequence[dict[str, Any]]) -> tuple[float, str] | None:
    """The slower server's capacity in requests/s and its label: each server's best request throughput over
    its equal-concurrency runs (each point the median over rounds), the lowest of those. None without runs."""
    per: dict[str, dict[int, list[float]]] = {}
    for r in concurrency_runs:
        tput = r["client"].get("request_throughput")
        if tput:
            per.setdefault(r["server"], {}).setdefault(r["concurrency"], []).append(float(tput))
    best = {label: max(statistics.median(v) for v in by_c.values()) for label, by_c in per.items()}
    if not best:
        return None
    label = min(best, key=lambda k: best[k])
    return best[label], label


def rate_levels(capacity_rps: float, fractions: Sequence[float]) -> list[float]:
    """Offered rates below capacity: each fraction of it, rounded to 3 significant digits, ascending."""
    if not all(0 < f < 1 for f in fractions):
        raise ValueError(f"fractions of the capacity must lie in (0, 1), got {list(fractions)}")
    return sorted({float(f"{capacity_rps * f:.3g}") for f in fractions})


def prompts_for(rate: float, duration_s: float, minimum: int) -> int:
    """Requests of one rate run: ``duration_s`` of arrivals, at least ``minimum``."""
    return max(minimum, round(rate * duration_s))


def interleaved(servers: Sequence[T], level: int, rnd: int) -> list[T]:
    """The servers' order at one rate level of one round: A B, then B A at the next level (and the next
    round starts where the last left off), so over two levels each server runs first and last once: A B B A."""
    return list(servers) if (level + rnd) % 2 == 0 else list(reversed(servers))


def rate_latencies(ttfts: Sequence[float], itls: Sequence[Sequence[float] | None]) -> dict[str, float | None]:
    """TTFT¹ and ITL¹ percentiles (ms) of one run from the client's per-request TTFTs and gaps (s): TTFT¹ =
    TTFT + first gap, ITL¹ = every later gap, pooled over requests (as the client pools ITLs)."""
    firsts = [t + gaps[0] for t, gaps in zip(ttfts, itls, strict=False) if gaps]
    rest = [g for gaps in itls if gaps for g in gaps[1:]]
    out: dict[str, float | None] = {}
    for name, values in (("ttft", firsts), ("itl", rest)):
        for q in QUANTILES:
            out[f"p{q}_content_{name}_ms"] = float(np.percentile(values, q)) * 1000 if values else None
    return out


def _median(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def aggregate_rates(runs: Sequence[dict[str, Any]]) -> dict[str, dict[float, dict[str, Any]]]:
    """Per server label and offered rate: the median over rounds of every percentile, of the achieved rate
    (completed requests per second of the client's run) and of the mean TTFT¹; failed requests summed."""
    grouped: dict[str, dict[float, list[dict[str, Any]]]] = {}
    for r in runs:
        grouped.setdefault(r["server"], {}).setdefault(float(r["rate"]), []).append(r)
    out: dict[str, dict[float, dict[str, Any]]] = {}
    for label, by_rate in grouped.items():
        for rate, rs in sorted(by_rate.items()):
            agg: dict[str, Any] = {k: _median([r["latency"].get(k) for r in rs]) for k, _ in RATE_METRICS}
            agg["achieved_rps"] = _median([r["client"].get("request_throughput") for r in rs])
            agg["failed"] = sum(int(r["client"].get("failed", 0)) for r in rs)
            agg["rounds"] = len(rs)
            agg["load1"] = _median([r["load_before"][0] for r in rs])
            out.setdefault(label, {})[rate] = agg
    return out
