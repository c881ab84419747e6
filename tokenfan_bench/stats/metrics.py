"""Bench metrics per arm: TTFT, ITL, E2E, delivery latency, summaries (pure numpy: arrays in, numbers out).

Definitions (times are the client's ``time.time_ns()`` at receipt; the gateway stamps ``emit_ns``
with the same machine clock). Where they overlap they match ``vllm bench serve``:

- **TTFT**: request start (the ``POST /v1/streams`` that created the stream) -> first *content*
  event received by this subscriber. vLLM: request sent -> first chunk with text.
- **ITL**: gaps between successive content events of one subscriber, pooled over all subscribers
  of the arm (vLLM's ``itl`` list, pooled before taking percentiles). A coalesced event is one gap.
- **E2E**: request start -> last chunk (the one carrying ``finish_reason``) received. vLLM's
  ``latency`` (request sent -> last chunk).
- **Delivery latency**: ``recv_ns - emit_ns`` per *live* content event: events the engine emitted
  after the subscriber was connected (replayed history would only measure the join delay).
- **Engine->gateway / gateway->client**: the delivery latency split at the gateway's publish stamp
  ``sent_ns`` (uncoalesced live content events): where the time goes.
- **Tokens/s per stream**: ``(deltas - 1) / (last content - first content)``, i.e. 1/TPOT.
  "Deltas" are engine outputs (one token each unless the engine fell behind).
- Percentiles: ``numpy.percentile`` (linear interpolation), as vLLM. p50, p90, p99, p99.9, mean.

The A/B difference of two arms and its interval: :mod:`tokenfan_bench.stats.ab_difference`.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0, 99.9)
NS_PER_MS = 1e6


@dataclass
class ArmSamples:
    """Raw samples of one arm. Event rows: one per chunk received. Subscriber rows: one per subscriber.

    ``stream`` ids are unique per run; an arm has at most one subscriber per stream, and the event
    rows of one subscriber are contiguous and in receive order.
    """

    transport: str
    stream: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    seq: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    recv_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    emit_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    sent_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    deltas: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    content: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    live: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    # The shaping path's jitter on each event (ns), known because it is seeded (see :func:`delivery_ns`);
    # empty when the arm's path has none (no ``--net``).
    path_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    # Events that are the first after their generation moved to another engine (empty: none): the gap
    # before each is the failover's, not the transport's, so :func:`itl_ns` leaves it out.
    migrated: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    sub_stream: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    post_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    connected_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    ok: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    errors: list[str] = field(default_factory=list)

    EVENT_FIELDS = ("stream", "seq", "recv_ns", "emit_ns", "sent_ns", "deltas", "content", "live")
    SUB_FIELDS = ("sub_stream", "post_ns", "connected_ns", "ok")

    @classmethod
    def concat(cls, transport: str, parts: list[ArmSamples]) -> ArmSamples:
        out = cls(transport)
        for f in fields(cls):
            if f.name in cls.EVENT_FIELDS + cls.SUB_FIELDS and parts:
                setattr(out, f.name, np.concatenate([getattr(p, f.name) for p in parts]))
        if any(p.path_ns.size for p in parts):
            out.path_ns = np.concatenate([p.known_path_ns() for p in parts])
        if any(p.migrated.size for p in parts):
            out.migrated = np.concatenate([p.migrated if p.migrated.size else np.zeros(p.seq.size, bool)
                                           for p in parts])
        out.errors = [e for p in parts for e in p.errors]
        return out

    def known_path_ns(self) -> np.ndarray:
        """:attr:`path_ns`, or zeros for an arm without a shaped path."""
        return self.path_ns if self.path_ns.size == self.recv_ns.size else np.zeros(self.recv_ns.size)


def summary_ms(values_ns: np.ndarray) -> dict[str, float | int | None]:
    """n, mean and percentiles of nanosecond values, in milliseconds (None when empty)."""
    x = np.asarray(values_ns, dtype=np.float64) / NS_PER_MS
    out: dict[str, float | int | None] = {"n": int(x.size)}
    if x.size == 0:
        out.update({"mean": None, **{_pname(p): None for p in PERCENTILES}})
        return out
    out["mean"] = float(x.mean())
    for p, v in zip(PERCENTILES, np.percentile(x, PERCENTILES)):
        out[_pname(p)] = float(v)
    return out


def summary_plain(values: np.ndarray) -> dict[str, float | int | None]:
    x = np.asarray(values, dtype=np.float64)
    out: dict[str, float | int | None] = {"n": int(x.size), "mean": float(x.mean()) if x.size else None}
    for p, v in zip(PERCENTILES, np.percentile(x, PERCENTILES) if x.size else [None] * len(PERCENTILES)):
        out[_pname(p)] = None if v is None else float(v)
    return out


def _pname(p: float) -> str:
    return f"p{p:g}"


# -- per-arm metrics --------------------------------------------------------------------------


def delivery_ns(a: ArmSamples, *, without_path_jitter: bool = False) -> np.ndarray:
    """Delivery latency of the live content events. ``without_path_jitter``: minus the jitter the shaping
    proxy added on purpose (:attr:`ArmSamples.path_ns`), for comparing arms that read different streams
    (:func:`difference_boots`)."""
    m = a.content & a.live
    d = a.recv_ns[m] - a.emit_ns[m]
    return d - a.known_path_ns()[m] if without_path_jitter and a.path_ns.size else d


def _split(a: ArmSamples, part: str) -> np.ndarray:
    m = a.content & a.live & (a.sent_ns > 0) & (a.deltas == 1)  # a coalesced event is re-stamped when merged
    return (a.sent_ns[m] - a.emit_ns[m]) if part == "engine" else (a.recv_ns[m] - a.sent_ns[m])


def itl_ns(a: ArmSamples) -> np.ndarray:
    """Pooled gaps between successive content events of each subscriber (a gap that ends at the first event
    after a migration to another engine is the failover's, and left out)."""
    s, t = a.stream[a.content], a.recv_ns[a.content]
    same = s[1:] == s[:-1]
    if a.migrated.size:
        same &= ~a.migrated[a.content][1:]
    return np.diff(t)[same]


def _per_subscriber(a: ArmSamples) -> dict[str, np.ndarray]:
    """First/last content receive time, last chunk time and deltas per stream (sorted stream ids)."""
    c = a.content
    ids, first_idx = np.unique(a.stream[c], return_index=True)
    last_idx = np.unique(a.stream[c][::-1], return_index=True)[1]
    last_idx = c.sum() - 1 - last_idx
    tc = a.recv_ns[c]
    deltas = np.bincount(np.searchsorted(ids, a.stream[c]), weights=a.deltas[c], minlength=ids.size)
    all_ids, rev_idx = np.unique(a.stream[::-1], return_index=True)
    last_chunk = a.recv_ns[::-1][rev_idx]
    return {"ids": ids, "first": tc[first_idx], "last": tc[last_idx], "deltas": deltas,
            "chunk_ids": all_ids, "last_chunk": last_chunk}


def arm_metrics(a: ArmSamples, wall_s: float) -> dict[str, Any]:
    per = _per_subscriber(a)
    post = dict(zip(a.sub_stream.tolist(), a.post_ns.tolist()))
    ok_ids = set(a.sub_stream[a.ok].tolist())
    ttft = np.array([f - post[i] for i, f in zip(per["ids"].tolist(), per["first"].tolist())], dtype=np.int64)
    e2e = np.array([t - post[i] for i, t in zip(per["chunk_ids"].tolist(), per["last_chunk"].tolist())
                    if i in ok_ids], dtype=np.int64)
    span = (per["last"] - per["first"]) / 1e9
    keep = (per["deltas"] >= 2) & (span > 0)
    tps = (per["deltas"][keep] - 1) / span[keep]
    content_events = int(a.content.sum())
    return {
        "transport": a.transport,
        "subscribers": int(a.sub_stream.size),
        "errors": int((~a.ok).sum()),
        "error_examples": sorted(set(a.errors))[:5],
        "error_kinds": error_kinds(a.errors),
        "events": int(a.seq.size),
        "content_events": content_events,
        "deltas_delivered": int(a.deltas[a.content].sum()),
        "coalesced_events": int((a.deltas > 1).sum()),
        "live_content_events": int((a.content & a.live).sum()),
        "deliveries_per_s": content_events / wall_s if wall_s > 0 else None,
        "ttft_ms": summary_ms(ttft),
        "itl_ms": summary_ms(itl_ns(a)),
        "e2e_ms": summary_ms(e2e),
        "delivery_ms": summary_ms(delivery_ns(a)),
        # delivery = engine->gateway (publish - emit) + gateway->client (receive - publish)
        "engine_to_gateway_ms": summary_ms(_split(a, "engine")),
        "gateway_to_client_ms": summary_ms(_split(a, "client")),
        "tokens_per_s": summary_plain(tps),
    }


_CODE = re.compile(r"""["']code["']:\s*["']([a-z_]+)["']""")


def error_kinds(errors: list[str]) -> dict[str, int]:
    """``errors`` counted by kind: the OpenAI ``code`` an error names (``client_subscription_limit``), else
    the start of its message; most frequent first."""
    kinds = Counter(m.group(1) if (m := _CODE.search(e)) else e[:120] for e in errors)
    return dict(kinds.most_common())


def saturation_point(levels: list[int], p99_ms: list[float | None], threshold_ms: float = 50.0) -> int | None:
    """The lowest concurrency whose p99 delivery latency exceeds ``threshold_ms`` (None: never)."""
    for n, p in sorted(zip(levels, p99_ms), key=lambda t: t[0]):
        if p is not None and p > threshold_ms:
            return n
    return None
