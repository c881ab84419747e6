"""The bench's GC probe: every garbage collection of a process the bench starts, timed by ``gc.callbacks``.

Loaded as ``sitecustomize`` (its directory first on ``PYTHONPATH``, :func:`tokenfan_bench.stats.gc_probe.env`)
by every Python process started with ``TOKENFAN_GC_PROBE_DIR`` set, their children too; it changes nothing in
the process but the timing callback. Each process appends JSON lines to ``DIR/gc-<pid>.jsonl``: its command
line first; each collection of the middle or oldest generation, and any of 1 ms or more, with its time
(``time.monotonic()``: the bench's clock too), generation, duration and the running tally per generation
(count, seconds, longest); and the tally alone at the end of a young collection at most twice a second. Read by
:func:`tokenfan_bench.stats.gc_probe.summary`.
"""

from __future__ import annotations

import gc
import json
import os
import time
from typing import Any, TextIO

LOGGED_S = 0.001  # a young collection this long or longer gets its own line
TALLY_EVERY_S = 0.5


class _Probe:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.pid = 0
        self.out: TextIO | None = None
        self.started = 0.0
        self.tally = [[0, 0.0, 0.0] for _ in range(3)]  # per generation: count, seconds, longest
        self.tallied = 0.0

    def _open(self) -> TextIO:
        self.pid = os.getpid()
        self.out = open(os.path.join(self.directory, f"gc-{self.pid}.jsonl"), "a", buffering=1)  # noqa: SIM115
        with open("/proc/self/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        self.out.write(json.dumps({"pid": self.pid, "argv": argv, "t": time.monotonic()}) + "\n")
        self.tally = [[0, 0.0, 0.0] for _ in range(3)]  # a forked child counts its own
        return self.out

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
            return
        took = time.perf_counter() - self.started
        out = self.out if self.out is not None and self.pid == os.getpid() else self._open()
        gen = info["generation"]
        row = self.tally[gen]
        row[0] += 1
        row[1] += took
        row[2] = max(row[2], took)
        now = time.monotonic()
        if gen or took >= LOGGED_S:
            self.tallied = now
            out.write(json.dumps({"t": now, "gen": gen, "s": took, "collected": info.get("collected", 0),
                                  "tally": self.tally}) + "\n")
        elif now - self.tallied >= TALLY_EVERY_S:
            self.tallied = now
            out.write(json.dumps({"t": now, "tally": self.tally}) + "\n")


_dir = os.environ.get("TOKENFAN_GC_PROBE_DIR")
if _dir:
    os.makedirs(_dir, exist_ok=True)
    gc.callbacks.append(_Probe(_dir))
