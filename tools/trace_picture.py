"""Draw one trace as a waterfall (PNG): the spans a tracing test recorded (``tests/otlp.py`` ``dump``: JSON of the
decoded OTLP spans), one bar per span under its parent, its events as marks with their names.

    python tools/trace_picture.py test-artifacts/trace-vllm-migration.json docs/observability-trace.png

docs/observability.md shows the picture this draws from tests/e2e/test_vllm_tracing.py's trace.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after the backend is chosen

COLORS = {"tokenfan-gateway": "#4c72b0", "tokenfan-engine": "#dd8452"}
EVENT_LABEL = {"first_token": "first token", "engine_lost": "engine lost", "migration": "migration",
               "resume": "resume", "reader_cut": "cut", "cancel": "cancel", "adoption": "adoption"}


def ordered(spans: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """Depth-first, children after their parent in start order: (depth, span)."""
    ids = {s["span_id"] for s in spans}
    children: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        children.setdefault(s["parent_id"] if s["parent_id"] in ids else "", []).append(s)
    out: list[tuple[int, dict[str, Any]]] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s["start_ns"]):
            out.append((depth, s))
            walk(s["span_id"], depth + 1)

    walk("", 0)
    return out


def label(s: dict[str, Any], engines: dict[str, str], depth: int) -> str:
    """The span's name and where it ran: the gateway, or the engine (by its socket; vLLM's spans by its pid)."""
    where = s["resource"].get("tokenfan.engine.address") or engines.get(str(s["resource"].get("vllm.process_id")))
    if s["resource"].get("service.name") == "tokenfan-gateway":
        where = "gateway"
    elif where:
        where = "engine " + where.rsplit("/", 1)[-1]
    return ("└ " if depth else "") + f"{s['name']}  [{where or s['resource'].get('service.name', '')}]"


def draw(spans: list[dict[str, Any]], out: Path, title: str) -> None:
    rows = ordered(spans)
    engines = {str(s["resource"]["process.pid"]): s["resource"]["tokenfan.engine.address"] for s in spans
               if "process.pid" in s["resource"] and "tokenfan.engine.address" in s["resource"]}
    t0 = min(s["start_ns"] for s in spans)
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(rows) + 1.6))
    for y, (depth, s) in enumerate(rows):
        start, end = (s["start_ns"] - t0) / 1e9, (s["end_ns"] - t0) / 1e9
        ax.barh(y, max(end - start, 0.004), left=start, height=0.5,
                color=COLORS.get(s["resource"].get("service.name", ""), "#55a868"))
        ax.text(-0.01, y, label(s, engines, depth), ha="right", va="center", fontsize=8,
                transform=ax.get_yaxis_transform())
        for k, e in enumerate(s["events"]):
            x = (e["time_ns"] - t0) / 1e9
            ax.plot([x], [y], marker="v", color="black", markersize=6)
            ax.annotate(EVENT_LABEL.get(e["name"], e["name"]), (x, y), xytext=(0, 9 + 8 * (k % 2)),
                        textcoords="offset points", ha="center", fontsize=7)
    ax.set_ylim(len(rows) - 0.4, -0.8)
    ax.set_yticks([])
    ax.set_xlabel("seconds since the first span started")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.subplots_adjust(left=0.3, right=0.98, top=0.9, bottom=0.12)
    fig.savefig(out, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spans", type=Path, help="JSON of decoded spans (tests/otlp.py dump)")
    ap.add_argument("out", type=Path, help="the PNG to write")
    ap.add_argument("--trace", help="only this trace id (default: the trace with the most spans)")
    args = ap.parse_args()
    spans = json.loads(args.spans.read_text())
    trace = args.trace or max({s["trace_id"] for s in spans}, key=lambda t: sum(s["trace_id"] == t for s in spans))
    mine = [s for s in spans if s["trace_id"] == trace]
    draw(mine, args.out, f"trace {trace}: {len(mine)} spans")


if __name__ == "__main__":
    main()
