"""``tokenfan bench cpu``: the accounting (windows, summaries, marginal reader cost, setup, capacity),
the event counting of its client and the shape of its report, with plain values (no processes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tokenfan_bench.cpu import gateway_cost
from tokenfan_bench.cpu.load_client import CHAT_EVENT, RESPONSES_EVENT, count_markers


def snap(t: float, server: float, engine: float | None, client: float, events: int) -> gateway_cost.Snapshot:
    return gateway_cost.Snapshot(t=t, server_s=server, engine_s=engine, client_s=client, events=events)


def test_window_divides_each_process_cpu_by_the_events_delivered_in_it() -> None:
    w = gateway_cost.window(snap(10.0, 5.0, 2.0, 1.0, 1000), snap(14.0, 6.0, 2.5, 1.2, 21000))
    assert w["events"] == 20000
    assert w["events_per_s"] == pytest.approx(5000.0)
    assert w["server_us_per_event"] == pytest.approx(50.0)
    assert w["engine_us_per_event"] == pytest.approx(25.0)
    assert w["client_us_per_event"] == pytest.approx(10.0)
    assert w["server_cpu_util"] == pytest.approx(0.25)


def test_window_without_engine_or_events_has_no_per_event_figure() -> None:
    w = gateway_cost.window(snap(0.0, 1.0, None, 0.0, 7), snap(1.0, 1.5, None, 0.1, 7))
    assert w["engine_us_per_event"] is None and w["engine_cpu_s"] is None
    assert w["server_us_per_event"] is None and w["client_us_per_event"] is None
    assert w["events_per_s"] == 0


def test_summarize_gives_median_and_percentiles_over_windows() -> None:
    windows = [{"x": v} for v in (3.0, 1.0, 2.0, None, 4.0, 5.0)]
    s = gateway_cost.summarize(windows, "x")
    assert s is not None
    assert s["n"] == 5 and s["p50"] == 3.0 and s["min"] == 1.0 and s["max"] == 5.0
    assert s["mean"] == pytest.approx(3.0)
    assert 4.0 < s["p90"] <= 5.0
    assert gateway_cost.summarize([{"x": None}], "x") is None
    assert gateway_cost.median_of(s) == 3.0 and gateway_cost.median_of(None) is None


def test_marginal_cost_per_additional_reader_is_the_slope_between_the_runs() -> None:
    # 1 reader: 0.10 CPU at 500 events/s; 20 readers: 0.48 CPU at 10,000 events/s -> 0.38 / 9,500 = 40 µs
    one = [{"server_cpu_util": 0.10, "events_per_s": 500.0}] * 3
    many = [{"server_cpu_util": 0.48, "events_per_s": 10_000.0}] * 3
    assert gateway_cost.marginal_per_reader(one, many) == pytest.approx(40.0)
    assert gateway_cost.marginal_per_reader(many, one) is None  # no more events: no slope
    assert gateway_cost.marginal_per_reader([], many) is None


def test_setup_figures_net_subtracts_the_steady_cost_of_the_setup_events() -> None:
    f = gateway_cost.setup_figures(cpu_s=0.5, engine_s=0.1, client_s=0.05, generations=100, events=400,
                          steady_us_per_event=100.0)
    assert f["server_us_per_generation"] == pytest.approx(5000.0)
    assert f["server_us_per_generation_net"] == pytest.approx(5000.0 - 4 * 100.0)
    assert f["engine_us_per_generation"] == pytest.approx(1000.0)
    assert gateway_cost.setup_figures(0.5, None, 0.0, 10, 0, None)["server_us_per_generation_net"] is None


def test_capacity_is_the_best_level_that_held() -> None:
    assert gateway_cost.held(30.0, 0, 9_800.0, 10_000.0, 50.0)
    assert not gateway_cost.held(60.0, 0, 10_000.0, 10_000.0, 50.0)  # too slow
    assert not gateway_cost.held(10.0, 1, 10_000.0, 10_000.0, 50.0)  # an error
    assert not gateway_cost.held(10.0, 0, 9_000.0, 10_000.0, 50.0)  # events lost or late
    assert not gateway_cost.held(None, 0, 0.0, 10_000.0, 50.0)
    levels = [{"streams": 100, "events_per_s": 5000.0, "held": True},
              {"streams": 200, "events_per_s": 9900.0, "held": True},
              {"streams": 400, "events_per_s": 15000.0, "held": False}]
    c = gateway_cost.capacity_of(levels, 50.0)
    assert c["tokens_per_s"] == 9900.0 and c["streams"] == 200 and c["levels"] is levels
    assert gateway_cost.capacity_of(levels[2:], 50.0)["tokens_per_s"] is None


@pytest.mark.parametrize("cut", range(40))
def test_count_markers_counts_a_marker_split_across_reads_once(cut: int) -> None:
    stream = b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n"
    n1, tail = count_markers(b"", stream[:cut], CHAT_EVENT)
    n2, _ = count_markers(tail, stream[cut:], CHAT_EVENT)
    assert n1 + n2 == 2


def test_count_markers_responses_deltas_only() -> None:
    data = (b"event: response.created\ndata: {}\n\n" + RESPONSES_EVENT + b"data: {}\n\n" + RESPONSES_EVENT
            + b"data: {}\n\nevent: response.output_text.done\ndata: {}\n\n")
    assert count_markers(b"", data, RESPONSES_EVENT)[0] == 2


def _mode_run(us: float, events_per_s: float, util: float) -> dict:
    windows = [{"server_us_per_event": us, "engine_us_per_event": us / 2, "client_us_per_event": 10.0,
                "events_per_s": events_per_s, "server_cpu_util": util}] * 3
    steady = {"windows": windows, "offered_events_per_s": events_per_s, "errors": 0, "error_examples": [],
              "ended_during_run": 0, **{k: gateway_cost.summarize(windows, k) for k in gateway_cost.SUMMARY_KEYS}}
    setup = gateway_cost.setup_figures(0.2, 0.1, 0.01, 10, 30, us)
    return {"steady": steady, "setup": setup}


def test_report_shape_ratios_and_summary() -> None:
    gw = {"a": {"mode": "a", "name": "POST SSE", "readers": 1, **_mode_run(60.0, 5000.0, 0.30)},
          "b1": {"mode": "b", "name": "fan-out SSE", "readers": 1, **_mode_run(80.0, 500.0, 0.04)},
          "b": {"mode": "b", "name": "fan-out SSE", "readers": 20, **_mode_run(20.0, 10_000.0, 0.20)}}
    raw = {"a": {"mode": "a", "name": "POST SSE", "readers": 1, **_mode_run(20.0, 5000.0, 0.10)},
           "b1": {"mode": "b", "name": "fan-out SSE", "readers": 1, **_mode_run(20.0, 500.0, 0.01)},
           "b": {"mode": "b", "name": "fan-out SSE", "readers": 20, **_mode_run(8.0, 10_000.0, 0.08)}}
    rows = gateway_cost.compare(gw, raw)
    assert rows["a"]["ratio_to_raw"] == pytest.approx(3.0)
    assert rows["a"]["engine_us_per_event"] == pytest.approx(30.0)
    assert rows["b"]["gateway_us_per_additional_reader"] == pytest.approx(0.16 / 9500 * 1e6)
    assert rows["b"]["raw_us_per_additional_reader"] == pytest.approx(0.07 / 9500 * 1e6)
    assert all(math.isfinite(v) for r in rows.values() for v in r.values() if isinstance(v, float))
    results = {"meta": {"command": ["tokenfan", "bench", "cpu"], "load": "0.1 0.1 0.1", "time": "T",
                        "machine": {"cpus": 2, "cpu_model": "X", "platform": "Linux"},
                        "settings": {"tokens_per_s": 50.0, "repeats": 3, "window": 4.0, "warmup": 2.0,
                                     "threshold_ms": 50.0}},
               "gateway": gw, "raw": raw, "modes": rows,
               "capacity": {"workers=1": gateway_cost.capacity_of(
                   [{"streams": 100, "events_per_s": 5000.0, "held": True, "delivery_ms": {"p99": 9.0},
                     "server_us_per_event": 50.0, "client_us_per_event": 9.0}], 50.0)}}
    md = gateway_cost.summary_md(results)
    assert "| a POST SSE | 1 | 5,000 (5,000) | 60.0 | 30.0 | 20.0 | 3.00× |" in md
    assert "per additional reader: gateway 16.8 µs, raw floor 7.4 µs" in md
    assert "| workers=1 | 5,000 | 100 |" in md


def test_a_mode_that_failed_is_reported_as_such_and_the_others_still_compare() -> None:
    gw = {"a": {"mode": "a", "name": "POST SSE", "readers": 1, "failed": "first events of 100 readers not seen"},
          "d": {"mode": "d", "name": "Responses SSE", "readers": 1, **_mode_run(90.0, 5000.0, 0.45)}}
    raw = {"a": {"mode": "a", "name": "POST SSE", "readers": 1, **_mode_run(20.0, 5000.0, 0.10)},
           "d": {"mode": "d", "name": "Responses SSE", "readers": 1, "failed": "connect: refused"}}
    rows = gateway_cost.compare(gw, raw)
    assert rows["a"]["failed"].startswith("first events")
    assert rows["d"]["gateway_us_per_event"] == pytest.approx(90.0) and rows["d"]["raw_us_per_event"] is None
    assert rows["d"]["ratio_to_raw"] is None


def test_bench_pass_drives_the_real_one_pass_and_writes_each_connection_once_per_step(tmp_path: Path) -> None:
    """``tokenfan bench pass`` runs the real token path in-process: every reader caught up is written in the
    pass (an event per reader per step), and each connection gets one write per step whatever it carries
    (a /v1/ws socket with all its generations: one; a Responses stream: one)."""
    import json

    from tokenfan_bench.cpu import step_pass_cost

    assert step_pass_cost.main(["--modes", "a,b,c,d", "--generations", "6", "--streams", "2", "--readers", "3",
                           "--steps", "10", "--repeats", "2", "--out", str(tmp_path)]) == 0
    modes = json.loads((tmp_path / "results.json").read_text())["modes"]
    assert {k: (r["generations"], r["readers"], r["writes_per_step"]) for k, r in modes.items()} == {
        "a": (6, 1, 6.0), "b": (2, 3, 6.0), "c": (6, 1, 1.0), "d": (6, 1, 6.0)}
    assert all(r["us_per_event"]["n"] == 2 and r["us_per_event"]["p50"] > 0 for r in modes.values())
    assert "| c /v1/ws | 6 × 1 | 1 |" in (tmp_path / "summary.md").read_text()
