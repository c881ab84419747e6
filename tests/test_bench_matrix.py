"""The report's statistics (tokenfan_bench/stats/report_estimates.py) and the browser arm's sample conversion
(tokenfan_bench/clients/browser.py), on hand-made samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway.core.metrics import DeliveryCollector
from tokenfan_bench.clients.browser import samples
from tokenfan_bench.clients.workers import Plan, Worker
from tokenfan_bench.report.plots import _symlog_limits
from tokenfan_bench.stats.metrics import ArmSamples
from tokenfan_bench.stats.report_estimates import (
    Sleeps,
    applied_delay,
    contains_zero,
    difference_in_differences,
    equivalent,
    gap_p99_difference,
    gaps_by_stream,
    injected_sleeps,
    recovered,
    stalls,
    ttft_by_stream,
    ttft_difference,
    verdict,
)

MS = 1_000_000


def arm(streams: int, tokens: int, *, start_ms: float = 10.0, gap_ms: float = 50.0, shift_ms: float = 0.0,
        stall: tuple[int, int, float] | None = None) -> ArmSamples:
    """``streams`` subscribers, each receiving ``tokens`` content events ``gap_ms`` apart, the first
    ``start_ms`` after its request; ``stall`` = (stream, token, extra ms) delays that token and the rest."""
    a = ArmSamples("sse")
    rows = []
    for s in range(streams):
        t = s * 1000 * MS + (start_ms + shift_ms) * MS
        for k in range(tokens):
            if stall and stall[0] == s and stall[1] == k:
                t += stall[2] * MS
            rows.append((s, k, int(t)))
            t += gap_ms * MS
    m = np.array(rows, np.int64)
    a.stream, a.seq, a.recv_ns = m[:, 0], m[:, 1], m[:, 2]
    a.emit_ns = a.recv_ns - MS
    a.sent_ns = a.emit_ns
    a.deltas = np.ones(len(rows), np.int64)
    a.content = np.ones(len(rows), bool)
    a.live = np.ones(len(rows), bool)
    a.sub_stream = np.arange(streams, dtype=np.int64)
    a.post_ns = a.sub_stream * 1000 * MS
    a.connected_ns = a.post_ns
    a.ok = np.ones(streams, bool)
    return a


def test_ttft_is_the_first_content_event_after_the_request():
    assert ttft_by_stream(arm(3, 5, start_ms=12)) == {0: 12 * MS, 1: 12 * MS, 2: 12 * MS}


def test_a_constant_ttft_shift_is_found_paired_and_unpaired():
    a, b = arm(30, 10), arm(30, 10, shift_ms=7)
    for paired in (True, False):
        d = ttft_difference(a, b, paired=paired, n_boot=200, seed=1)
        assert d["median"] == pytest.approx(7.0)
        assert d["ci95"][0] == pytest.approx(7.0) and d["ci95"][1] == pytest.approx(7.0)
        assert d["n"] == 30


def test_gaps_are_split_by_subscriber():
    g = gaps_by_stream(arm(2, 4, gap_ms=20))
    assert set(g) == {0, 1} and all((v == 20 * MS).all() for v in g.values())


def test_a_stall_raises_the_p99_gap_and_is_counted():
    calm = arm(10, 5)
    stalled = arm(10, 5, stall=(3, 2, 400.0))  # one of 40 gaps: above the pooled p99
    s = stalls(stalled)
    assert s["stalls"] == 1 and s["longest_gap_ms"] == pytest.approx(450.0)
    assert stalls(calm)["stalls"] == 0
    d = gap_p99_difference(calm, stalled, n_boot=100, seed=0)
    assert d["median"] > 0 and d["n"] == 10
    shifted = arm(10, 5)
    shifted.stream, shifted.sub_stream = shifted.stream + 100, shifted.sub_stream + 100  # other streams: unpaired
    unpaired = gap_p99_difference(calm, shifted, n_boot=100, seed=0)
    assert unpaired["paired"] is False and unpaired["median"] == 0 and unpaired["n"] == 10
    same = gap_p99_difference(calm, arm(10, 5), n_boot=100, seed=0)
    assert same["median"] == 0 and same["ci95"] == [0.0, 0.0]


@pytest.mark.parametrize(("ci", "expected"), [([1.0, 2.0], "sse lower"), ([-2.0, -1.0], "ws lower"),
                                              ([-1.0, 1.0], "no difference resolved")])
def test_verdict_reads_the_interval(ci, expected):
    assert verdict({"median": sum(ci) / 2, "ci95": ci}, "sse", "ws") == expected


def test_verdict_without_a_measurement():
    assert verdict({"median": None, "ci95": [None, None]}, "a", "b") == "not measured"


def test_calibration_recovered_is_the_expected_delay_within_the_resolution_and_excludes_0():
    assert recovered({"ci95": [2.05, 2.2]}, 2.1)
    assert recovered({"ci95": [2.15, 2.3]}, 2.1)  # misses by 0.05 ms, within the 0.1 ms resolution
    assert not recovered({"ci95": [3.07, 3.28]}, 2.1)  # reads a millisecond long
    assert not recovered({"ci95": [-0.1, 2.5]}, 2.1)  # does not exclude 0
    assert not recovered({"ci95": [1.5, 1.9]}, 2.1)  # too short
    assert not recovered({"ci95": [float("nan"), float("nan")]}, 2.1)
    assert contains_zero({"ci95": [-0.01, 0.02]}) and not contains_zero({"ci95": [0.01, 0.02]})


def gateway_metrics(slept: dict[str, list[float]]) -> str:
    """The ``/metrics`` text of a gateway started with ``--inject-delay`` whose sleeps took ``slept``."""
    c = DeliveryCollector()
    c.inject({"ws": 0.002, "sse": 0.0})
    for t, values in slept.items():
        for v in values:
            c.injected[t].observe(v)
    reg = CollectorRegistry()
    reg.register(c)
    return generate_latest(reg).decode()


def test_the_applied_delay_is_the_gateways_timed_sleeps_between_two_scrapes():
    warm = [0.0021] * 5  # before the calibration's runs: left out
    run = [0.00203, 0.00207, 0.00211, 0.00214, 0.00219, 0.00224, 0.0031]  # one late wake-up
    before = injected_sleeps(gateway_metrics({"ws": warm}))
    after = injected_sleeps(gateway_metrics({"ws": warm + run}))
    applied = applied_delay(after - before)
    assert applied["n"] == len(run)
    assert applied["mean_ms"] == pytest.approx(np.mean(run) * 1e3)
    assert abs(applied["median_ms"] - np.median(run) * 1e3) <= 0.02  # read within its 20 µs bucket
    assert applied_delay(injected_sleeps(gateway_metrics({"sse": run}), "sse"))["n"] == len(run)


def test_a_gateway_that_never_slept_applied_nothing():
    placebo = injected_sleeps(gateway_metrics({}))  # the placebo's ws:0 never sleeps
    assert placebo.count == 0 and placebo.buckets  # exported, at 0
    assert applied_delay(placebo - placebo) == {"mean_ms": 0.0, "median_ms": 0.0, "n": 0}
    assert injected_sleeps("# no such family\n") == Sleeps()  # a gateway without --inject-delay


def test_the_median_of_sleeps_past_the_last_bound_is_that_bound():
    sleeps = Sleeps(((0.002, 1.0), (0.003, 1.0), (float("inf"), 4.0)), 0.5, 4.0)
    assert applied_delay(sleeps)["median_ms"] == pytest.approx(3.0)
    assert applied_delay(sleeps)["mean_ms"] == pytest.approx(125.0)


@pytest.mark.parametrize(("ci", "within"), [([0.033, 0.055], True), ([-16.0, 16.0], True), ([0.01, 20.0], False),
                                            ([2249.0, 2251.0], False), ([float("nan")] * 2, False)])
def test_equivalence_wants_the_whole_interval_inside_the_margin(ci, within):
    assert equivalent({"median": 0.04, "ci95": ci}, 16.7) is within


def test_subscription_order_alternates_a_permutation_and_its_reverse():
    w = Worker(Plan(url="http://x", transports=("sse", "sse", "ws", "sse-h2"), streams=1, max_tokens=1,
                    duration=None, separate=False))
    arms = ("A", "B", "C", "D")
    orders = [w._order(arms) for _ in range(40)]
    for first, second in zip(orders[::2], orders[1::2]):
        assert sorted(first) == list(arms) and second == first[::-1]
    for x, y in (("A", "B"), ("A", "C"), ("C", "D")):  # each pair is in each order equally often
        assert sum(o.index(x) < o.index(y) for o in orders) == 20


def test_diff_plot_limits_hold_every_interval():
    lo, hi = _symlog_limits(-4.04, 3.28, 0.1)
    assert lo < -4.04 and hi > 3.28
    lo, hi = _symlog_limits(-0.02, 0.05, 0.1)
    assert lo <= -0.1 and hi >= 0.1


def test_browser_records_become_samples_on_the_server_clock():
    records = [
        {"arm": 0, "stream": 7, "postMs": 1000.0, "openMs": 1005.0, "text": "ab", "error": None,
         "rows": [[0, 1_002_000_000, 0, 1003.5, 1, 1], [1, 1_010_000_000, 0, 1011.0, 1, 1],
                  [2, 1_020_000_000, 0, 1021.0, 1, 0]]},
        {"arm": 1, "stream": 7, "postMs": 1000.0, "openMs": None, "text": "", "error": "HTTP 503", "rows": []},
    ]
    a = samples(records, 0, "browser-es", offset_ms=2.0)
    assert a.recv_ns.tolist() == [1_005_500_000, 1_013_000_000, 1_023_000_000]
    assert a.seq.tolist() == [0, 1, 2] and a.content.tolist() == [True, True, False]
    assert a.live.tolist() == [False, True, True]  # the first was emitted before the page connected
    assert a.ok.tolist() == [True] and a.post_ns.tolist() == [1_002_000_000]
    b = samples(records, 1, "browser-ws", offset_ms=2.0)
    assert b.ok.tolist() == [False] and b.errors == ["HTTP 503"] and b.recv_ns.size == 0


def test_difference_in_differences_removes_the_arms_own_difference():
    base_a, base_b = arm(25, 12), arm(25, 12, shift_ms=-2.0)  # B is 2 ms ahead without any delay
    cal_a, cal_b = arm(25, 12), arm(25, 12, shift_ms=-2.0 + 1.5)  # and 1.5 ms is injected into B
    d = difference_in_differences([((cal_a, cal_b), (base_a, base_b))], paired=True, n_boot=200, seed=0)
    assert d["median"] == pytest.approx(1.5) and d["ci95"] == [pytest.approx(1.5), pytest.approx(1.5)]
    assert d["cal_ms"] == pytest.approx(-0.5) and d["placebo_ms"] == pytest.approx(-2.0)
    assert recovered(d, 1.5)


def on_streams(a: ArmSamples, first: int) -> ArmSamples:
    """``a`` moved to stream ids ``first``, ``first + 1``, ... (another arm's streams)."""
    a.stream, a.sub_stream = a.stream + first, a.sub_stream + first
    return a


def test_difference_in_differences_on_separate_streams_compares_the_arms_medians():
    rng = np.random.default_rng(3)

    def noisy(first: int, shift_ms: float) -> ArmSamples:
        """Delivery 1 ms + ``shift_ms`` + 0-0.2 ms of receive noise."""
        a = on_streams(arm(25, 12), first)
        a.recv_ns = a.recv_ns + int(shift_ms * MS) + rng.integers(0, 200_000, a.recv_ns.size)
        return a

    base = (noisy(0, 0.0), noisy(100, -2.0))
    cal = (noisy(200, 0.0), noisy(300, -2.0 + 1.5))
    d = difference_in_differences([(cal, base)], paired=False, n_boot=300, seed=0)
    assert d["median"] == pytest.approx(1.5, abs=0.05) and d["cal_ms"] == pytest.approx(-0.5, abs=0.05)
    assert d["ci95"][0] < 1.5 < d["ci95"][1] and d["ci95"][1] - d["ci95"][0] < 0.2
    assert d["streams"] == 25 and "unpaired" in d["method"]
    # paired, the arms have no token in common: nothing to compare
    assert difference_in_differences([(cal, base)], paired=True, n_boot=50, seed=0)["median"] is None


def test_difference_in_differences_averages_run_pairs_so_a_runs_common_shift_cancels():
    """Two pairs whose runs each move both arms together by a different amount (as a browser run does): the
    DiD is the mean of the pairs' own, unmoved by the shifts, and its interval stays as tight as one pair's."""
    rng = np.random.default_rng(5)

    def run(first: int, common_ms: float, inject_ms: float) -> tuple[ArmSamples, ArmSamples]:
        out = []
        for k, shift in enumerate((0.0, -2.0 + inject_ms)):
            a = on_streams(arm(25, 12), first + 100 * k)
            a.recv_ns = a.recv_ns + int((shift + common_ms) * MS) + rng.integers(0, 200_000, a.recv_ns.size)
            out.append(a)
        return out[0], out[1]

    pairs = [(run(0, 0.6, 1.5), run(1000, -0.4, 0.0)), (run(2000, -0.5, 1.5), run(3000, 0.3, 0.0))]
    d = difference_in_differences(pairs, paired=False, n_boot=300, seed=0)
    assert d["pairs"] == 2 and len(d["per_pair_ms"]) == 2
    assert d["median"] == pytest.approx(1.5, abs=0.05) and all(x == pytest.approx(1.5, abs=0.08) for x in d["per_pair_ms"])
    assert d["ci95"][0] < 1.5 < d["ci95"][1] and d["ci95"][1] - d["ci95"][0] < 0.2
    assert d["streams"] == 50


def test_a_full_report_runs_the_loss_section_last_and_writes_it_after_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's own wiring of the loss section (tests/e2e/test_bench_loss.py runs the section itself and
    tests/e2e/test_bench_report.py the matrix with ``--loss none``): the matrix and the loss run are stand-ins."""
    from tokenfan_bench.report import loss, matrix

    calls: list[str] = []

    class Ran:
        def __init__(self, s: object) -> None:
            self.runs: dict[str, object] = {}

        def run(self) -> dict[str, object]:
            calls.append("matrix")
            return {"profiles": {}}

    def report(results: dict[str, object], runs: object, out: Path, plots: Path) -> None:
        out.write_text("# report\n\n## CPU and bytes on the wire\n")

    monkeypatch.setattr(matrix, "Matrix", Ran)
    monkeypatch.setattr(matrix, "write_report", report)
    monkeypatch.setattr(matrix, "_run_loss", lambda ns, s: calls.append(f"loss {ns.loss}") or {"levels": {}})
    monkeypatch.setattr(loss, "write_section", lambda results, out: out.write_text(out.read_text() + "## loss\n"))
    out = tmp_path / "r.md"
    assert matrix.main(["--loss", "1%", "--out", str(out)]) == 0
    assert calls == ["matrix", "loss 1%"] and out.read_text().endswith("## CPU and bytes on the wire\n## loss\n")
    calls.clear()
    assert matrix.main(["--loss", "none", "--out", str(out)]) == 0
    assert calls == ["matrix"] and "## loss" not in out.read_text()
