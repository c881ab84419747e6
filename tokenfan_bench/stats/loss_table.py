"""The loss table's estimates, per arm: delivery p50 and p99 and the stall rate, each with a 95% interval
from the stream-cluster bootstrap (streams resampled with replacement, every token of a drawn stream kept:
under loss one stream's tokens stall together, so they are not independent draws).

Pure: samples in, numbers out. A stall is :data:`~tokenfan_bench.stats.report_estimates.STALL_FACTOR` × the
stream's median gap and at least :data:`~tokenfan_bench.stats.report_estimates.STALL_MIN_MS`, as in the
rest of the report.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenfan_bench.stats.metrics import ArmSamples
from tokenfan_bench.stats.report_estimates import STALL_FACTOR, STALL_MIN_MS, gaps_by_stream


def delivery_by_stream(a: ArmSamples) -> list[np.ndarray]:
    """Each stream's delivery latencies (ms) of its live content events."""
    m = a.content & a.live
    streams, d = a.stream[m], (a.recv_ns[m] - a.emit_ns[m]) / 1e6
    return [d[streams == s] for s in np.unique(streams)]


def quantile_ci(groups: list[np.ndarray], q: float, n_boot: int, seed: int) -> dict[str, Any]:
    """The pooled ``q``-th percentile of ``groups`` and its 95% stream-cluster bootstrap interval."""
    groups = [g for g in groups if g.size]
    if not groups:
        return {"value": None, "ci95": [None, None], "streams": 0}
    rng = np.random.default_rng(seed)
    value = float(np.percentile(np.concatenate(groups), q))
    boots = np.empty(n_boot)
    for i in range(n_boot):
        pick = rng.integers(0, len(groups), len(groups))
        boots[i] = np.percentile(np.concatenate([groups[j] for j in pick]), q)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return {"value": value, "ci95": [float(lo), float(hi)], "streams": len(groups)}


def stall_counts(a: ArmSamples) -> list[tuple[int, int]]:
    """Per stream: (stalls, gaps)."""
    out = []
    for g in gaps_by_stream(a).values():
        if g.size < 3:
            continue
        limit = max(STALL_FACTOR * float(np.median(g)), STALL_MIN_MS * 1e6)
        out.append((int((g > limit).sum()), int(g.size)))
    return out


def stall_rate_ci(a: ArmSamples, n_boot: int, seed: int) -> dict[str, Any]:
    """Stalls per 1000 gaps and its 95% stream-cluster bootstrap interval."""
    counts = np.array(stall_counts(a), np.int64).reshape(-1, 2)
    if not counts.size or counts[:, 1].sum() == 0:
        return {"value": None, "ci95": [None, None], "stalls": 0, "gaps": 0}
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(counts), (n_boot, len(counts)))
    stalls, gaps = counts[pick, 0].sum(axis=1), counts[pick, 1].sum(axis=1)
    boots = 1000 * stalls / np.maximum(gaps, 1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return {"value": 1000 * float(counts[:, 0].sum()) / float(counts[:, 1].sum()), "ci95": [float(lo), float(hi)],
            "stalls": int(counts[:, 0].sum()), "gaps": int(counts[:, 1].sum())}


def arm_row(a: ArmSamples, n_boot: int, seed: int) -> dict[str, Any]:
    """One arm's cells of the loss table."""
    groups = delivery_by_stream(a)
    return {"transport": a.transport, "p50": quantile_ci(groups, 50, n_boot, seed),
            "p99": quantile_ci(groups, 99, n_boot, seed + 1), "stalls": stall_rate_ci(a, n_boot, seed + 2),
            "errors": len(a.errors), "subscribers": int(a.sub_stream.size), "late": late_subscribers(a)}


def late_subscribers(a: ArmSamples) -> int:
    """Subscribers with content but none of it live: they joined after their stream's last content event."""
    m = a.content
    saw, live = set(a.stream[m].tolist()), set(a.stream[m & a.live].tolist())
    return len(saw - live)


def lowest(rows: dict[str, dict[str, Any]], metric: str) -> str | None:
    """The arm whose interval of ``metric`` lies wholly below every other arm's, if one does."""
    best: str | None = None
    for k, r in rows.items():
        lo_hi = r[metric]["ci95"]
        if lo_hi[1] is None:
            continue
        others = [o[metric]["ci95"][0] for j, o in rows.items() if j != k and o[metric]["ci95"][0] is not None]
        if others and all(lo_hi[1] < x for x in others):
            best = k
    return best
