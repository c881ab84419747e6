"""``tokenfan bench capacity`` end to end on tiny levels: it spawns the synthetic engine + one gateway and the
raw floor per transport and stream interval, drives POST SSE, fan-out and /v1/ws with timed events through
real sockets, and writes every figure of its report. Speed is measured by the bench, never asserted: only
that each level was measured (tokens, latencies, CPU) and the report is complete."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

TINY = ["--levels", "2,4", "--stream-intervals", "1,2", "--tokens-per-s", "40", "--per-connection", "2",
        "--window", "0.5", "--repeats", "2", "--warmup", "0.3", "--ramp", "0.2", "--settle", "0.2",
        "--threshold-ms", "100000", "--min-delivered", "0"]  # bounds no level misses: every level runs, whatever the load


def finite(x: object, low: float = 0.0) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x >= low


def test_bench_capacity_measures_every_transport_and_interval_beside_the_floor(tmp_path: Path) -> None:
    out = tmp_path / "capacity"
    proc = subprocess.run([sys.executable, "-m", "tokenfan.cli", "bench", "capacity", *TINY, "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    assert r["meta"]["command"][:3] == ["tokenfan", "bench", "capacity"] and r["meta"]["machine"]["cpus"]
    assert r["meta"]["time"] and r["meta"]["load_end"]
    assert set(r["intervals"]) == {"1", "2"} and set(r["headline"]) == {"a", "b", "c"}
    for interval, per in r["intervals"].items():
        assert set(per) == {"a", "b", "c"}
        for mode, row in per.items():
            for kind in ("gateway", "raw"):
                levels = row[kind]["levels"]
                assert [lv["streams"] for lv in levels] == [2, 4], (interval, mode, kind, levels)
                for lv in levels:
                    assert lv["held"] and lv["errors"] == 0, (interval, mode, kind, lv)
                    assert lv["stream_interval"] == int(interval) and finite(lv["tokens_per_s"], 1.0)
                    assert lv["delivery_ms"]["n"] > 0 and finite(lv["delivery_ms"]["p99"])
                    assert finite(lv["server_cpu_util"]) and finite(lv["client_cpu_util"])
                assert row[kind]["streams"] == 4
            h = row["headline"]
            assert h["streams"] == 4 and finite(h["tokens_per_s"], 1.0) and finite(h["raw_tokens_per_s"], 1.0)
            assert finite(h["gateway_cpu_util"]) and finite(h["engine_cpu_util"]) and finite(h["floor_ratio"])
            assert h["raw_at_gateway_level"]["delivery_p99_ms"] is not None
            assert h["top_level_reached"] == {"gateway": True, "raw": True} and "met" in h["goal"]
    assert r["headline"]["b"]["stream_interval"] == 1
    md = (out / "summary.md").read_text()
    for text in ("| POST SSE |", "| fan-out SSE |", "| /v1/ws |", "## 2 token(s) per event", "tokenfan bench capacity"):
        assert text in md
    assert "tokenfan bench capacity" in proc.stdout
