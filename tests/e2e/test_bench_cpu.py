"""``tokenfan bench cpu`` end to end on a tiny load: it spawns a synthetic engine + gateway and the raw
floor, drives all four modes and a capacity step through real sockets, and writes a complete report.
Only the report's structure and that its figures are finite and positive are checked: speed is
measured by the bench, never asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

TINY = ["--modes", "a,b,c,d", "--generations", "4", "--streams", "2", "--readers", "3", "--per-connection", "2",
        "--window", "1", "--repeats", "2", "--warmup", "0.3", "--ramp", "0.2", "--settle", "0.2",
        "--capacity", "--capacity-levels", "4", "--capacity-workers", "1,2"]


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def measured(x: object) -> bool:
    """A CPU figure of a process that did almost nothing: /proc counts CPU in 10 ms ticks, so the raw
    floor's share of a tiny load (or of a 2-token setup phase) may round to 0, never below."""
    return isinstance(x, (int, float)) and math.isfinite(x) and x >= 0


def test_bench_cpu_reports_every_mode_against_the_raw_floor(tmp_path: Path) -> None:
    out = tmp_path / "cpu"
    proc = subprocess.run([sys.executable, "-m", "tokenfan.cli", "bench", "cpu", *TINY, "--out", str(out)],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    assert r["meta"]["command"][:3] == ["tokenfan", "bench", "cpu"] and r["meta"]["machine"]["cpus"]
    assert set(r["modes"]) == {"a", "b1", "b", "c", "d"}
    for key, row in r["modes"].items():
        assert row["errors"] == 0, (key, r["gateway"][key]["steady"]["error_examples"])
        for fig in ("gateway_us_per_event", "engine_us_per_event", "client_us_per_event",
                    "raw_client_us_per_event", "events_per_s"):
            assert positive(row[fig]), (key, fig, row[fig])
        for fig in ("raw_us_per_event", "setup_us_per_generation", "raw_setup_us_per_generation"):
            assert measured(row[fig]), (key, fig, row[fig])
        for side in ("gateway", "raw"):
            steady = r[side][key]["steady"]
            assert len(steady["windows"]) == 2
            assert steady["server_us_per_event"]["n"] == 2 and measured(steady["server_us_per_event"]["p50"])
            assert r[side][key]["setup"]["generations"] == (2 if key.startswith("b") else 4)
    assert r["modes"]["b"]["readers"] == 3 and r["modes"]["b1"]["readers"] == 1
    assert "gateway_us_per_additional_reader" in r["modes"]["b"]
    assert set(r["capacity"]) == {"workers=1", "workers=2", "raw"}
    for label, c in r["capacity"].items():
        (level,) = c["levels"]
        assert level["streams"] == 4 and positive(level["events_per_s"]), (label, level)
        assert positive(level["delivery_ms"]["p99"]) and measured(level["server_us_per_event"]), (label, level)
    md = (out / "summary.md").read_text()
    assert "| a POST SSE |" in md and "| d Responses SSE |" in md and "| workers=2 |" in md
    assert "tokenfan bench cpu" in proc.stdout
