"""The packet-loss section's pure parts: loss levels, the kernel counters' parsers, the wire's flow keys and
burst chain, the loss table's estimators (checked against brute force), and the WebTransport head codec."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from gateway.http3.wire import HeadError, RequestHead, parse_response_head, response_head, split_head
from tokenfan_bench.network.lossy import measured, parse_iptables, parse_loss, parse_snmp
from tokenfan_bench.network.wire import Bursts, flow_key, parse_burst
from tokenfan_bench.stats.loss_table import arm_row, lowest, quantile_ci, stall_counts
from tokenfan_bench.stats.metrics import ArmSamples


def test_loss_levels_parse_random_and_burst() -> None:
    assert parse_loss("0.5%").random == pytest.approx(0.005) and not parse_loss("0.5%").burst
    b = parse_loss("2%-burst/4")
    assert b.burst == pytest.approx(0.02) and b.burst_len == 4 and not b.random
    assert parse_loss("5%-burst").burst_len == 8
    for bad in ("2", "60%", "2%-bursty"):
        with pytest.raises(ValueError):
            parse_loss(bad)
    assert parse_burst("3%/10") == (pytest.approx(0.03), 10.0) and parse_burst(None) == (0.0, 1.0)


def test_snmp_and_netstat_text_parse_to_the_counted_fields() -> None:
    text = ("Tcp: RtoAlgorithm OutSegs RetransSegs InSegs\nTcp: 1 100 7 90\n"
            "Udp: InDatagrams NoPorts OutDatagrams\nUdp: 5 0 6\n"
            "TcpExt: SyncookiesSent TCPLossProbes TCPTimeouts\nTcpExt: 0 3 2\n")
    assert parse_snmp(text) == {"Tcp.OutSegs": 100, "Tcp.RetransSegs": 7, "Tcp.InSegs": 90, "Udp.InDatagrams": 5,
                                "Udp.OutDatagrams": 6, "TcpExt.TCPLossProbes": 3, "TcpExt.TCPTimeouts": 2}


def test_iptables_counts_and_measured_loss_per_protocol() -> None:
    listing = """Chain OUTPUT (policy ACCEPT 0 packets, 0 bytes)
    pkts      bytes target     prot opt in     out     source               destination
     100     9000            tcp  --  *      tfw0    0.0.0.0/0            0.0.0.0/0            /* tokenfan-seen-up-tcp */
       2      180 DROP       tcp  --  *      tfw0    0.0.0.0/0            0.0.0.0/0            statistic mode random probability 0.02000000000 /* tokenfan-drop-up-tcp */
      50     4000            udp  --  *      tfw0    0.0.0.0/0            0.0.0.0/0            /* tokenfan-seen-up-udp */
       1       80 DROP       udp  --  *      tfw0    0.0.0.0/0            0.0.0.0/0            statistic mode random probability 0.02000000000 /* tokenfan-drop-up-udp */
"""
    rules = parse_iptables(listing)
    assert rules == {"tokenfan-seen-up-tcp": 100, "tokenfan-drop-up-tcp": 2, "tokenfan-seen-up-udp": 50,
                     "tokenfan-drop-up-udp": 1}
    tcp0 = {"Tcp.OutSegs": 10, "Tcp.RetransSegs": 1}
    wire: dict[str, dict[str, dict[str, int]]] = {"packets": {}, "burst_drops": {}, "queue_drops": {}}
    before = {"iptables": {}, "wire": wire, "tcp": {"client": tcp0, "gateway": tcp0}}
    after = {"iptables": rules, "wire": wire, "tcp": {"client": tcp0, "gateway": {"Tcp.OutSegs": 110,
                                                                                  "Tcp.RetransSegs": 5}}}
    m = measured(before, after)
    assert m["protocols"]["tcp"]["loss"] == pytest.approx(0.02) and m["protocols"]["udp"]["loss"] == pytest.approx(0.02)
    assert m["tcp"]["gateway"]["retrans_per_segment"] == pytest.approx(0.04)


def _ipv4(proto: int, src: str, sport: int, dst: str, dport: int) -> bytes:
    head = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40, 0, 0, 64, proto, 0, bytes(map(int, src.split("."))),
                       bytes(map(int, dst.split("."))))
    return head + struct.pack("!HH", sport, dport) + b"\0" * 16


def test_flow_keys_tell_connections_apart_and_pair_their_directions() -> None:
    a = flow_key(_ipv4(6, "10.77.0.1", 40000, "10.77.0.2", 443))
    back = flow_key(_ipv4(6, "10.77.0.2", 443, "10.77.0.1", 40000))
    other = flow_key(_ipv4(6, "10.77.0.1", 40001, "10.77.0.2", 443))
    quic = flow_key(_ipv4(17, "10.77.0.1", 40000, "10.77.0.2", 443))
    assert a[0] == 6 and quic[0] == 17 and a != other and a != quic
    assert (a[1], a[2]) == (back[2], back[1])
    assert flow_key(b"\x60" + b"\0" * 40) == (0, b"", b"")  # not IPv4: one flow of its own


def test_burst_chain_loses_the_asked_fraction_in_bursts_of_the_asked_length() -> None:
    chain = Bursts(0.05, 8, random.Random(1))
    drops = np.array([chain.drop() for _ in range(400_000)])
    assert drops.mean() == pytest.approx(0.05, rel=0.1)
    starts = np.flatnonzero(drops[1:] & ~drops[:-1])
    assert drops.sum() / len(starts) == pytest.approx(8, rel=0.15)
    assert not any(Bursts(0.0, 8, random.Random(1)).drop() for _ in range(1000))


def _arm(per_stream: list[list[float]], gap_ms: float = 50.0) -> ArmSamples:
    """An arm whose stream ``i`` delivered its tokens with the given delivery latencies (ms), one token every
    ``gap_ms`` (plus the delivery latency)."""
    a = ArmSamples("sse")
    rows = [(i, k, int(1e9 + k * gap_ms * 1e6), int(1e9 + k * gap_ms * 1e6 + d * 1e6))
            for i, ds in enumerate(per_stream) for k, d in enumerate(ds)]
    m = np.array(rows, np.int64)
    a.stream, a.seq, a.emit_ns, a.recv_ns = m[:, 0], m[:, 1], m[:, 2], m[:, 3]
    n = len(rows)
    a.sent_ns, a.deltas = np.zeros(n, np.int64), np.ones(n, np.int64)
    a.content, a.live = np.ones(n, bool), np.ones(n, bool)
    a.sub_stream = np.arange(len(per_stream))
    return a


def test_quantiles_and_their_intervals_match_brute_force() -> None:
    rng = np.random.default_rng(3)
    groups = [rng.exponential(30, 40) for _ in range(12)]
    r = quantile_ci(groups, 99, 300, seed=5)
    assert r["value"] == pytest.approx(np.percentile(np.concatenate(groups), 99))
    boot = np.random.default_rng(5)
    brute = [np.percentile(np.concatenate([groups[j] for j in boot.integers(0, 12, 12)]), 99) for _ in range(300)]
    assert r["ci95"] == pytest.approx(list(np.percentile(brute, [2.5, 97.5])))
    assert r["ci95"][0] <= r["value"] <= r["ci95"][1]


def test_stalls_count_gaps_over_five_medians_and_250ms() -> None:
    steady = [30.0] * 20
    stalled = [30.0] * 10 + [330.0] + [30.0] * 9  # one token held 300 ms: the gap before it is 350 ms
    a = _arm([steady, stalled])
    assert stall_counts(a) == [(0, 19), (1, 19)]
    row = arm_row(a, 200, seed=1)
    assert row["stalls"]["value"] == pytest.approx(1000 / 38) and row["stalls"]["stalls"] == 1
    assert row["p50"]["value"] == pytest.approx(30.0)


def test_a_subscriber_whose_content_was_all_replayed_is_late() -> None:
    a = _arm([[30.0] * 5, [31.0] * 5, [32.0] * 5])
    assert arm_row(a, 20, seed=1)["late"] == 0
    a.live[a.stream == 1] = False  # joined after its stream's last token: every event a replay
    a.live[(a.stream == 2) & (a.seq < 2)] = False  # joined mid-stream: live from then on
    row = arm_row(a, 20, seed=1)
    assert row["late"] == 1 and row["p50"]["streams"] == 2


def test_lowest_needs_an_interval_below_every_other() -> None:
    def cell(lo: float, hi: float) -> dict[str, dict[str, object]]:
        return {"p99": {"value": (lo + hi) / 2, "ci95": [lo, hi]}}

    assert lowest({"sse": cell(10, 20), "wt": cell(5, 9), "ws": cell(12, 30)}, "p99") == "wt"
    assert lowest({"sse": cell(10, 20), "wt": cell(5, 11)}, "p99") is None


def test_webtransport_request_head_round_trips_and_refuses_bad_heads() -> None:
    head = RequestHead("GET", "/v1/streams/x/events?after=3", {"last-event-id": "7"})
    parsed = split_head(head.encode() + b"body")
    assert parsed == (head, b"body")
    assert split_head(b'{"method": "GET", "pa') is None  # not complete yet
    for bad in (b"[1]\n", b"nope\n", b'{"method": "PUT", "path": "/"}\n', b'{"path": "x"}\n',
                b'{"path": "/", "headers": {"a": 1}}\n', b"x" * 20000):
        with pytest.raises(HeadError):
            split_head(bad)
    line = response_head(429, [(b"Content-Type", b"application/json"), (b"x-a", b"1"), (b"x-a", b"2")])
    assert parse_response_head(line + b"{}") == (429, {"content-type": "application/json", "x-a": "1, 2"}, b"{}")


def test_loss_section_tables_have_as_many_cells_as_columns() -> None:
    from tokenfan_bench.report.loss import section

    row = arm_row(_arm([[30.0] * 20, [31.0] * 20]), 50, seed=1)
    diff = {"median": 0.01, "ci95": [-0.02, 0.03]}
    rows = {k: {**row, "transport": t} for k, t in zip("ABCDEF", ("sse", "sse", "sse-h2", "ws", "sse-h3", "wt"))}
    brows = {k: {**row, "transport": t} for k, t in zip("ABCD", ("browser-es", "browser-es", "browser-ws", "browser-wt"))}
    proto = {"packets": 100, "dropped": 2, "loss": 0.02, "queue_drops": 0}
    level = {"run": {"loss_rows": rows, "diffs_ms": {"B-A": diff}},
             "calibration": {"diffs_ms": {"B-A": diff, "C-A": {"median": 2.0, "ci95": [1.9, 2.1]}}, "expected_ms": 2.0},
             "browser": {"loss_rows": brows, "diffs_ms": {"B-A": diff}},
             "measured": {"protocols": {"tcp": proto, "udp": proto},
                          "tcp": {"gateway": {"Tcp.RetransSegs": 2, "Tcp.OutSegs": 100, "retrans_per_segment": 0.02}}}}
    lines = section({"base": "rtt=60ms", "k": 8, "streams": 10, "levels": {"2%": level}})
    tables = [ln for ln in lines if ln.startswith("|")]
    assert len(tables) == 2 + 8 + 2 + 1  # two heads, a row per transport and browser API, one verdict row
    widths = {ln.count(" | ") for ln in tables if not ln.startswith("| ---")}
    assert len({ln.count("|") for ln in tables[:10]}) == 1 and len({ln.count("|") for ln in tables[10:]}) == 1, widths
    assert "✓ recovered" in tables[-1]


def test_the_quic_calibration_wakes_as_many_readers_after_each_sleep() -> None:
    """The QUIC calibration's delayed and placebo sides have as many arms: readers whose sleeps end together
    write and are read one after the other through pure-Python QUIC, so a side with more arms queues longer
    after its sleep than the gateway's timed sleeps show (three arms read 1.6 ms for 1.9 applied, four 1.83 and
    1.90: docs/benchmarks.md)."""
    from tokenfan_bench.report.loss import QUIC_CAL

    assert QUIC_CAL[:3] == ("sse-h3", "sse-h3", "wt")  # A, the A/A B, C: the report reads B − A and C − A
    assert QUIC_CAL.count("sse-h3") == QUIC_CAL.count("wt")
