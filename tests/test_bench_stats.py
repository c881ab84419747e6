"""The bench's pure parts: SSE decoding, chunk sampling, metrics and bootstrap statistics."""

from __future__ import annotations

import numpy as np
import pytest

from tokenfan_bench.stats import (
    ArmSamples,
    arm_metrics,
    bootstrap_medians,
    itl_ns,
    median_difference,
    paired_differences,
    saturation_point,
    summary_ms,
)
from tokenfan_bench.wire import SseDecoder, chunk_sample

MS = 1_000_000


def chunk(seq: int, emit_ns: int, text: str = "x", *, chat: bool = True, coalesced: int | None = None,
          finish: str | None = None) -> dict:
    tf = {"seq": seq, "emit_ns": emit_ns, "sent_ns": emit_ns}
    if coalesced:
        tf["coalesced"] = coalesced
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    choice["finish_reason"] = finish
    return {"choices": [choice], "tokenfan": tf}


def arm(transport: str, streams: dict[int, list[tuple[int, int, int]]], post_ns: int = 0) -> ArmSamples:
    """``streams``: stream id -> [(seq, emit_ns, recv_ns)], all content, live, uncoalesced."""
    rows = [(s, q, e, r) for s, evs in streams.items() for q, e, r in evs]
    a = ArmSamples(transport)
    a.stream, a.seq, a.emit_ns, a.recv_ns = (np.array(col, np.int64) for col in zip(*rows))
    a.sent_ns = a.emit_ns.copy()
    a.deltas = np.ones(len(rows), np.int64)
    a.content = np.ones(len(rows), bool)
    a.live = np.ones(len(rows), bool)
    a.sub_stream = np.array(list(streams), np.int64)
    a.post_ns = np.full(len(streams), post_ns, np.int64)
    a.connected_ns = np.full(len(streams), post_ns, np.int64)
    a.ok = np.ones(len(streams), bool)
    return a


# -- wire -------------------------------------------------------------------------------------


def test_sse_decoder_reassembles_events_split_across_reads_and_drops_comments():
    stream = b": tokenfan stream x\n\nretry: 1000\n\nid: 0\ndata: {\"a\":1}\n\nid: 1\ndata: {\"a\":2}\n\ndata: [DONE]\n\n"
    dec = SseDecoder()
    events = [ev for i in range(0, len(stream), 7) for ev in dec.feed(stream[i:i + 7])]
    assert [(e.event, e.id, e.data) for e in events] == [
        ("message", "0", b'{"a":1}'), ("message", "1", b'{"a":2}'), ("message", None, b"[DONE]")]


def test_sse_decoder_reports_named_events():
    (ev,) = SseDecoder().feed(b'event: error\ndata: {"error":{}}\n\n')
    assert ev.event == "error" and ev.data == b'{"error":{}}'


def test_chunk_sample_role_chunk_is_not_content_and_coalesced_counts_deltas():
    role = chunk(0, 5, "")
    role["choices"][0]["delta"]["role"] = "assistant"
    assert chunk_sample(role) == (0, 5, 5, 1, False, False)
    assert chunk_sample(chunk(7, 9, " hi", coalesced=3, finish="length")) == (7, 9, 9, 3, True, True)
    assert chunk_sample(chunk(2, 1, " hi", chat=False)).content
    assert not chunk_sample({"choices": [], "usage": {}, "tokenfan": {"seq": 9, "emit_ns": 1}}).content


# -- metrics ----------------------------------------------------------------------------------


def test_summary_uses_numpy_linear_percentiles_in_ms():
    x = np.arange(1, 1001) * MS
    s = summary_ms(x)
    assert s["n"] == 1000 and s["mean"] == pytest.approx(500.5)
    assert s["p50"] == pytest.approx(np.percentile(np.arange(1, 1001), 50))
    assert s["p99.9"] == pytest.approx(np.percentile(np.arange(1, 1001), 99.9))
    assert summary_ms(np.array([]))["p99"] is None


def test_itl_pools_gaps_within_each_subscriber_only():
    a = arm("sse", {1: [(1, 0, 10), (2, 0, 30)], 2: [(1, 0, 1000), (2, 0, 1005), (3, 0, 1025)]})
    assert sorted(itl_ns(a).tolist()) == [5, 20, 20]


def test_arm_metrics_ttft_e2e_delivery_and_rate_follow_their_definitions():
    # one stream: request at 0, tokens emitted every 50 ms from 20 ms, received 1 ms later
    evs = [(k + 1, (20 + 50 * k) * MS, (21 + 50 * k) * MS) for k in range(11)]
    m = arm_metrics(arm("ws", {1: evs}), wall_s=1.0)
    assert m["ttft_ms"]["p50"] == pytest.approx(21)
    assert m["e2e_ms"]["p50"] == pytest.approx(521)
    assert m["delivery_ms"]["p99"] == pytest.approx(1)
    assert m["itl_ms"]["mean"] == pytest.approx(50)
    assert m["tokens_per_s"]["p50"] == pytest.approx(20)
    assert m["errors"] == 0 and m["content_events"] == 11


# -- statistics -------------------------------------------------------------------------------


def test_cluster_bootstrap_with_singleton_clusters_matches_brute_force_resampling():
    rng = np.random.default_rng(3)
    v = rng.normal(size=301)
    fast = bootstrap_medians(v, np.arange(v.size), 4000, np.random.default_rng(1))
    brute = np.median(v[np.random.default_rng(2).integers(0, v.size, (4000, v.size))], axis=1)
    assert np.percentile(fast, [2.5, 50, 97.5]) == pytest.approx(np.percentile(brute, [2.5, 50, 97.5]), abs=0.03)


def _two_arms(shift_ns: int, n_streams: int = 40, tokens: int = 30, seed: int = 0, order_ns: int = 0,
              signs: tuple[int, ...] = (1, -1)):
    """Arm B receives every token ``shift_ns`` after arm A, plus jitter; ``order_ns``: a fixed
    per-stream offset with the sign ``signs[stream % len(signs)]`` (the gateway's fixed write order
    between two same-transport subscribers of one stream)."""
    rng = np.random.default_rng(seed)
    a, b = {}, {}
    for s in range(n_streams):
        sign = signs[s % len(signs)]
        evs_a, evs_b = [], []
        for k in range(1, tokens + 1):
            emit = k * 50 * MS
            ra = emit + int(rng.exponential(0.5 * MS))
            evs_a.append((k, emit, ra))
            evs_b.append((k, emit, ra + shift_ns + sign * order_ns + int(rng.normal(0, 20_000))))
        a[s], b[s] = evs_a, evs_b
    return a, b


def test_paired_difference_recovers_a_known_shift():
    a, b = _two_arms(1 * MS)
    d = median_difference(arm("sse", a), arm("ws", b), paired=True, seed=0)
    assert d["median"] == pytest.approx(1.0, abs=0.02)
    assert d["ci95"][0] < 1.0 < d["ci95"][1] or d["ci95"][1] - d["ci95"][0] < 0.02
    assert d["streams"] == 40


@pytest.mark.parametrize("seed", range(5))
def test_aa_interval_contains_zero_when_per_stream_write_order_is_balanced(seed):
    a, b = _two_arms(0, seed=seed, order_ns=85_000)
    d = median_difference(arm("sse", a), arm("sse", b), paired=True, seed=seed)
    assert d["ci95"][0] <= 0 <= d["ci95"][1]


def test_stream_cluster_interval_is_wider_than_a_token_bootstrap_when_streams_differ():
    a, b = _two_arms(0, n_streams=40, seed=2, order_ns=85_000, signs=(1, 1, -1))
    d, s = paired_differences(arm("sse", a), arm("sse", b))
    rng = np.random.default_rng(0)
    by_stream = np.percentile(bootstrap_medians(d, s, 1000, rng), [2.5, 97.5])
    by_token = np.percentile(bootstrap_medians(d, np.arange(d.size), 1000, rng), [2.5, 97.5])
    assert np.ptp(by_stream) > 2 * np.ptp(by_token)


def test_unpaired_difference_of_medians_recovers_a_shift():
    a, b = _two_arms(2 * MS, seed=4)
    b = {s + 1000: evs for s, evs in b.items()}  # separate streams
    d = median_difference(arm("sse", a), arm("ws", b), paired=False, seed=0)
    assert d["median"] == pytest.approx(2.0, abs=0.15)
    assert d["ci95"][0] < 2.0 < d["ci95"][1]


def test_saturation_point_is_the_lowest_concurrency_past_the_threshold():
    assert saturation_point([1000, 10, 100], [80.0, 2.0, 60.0]) == 100
    assert saturation_point([1, 10], [1.0, None]) is None
