"""``tokenfan bench sizing`` measures a gateway's and Redis's memory per stream, subscriber, background response
and event (its figures are docs/operations.md's; here only that each is measured and Redis's are exact)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.procs import ROOT
from tests.system import require


def test_the_sizing_bench_measures_every_figure(tmp_path: Path) -> None:
    require("redis-server")
    out = tmp_path / "sizing"
    r = subprocess.run([sys.executable, "-m", "tokenfan.cli", "bench", "sizing", "--streams", "60", "--subscribers",
                        "100", "--responses", "30", "--streams-events", "20", "--short", "10", "--long", "60",
                        "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads((out / "sizing.json").read_text())
    idle, events = result["idle"], result["events"]
    # Redis's used_memory is exact: every running stream and every event of a finished one holds bytes there
    assert idle["redis_bytes_per_running_stream"] > 100, idle
    assert events["redis_bytes_per_event"] > 20, events
    short, long_ = events["redis_bytes_per_finished_stream"]
    assert long_ > short > 0, events
    # the gateway holds each subscriber's socket state (RSS grows; the allocator rounds, so only > 0)
    assert idle["gateway_bytes_per_subscriber"] > 0, idle
    assert events["gateway_bytes_per_finished_stream"][1] > 0, events
    assert "| Redis, per event |" in (out / "summary.md").read_text()
    assert result["meta"]["command"].startswith("tokenfan bench sizing --streams 60")
