"""Where a token's time goes inside the browser page, per API: the statistics of ``tokenfan bench
page-levels`` (:mod:`tokenfan_bench.page_levels`, page code ``web/js/levels.js``). Pure numpy.

Each stream is read at once by three readers of one page: ``es`` (EventSource, stamped first thing in
``onmessage``, and the event's ``timeStamp``), ``fetch`` (the same SSE URL read by a ``ReadableStream``
reader, stamped when ``read()`` resolves: the earliest page code sees HTTP bytes) and ``ws`` (WebSocket,
``onmessage`` and ``timeStamp``). :func:`tokens` joins their rows per ``(stream, seq)``; every estimate is a
per-token difference between two of those stamps, paired, averaged over the token pairs ``2k, 2k+1`` of a
stream (the gateway writes SSE readers first on even ``seq`` and WebSocket readers first on odd ones, so
the write order cancels) and summarised by its median with a stream-cluster bootstrap 95% interval
(:func:`tokenfan_bench.stats.ab_difference.bootstrap_medians`; tokens when fewer than
:data:`~tokenfan_bench.stats.ab_difference.MIN_CLUSTERS` streams).

The ``… − gateway send`` levels compare a page stamp with the gateway's ``sent_ns`` (its clock): they carry
the clock offset's uncertainty (one constant per run, the same for every API), so only their differences
are exact; they show the order of magnitude of the browser's own part of the delivery.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenfan_bench.stats.ab_difference import MIN_CLUSTERS, bootstrap_medians

READERS = ("es", "fetch", "ws")
# Stamps of a token: the reader's performance.now() in its handler, and the event's timeStamp (es, ws).
STAMPS = ("es", "es_ts", "fetch", "ws", "ws_ts")
SEND = "send"  # the gateway's sent_ns, on the page clock (through the run's clock offset)

# (name, minuend, subtrahend, what it measures)
LEVELS: tuple[tuple[str, str, str, str], ...] = (
    ("es − fetch", "es", "fetch", "EventSource's own dispatch: same bytes, its handler against the stream reader"),
    ("ws − fetch", "ws", "fetch", "the transports at the lowest level each API allows"),
    ("ws − es", "ws", "es", "what the A/B report's browser arms compare (handler against handler)"),
    ("es handler − es timeStamp", "es", "es_ts", "EventSource: handler stamp against the event's creation"),
    ("ws handler − ws timeStamp", "ws", "ws_ts", "WebSocket: handler stamp against the event's creation"),
    ("fetch − gateway send", "fetch", SEND, "the browser's part for HTTP bytes (± the clock offset)"),
    ("ws − gateway send", "ws", SEND, "the browser's part for WebSocket frames (± the clock offset)"),
)


@dataclass
class Tokens:
    """Tokens every reader received live, one entry per token; page stamps in ms on the page's
    ``performance.now()`` clock, ``send`` (the gateway's ``sent_ns``) moved onto that clock."""

    stream: np.ndarray
    seq: np.ndarray
    stamps: dict[str, np.ndarray] = field(default_factory=dict)
    fetch_batch: np.ndarray = field(default_factory=lambda: np.zeros(0))  # SSE events in the fetch read
    dropped: int = 0  # tokens some reader missed or received before every reader was open

    def __len__(self) -> int:
        return int(self.seq.size)


def tokens(records: list[dict[str, Any]], *, server_minus_page_ms: float) -> Tokens:
    """Join the page's records (``levels.js``: one per stream and reader, rows ``[seq, emit_ns, sent_ns,
    now_ms, ts_ms, batch]``) into :class:`Tokens`. ``server_minus_page_ms``: the server clock (epoch ms) minus
    the page's ``performance.now()``, i.e. the clock offset plus ``performance.timeOrigin``. A stream with a
    failed reader is left out; a token counts when every reader got it and it was emitted after the last
    reader opened (none of them read it from the stream's replay)."""
    by_stream: dict[int, dict[str, dict[str, Any]]] = {}
    for r in records:
        by_stream.setdefault(int(r["stream"]), {})[r["reader"]] = r
    rows: list[list[float]] = []
    dropped = 0
    for sid, recs in sorted(by_stream.items()):
        if set(recs) != set(READERS) or any(r["error"] is not None or r["openMs"] is None for r in recs.values()):
            continue
        opened_ms = max(r["openMs"] for r in recs.values()) + server_minus_page_ms
        per = {name: {int(row[0]): row for row in r["rows"] if row[0] >= 0} for name, r in recs.items()}
        seqs = set().union(*per.values())
        for seq in sorted(seqs):
            got = [per[name].get(seq) for name in READERS]
            es, fe, ws = got
            if es is None or fe is None or ws is None or es[1] / 1e6 < opened_ms:
                dropped += 1
                continue
            rows.append([sid, seq, es[2] / 1e6 - server_minus_page_ms, es[3], es[4], fe[3], ws[3], ws[4], fe[5]])
    m = np.array(rows, dtype=np.float64).reshape(-1, 9)
    return Tokens(stream=m[:, 0].astype(np.int64), seq=m[:, 1].astype(np.int64),
                  stamps={SEND: m[:, 2], "es": m[:, 3], "es_ts": m[:, 4], "fetch": m[:, 5], "ws": m[:, 6],
                          "ws_ts": m[:, 7]},
                  fetch_batch=m[:, 8].astype(np.int64), dropped=dropped)


def order_balanced(d: np.ndarray, stream: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Means of ``d`` over the token pairs ``2k, 2k+1`` of a stream where both are present, and each mean's
    stream: the gateway's write order (SSE first on even ``seq``) cancels inside a pair."""
    order = np.lexsort((seq, stream))
    d, stream, seq = d[order], stream[order], seq[order]
    key = stream.astype(np.int64) * (1 << 32) + seq // 2
    _, first, counts = np.unique(key, return_index=True, return_counts=True)
    idx = first[counts == 2]
    return (d[idx] + d[idx + 1]) / 2.0, stream[idx]


def level_boots(t: Tokens, minuend: str, subtrahend: str, *, n_boot: int,
                rng: np.random.Generator) -> dict[str, Any]:
    """One per-token difference (ms): its order-balanced median, ``n_boot`` bootstrap replicates of it
    (streams resampled), the 10th and 90th percentiles of the pair means, and the counts."""
    d = t.stamps[minuend] - t.stamps[subtrahend]
    ok = np.isfinite(d) & (t.stamps[minuend] >= 0) & (t.stamps[subtrahend] >= 0)
    pairs, streams = order_balanced(d[ok], t.stream[ok], t.seq[ok])
    n_streams = int(np.unique(streams).size)
    clusters = streams if n_streams >= MIN_CLUSTERS else np.arange(pairs.size)
    return {"median": float(np.median(pairs)) if pairs.size else float("nan"),
            "boots": bootstrap_medians(pairs, clusters, n_boot, rng),
            "p10": float(np.percentile(pairs, 10)) if pairs.size else float("nan"),
            "p90": float(np.percentile(pairs, 90)) if pairs.size else float("nan"),
            "n": int(pairs.size), "streams": n_streams,
            "bootstrap": "stream clusters" if n_streams >= MIN_CLUSTERS else "tokens (few streams)"}


def interval(boots: np.ndarray) -> list[float]:
    """The 95% percentile interval of bootstrap replicates (NaN when any is not finite)."""
    if boots.size == 0 or not np.isfinite(boots).all():
        return [float("nan"), float("nan")]
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return [float(lo), float(hi)]


def summarise(level: dict[str, Any]) -> dict[str, Any]:
    """A :func:`level_boots` result without its replicates, with its interval."""
    out = {k: v for k, v in level.items() if k != "boots"}
    out["ci95"] = interval(level["boots"])
    return out


def levels(t: Tokens, *, n_boot: int, seed: int) -> dict[str, dict[str, Any]]:
    """Every difference of :data:`LEVELS` with its replicates (one generator, in that order)."""
    rng = np.random.default_rng(seed)
    return {name: {**level_boots(t, a, b, n_boot=n_boot, rng=rng), "what": what} for name, a, b, what in LEVELS}


def shift(delayed: dict[str, Any], placebo: dict[str, Any]) -> dict[str, Any]:
    """How far a delay moved one difference between two runs (delayed − placebo): the difference of
    their medians, with the replicates subtracted pairwise (independent runs)."""
    boots = delayed["boots"] - placebo["boots"]
    return {"median": delayed["median"] - placebo["median"], "ci95": interval(boots)}
