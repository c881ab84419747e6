"""``tokenfan bench capacity``: the most tokens/s one gateway process carries within a delivery bound, per
transport, beside the raw floor, and the gateway's CPU cores it used there (tokens per gateway core).

The synthetic engine runs at GPU-like step rates (``--tokens-per-s`` steps/s, ``--steps shared``: every
stream's token in one engine step, as a GPU batches them). For each transport (``a`` POST SSE
``/v1/chat/completions`` with ``stream: true``; ``b`` fan-out: ``POST /v1/streams`` + one SSE reader per
stream; ``c`` ``/v1/ws``, ``--per-connection`` generations per socket) the levels of ``--levels`` streams
run in ascending order until one does not hold: p99 delivery latency (client receive - engine emit, each
event's ``emit_ns``: fan-out chunks carry it, POST SSE and ``/v1/ws`` chunks on ``?tokenfan_timing=1``) ≤
``--threshold-ms``, no error, ≥ 95 % (``--min-delivered``) of the offered tokens delivered. A level measures
``--window`` × ``--repeats`` s once every stream has its first event and ``--warmup`` s have passed; no
connection opens or closes inside it. The capacity is the best level that held. The same client and levels
then run against the raw floor (:mod:`tokenfan_bench.servers.raw_floor`), in the same run.

Per level: tokens/s, p50/p90/p99/max delivery, the gateway's CPU utilisation (user + system seconds per
second of the gateway process, i.e. cores used), the engine worker's and the client's, and tokens per gateway
core (tokens/s ÷ cores used). ``--stream-intervals 1,4`` also measures the engine sending 4 tokens per
delta (vLLM's ``--stream-interval``; the floor sends the same); the headline is 1 token per step.
``--profile`` records the gateway with ``py-spy record --native`` during each level's window
(``DIR/profiles/``) and reports its hottest frames of the best level.

This is :mod:`tokenfan_bench.cpu.gateway_cost`'s ``--capacity`` machinery (the levels, the load of
:mod:`tokenfan_bench.cpu.load_client`, the CPU accounting), for three transports and one gateway process.

Output: ``DIR/results.json`` and ``DIR/summary.md`` (also printed): the machine, its load, the date and the
exact command.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenfan_bench.cpu import gateway_cost as gc
from tokenfan_bench.cpu.load_client import MODE_NAMES
from tokenfan_bench.report import run_outputs

TRANSPORTS = ("a", "b", "c")
GOAL_TOKENS_PER_CORE = 30_000.0  # tokens/s per gateway core on a 2-core host
GOAL_FLOOR_RATIO = 1.5  # or within this factor of the raw floor's tokens/s


# -- the figures (pure) --------------------------------------------------------------------------


def headline(gateway: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """One transport's figures from its gateway and raw-floor capacities (:func:`gateway_cost.capacity_of`):
    the gateway's best level and cores used there, the floor's best level, the floor at the gateway's best
    level (the same load: its cores used), and both ratios against the goal."""
    g, r = gateway.get("best"), raw.get("best")
    same = next((lv for lv in raw["levels"] if g is not None and lv["streams"] == g["streams"] and "error" not in lv),
                None)
    out: dict[str, Any] = {
        "tokens_per_s": gateway["tokens_per_s"], "streams": gateway["streams"],
        "delivery_p99_ms": (g or {}).get("delivery_ms", {}).get("p99"),
        "gateway_cpu_util": (g or {}).get("server_cpu_util"),
        "tokens_per_gateway_core": (g or {}).get("tokens_per_server_core"),
        "engine_cpu_util": (g or {}).get("engine_cpu_util"),
        "raw_tokens_per_s": raw["tokens_per_s"], "raw_streams": raw["streams"],
        "raw_cpu_util": (r or {}).get("server_cpu_util"), "raw_tokens_per_core": (r or {}).get("tokens_per_server_core"),
        "raw_at_gateway_level": None if same is None else {
            "tokens_per_s": same.get("tokens_per_s"), "cpu_util": same.get("server_cpu_util"),
            "tokens_per_core": same.get("tokens_per_server_core"), "delivery_p99_ms": same["delivery_ms"]["p99"]},
        "top_level_reached": {"gateway": _all_held(gateway), "raw": _all_held(raw)},
    }
    out["floor_ratio"] = gc.ratio(raw["tokens_per_s"], gateway["tokens_per_s"])  # floor tok/s ÷ gateway tok/s
    out["floor_per_core_ratio"] = gc.ratio(out["raw_at_gateway_level"] and out["raw_at_gateway_level"]["tokens_per_core"],
                                           out["tokens_per_gateway_core"])
    per_core = out["tokens_per_gateway_core"]
    out["goal"] = {"tokens_per_gateway_core": GOAL_TOKENS_PER_CORE, "floor_ratio": GOAL_FLOOR_RATIO,
                   "met": bool((per_core is not None and per_core >= GOAL_TOKENS_PER_CORE)
                               or (out["floor_ratio"] is not None and out["floor_ratio"] <= GOAL_FLOOR_RATIO))}
    return out


def _all_held(cap: dict[str, Any]) -> bool:
    """Every level held: the capacity is at least the last level's (the levels, not the server, were the limit)."""
    return bool(cap["levels"]) and all(lv["held"] for lv in cap["levels"])


def hottest(raw_profile: str, n: int = 15) -> dict[str, Any]:
    """The ``n`` frames with the most samples of a ``py-spy record --format raw`` profile (one line per
    stack: ``frame;frame;...;leaf COUNT``): ``self`` (the leaf frame), ``inclusive`` (on the stack, once
    per sample), as shares of all samples."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in raw_profile.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        frames = stack.split(";")
        total += k
        own[frames[-1]] += k
        for f in set(frames):
            incl[f] += k
    return {"samples": total, "self": [(f, c / total) for f, c in own.most_common(n)],
            "inclusive": [(f, c / total) for f, c in incl.most_common(n)]}


# -- profiling -----------------------------------------------------------------------------------


class Profiler:
    """``py-spy record --native`` of the gateway process during each level's measured window."""

    def __init__(self, out: Path, rate: int, interval: int) -> None:
        self.dir = out / "profiles"
        self.rate, self.interval = rate, interval
        self.exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        self.files: dict[tuple[str, int], Path] = {}

    @contextlib.contextmanager
    def __call__(self, srv: gc.Server, mode: str, streams: int, seconds: float) -> Iterator[None]:
        if srv.kind != "gateway":
            yield
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"gateway-{mode}-i{self.interval}-{streams}.txt"
        proc = subprocess.Popen([self.exe, "record", "--native", "-r", str(self.rate), "-d", str(max(1, int(seconds))),
                                 "-f", "raw", "-o", str(path), "-p", str(srv.cpu.root.pid)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            yield
        finally:
            try:
                proc.wait(seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if path.is_file():
            self.files[(mode, streams)] = path


# -- the run -------------------------------------------------------------------------------------


def run(ns: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    out: Path = ns.out
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"meta": {**run_outputs.meta(["capacity", *argv], ns.seed),
                                        "settings": gc.settings_of(ns)}, "intervals": {}, "headline": {}}
    runner = gc.loop_runner()
    for interval in ns.stream_intervals:
        per: dict[str, Any] = {}
        for mode in ns.transports:
            profiler = Profiler(out, ns.profile_rate, interval) if ns.profile else None
            with gc.spawned("gateway", ns, out, interval=interval) as srv:
                print(f"capacity, {MODE_NAMES[mode]}, one gateway process, stream interval {interval}", file=sys.stderr)
                gw = runner(gc.capacity(srv, ns, mode, ns.levels, interval, profiler))
            with gc.spawned("raw", ns, out, interval=interval) as srv:
                print(f"capacity, {MODE_NAMES[mode]}, raw floor", file=sys.stderr)
                raw = runner(gc.capacity(srv, ns, mode, ns.levels, interval))
            row: dict[str, Any] = {"name": MODE_NAMES[mode], "gateway": gw, "raw": raw, "headline": headline(gw, raw)}
            if profiler is not None and gw["streams"] is not None:
                path = profiler.files.get((mode, gw["streams"]))
                if path is not None:
                    row["profile"] = {"file": str(path), **hottest(path.read_text(errors="replace"))}
            per[mode] = row
            _write(out, results | {"intervals": {**results["intervals"], str(interval): per}})
        results["intervals"][str(interval)] = per
    first = str(ns.stream_intervals[0])
    results["headline"] = {mode: {"name": MODE_NAMES[mode], "stream_interval": int(first), **r["headline"]}
                           for mode, r in results["intervals"][first].items()}
    results["meta"]["load_end"] = run_outputs.load()
    _write(out, results)
    return results


def _write(out: Path, results: dict[str, Any]) -> None:
    run_outputs.write_json(out / "results.json", results)
    (out / "summary.md").write_text(summary_md(results))


def _f(x: float | None, nd: int = 0) -> str:
    return "–" if x is None else f"{x:,.{nd}f}"


def summary_md(results: dict[str, Any]) -> str:
    meta, s = results["meta"], results["meta"]["settings"]
    m = meta["machine"]
    lines = ["# tokenfan bench capacity", "", f"`{' '.join(meta['command'])}`", "",
             (f"{m['cpus']} CPUs ({m['cpu_model']}), {m['platform']}; load (1/5/15 min) {meta['load']} at start, "
              f"{meta.get('load_end', '–')} at end; {meta['time']}. Synthetic engine, {s['tokens_per_s']:g} steps/s "
              f"({s['steps']} steps), one gateway process; a level holds at p99 delivery ≤ {s['threshold_ms']:g} ms, "
              f"no error, ≥ {s['min_delivered']:.0%} of the offered tokens delivered; {s['window'] * s['repeats']:g} s measured per "
              "level. CPU utilisation = CPU seconds per second (cores used); tokens per core = tokens/s ÷ that."), ""]
    for interval, per in results["intervals"].items():
        lines += [f"## {interval} token(s) per event", "",
                  ("| transport | gateway tok/s | streams | p99 ms | gateway cores | tok/s per gateway core "
                   "| engine cores | floor tok/s | floor cores at the gateway's level | floor tok/s per core there "
                   "| floor ÷ gateway (tok/s; per core) | goal |"), "|" + "---|" * 12]
        for r in per.values():
            h = r["headline"]
            same = h["raw_at_gateway_level"] or {}
            lines.append(
                f"| {r['name']} | {_f(h['tokens_per_s'])}{'' if not h['top_level_reached']['gateway'] else ' (all levels held)'}"
                f" | {h['streams'] or '–'} | {_f(h['delivery_p99_ms'], 1)} | {_f(h['gateway_cpu_util'], 2)}"
                f" | {_f(h['tokens_per_gateway_core'])} | {_f(h['engine_cpu_util'], 2)}"
                f" | {_f(h['raw_tokens_per_s'])}{'' if not h['top_level_reached']['raw'] else ' (all levels held)'}"
                f" | {_f(same.get('cpu_util'), 2)} | {_f(same.get('tokens_per_core'))}"
                f" | {_f(h['floor_ratio'], 2)}×; {_f(h['floor_per_core_ratio'], 2)}× | {'met' if h['goal']['met'] else 'missed'} |")
        lines += ["", "Levels (streams → tok/s, p99 ms, cores used; ✗ did not hold: why):", ""]
        for r in per.values():
            for kind in ("gateway", "raw"):
                lv = "; ".join(
                    f"{x['streams']} → " + (x["error"][:120] if "error" in x else
                                            f"{_f(x['tokens_per_s'])}, {_f(x['delivery_ms']['p99'], 1)}, "
                                            f"{_f(x['server_cpu_util'], 2)}")
                    + ("" if x["held"] else f" ✗ {x.get('why_not') or ''}") for x in r[kind]["levels"])
                lines.append(f"- {r['name']}, {kind}: {lv}")
            prof = r.get("profile")
            if prof and prof.get("self"):
                lines.append(f"- {r['name']}, gateway profile at {r['gateway']['streams']} streams "
                             f"({prof['samples']} samples, `{prof['file']}`), self: "
                             + ", ".join(f"{f} {share:.1%}" for f, share in prof["self"][:8]))
        lines.append("")
    return "\n".join(lines) + "\n"


# -- CLI -----------------------------------------------------------------------------------------


def _transports(s: str) -> list[str]:
    modes = [x.strip() for x in s.split(",") if x.strip()]
    if not modes or any(m not in TRANSPORTS for m in modes):
        raise argparse.ArgumentTypeError(f"--transports takes some of {','.join(TRANSPORTS)}; got {s!r}")
    return modes


def _ascending(s: str) -> list[int]:
    vals = [int(x) for x in s.split(",") if x.strip()]
    if not vals or vals != sorted(vals) or vals[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers in ascending order; got {s!r}")
    return vals


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan bench capacity", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--transports", type=_transports, default=list(TRANSPORTS),
                    help="a (POST SSE), b (fan-out, one SSE reader per stream), c (/v1/ws); default a,b,c")
    ap.add_argument("--levels", type=_ascending, default=[128, 256, 384, 512, 640, 768, 1024],
                    help="streams per level, ascending (default 128,256,384,512,640,768,1024)")
    ap.add_argument("--tokens-per-s", type=float, default=50.0, help="engine steps (tokens) per second per stream (50)")
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--steps", choices=("shared", "per-stream"), default="shared",
                    help="engine step clock: shared (one step for every stream, as a GPU batches; default) or "
                         "per-stream")
    ap.add_argument("--stream-intervals", type=_ascending, default=[1],
                    help="tokens per event (the engine's --stream-interval), e.g. 1,4; the first is the headline")
    ap.add_argument("--per-connection", type=int, default=64, help="generations per /v1/ws socket (default 64)")
    ap.add_argument("--threshold-ms", type=float, default=50.0, help="p99 delivery latency a level must hold")
    ap.add_argument("--min-delivered", type=float, default=0.95,
                    help="share of the offered tokens a level must deliver in its window (default 0.95)")
    ap.add_argument("--ramp", type=float, default=3.0, help="seconds over which a level's streams start")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds after every stream's first event")
    ap.add_argument("--window", type=float, default=5.0, help="seconds per measured window")
    ap.add_argument("--repeats", type=int, default=2, help="windows per level (measured back to back)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds after closing a level")
    ap.add_argument("--start-timeout", type=float, default=60.0, help="seconds for every stream's first event")
    ap.add_argument("--profile", action="store_true",
                    help="py-spy record --native the gateway during each level (DIR/profiles/); needs py-spy")
    ap.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    ap.add_argument("--gateway-arg", action="append", default=[], metavar="ARG", help="extra gateway argument")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="output directory (default bench-results/capacity-<time>)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser().parse_args(argv)
    ns.out = ns.out or Path("bench-results") / time.strftime("capacity-%Y%m%d-%H%M%S")
    results = run(ns, argv)
    print(summary_md(results))
    print(f"wrote {ns.out / 'results.json'} and {ns.out / 'summary.md'}", file=sys.stderr)
    return 0
