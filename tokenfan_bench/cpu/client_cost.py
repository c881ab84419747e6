"""What the bench client itself costs: CPU seconds per received event, per client and transport.

Runs the ordinary bench workers (one process) against the raw floor server (spawned, so the server
does as little as possible) or ``--url``, with two arms of the same transport, and divides the
worker's CPU time during the run (user + system, so the kernel's receive path counts) by the events
it received. Prints a markdown table; ``--json`` writes the rows.

Run: ``python -m tokenfan_bench.cpu.client_cost --clients fast,python --transports sse,ws --streams 200``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tokenfan_bench.clients.workers import Plan
from tokenfan_bench.report.run_outputs import load
from tokenfan_bench.runner import run_clients
from tokenfan_bench.servers import processes


def measure(url: str, client: str, transport: str, ns: argparse.Namespace) -> dict[str, Any]:
    plan = Plan(url=url, transports=(transport, transport), streams=ns.streams, max_tokens=ns.max_tokens,
                duration=None, separate=False, ramp=ns.ramp, client=client, cafile=ns.cafile,
                h2_streams_per_connection=ns.h2_streams_per_connection)
    run = run_clients(plan, 1, f"{client} {transport}", progress_bar=False)
    events = sum(int(a.seq.size) for a in run.arms.values())
    errors = sum(len(a.errors) for a in run.arms.values())
    return {"client": client, "transport": transport, "subscribers": 2 * ns.streams, "events": events,
            "errors": errors, "wall_s": run.wall_s, "cpu_s": run.client_cpu_s,
            "cpu_us_per_event": run.client_cpu_s / events * 1e6 if events else None,
            "events_per_s": events / run.wall_s, "server_cpu_s": run.cpu_s}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tokenfan_bench.cpu.client_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="server to use (default: spawn the raw floor server)")
    ap.add_argument("--clients", default="fast,python")
    ap.add_argument("--transports", default="sse,ws")
    ap.add_argument("--streams", type=int, default=200, help="streams, each watched by two subscribers")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--tokens-per-s", type=float, default=50.0, help="rate of the spawned raw server")
    ap.add_argument("--ramp", type=float, default=1.0)
    ap.add_argument("--cafile", default=None)
    ap.add_argument("--h2-streams-per-connection", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    rows = []
    if ns.url:
        for c in ns.clients.split(","):
            rows += [measure(ns.url, c, t, ns) for t in ns.transports.split(",")]
    else:
        with processes.spawn_raw(ns.tokens_per_s, 20.0, Path("bench-results/clientcost-logs")) as raw:
            for c in ns.clients.split(","):
                rows += [measure(raw.url, c, t, ns) for t in ns.transports.split(",")]
    print(f"load {load()}, {ns.streams} streams x 2 subscribers x "
          f"{ns.max_tokens} tokens", file=sys.stderr)
    print("| client | transport | events | errors | events/s | client CPU µs/event |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        per = f"{r['cpu_us_per_event']:.1f}" if r["cpu_us_per_event"] else "–"
        print(f"| {r['client']} | {r['transport']} | {r['events']} | {r['errors']} | {r['events_per_s']:.0f} | {per} |")
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
