"""The A/B difference of two arms' delivery latency, with a cluster-bootstrap interval (pure numpy).

The A/B difference is the median of ``B - A`` delivery latency with a bootstrap 95% interval:
paired per token when both arms watch the same stream (``recv_B - recv_A`` for the same stream and
``seq``: engine and gateway jitter cancel), otherwise the difference of the two medians. Unpaired arms
read different tokens at different times, so through a shaping proxy each token's delivery first loses
the path jitter the proxy added to it (:attr:`ArmSamples.path_ns`: a seeded function of time, the same
for every connection, so it is known and has the same distribution in both arms; subtracting it removes
noise the profile adds on purpose, not a transport's effect). The arm tables stay raw. The
bootstrap resamples *streams* (clusters), not tokens: tokens of one stream share one subscriber
pair, its connection order and its place in the gateway's wake-up order, so they are not
independent, and an i.i.d. token bootstrap gives intervals that are too narrow (an A/A run then
"finds" a difference). With fewer than ``MIN_CLUSTERS`` streams tokens are resampled i.i.d.

Write order: the gateway wakes SSE subscribers first on even ``seq`` and WS first on odd ``seq``,
and rotates the order inside each transport by ``seq`` as well. With one subscriber per arm and
stream, consecutive tokens therefore reach the two arms in opposite orders, and whoever is written
first is ~5-25 µs ahead. The per-token differences are then a two-humped mixture whose median
jumps between the humps; so the paired estimator first averages each (even, odd) pair of tokens,
which cancels the write-order effect exactly and leaves the transport difference plus noise, and
takes the median of those pair means. The client takes the receive time before parsing and yields
once, so its own parsing order adds no such bias.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenfan_bench.stats.metrics import NS_PER_MS, ArmSamples, delivery_ns

# Receive times are stamped by the client after an epoll wake-up; when both arms' data arrive in
# one wake-up, the one read first is stamped first. A/A runs show such fixed offsets of up to ~1 µs
# per stream that no amount of sampling removes, so differences below 2 µs are not resolved: the
# reported interval is the bootstrap interval widened by this floor (both kept in results.json).
SYSTEMATIC_FLOOR_NS = 2_000
MIN_CLUSTERS = 20


def _pair_keys(a: ArmSamples) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    m = a.content & a.live & (a.deltas == 1)
    return a.stream[m] * (1 << 24) + a.seq[m], a.recv_ns[m], a.stream[m]


def paired_differences(a: ArmSamples, b: ArmSamples) -> tuple[np.ndarray, np.ndarray]:
    """``recv_B - recv_A`` (ns) for every (stream, seq) both arms received live and uncoalesced,
    with the stream id of each pair."""
    d, s, _ = _paired(a, b)
    return d, s


def _paired(a: ArmSamples, b: ArmSamples) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ka, ta, sa = _pair_keys(a)
    kb, tb, _ = _pair_keys(b)
    keys, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)
    return tb[ib] - ta[ia], sa[ia], keys


def order_balanced_differences(a: ArmSamples, b: ArmSamples) -> tuple[np.ndarray, np.ndarray]:
    """Means of the paired differences of tokens ``2k`` and ``2k+1`` of each stream (both needed):
    the gateway writes those two in opposite orders, so the write-order effect cancels."""
    d, s, keys = _paired(a, b)
    pair = keys // 2  # keys = stream << 24 | seq: same stream, seq // 2
    _, first, counts = np.unique(pair, return_index=True, return_counts=True)
    full = counts == 2
    idx = first[full]
    return (d[idx] + d[idx + 1]) / 2.0, s[idx]


def bootstrap_medians(values: np.ndarray, clusters: np.ndarray, n_boot: int,
                      rng: np.random.Generator) -> np.ndarray:
    """Medians of ``n_boot`` cluster-bootstrap resamples (resample clusters with replacement).

    Computed as weighted medians over the sorted values, so no resample is materialized.
    """
    order = np.argsort(values, kind="stable")
    v = np.asarray(values, dtype=np.float64)[order]
    _, c = np.unique(np.asarray(clusters)[order], return_inverse=True)
    k = int(c.max()) + 1 if c.size else 0
    if v.size == 0:
        return np.full(n_boot, np.nan)
    out = np.empty(n_boot)
    rows = max(1, min(n_boot, 4_000_000 // max(v.size, k)))
    for start in range(0, n_boot, rows):
        r = min(rows, n_boot - start)
        draws = rng.integers(0, k, size=(r, k))
        counts = np.bincount((draws + np.arange(r)[:, None] * k).ravel(), minlength=r * k).reshape(r, k)
        cum = np.cumsum(counts[:, c], axis=1)
        total = cum[:, -1]
        # np.median of the resample: the mean of the values of rank (T+1)//2 and T//2 + 1 (1-based).
        lo = np.minimum((cum < ((total + 1) // 2)[:, None]).sum(axis=1), v.size - 1)
        hi = np.minimum((cum < (total // 2 + 1)[:, None]).sum(axis=1), v.size - 1)
        out[start:start + r] = (v[lo] + v[hi]) / 2.0
    return out


def difference_boots(a: ArmSamples, b: ArmSamples, *, paired: bool, n_boot: int,
                     rng: np.random.Generator) -> dict[str, Any]:
    """Median B - A delivery latency (ns) and ``n_boot`` bootstrap replicates of it: paired per token
    (write order balanced) when both arms read the same streams, else the difference of the two arms'
    medians, each arm's streams resampled on their own. Streams are the clusters when there are
    ``MIN_CLUSTERS`` of them (per arm when unpaired), else tokens."""
    if paired:
        d, s = order_balanced_differences(a, b)
        n_clusters = int(np.unique(s).size)
        clusters = s if n_clusters >= MIN_CLUSTERS else np.arange(d.size)
        return {"median": float(np.median(d)) if d.size else float("nan"),
                "boots": bootstrap_medians(d, clusters, n_boot, rng), "n": int(d.size), "streams": n_clusters,
                "method": "paired per token pair (write order balanced), "
                          + ("stream-cluster bootstrap" if n_clusters >= MIN_CLUSTERS else "token bootstrap (few streams)")}
    da, db = delivery_ns(a, without_path_jitter=True), delivery_ns(b, without_path_jitter=True)
    sa, sb = a.stream[a.content & a.live], b.stream[b.content & b.live]
    ka, kb = np.unique(sa).size, np.unique(sb).size
    ca = sa if ka >= MIN_CLUSTERS else np.arange(da.size)
    cb = sb if kb >= MIN_CLUSTERS else np.arange(db.size)
    return {"median": float(np.median(db) - np.median(da)) if da.size and db.size else float("nan"),
            "boots": bootstrap_medians(db, cb, n_boot, rng) - bootstrap_medians(da, ca, n_boot, rng),
            "n": int(min(da.size, db.size)), "streams": int(min(ka, kb)),
            "method": "unpaired difference of medians"
                      + (" (the path's known jitter removed), " if a.path_ns.size or b.path_ns.size else ", ")
                      + ("stream-cluster bootstrap" if min(ka, kb) >= MIN_CLUSTERS else "token bootstrap (few streams)")}


def median_difference(a: ArmSamples, b: ArmSamples, *, paired: bool, n_boot: int = 2000,
                      seed: int = 0) -> dict[str, Any]:
    """Median B - A delivery latency (ms) with a bootstrap 95% CI (see the module docstring)."""
    d = difference_boots(a, b, paired=paired, n_boot=n_boot, rng=np.random.default_rng(seed))
    boots = d["boots"]
    lo, hi = (np.percentile(boots, [2.5, 97.5]) if np.isfinite(boots).all() else (np.nan, np.nan))
    # The bootstrap covers sampling noise only. Widen by the client's systematic floor (see
    # SYSTEMATIC_FLOOR_NS) so that an A/A run's interval is honest about what cannot be resolved.
    return {"median": d["median"] / NS_PER_MS,
            "ci95": [float(lo - SYSTEMATIC_FLOOR_NS) / NS_PER_MS, float(hi + SYSTEMATIC_FLOOR_NS) / NS_PER_MS],
            "ci95_sampling": [float(lo) / NS_PER_MS, float(hi) / NS_PER_MS],
            "systematic_floor_ms": SYSTEMATIC_FLOOR_NS / NS_PER_MS,
            "paired": paired, "method": d["method"], "n": d["n"], "streams": d["streams"], "n_boot": n_boot,
            "seed": seed}
