"""``tokenfan bench fanout`` end to end on a tiny load: two listed streams, SSE and WebSocket subscribers over
two client processes, on a gateway with 1 and 2 workers and on the raw floor. Checked: every subscriber of
every server got every event of its stream and its end (counted by the bench), and the report is complete;
speed is measured by the bench, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_bench_cpu import measured

TINY = ["--levels", "24", "--workers-list", "1,2", "--streams", "2", "--tokens-per-s", "20", "--window", "1.5",
        "--warmup", "0.3", "--clients", "2"]


def test_bench_fanout_counts_every_delivery_on_each_server_and_reports_the_spread(tmp_path: Path) -> None:
    out = tmp_path / "fanout"
    proc = subprocess.run([sys.executable, "-m", "tokenfan.cli", "bench", "fanout", *TINY, "--out", str(out)],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    assert r["meta"]["command"][:3] == ["tokenfan", "bench", "fanout"]
    assert [row["server"] for row in r["runs"]] == ["gateway --workers 1", "gateway --workers 2", "raw floor"]
    for row in r["runs"]:
        d = row["delivery"]
        assert d["subscribers"] == 24 and d["complete"] == 24, (row["server"], d["incomplete_examples"])
        assert d["delivered_events"] == d["expected_events"] > 24 * 10, row["server"]
        assert row["failed_to_subscribe"] == 0
        spread = row["spread_ms"]
        assert spread["events"] > 0 and spread["complete"] == spread["events"], (row["server"], spread)
        assert all(measured(spread[k]) for k in ("p50_ms", "p99_ms", "max_ms")), spread
        assert spread["p50_ms"] <= spread["p99_ms"] <= spread["max_ms"]
        assert row["deliveries"] > 0 and measured(row["cpu_us_per_delivery"]) and row["rss_mb"] > 0
        assert len(row["spread_per_stream"]) == 2
    assert (out / "spread_vs_n.png").stat().st_size > 0
    md = (out / "summary.md").read_text()
    assert "| gateway --workers 2 | 24 |" in md and "| raw floor | 24 |" in md
    assert "tokenfan bench fanout" in proc.stdout
