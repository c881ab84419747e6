"""The GC probe's logs read back: each server process's garbage collections in each phase of a run.

:func:`env` is the environment that loads the probe (:mod:`tokenfan_bench.servers.gc_probe.sitecustomize`) into
the processes the bench starts; :func:`summary` reads their logs for named phases (``time.monotonic()`` spans:
one clock for every process of the machine). Per role (``gateway``, ``engine``: every process of that role
together) and phase: per generation the count and total seconds (from the probe's running tallies: exact for the middle and
oldest generations, the young one's to within half a second of the phase's edges), and the largest collection
(from its own line).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PROBE_DIR = Path(__file__).resolve().parent.parent / "servers" / "gc_probe"


def env(log_dir: Path) -> dict[str, str]:
    """The environment of a process whose collections the probe logs into ``log_dir``."""
    path = os.pathsep.join(p for p in (str(PROBE_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "TOKENFAN_GC_PROBE_DIR": str(log_dir)}


def role(argv: list[str]) -> str:
    """``engine`` (an engine worker), ``gateway`` (a gateway or its supervisor) or ``other``."""
    if any("engine_worker" in a for a in argv) or "engine" in argv:
        return "engine"
    if any(a == "gateway" or a == "serve" for a in argv):
        return "gateway"
    return "other"


def read(path: Path) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """One process's log: its command line, its collections' lines and its tallies."""
    argv: list[str] = []
    collections, tallies = [], []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by the process's end
        if "argv" in row:
            argv = row["argv"]
            continue
        if "tally" in row:
            tallies.append(row)
        if "gen" in row:
            collections.append(row)
    return argv, collections, tallies


def _tally_at(tallies: list[dict[str, Any]], t: float) -> list[list[float]]:
    """The last tally at or before ``t`` (zeros before the first)."""
    last: list[list[float]] = [[0, 0.0, 0.0] for _ in range(3)]
    for row in tallies:
        if row["t"] > t:
            break
        last = row["tally"]
    return last


def summary(log_dir: Path, phases: dict[str, tuple[float, float]]) -> dict[str, dict[str, Any]]:
    """``{role: {phase: {"generations": [{count, total_ms}] × 3, "largest": {gen, ms, t} | None}, "processes": n}}``."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(log_dir.glob("gc-*.jsonl")):
        argv, collections, tallies = read(path)
        r = out.setdefault(role(argv), {"processes": 0})
        r["processes"] += 1
        for name, (t0, t1) in phases.items():
            ph = r.setdefault(name, {"generations": [{"count": 0, "total_ms": 0.0} for _ in range(3)],
                                     "largest": None})
            a, b = _tally_at(tallies, t0), _tally_at(tallies, t1)
            for g in range(3):
                ph["generations"][g]["count"] += int(b[g][0] - a[g][0])
                ph["generations"][g]["total_ms"] = round(ph["generations"][g]["total_ms"]
                                                         + (b[g][1] - a[g][1]) * 1000, 3)
            inside = [c for c in collections if t0 <= c["t"] <= t1]
            if inside:
                top = max(inside, key=lambda c: c["s"])
                if ph["largest"] is None or top["s"] * 1000 > ph["largest"]["ms"]:
                    ph["largest"] = {"gen": top["gen"], "ms": round(top["s"] * 1000, 3), "t": top["t"]}
    return out
