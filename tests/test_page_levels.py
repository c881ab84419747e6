"""The page-levels statistics (tokenfan_bench/stats/page_levels.py) on hand-made page records, and the
report's browser delivery cell (tokenfan_bench/report/markdown.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tokenfan_bench.page_levels import calibration, summary_md
from tokenfan_bench.report.markdown import BROWSER_DELIVERY_NOTE, _answer, browser_delivery
from tokenfan_bench.stats import page_levels as pl

MS = 1_000_000  # page and server times near 1.7e12 ms: doubles resolve about 0.2 µs there
ORIGIN_MS = 1_700_000_000_000.0  # performance.timeOrigin of the hand-made page
OFFSET_MS = 0.25  # server clock − page clock


def records(streams: int = 24, tokens: int = 20, *, es_ms: float = 0.4, fetch_ms: float = 0.3, ws_ms: float = -0.8,
            ts_ms: float = 0.05, ws_first_odd_ms: float = 0.0, open_after: int = 0,
            missing: tuple[int, int] | None = None) -> list[dict]:
    """Page records as levels.js returns them: each token sent at a known server time and read
    ``1 ms + X_ms`` later by reader X (``ws_first_odd_ms`` more WebSocket head start on odd seq, as the
    gateway's write order would give), the events created ``ts_ms`` before their handlers ran; readers open
    before token ``open_after``; ``missing`` = (stream, seq) the WebSocket never got."""
    page = -ORIGIN_MS - OFFSET_MS  # server ms -> page performance.now() ms
    out = []
    for s in range(streams):
        t0 = ORIGIN_MS + OFFSET_MS + 10_000.0 + s * 5_000.0
        open_ms = t0 + 50.0 * open_after - 25.0 + page
        for reader, extra in (("es", es_ms), ("fetch", fetch_ms), ("ws", ws_ms)):
            rows = []
            for k in range(tokens):
                if reader == "ws" and missing == (s, k):
                    continue
                sent = t0 + 50.0 * k
                odd = ws_first_odd_ms if (reader == "ws" and k % 2) else 0.0
                now = sent + 1.0 + extra - odd + page
                ts = -1 if reader == "fetch" else now - ts_ms
                rows.append([k, int((sent - 0.1) * MS), int(sent * MS), now, ts, 2 if reader == "fetch" else 1])
            out.append({"stream": s, "reader": reader, "openMs": open_ms, "rows": rows, "error": None})
    return out


def run_levels(recs: list[dict], n_boot: int = 300) -> dict:
    t = pl.tokens(recs, server_minus_page_ms=ORIGIN_MS + OFFSET_MS)
    return {name: pl.summarise(d) for name, d in pl.levels(t, n_boot=n_boot, seed=1).items()}


def test_every_level_difference_reads_the_offsets_the_records_carry():
    lv = run_levels(records())
    expected = {"es − fetch": 0.1, "ws − fetch": -1.1, "ws − es": -1.2, "es handler − es timeStamp": 0.05,
                "ws handler − ws timeStamp": 0.05, "fetch − gateway send": 1.3, "ws − gateway send": 0.2}
    for name, value in expected.items():
        assert lv[name]["median"] == pytest.approx(value, abs=1e-3), name
        lo, hi = lv[name]["ci95"]
        assert lo <= value + 1e-3 and value - 1e-3 <= hi, name
        assert lv[name]["streams"] == 24 and lv[name]["bootstrap"] == "stream clusters"


def test_the_gateways_write_order_cancels_inside_a_token_pair():
    lv = run_levels(records(ws_first_odd_ms=0.4))
    assert lv["ws − fetch"]["median"] == pytest.approx(-1.1 - 0.2, abs=1e-3)
    assert lv["ws − fetch"]["n"] == 24 * 10  # one mean per pair of tokens


def test_a_token_some_reader_missed_or_read_from_the_replay_is_left_out():
    t = pl.tokens(records(streams=3, tokens=10, open_after=2, missing=(1, 5)),
                  server_minus_page_ms=ORIGIN_MS + OFFSET_MS)
    assert len(t) == 3 * 8 - 1
    assert t.dropped == 3 * 2 + 1
    assert set(t.seq[t.stream == 1]) == {2, 3, 4, 6, 7, 8, 9}


def test_a_stream_with_a_failed_reader_is_left_out_whole():
    recs = records(streams=3, tokens=4)
    recs[4]["error"] = "fetch: HTTP 500"  # stream 1's fetch reader
    t = pl.tokens(recs, server_minus_page_ms=ORIGIN_MS + OFFSET_MS)
    assert sorted(set(t.stream.tolist())) == [0, 2]


def test_few_streams_fall_back_to_a_token_bootstrap():
    lv = run_levels(records(streams=3, tokens=20))
    assert lv["ws − es"]["bootstrap"] == "tokens (few streams)"


def test_order_balanced_needs_both_tokens_of_a_pair():
    d = np.array([1.0, 3.0, 5.0, 7.0, 9.0])
    means, streams = pl.order_balanced(d, np.array([0, 0, 0, 1, 1]), np.array([0, 1, 2, 4, 5]))
    assert means.tolist() == [2.0, 8.0] and streams.tolist() == [0, 1]


def _run(recs: list[dict]) -> dict:
    t = pl.tokens(recs, server_minus_page_ms=ORIGIN_MS + OFFSET_MS)
    return {"levels": pl.levels(t, n_boot=300, seed=2)}


def test_the_calibration_recovers_a_delay_on_the_websocket_path_and_leaves_eventsource_unmoved():
    placebo, delayed = _run(records(ws_ms=-0.8)), _run(records(ws_ms=-0.8 + 2.0))
    cal = calibration(delayed, placebo, {"mean_ms": 3.1, "median_ms": 3.1, "n": 100},
                      {"mean_ms": 1.1, "median_ms": 1.1, "n": 100})
    assert cal["expected_ms"] == pytest.approx(2.0)
    assert cal["moved"]["ws − fetch"]["median"] == pytest.approx(2.0, abs=1e-3)
    assert cal["ws_recovered"] and cal["es_unmoved"]


def test_a_stamp_that_does_not_follow_its_apis_arrival_fails_the_calibration():
    # The WebSocket's stamp moves by half the delay, EventSource's moves with the WebSocket's arrival.
    placebo = _run(records(ws_ms=-0.8))
    delayed = _run(records(ws_ms=-0.8 + 1.0, es_ms=0.4 + 0.5))
    cal = calibration(delayed, placebo, {"mean_ms": 3.0, "median_ms": 3.0, "n": 100},
                      {"mean_ms": 1.0, "median_ms": 1.0, "n": 100})
    assert not cal["ws_recovered"] and not cal["es_unmoved"]


def test_the_summary_names_every_level_and_the_command():
    run = _run(records())
    res = {"meta": {"command": ["tokenfan", "bench", "page-levels"], "time": "T", "load": "0.1 0.1 0.1",
                    "machine": {"cpu_model": "CPU", "cpus": 2}},
           "chromium": "Chromium 1", "load_after": "0.2 0.2 0.2",
           "runs": {"measured": {**run, "tokens": 1, "streams": 24, "dropped": 0, "errors": [],
                                 "clock_offset_ms": 0.1, "clock_uncertainty_ms": 0.2,
                                 "fetch_events_per_read": {"mean": 1.0, "max": 1}}}}
    text = summary_md(res)
    assert "`tokenfan bench page-levels`" in text
    for name, *_ in pl.LEVELS:
        assert f"| {name} |" in text


def test_the_answer_tables_browser_delivery_cell_is_websocket_minus_eventsource_with_its_interval():
    b = {"diffs_ms": {"B-A": {"median": 0.01, "ci95": [-0.2, 0.25]},
                      "D-A": {"median": -1.224, "ci95": [-1.370, -1.078]}}}
    assert browser_delivery(b) == "-1.22 [-1.37, -1.08] (WebSocket lower)"
    assert browser_delivery(None) == "–"


def _d(median: float, lo: float, hi: float) -> dict:
    return {"median": median, "ci95": [lo, hi]}


def test_the_answer_table_has_a_browser_delivery_cell_per_profile_and_explains_it():
    zero, ws_first = _d(0.0, -0.1, 0.1), _d(-1.224, -1.370, -1.078)
    run = {k: {"B-A": zero, "C-A": zero, "D-A": zero} for k in ("diffs_ms", "ttft_diffs_ms", "gap_p99_diffs_ms")}
    browser = {**run, "diffs_ms": {"B-A": zero, "C-A": zero, "D-A": ws_first}}
    cal = {"diffs_ms": {"B-A": _d(2.0, 1.95, 2.05)}, "expected_ms": 2.0}
    profiles = {"lan": {"levels": {"10": run}, "responses": run, "browser": browser, "calibration": cal,
                        "browser_calibration": {**cal, "did_ms": _d(2.0, 1.9, 2.1)}},
                "3g": {"levels": {"10": run}, "responses": run, "calibration": cal}}  # no browser arm
    lines = _answer({"profiles": profiles}, "10", "ab-report")
    header, rule, lan, g3 = lines[4:8]
    assert "| browser delivery: WebSocket − EventSource ms [95% CI] |" in header
    assert header.count("|") == rule.count("|") == lan.count("|") == g3.count("|")
    assert "| -1.22 [-1.37, -1.08] (WebSocket lower) |" in lan
    assert "| – | – |" in g3  # neither browser cell without the browser arm
    assert BROWSER_DELIVERY_NOTE in lines
