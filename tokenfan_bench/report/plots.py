"""The plots of ``tokenfan bench report`` (matplotlib, Agg): TTFT, gaps, delivery differences with their
intervals, delivery CDFs per profile, CPU and bytes per token."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from tokenfan_bench.runner import Run
from tokenfan_bench.stats.metrics import delivery_ns
from tokenfan_bench.stats.report_estimates import calibration_difference


def slug(name: str) -> str:
    """A profile name as a file name (custom profiles carry '=', ',' and '%')."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(results: dict[str, Any], level0: str) -> dict[str, dict[str, dict[str, Any]]]:
    """profile -> transport label -> that arm's metrics (first arm of each transport)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, p in results["profiles"].items():
        d: dict[str, dict[str, Any]] = {}
        for r in (p["levels"][level0], p["responses"], p.get("browser")):
            if r is None:
                continue
            for k, a in r["arms"].items():
                d.setdefault(a["transport"], {**a, "gap_p99": r["gap_p99_ms"][k]})
        out[name] = d
    return out


def write_plots(results: dict[str, Any], runs: dict[str, Run], plots: Path) -> None:
    plt = _plt()
    level0 = str(results["settings"]["levels"].strip("[]").split(",")[0]).strip()
    series = _series(results, level0)
    profiles = list(series)
    transports = list(dict.fromkeys(t for d in series.values() for t in d))
    width = 0.8 / max(1, len(transports))
    x = np.arange(len(profiles))

    fig, ax = plt.subplots(figsize=(10, 4.8))
    for i, t in enumerate(transports):
        ax.bar(x + i * width, [series[p].get(t, {}).get("ttft_ms", {}).get("p50") or 0 for p in profiles], width,
               label=t)
    ax.set_xticks(x + 0.4 - width / 2, profiles)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT p50 (ms, log)")
    ax.set_title(f"Time to first token by profile and transport ({level0} streams)")
    ax.legend(ncol=4, fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(plots / "ttft.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, title in ((axes[0], "p50", "inter-token gap p50 (ms)"), (axes[1], "p99", "inter-token gap p99 (ms)")):
        for i, t in enumerate(transports):
            vals = [(series[p].get(t, {}).get("itl_ms", {}).get("p50") if key == "p50"
                     else series[p].get(t, {}).get("gap_p99")) or 0 for p in profiles]
            ax.bar(x + i * width, vals, width, label=t)
        ax.set_xticks(x + 0.4 - width / 2, profiles, fontsize=8)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    axes[1].legend(ncol=2, fontsize=7)
    fig.tight_layout()
    fig.savefig(plots / "gaps.png", dpi=100)
    plt.close(fig)

    _plot_diffs(results, level0, plots / "diffs.png")
    for name in profiles:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for tag in (f"{name} fan-out N={level0}", f"{name} browser"):
            run = runs.get(tag)
            if run is None:
                continue
            for k, sarm in run.arms.items():
                if k == "B":  # the A/A twin
                    continue
                v = np.sort(delivery_ns(sarm)) / 1e6
                if v.size:
                    ax.plot(v, np.arange(1, v.size + 1) / v.size, label=f"{sarm.transport} (n={v.size})")
        ax.set_xscale("log")
        ax.set_xlabel("delivery latency (ms): receive − engine emit")
        ax.set_ylabel("fraction of tokens")
        ax.set_title(f"{name}: delivery latency CDF ({level0} streams; browser {results['settings']['browser_streams']})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plots / f"cdf_{slug(name)}.png", dpi=100)
        plt.close(fig)

    cpu = results.get("cpu", {})
    if cpu:
        fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
        names = list(dict.fromkeys(t for per in cpu.values() for t in per.get("runs", {})))
        xs = np.arange(len(names))
        w = 0.8 / max(1, len(cpu))
        for ax, getter, title in (
                (axes[0], lambda r: r["server"].get("cpu_us_per_token"), "server CPU µs / delivered token"),
                (axes[1], lambda r: r["client"].get("cpu_us_per_event"), "client CPU µs / received event"),
                (axes[2], lambda r: (r.get("wire") or {}).get("A", {}).get("down_bytes_per_token"),
                 "down bytes / token (TLS)")):
            for j, (profile, per) in enumerate(cpu.items()):
                means, lo, hi = [], [], []
                for t in names:
                    vals = [v for v in (getter(r) for r in per.get("runs", {}).get(t, [])) if v is not None] or [0.0]
                    means.append(float(np.mean(vals)))
                    lo.append(means[-1] - min(vals))
                    hi.append(max(vals) - means[-1])
                ax.bar(xs + j * w, means, w, yerr=[lo, hi], capsize=2, label=profile)
            ax.set_xticks(xs + 0.4 - w / 2, names, fontsize=8)
            ax.set_title(title, fontsize=10)
            ax.grid(True, axis="y", alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plots / "cpu_bytes.png", dpi=100)
        plt.close(fig)


def _symlog_limits(lo: float, hi: float, linthresh: float, pad: float = 1.6) -> tuple[float, float]:
    """Axis limits of a symlog axis that hold ``[lo, hi]`` with room for the markers: ``pad`` times the
    value beyond the linear range, a linear margin inside it."""
    def out(x: float) -> float:
        return x * pad if abs(x) > linthresh else x + np.sign(x or 1) * linthresh * (pad - 1)

    return (min(out(lo), -linthresh), max(out(hi), linthresh))


def _plot_diffs(results: dict[str, Any], level0: str, path: Path) -> None:
    """Forest plot: per profile, the delivery differences vs A with their intervals."""
    plt = _plt()
    rows: list[tuple[str, dict[str, Any]]] = []
    for name, p in results["profiles"].items():
        r = p["levels"][level0]
        rows += [(f"{name}: sse A/A", r["diffs_ms"]["B-A"]), (f"{name}: ws − sse", r["diffs_ms"]["C-A"]),
                 (f"{name}: sse-h2 − sse", r["diffs_ms"]["D-A"]),
                 (f"{name}: calibration", p["calibration"]["diffs_ms"]["B-A"])]
        if p.get("browser"):
            rows += [(f"{name}: browser A/A", p["browser"]["diffs_ms"]["B-A"]),
                     (f"{name}: browser ws − es", p["browser"]["diffs_ms"]["D-A"]),
                     (f"{name}: browser calibration", calibration_difference(p["browser_calibration"]))]
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(rows) + 1.2))
    ends = [float(results["settings"]["inject_ms"]), 0.0]
    for i, (label, d) in enumerate(rows):
        lo, hi = d["ci95"]
        if d.get("median") is None or not all(np.isfinite([d["median"], lo, hi])):
            ax.text(0, i, "not measured", fontsize=6, va="center", ha="center", color="grey")
            continue
        ends += [lo, hi, d["median"]]
        ax.errorbar([d["median"]], [i], xerr=[[d["median"] - lo], [hi - d["median"]]], fmt="o", capsize=3,
                    color="C3" if "calibration" in label else "C0")
    ax.axvline(0, color="grey", linewidth=1)
    ax.axvline(float(results["settings"]["inject_ms"]), color="C3", linewidth=1, linestyle="--")
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlim(*_symlog_limits(min(ends), max(ends), 0.1))
    ax.set_xlabel("median delivery difference (ms), 95% CI (browser: unpaired, one arm per stream)")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
