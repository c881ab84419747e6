"""``tokenfan bench durable`` runs its five arms (no broker, Redis on loopback, Redis behind 1 ms, a primary with a
replica on loopback, and both behind 1 ms) and reports every event of each (its figures are not asserted:
docs/failures.md has them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.procs import ROOT
from tests.system import require


def test_the_durable_bench_measures_every_event_of_its_five_arms(tmp_path: Path) -> None:
    require("redis-server")
    out = tmp_path / "durable"
    r = subprocess.run([sys.executable, "-m", "tokenfan.cli", "bench", "durable", "--streams", "2", "--tokens", "8",
                        "--rounds", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    arms = results["arms"]
    assert set(arms) == {"memory", "redis", "redis-1ms", "replica", "replica-1ms"}
    # 2 streams x 8 tokens, twice (A B C D E E D C B A): every content event of each arm has a latency
    assert all(a["events"] >= 2 * 2 * 7 and a["ms"]["50"] > 0 for a in arms.values()), arms
    assert results["redis_path_probe"]["rtt_ms"] >= 1.0  # the 1 ms arm really goes through a 1 ms path
    # the replica arms' pipelines wait for their replica (auto: one online); a primary without one is not asked
    waits = results["waits"]
    assert waits["redis"] == 0 and waits["replica"] > 0 and waits["replica-1ms"] > 0, waits
    assert "| redis-1ms |" in (out / "summary.md").read_text() and "| replica-1ms |" in (out / "summary.md").read_text()
