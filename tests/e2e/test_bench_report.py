"""``tokenfan bench report`` on a tiny matrix against real processes (synthetic engines, TLS and plain
gateways, the shaping proxy, nginx, Chromium): the report, its plots and its raw results are complete
and every arm, the browser's included, received every token. Structure and correctness only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.system import require
from tokenfan_bench.cli import main as bench_main
from tokenfan_bench.report.matrix import BROWSER, FANOUT, RESPONSES, VIA
from tokenfan_bench.report.plots import slug
from tokenfan_bench.stats.report_estimates import PLACEBO_MS


@pytest.mark.alone  # reads time: no other test runs beside it (tests/conftest.py)
@pytest.mark.timeout(600)
def test_report_runs_a_tiny_matrix_and_writes_markdown_plots_and_results(tmp_path: Path) -> None:
    require("nginx")
    require("/usr/bin/chromium")
    out, data = tmp_path / "ab-report.md", tmp_path / "data"
    tokens, streams = 8, 3
    assert bench_main(["report", "--profiles", "rtt=10ms,jitter=2ms,down=10mbit,up=5mbit", "--via-profiles", "lan",
                       "--levels", str(streams), "--max-tokens", str(tokens), "--rate", "50", "--ttft-ms", "100", "--ramp", "0.2",
                       "--browser-streams", "2", "--browser-rounds", "1", "--min-streams", "1", "--cpu-repeats", "1",
                       "--browser-calibration-runs", "2",
                       # no loss section: tests/e2e/test_bench_loss.py runs it (about 20 s here, which this
                       # test, alone on the machine, would keep both workers waiting for)
                       "--loss", "none",
                       "--bootstrap", "100", "--out", str(out), "--data", str(data)]) == 0
    results = json.loads((data / "results.json").read_text())
    (name, profile), = results["profiles"].items()
    assert profile["network"]["profile"]["measured"]["rtt_ms"] > 0
    runs = {"fan-out": (profile["levels"][str(streams)], FANOUT, streams),
            "responses": (profile["responses"], RESPONSES, streams),
            "browser": (profile["browser"], BROWSER, 1)}  # 2 slots x 2 rounds, each stream read by one arm
    for what, (run, arms, subscribers) in runs.items():
        assert [a["transport"].removeprefix("browser-") for a in run["arms"].values()] == list(arms), what
        for a in run["arms"].values():
            assert a["errors"] == 0, (what, a["error_examples"])
            # every event of every stream (errors counts a gap in the sequence or a stream without its end);
            # one per token unless the engine was late on a busy machine (it then sends the tokens due in one)
            assert subscribers <= a["deltas_delivered"] <= subscribers * tokens, what
        assert set(run["ttft_diffs_ms"]) == set(run["gap_p99_diffs_ms"]) == {f"{k}-A" for k in list(run["arms"])[1:]}
        assert set(run["stalls"]) == set(run["arms"])
    assert profile["browser_calibration"]["did_ms"]["n"] > 0  # the difference-in-differences was measured
    assert profile["browser_calibration"]["did_ms"]["pairs"] == 2  # --browser-calibration-runs, averaged
    assert len(profile["browser_calibration"]["did_ms"]["per_pair_ms"]) == 2
    for run in ("browser", "browser_calibration", "browser_placebo"):
        assert profile[run]["separate_streams"] is True, run  # one arm per stream: arms read no token twice
    assert profile["browser"]["browser"]["texts_identical"] is True
    for cal in ("calibration", "browser_calibration"):
        assert all(a["errors"] == 0 for a in profile[cal]["arms"].values()), cal
        assert profile[cal]["applied"]["n"] > 0, cal  # the delayed gateway timed its sleeps in that run
        assert profile[cal]["expected_ms"] > 0, cal
    # the browser's placebo sleeps PLACEBO_MS before each WebSocket write and its delayed gateway that + 2 ms.
    # The floors (a delay not applied) hold for the mean; the ceilings (a delay applied twice) for the median,
    # read to ±10 µs (gateway.core.metrics.injected_delay_bounds): a late wake-up on a busy loop can add 10 ms
    # to one of the 16 sleeps (a fresh-clone run: mean 4.01 ms, median 3.26 ms)
    placebo, delayed = profile["browser_calibration"]["applied_placebo"], profile["browser_calibration"]["applied"]
    assert placebo["n"] > 0 and PLACEBO_MS <= placebo["mean_ms"] and placebo["median_ms"] < PLACEBO_MS + 1
    assert PLACEBO_MS + 2 <= delayed["mean_ms"] and delayed["median_ms"] < PLACEBO_MS + 3
    assert profile["browser_calibration"]["expected_ms"] == pytest.approx(delayed["mean_ms"] - placebo["mean_ms"])
    via = results["via"]["lan"]["run"]
    assert [(w["transport"], w["via"]) for k, w in via["wire"].items() if k != "post"] == \
        [(a.partition("@")[0], a.partition("@")[2] or "direct") for a in VIA]
    assert all(a["errors"] == 0 and streams <= a["deltas_delivered"] <= streams * tokens for a in via["arms"].values())
    assert set(results["cpu"][name]["runs"]) == {"sse", "ws", "sse-h2", "resp-sse", "resp-ws"}  # per profile
    text = out.read_text()
    for heading in ("## Method", "## The answer per profile", f"## {name}", "## Through nginx",
                    "## CPU and bytes on the wire"):
        assert heading in text
    assert "browser delivery: WebSocket − EventSource ms [95% CI]" in text  # the answer table's column
    assert "loss" not in results and "## Under real packet loss" not in text  # --loss none
    plots = tmp_path / "ab-report"
    for png in ("ttft.png", "gaps.png", "diffs.png", "cpu_bytes.png", f"cdf_{slug(name)}.png"):
        assert (plots / png).stat().st_size > 1000, png
        assert f"ab-report/{png}" in text
