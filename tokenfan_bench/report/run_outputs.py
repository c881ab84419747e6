"""Bench outputs: the results dictionary (``results.json``), ``summary.md``, the printed table and
PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from tokenfan_bench.runner import Run
from tokenfan_bench.stats.ab_difference import median_difference
from tokenfan_bench.stats.metrics import arm_metrics, delivery_ns

METRIC_ROWS = (("ttft_ms", "TTFT ms"), ("itl_ms", "ITL ms"), ("e2e_ms", "E2E ms"),
               ("delivery_ms", "delivery ms"), ("engine_to_gateway_ms", "  engine→gateway ms"),
               ("gateway_to_client_ms", "  gateway→client ms"), ("tokens_per_s", "tokens/s/stream"))
STATS = ("mean", "p50", "p90", "p99", "p99.9")


def run_result(run: Run, *, n_boot: int, seed: int) -> dict[str, Any]:
    """Metrics of every arm, the differences to arm A (``diff_ms`` is B - A), and the CPU cost of
    one run on both sides (server from ``/metrics``, client from the workers' process time)."""
    a = run.arms["A"]
    arms = {k: arm_metrics(v, run.wall_s) for k, v in run.arms.items()}
    paired = not run.plan.separate
    diffs = {f"{k}-A": median_difference(a, v, paired=paired, n_boot=n_boot, seed=seed)
             for k, v in run.arms.items() if k != "A"}
    delivered = sum(m["deltas_delivered"] for m in arms.values())
    events = sum(m["content_events"] for m in arms.values())
    server: dict[str, Any] = {"url": run.plan.url, "cpu_s": run.cpu_s, "chunks_sent": run.sent,
                              "deliveries_per_s": events / run.wall_s}
    if run.cpu_s is not None:
        server["cpu_util"] = run.cpu_s / run.wall_s
        # Both arms share the server process: its CPU is divided by what both arms received.
        server["cpu_us_per_token"] = run.cpu_s / delivered * 1e6 if delivered else None
        server["cpu_us_per_event"] = run.cpu_s / events * 1e6 if events else None
        server["deliveries_per_cpu_s"] = events / run.cpu_s if run.cpu_s > 0 else None
    received = sum(m["events"] for m in arms.values())
    return {
        "streams": run.plan.streams, "max_tokens": run.plan.max_tokens, "duration_s": run.plan.duration,
        "separate_streams": run.plan.separate, "workers": run.workers, "wall_s": run.wall_s,
        "arms": arms, "diff_ms": diffs["B-A"], "diffs_ms": diffs,
        "server": server,
        "client": {"kind": run.plan.client, "workers": run.workers, "cpu_s": run.client_cpu_s,
                   "events": received,
                   "cpu_us_per_event": run.client_cpu_s / received * 1e6 if received else None,
                   "cpu_util_per_worker": run.client_cpu_s / run.wall_s / run.workers,
                   "h2_streams_per_connection": run.plan.h2_streams_per_connection},
    }


def baseline_result(gw: dict[str, Any], raw: dict[str, Any], rate: float) -> dict[str, Any]:
    """The raw floor and the gateway as a ratio of it."""
    g, r = gw["server"], raw["server"]
    out: dict[str, Any] = {"kind": "raw", "tokens_per_s": rate, "run": raw,
                           "deliveries_per_s_ratio": g["deliveries_per_s"] / r["deliveries_per_s"]}
    if g.get("deliveries_per_cpu_s") and r.get("deliveries_per_cpu_s"):
        out["deliveries_per_cpu_s_ratio"] = g["deliveries_per_cpu_s"] / r["deliveries_per_cpu_s"]
        out["cpu_per_token_ratio"] = g["cpu_us_per_token"] / r["cpu_us_per_token"]
    return out


def load() -> str:
    """The 1/5/15-minute load averages, as every report writes them (``0.71 1.25 1.71``)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def meta(argv: list[str], seed: int) -> dict[str, Any]:
    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    for pkg in ("tokenfan", "httpx", "websockets", "picows", "aiofastnet", "h2", "hpack", "numpy", "uvicorn",
                "starlette", "uvloop", "orjson"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"command": ["tokenfan", "bench", *argv], "versions": versions, "seed": seed,
            "machine": {"platform": platform.platform(), "machine": platform.machine(), "cpus": os.cpu_count(),
                        "cpu_model": _cpu_model(), "hostname": platform.node()},
            "load": load(),  # when the run started
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


# -- errors -----------------------------------------------------------------------------------


def _runs(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every measured run in ``results``: the sweep's levels (or the one run), and the raw floor's."""
    runs = list(results.get("sweep") or [results])
    if "baseline" in results:
        runs.append(results["baseline"]["run"])
    return runs


def run_errors(results: dict[str, Any]) -> dict[str, Any] | None:
    """Failed subscriptions over every run of ``results`` (``None``: none failed): how many of how many,
    and by kind (the OpenAI error ``code`` where the gateway gave one)."""
    failed = subscribers = 0
    kinds: dict[str, int] = {}
    for run in _runs(results):
        for arm in run["arms"].values():
            failed += arm["errors"]
            subscribers += arm["subscribers"]
            for kind, n in arm.get("error_kinds", {}).items():
                kinds[kind] = kinds.get(kind, 0) + n
    if not failed:
        return None
    return {"failed": failed, "subscribers": subscribers,
            "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]))}


_WITHHELD_SERVER = ("cpu_us_per_token", "cpu_us_per_event", "deliveries_per_cpu_s", "deliveries_per_s")


def withhold(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` of a run with errors: every latency, rate and CPU figure set to ``None`` (a refused
    attempt costs the gateway little and lightens the load on the others, so none of them measures the
    run asked for); the counts of subscribers, errors and events stay."""
    for run in _runs(results):
        for arm in run["arms"].values():
            for key, _ in METRIC_ROWS:
                arm[key] = {k: None for k in arm[key]}
            arm["deliveries_per_s"] = None
        for d in run.get("diffs_ms", {}).values():
            d["median"] = None
            d["ci95"] = [None, None]
        for key in _WITHHELD_SERVER:
            if key in run.get("server", {}):
                run["server"][key] = None
    if "diffs_ms" in results:
        results["diff_ms"] = results["diffs_ms"]["B-A"]
    results.pop("saturation", None)
    if "baseline" in results:
        for key in ("deliveries_per_s_ratio", "deliveries_per_cpu_s_ratio", "cpu_per_token_ratio"):
            results["baseline"][key] = None
    return results


def errors_md(errors: dict[str, Any]) -> list[str]:
    """The warning a run with errors opens with, in place of its answer."""
    kinds = "; ".join(f"{n:,} × `{k}`" for k, n in errors["kinds"].items())
    return ["## This run had errors: no figures", "",
            (f"**{errors['failed']:,} of {errors['subscribers']:,} subscriptions failed** ({kinds}). Latency, "
            "CPU and rate figures are withheld: failed attempts lighten the load on the others and cost the "
            "gateway little, so none of them would measure the run asked for. A refusal with a `client_*_limit` "
            "code is a limit of the gateway (docs/limits.md: start it with those limits lifted); other errors "
            "are in each arm's `error_examples` in results.json."), ""]


# -- text -------------------------------------------------------------------------------------


def _f(x: Any, nd: int = 2) -> str:
    return "–" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def arm_table(result: dict[str, Any]) -> str:
    arms = result["arms"]
    head = ["metric"] + [f"{k} ({v['transport']}) {s}" for k, v in arms.items() for s in ("p50", "p99")] + \
        [f"{k} mean" for k in arms]
    rows = [head, ["---"] * len(head)]
    for key, name in METRIC_ROWS:
        rows.append([name] + [_f(arms[k][key][s]) for k in arms for s in ("p50", "p99")]
                    + [_f(arms[k][key]["mean"]) for k in arms])
    for key, name in (("deliveries_per_s", "deliveries/s"), ("content_events", "content events"),
                      ("coalesced_events", "coalesced events"), ("errors", "errors")):
        rows.append([name] + [_f(arms[k][key], 1) for k in arms for _ in range(2)] + [""] * len(arms))
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def diff_line(result: dict[str, Any]) -> str:
    diffs = result.get("diffs_ms") or {"B-A": result["diff_ms"]}
    if any(d["median"] is None for d in diffs.values()):
        return "median delivery latency difference: withheld (the run had errors)"
    return "\n".join(
        f"median delivery latency {k.replace('-', ' - ')} = {d['median']:+.3f} ms, 95% CI [{d['ci95'][0]:+.3f}, "
        f"{d['ci95'][1]:+.3f}] ({d['method']}; {d['n']} samples, {d['streams']} streams)" for k, d in diffs.items())


def server_line(result: dict[str, Any]) -> str:
    s = result["server"]
    if s.get("deliveries_per_s") is None:
        return "server deliveries/s and CPU: withheld (the run had errors)"
    parts = [f"server deliveries/s {s['deliveries_per_s']:.0f}"]
    if s.get("cpu_s") is not None:
        parts.append(f"CPU {s['cpu_s']:.2f} s ({100 * s['cpu_util']:.0f}% of a core)")
        if s.get("cpu_us_per_token") is not None:
            parts.append(f"{s['cpu_us_per_token']:.1f} µs CPU per delivered token (all arms)")
    c = result.get("client")
    if c:
        per_event = f", {c['cpu_us_per_event']:.1f} µs CPU per received event" if c.get("cpu_us_per_event") else ""
        parts.append(f"{c.get('kind', 'python')} client: {c['workers']} process(es) at "
                     f"{100 * c['cpu_util_per_worker']:.0f}% CPU each{per_event}"
                     + (" (client-bound: add --workers)" if c["cpu_util_per_worker"] > 0.8 else ""))
    return ", ".join(parts)


def summary_md(results: dict[str, Any]) -> str:
    m = results["meta"]
    arms = ", ".join(f"{k} = {v['transport']}" for k, v in results["arms"].items())
    client = results.get("client", {}).get("kind")
    load = f" · load {m['load']}" if m.get("load") else ""
    out = ["# tokenfan bench", "", f"`{' '.join(m['command'])}`", "",
           f"{m['time']} · {m['machine']['cpu_model']} × {m['machine']['cpus']} · Python {m['versions']['python']}"
           + load, "", f"Arms: {arms}; {results['streams']} streams × {results['max_tokens']} tokens"
           + (" (separate streams per arm)" if results["separate_streams"] else " (every arm on every stream)")
           + (f"; client: {client}" if client else ""), ""]
    if results.get("errors"):
        out += errors_md(results["errors"]) + [error_table(results), ""]
        if "sweep" in results:
            out += ["## Sweep", "", sweep_table(results), ""]
        return "\n".join(out)
    out += [arm_table(results), "", diff_line(results), "", server_line(results), ""]
    if "baseline" in results:
        b = results["baseline"]
        out += ["## Raw floor", "", (f"Same clients against `tokenfan_bench/servers/raw_floor.py` at {b['tokens_per_s']:g} "
                 "tokens/s per stream."), "", arm_table(b["run"]), "", server_line(b["run"]), "",
                f"Gateway deliveries/s = {b['deliveries_per_s_ratio']:.2f} × raw"
                + (f"; deliveries per CPU-second = {b['deliveries_per_cpu_s_ratio']:.3f} × raw "
                   f"(gateway CPU per token = {b['cpu_per_token_ratio']:.1f} × raw)"
                   if "deliveries_per_cpu_s_ratio" in b else ""), ""]
    if "sweep" in results:
        out += ["## Sweep", "", sweep_table(results), ""]
        for rate, sat in results["saturation"].items():
            out.append(f"- {rate} tokens/s: saturation (p99 delivery > {results['saturation_threshold_ms']:g} ms) at "
                       + ", ".join(f"{t} = {n if n is not None else 'not reached'}" for t, n in sat.items()))
        out.append("")
    out.append("Definitions: see `tokenfan_bench/stats/metrics.py` (TTFT, ITL, E2E as in `vllm bench serve`; delivery = "
               "client receive − engine emit, live events only).")
    return "\n".join(out)


def error_table(results: dict[str, Any]) -> str:
    rows = ["| arm | subscribers | failed | events received | first errors |", "| --- | --- | --- | --- | --- |"]
    for k, a in results["arms"].items():
        first = "; ".join(f"`{e[:100]}`" for e in a["error_examples"][:2])
        rows.append(f"| {k} ({a['transport']}) | {a['subscribers']} | {a['errors']} | {a['events']} | {first} |")
    return "\n".join(rows)


def sweep_table(results: dict[str, Any]) -> str:
    rows = ["| tokens/s | streams | transport | delivery p50 ms | delivery p99 ms | deliveries/s | errors |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["sweep"]:
        for arm in r["arms"].values():
            rows.append(f"| {_f(r['tokens_per_s'], 0)} | {r['streams']} | {arm['transport']} | "
                        f"{_f(arm['delivery_ms']['p50'])} | {_f(arm['delivery_ms']['p99'])} | "
                        f"{_f(arm['deliveries_per_s'], 0)} | {arm['errors']} |")
    return "\n".join(rows)


def write_json(path: Path, results: dict[str, Any]) -> None:
    path.write_text(json.dumps(results, indent=2, default=_json_default) + "\n")


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


# -- plots ------------------------------------------------------------------------------------


def plot_cdf(run: Run, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, s in run.arms.items():
        x = np.sort(delivery_ns(s)) / 1e6
        if x.size:
            ax.plot(x, np.arange(1, x.size + 1) / x.size, label=f"{arm}: {s.transport} (n={x.size})")
    ax.set_xscale("log")
    ax.set_xlabel("delivery latency (ms): client receive − engine emit")
    ax.set_ylabel("fraction of tokens")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[tuple[Any, str], list[tuple[int, float]]] = {}
    for r in results["sweep"]:
        for arm in r["arms"].values():
            p99 = arm["delivery_ms"]["p99"]
            if p99 is not None:
                series.setdefault((r["tokens_per_s"], arm["transport"]), []).append((r["streams"], p99))
    for (rate, transport), pts in sorted(series.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"{transport} @ {rate if rate is not None else '?'} tok/s")
    ax.axhline(results["saturation_threshold_ms"], color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("p99 delivery latency (ms)")
    ax.set_title("p99 delivery latency vs concurrency")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
