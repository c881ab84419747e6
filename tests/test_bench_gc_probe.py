"""The bench's GC probe: a process started with its environment logs each collection, and the summary puts
them in the right phase, per generation, with the largest."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tokenfan_bench.stats import gc_probe

CHILD = """
import gc, time
gc.collect(1)
time.sleep(0.3)
print(time.monotonic(), flush=True)
time.sleep(0.3)
junk = [[] for _ in range(200_000)]
gc.collect()
"""


def test_a_probed_process_logs_its_collections_and_the_summary_splits_them_by_phase(tmp_path: Path) -> None:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", CHILD, "gateway"], env={**gc_probe.env(tmp_path)},
                         capture_output=True, text=True, check=True).stdout
    t1 = time.monotonic()
    mid = float(out.split()[0])
    [log] = tmp_path.glob("gc-*.jsonl")
    argv, collections, _ = gc_probe.read(log)
    assert argv[-1] == "gateway" and any(c["gen"] == 2 for c in collections)

    s = gc_probe.summary(tmp_path, {"before": (t0, mid), "after": (mid, t1)})
    assert s["gateway"]["processes"] == 1
    before, after = s["gateway"]["before"], s["gateway"]["after"]
    assert before["generations"][1]["count"] >= 1 and before["generations"][2]["count"] == 0
    assert after["generations"][2]["count"] >= 1 and after["generations"][2]["total_ms"] > 0
    assert after["largest"] is not None and after["largest"]["ms"] >= max(
        c["s"] * 1000 for c in collections if c["t"] >= mid) - 5e-4  # the summary rounds to a microsecond


def test_without_the_probes_directory_a_process_is_not_probed(tmp_path: Path) -> None:
    env = gc_probe.env(tmp_path)
    del env["TOKENFAN_GC_PROBE_DIR"]
    subprocess.run([sys.executable, "-c", "import gc; gc.collect()"], env=env, check=True)
    assert not list(tmp_path.iterdir())
