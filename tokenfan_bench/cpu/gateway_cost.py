"""``tokenfan bench cpu``: the gateway's CPU per delivered token in steady state, beside the raw floor.

For each mode (:mod:`tokenfan_bench.cpu.load_client`: ``a`` POST SSE, ``b`` fan-out with ``--readers`` SSE
readers per stream, ``c`` ``/v1/ws`` with ``--per-connection`` generations per socket, ``d`` Responses
SSE), against a spawned synthetic engine + gateway and then against the raw floor server
(:mod:`tokenfan_bench.servers.raw_floor`, the same client and load):

1. **Steady state.** All generations are opened (spread over ``--ramp`` s) with enough tokens to outlast
   the run; once every reader has its first event and ``--warmup`` s have passed, ``--repeats`` windows
   of ``--window`` s are measured back to back. Per window: the server's CPU seconds (user + system, from
   ``/proc`` via psutil: the gateway process and all its children, so ``--workers`` sums every worker; the
   engine worker, a process of its own, reported apart), the content events the client received, and the
   client's own CPU (this process). Figures are µs of CPU per delivered event; the summary gives the
   median and percentiles over the windows. No connection is opened or closed inside a window.
2. **Setup.** Separately, the same number of 2-token generations are run to their end; their CPU per
   generation is reported gross and net of their events at the steady per-event cost. It never enters
   the per-token figure.

Mode ``b`` runs twice, with 1 reader and with ``--readers`` per stream: the marginal cost of an
additional reader is the difference of their CPU rates over the difference of their event rates.

``--capacity``: fan-out streams with one SSE reader each (the events carry ``emit_ns``, so delivery
latency = receive - engine emit, as in ``tokenfan bench``) at ``--capacity-levels`` streams until p99
delivery passes ``--threshold-ms`` (or events are lost); the capacity is the most delivered tokens/s of a
level that held. Measured for each ``--capacity-workers`` value (``--workers`` of the gateway).

Output: ``DIR/results.json`` and ``DIR/summary.md`` (also printed), with the machine, its load and the
exact command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from tokenfan_bench.cpu.load_client import MODE_NAMES, MODES, Load
from tokenfan_bench.report import run_outputs
from tokenfan_bench.servers import processes
from tokenfan_bench.stats.metrics import summary_plain

SUMMARY_KEYS = ("server_us_per_event", "engine_us_per_event", "client_us_per_event", "events_per_s")


# -- accounting (pure) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """Cumulative counters at one instant."""

    t: float  # monotonic seconds
    server_s: float  # CPU seconds of the server's process tree
    engine_s: float | None  # CPU seconds of the engine worker (None: no engine, the raw floor)
    client_s: float  # CPU seconds of this (client) process
    events: int  # content events received so far


def window(a: Snapshot, b: Snapshot) -> dict[str, float | int | None]:
    """Figures of the window between two snapshots (µs of CPU per delivered event)."""
    dt, ev = b.t - a.t, b.events - a.events
    server, client = b.server_s - a.server_s, b.client_s - a.client_s
    engine = None if a.engine_s is None or b.engine_s is None else b.engine_s - a.engine_s

    def per_event(cpu: float | None) -> float | None:
        return None if cpu is None or ev <= 0 else cpu / ev * 1e6

    return {"seconds": dt, "events": ev, "events_per_s": ev / dt if dt > 0 else None,
            "server_cpu_s": server, "server_cpu_util": server / dt if dt > 0 else None,
            "engine_cpu_s": engine, "client_cpu_s": client, "client_cpu_util": client / dt if dt > 0 else None,
            "server_us_per_event": per_event(server), "engine_us_per_event": per_event(engine),
            "client_us_per_event": per_event(client)}


def summarize(windows: list[dict[str, Any]], key: str) -> dict[str, float | int | None] | None:
    """n, mean, median and percentiles of one figure over the windows (None if no window has it)."""
    vals = [w[key] for w in windows if w.get(key) is not None]
    if not vals:
        return None
    out = summary_plain(np.array(vals, dtype=np.float64))
    out["min"], out["max"] = float(min(vals)), float(max(vals))
    return out


def median_of(summary: dict[str, Any] | None) -> float | None:
    return None if summary is None else summary.get("p50")


def marginal_per_reader(one: list[dict[str, Any]], many: list[dict[str, Any]]) -> float | None:
    """µs of server CPU per event added by additional readers: the difference of the median CPU rates
    (CPU s per s) over the difference of the median event rates, between a 1-reader and an R-reader run."""
    def med(ws: list[dict[str, Any]], k: str) -> float | None:
        vals = [w[k] for w in ws if w.get(k) is not None]
        return statistics.median(vals) if vals else None

    c1, cn = med(one, "server_cpu_util"), med(many, "server_cpu_util")
    e1, en = med(one, "events_per_s"), med(many, "events_per_s")
    if None in (c1, cn, e1, en) or en <= e1:  # type: ignore[operator]
        return None
    return (cn - c1) / (en - e1) * 1e6  # type: ignore[operator]


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def setup_figures(cpu_s: float, engine_s: float | None, client_s: float, generations: int, events: int,
                  steady_us_per_event: float | None) -> dict[str, float | int | None]:
    """Per-generation cost of a short-generation phase, gross and net of its events at the steady cost."""
    gross = cpu_s / generations * 1e6 if generations else None
    per_gen_events = events / generations if generations else 0.0
    net = None if gross is None or steady_us_per_event is None else gross - steady_us_per_event * per_gen_events
    return {"generations": generations, "events": events, "server_cpu_s": cpu_s,
            "server_us_per_generation": gross, "server_us_per_generation_net": net,
            "engine_us_per_generation": None if engine_s is None or not generations else engine_s / generations * 1e6,
            "client_us_per_generation": client_s / generations * 1e6 if generations else None}


def capacity_of(levels: list[dict[str, Any]], threshold_ms: float) -> dict[str, Any]:
    """The most delivered tokens/s among the levels that held (p99 ≤ threshold, no errors, ≥ 95 % of the
    offered tokens delivered), the level it came from (``best``) and every level."""
    held = [lv for lv in levels if lv["held"]]
    best = max(held, key=_tokens) if held else None
    return {"threshold_ms": threshold_ms, "tokens_per_s": _tokens(best) if best else None,
            "streams": best["streams"] if best else None, "best": best, "levels": levels}


def _tokens(level: dict[str, Any]) -> float:
    return float(level.get("tokens_per_s", level.get("events_per_s")) or 0.0)


def why_not_held(p99_ms: float | None, errors: int, tokens_per_s: float, offered: float,
                 threshold_ms: float, min_delivered: float = 0.95) -> str | None:
    """None if a level held, else the first reason it did not: no latencies, p99 over the bound, an error,
    or less than ``min_delivered`` of the offered tokens delivered (lost, or late past the window)."""
    if p99_ms is None:
        return "no event timed"
    if p99_ms > threshold_ms:
        return f"p99 {p99_ms:.1f} ms > {threshold_ms:g} ms"
    if errors:
        return f"{errors} error(s)"
    if tokens_per_s < min_delivered * offered:
        return f"{tokens_per_s:,.0f} of {offered:,.0f} offered tokens/s delivered"
    return None


def held(p99_ms: float | None, errors: int, events_per_s: float, offered: float, threshold_ms: float) -> bool:
    return why_not_held(p99_ms, errors, events_per_s, offered, threshold_ms) is None


def hold_ms(interval: int, tokens_per_s: float) -> float:
    """How long an event of ``interval`` tokens holds its oldest one (its ``emit_ns``, as the engine stamps a
    merged delta): the delivery bound of a level grows by it, the transport's share stays the threshold."""
    return (interval - 1) / tokens_per_s * 1000.0


def tokens_per_core(tokens_per_s: float | None, cpu_util: float | None) -> float | None:
    """Tokens/s per CPU core the server used (tokens/s ÷ its CPU seconds per second)."""
    return None if tokens_per_s is None or not cpu_util else tokens_per_s / cpu_util


# -- processes -----------------------------------------------------------------------------------


class ProcCpu:
    """CPU seconds (user + system) of a process and, with ``tree``, all its descendants alive now."""

    def __init__(self, pid: int, tree: bool = True) -> None:
        self.root = psutil.Process(pid)
        self.tree = tree

    def pids(self) -> list[int]:
        procs_ = [self.root, *(self.root.children(recursive=True) if self.tree else [])]
        return [p.pid for p in procs_]

    def seconds(self) -> float:
        total = 0.0
        procs_ = [self.root, *(self.root.children(recursive=True) if self.tree else [])]
        for p in procs_:
            with contextlib.suppress(psutil.Error):  # a child that went away counts 0
                t = p.cpu_times()
                total += t.user + t.system
        return total


@dataclass
class Server:
    kind: str  # "gateway" | "raw"
    url: str
    cpu: ProcCpu
    engine: ProcCpu | None

    def snapshot(self, events: int) -> Snapshot:
        return Snapshot(time.monotonic(), self.cpu.seconds(), self.engine.seconds() if self.engine else None,
                        time.process_time(), events)


@contextlib.contextmanager
def spawned(kind: str, ns: argparse.Namespace, out: Path, workers: int = 1, interval: int = 1) -> Iterator[Server]:
    """The synthetic engine + gateway (``--workers``), or the raw floor; ``interval``: tokens per event."""
    if kind == "raw":
        with processes.spawn_raw(ns.tokens_per_s, ns.ttft_ms, out / "logs", ns.steps, interval) as raw:
            yield Server("raw", raw.url, ProcCpu(raw.server_pid), None)
        return
    gw_args = ["--max-tokens-cap", str(10 * steady_tokens(ns)), "--ws-max-in-flight", str(max(32, ns.per_connection)),
               *ns.gateway_arg,
               *(["--workers", str(workers)] if workers > 1 else [])]
    with processes.spawn_synthetic(ns.tokens_per_s, ns.ttft_ms, out / "logs", gw_args,
                               engine_args=["--max-model-len", "1000000", "--synthetic-steps", ns.steps,
                                            *(["--stream-interval", str(interval)] if interval > 1 else [])]) as s:
        yield Server("gateway", s.url, ProcCpu(s.server_pid), ProcCpu(s.procs[0].pid, tree=False))


# -- phases --------------------------------------------------------------------------------------


def steady_tokens(ns: argparse.Namespace) -> int:
    """Tokens per generation so that none ends before the last window does (30 s of slack for the starts;
    the spawned gateway's --max-tokens-cap is raised to allow it)."""
    seconds = ns.ramp + ns.warmup + ns.repeats * ns.window + 30.0
    return int(ns.tokens_per_s * seconds) + 16


async def steady(srv: Server, mode: str, readers: int, ns: argparse.Namespace) -> dict[str, Any]:
    load = Load(srv.url, mode, generations=_generations(mode, ns), readers=readers,
                per_connection=ns.per_connection, max_tokens=steady_tokens(ns), ramp=ns.ramp, seed=ns.seed)
    try:
        await load.open()
        await load.wait_started(ns.start_timeout)
        await asyncio.sleep(ns.warmup)
        windows = []
        snap = srv.snapshot(load.tally.events)
        for _ in range(ns.repeats):
            await asyncio.sleep(ns.window)
            nxt = srv.snapshot(load.tally.events)
            windows.append(window(snap, nxt))
            snap = nxt
        ended_early = load.tally.ended
    finally:
        await load.aclose()
    await asyncio.sleep(ns.settle)
    offered = load.expected_readers * ns.tokens_per_s
    out: dict[str, Any] = {"windows": windows, "offered_events_per_s": offered,
                           "errors": len(load.tally.errors), "error_examples": sorted(set(load.tally.errors))[:5],
                           "ended_during_run": ended_early}
    for k in SUMMARY_KEYS:
        out[k] = summarize(windows, k)
    return out


async def setup(srv: Server, mode: str, readers: int, ns: argparse.Namespace,
                steady_us: float | None) -> dict[str, Any]:
    gens = _generations(mode, ns)
    load = Load(srv.url, mode, generations=gens, readers=readers, per_connection=ns.per_connection,
                max_tokens=2, ramp=ns.ramp, seed=ns.seed + 1)
    before = srv.snapshot(0)
    try:
        await load.open()
        await load.wait_ended(ns.start_timeout + ns.ramp + 30)
    finally:
        await load.aclose()
    await asyncio.sleep(ns.settle)  # the server's own cleanup of those generations counts too
    after = srv.snapshot(load.tally.events)
    engine = None if after.engine_s is None or before.engine_s is None else after.engine_s - before.engine_s
    fig: dict[str, Any] = setup_figures(after.server_s - before.server_s, engine, after.client_s - before.client_s, gens,
                        load.tally.events, steady_us)
    fig["errors"] = len(load.tally.errors)
    fig["error_examples"] = sorted(set(load.tally.errors))[:5]
    return fig


def _generations(mode: str, ns: argparse.Namespace) -> int:
    return ns.streams if mode == "b" else ns.generations


async def measure_modes(srv: Server, ns: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ns.modes:
        runs = [("b1", 1), ("b", ns.readers)] if mode == "b" else [(mode, 1)]
        for key, readers in runs:
            print(f"{srv.kind} mode {key} ({MODE_NAMES[mode]}, {readers} reader(s)): steady…", file=sys.stderr)
            row: dict[str, Any] = {"mode": mode, "name": MODE_NAMES[mode], "readers": readers}
            try:
                st = await steady(srv, mode, readers, ns)
                su = await setup(srv, mode, readers, ns, median_of(st["server_us_per_event"]))
            except TimeoutError as exc:  # the server did not keep up (or failed): reported, the run goes on
                out[key] = {**row, "failed": str(exc)}
                print(f"  failed: {exc}", file=sys.stderr)
                await asyncio.sleep(ns.settle)
                continue
            out[key] = {**row, "steady": st, "setup": su}
            print(f"  {_brief(st)}", file=sys.stderr)
    return out


async def capacity(srv: Server, ns: argparse.Namespace, mode: str = "b", levels: list[int] | None = None,
                   interval: int = 1, on_level: LevelHook | None = None) -> dict[str, Any]:
    """Levels of ``levels`` (default ``--capacity-levels``) streams of ``mode``, ascending until one does not
    hold; ``interval``: the engine's tokens per event (its ``--stream-interval``). ``on_level`` runs beside each
    level's measured window (a profiler)."""
    threshold = ns.threshold_ms + hold_ms(interval, ns.tokens_per_s)
    done: list[dict[str, Any]] = []
    for streams in levels or ns.capacity_levels:
        row = await capacity_level(srv, ns, mode, streams, interval, on_level, threshold)
        done.append(row)
        if "error" in row:
            print(f"  {srv.kind} {MODE_NAMES[mode]} {streams} streams: {row['error']}", file=sys.stderr)
        else:
            print(f"  {srv.kind} {MODE_NAMES[mode]} {streams} streams: {row['tokens_per_s']:,.0f} tok/s, p99 "
                  f"{_fmt(row['delivery_ms']['p99'])} ms, errors {row['errors']}, CPU {_fmt(row['server_cpu_util'], 2)}"
                  f" -> {'held' if row['held'] else 'NOT held'}", file=sys.stderr)
        if not row["held"]:
            break
    return capacity_of(done, threshold)


LevelHook = Any  # (Server, mode, streams, seconds) -> a context manager around the measured window


async def capacity_level(srv: Server, ns: argparse.Namespace, mode: str, streams: int, interval: int = 1,
                         on_level: LevelHook | None = None, threshold_ms: float | None = None) -> dict[str, Any]:
    """One level: ``streams`` generations of ``mode`` (fan-out: one SSE reader each; ``/v1/ws``:
    ``--per-connection`` per socket), each event's delivery latency (receive - engine emit), CPU over the window."""
    load = Load(srv.url, mode, generations=streams, readers=1, per_connection=ns.per_connection,
                max_tokens=steady_tokens(ns), ramp=ns.ramp, timing=True, seed=ns.seed)
    offered = streams * ns.tokens_per_s  # tokens/s
    seconds = ns.window * ns.repeats
    base: dict[str, Any] = {"streams": streams, "mode": mode, "stream_interval": interval,
                            "offered_tokens_per_s": offered}
    try:
        await load.open()
        await load.wait_started(ns.start_timeout)
        await asyncio.sleep(ns.warmup)
        assert load.tally.latencies_ns is not None
        with on_level(srv, mode, streams, seconds) if on_level is not None else contextlib.nullcontext():
            load.tally.latencies_ns.clear()
            a = srv.snapshot(load.tally.events)
            await asyncio.sleep(seconds)
            b = srv.snapshot(load.tally.events)
            lat = np.array(load.tally.latencies_ns, dtype=np.float64) / 1e6
            errors = len(load.tally.errors)
    except TimeoutError as exc:
        await load.aclose()
        await asyncio.sleep(ns.settle)
        return {**base, "held": False, "error": str(exc)}
    await load.aclose()
    await asyncio.sleep(ns.settle)
    w = window(a, b)
    p99 = float(np.percentile(lat, 99)) if lat.size else None
    events_per_s = w["events_per_s"] or 0.0
    tokens_per_s = events_per_s * interval
    verdict = why_not_held(p99, errors, tokens_per_s, offered, ns.threshold_ms if threshold_ms is None else threshold_ms,
                           getattr(ns, "min_delivered", 0.95))
    dt = b.t - a.t
    return {**base, "events_per_s": events_per_s, "tokens_per_s": tokens_per_s,
            "delivery_ms": {"p50": float(np.percentile(lat, 50)) if lat.size else None,
                            "p90": float(np.percentile(lat, 90)) if lat.size else None, "p99": p99,
                            "max": float(lat.max()) if lat.size else None, "n": int(lat.size)},
            "errors": errors, "error_examples": sorted(set(load.tally.errors))[:3], "held": verdict is None,
            "why_not": verdict,
            "engine_cpu_util": w["engine_cpu_s"] / dt if w["engine_cpu_s"] is not None and dt > 0 else None,
            "tokens_per_server_core": tokens_per_core(tokens_per_s, w["server_cpu_util"]),
            **{k: w[k] for k in ("server_us_per_event", "engine_us_per_event", "client_us_per_event",
                                 "server_cpu_util", "client_cpu_util")}}


# -- the run -------------------------------------------------------------------------------------


def run(ns: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    out: Path = ns.out
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"meta": {**run_outputs.meta(["cpu", *argv], ns.seed), "settings": settings_of(ns)},
                               "gateway": {}, "raw": {}}
    runner = loop_runner()
    if ns.modes:
        for kind in ("gateway", "raw"):
            with spawned(kind, ns, out) as srv:
                results[kind] = runner(measure_modes(srv, ns))
        results["modes"] = compare(results["gateway"], results["raw"])
    if ns.capacity:
        results["capacity"] = {}
        for workers in ns.capacity_workers:
            with spawned("gateway", ns, out, workers) as srv:
                print(f"capacity, gateway --workers {workers}", file=sys.stderr)
                results["capacity"][f"workers={workers}"] = runner(capacity(srv, ns))
        with spawned("raw", ns, out) as srv:
            print("capacity, raw floor", file=sys.stderr)
            results["capacity"]["raw"] = runner(capacity(srv, ns))
    results["meta"]["load_end"] = run_outputs.load()
    run_outputs.write_json(out / "results.json", results)
    (out / "summary.md").write_text(summary_md(results))
    return results


def compare(gw: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """Per mode: the medians side by side and the gateway/raw ratio."""
    rows: dict[str, Any] = {}
    for key, g in gw.items():
        if "failed" in g:
            rows[key] = {"name": g["name"], "readers": g["readers"], "failed": g["failed"]}
            continue
        r = raw.get(key)
        gs, rs = g["steady"], (r or {}).get("steady", {})
        row = {"name": g["name"], "readers": g["readers"],
               "gateway_us_per_event": median_of(gs["server_us_per_event"]),
               "engine_us_per_event": median_of(gs["engine_us_per_event"]),
               "client_us_per_event": median_of(gs["client_us_per_event"]),
               "raw_us_per_event": median_of(rs.get("server_us_per_event")),
               "raw_client_us_per_event": median_of(rs.get("client_us_per_event")),
               "events_per_s": median_of(gs["events_per_s"]), "offered_events_per_s": gs["offered_events_per_s"],
               "errors": gs["errors"] + (rs.get("errors") or 0),
               "setup_us_per_generation": g["setup"]["server_us_per_generation"],
               "setup_us_per_generation_net": g["setup"]["server_us_per_generation_net"],
               "raw_setup_us_per_generation": (r or {}).get("setup", {}).get("server_us_per_generation")}
        row["ratio_to_raw"] = ratio(row["gateway_us_per_event"], row["raw_us_per_event"])
        rows[key] = row
    if all(k in gw and "failed" not in gw[k] for k in ("b", "b1")):
        rows["b"]["gateway_us_per_additional_reader"] = marginal_per_reader(gw["b1"]["steady"]["windows"],
                                                                            gw["b"]["steady"]["windows"])
        if all(k in raw and "failed" not in raw[k] for k in ("b", "b1")):
            rows["b"]["raw_us_per_additional_reader"] = marginal_per_reader(raw["b1"]["steady"]["windows"],
                                                                            raw["b"]["steady"]["windows"])
            rows["b"]["additional_reader_ratio_to_raw"] = ratio(rows["b"]["gateway_us_per_additional_reader"],
                                                                rows["b"]["raw_us_per_additional_reader"])
    return rows


def _fmt(x: float | None, nd: int = 1) -> str:
    return "–" if x is None else f"{x:,.{nd}f}"


def summary_md(results: dict[str, Any]) -> str:
    meta = results["meta"]
    m = meta["machine"]
    s = meta["settings"]
    lines = ["# tokenfan bench cpu", "", f"`{' '.join(meta['command'])}`", "",
             (f"{m['cpus']} CPUs ({m['cpu_model']}), {m['platform']}; load (1/5/15 min) {meta['load']} at start, "
             f"{meta.get('load_end', '–')} at end; {meta['time']}. {s['tokens_per_s']:g} tokens/s per generation, "
             f"{s.get('steps', 'per-stream')} engine steps; "
             f"medians over {s['repeats']} windows of {s['window']:g} s in steady state (after {s['warmup']:g} s); "
             "CPU µs per delivered event (user + system of the process tree)."), ""]
    if results.get("modes"):
        lines += [("| mode | readers | events/s (offered) | gateway µs/event | engine µs/event | raw floor µs/event "
                  "| gateway / raw | client µs/event (gateway / raw) | setup µs/generation (net; raw) | errors |"),
                  "|" + "---|" * 10]
        for key, r in results["modes"].items():
            if "failed" in r:
                lines.append(f"| {key} {r['name']} | {r['readers']} | failed: {r['failed'][:200]} |" + " |" * 7)
                continue
            lines.append(
                f"| {key} {r['name']} | {r['readers']} | {_fmt(r['events_per_s'], 0)} ({_fmt(r['offered_events_per_s'], 0)}) "
                f"| {_fmt(r['gateway_us_per_event'])} | {_fmt(r['engine_us_per_event'])} | {_fmt(r['raw_us_per_event'])} "
                f"| {_fmt(r['ratio_to_raw'], 2)}× | {_fmt(r['client_us_per_event'])} / {_fmt(r['raw_client_us_per_event'])} "
                f"| {_fmt(r['setup_us_per_generation'], 0)} ({_fmt(r['setup_us_per_generation_net'], 0)}; "
                f"{_fmt(r['raw_setup_us_per_generation'], 0)}) | {r['errors']} |")
        b = results["modes"].get("b", {})
        if "gateway_us_per_additional_reader" in b:
            lines += ["", (f"Fan-out, per additional reader: gateway {_fmt(b['gateway_us_per_additional_reader'])} µs, "
                          f"raw floor {_fmt(b.get('raw_us_per_additional_reader'))} µs "
                          f"({_fmt(b.get('additional_reader_ratio_to_raw'), 2)}×).")]
    if results.get("capacity"):
        lines += ["", (f"Capacity (fan-out SSE, one reader per stream; p99 delivery ≤ "
                      f"{s['threshold_ms']:g} ms, no errors, ≥ 95 % of offered delivered):"), "",
                  ("| server | capacity tok/s | at streams | levels: streams → tok/s, p99 ms, gateway µs/event, "
                  "client µs/event |"), "|---|---|---|---|"]
        for label, c in results["capacity"].items():
            lv = "; ".join(f"{x['streams']} → {_fmt(x.get('events_per_s'), 0)}, {_fmt((x.get('delivery_ms') or {}).get('p99'))}"
                           f", {_fmt(x.get('server_us_per_event'))}, {_fmt(x.get('client_us_per_event'))}"
                           f"{'' if x['held'] else ' ✗'}" for x in c["levels"])
            lines.append(f"| {label} | {_fmt(c['tokens_per_s'], 0)} | {c['streams'] or '–'} | {lv} |")
    return "\n".join(lines) + "\n"


def _brief(st: dict[str, Any]) -> str:
    return (f"{_fmt(median_of(st['events_per_s']), 0)} events/s, server {_fmt(median_of(st['server_us_per_event']))} "
            f"µs/event, engine {_fmt(median_of(st['engine_us_per_event']))}, client "
            f"{_fmt(median_of(st['client_us_per_event']))}, errors {st['errors']}")


def settings_of(ns: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()}


def loop_runner() -> Any:
    try:
        import uvloop

        return uvloop.run
    except ImportError:
        return asyncio.run


def _list(conv: Any) -> Any:
    return lambda s: [conv(x) for x in s.split(",") if x.strip()]


def _modes(s: str) -> list[str]:
    modes = [x.strip() for x in s.split(",") if x.strip()]
    if any(m not in MODES for m in modes):
        raise argparse.ArgumentTypeError(f"--modes takes some of {','.join(MODES)}; got {s!r}")
    return modes


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan bench cpu", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--modes", type=_modes, default=list(MODES),
                    help="a (POST SSE), b (fan-out), c (/v1/ws), d (Responses SSE); default a,b,c,d; '' for none")
    ap.add_argument("--generations", type=int, default=100, help="generations of modes a, c, d (default 100)")
    ap.add_argument("--streams", type=int, default=10, help="fan-out streams of mode b (default 10)")
    ap.add_argument("--readers", type=int, default=20, help="SSE readers per stream in mode b (default 20)")
    ap.add_argument("--per-connection", type=int, default=50, help="generations per /v1/ws socket (default 50)")
    ap.add_argument("--tokens-per-s", type=float, default=50.0, help="synthetic tokens/s per generation (50)")
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--steps", choices=("shared", "per-stream"), default="shared",
                    help="engine step clock (engine --synthetic-steps, same for the raw floor): `shared`, every "
                         "generation's token in one step as a GPU engine batches them (default); `per-stream`, "
                         "each generation on its own phase, so most steps carry one token (the worst case)")
    ap.add_argument("--ramp", type=float, default=2.0, help="seconds over which generations start")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds after every reader's first event")
    ap.add_argument("--window", type=float, default=4.0, help="seconds per measured window")
    ap.add_argument("--repeats", type=int, default=5, help="measured windows per mode (medians over them)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds after closing a load")
    ap.add_argument("--start-timeout", type=float, default=30.0, help="seconds for every reader's first event")
    ap.add_argument("--capacity", action="store_true", help="also measure capacity (see above)")
    ap.add_argument("--capacity-levels", type=_list(int), default=[25, 50, 100, 200, 300, 400, 600],
                    help="fan-out streams per capacity level, ascending (default 25,50,100,200,300,400,600)")
    ap.add_argument("--capacity-workers", type=_list(int), default=[1, 2],
                    help="gateway --workers values for capacity (default 1,2)")
    ap.add_argument("--threshold-ms", type=float, default=50.0, help="p99 delivery latency a level must hold")
    ap.add_argument("--gateway-arg", action="append", default=[], metavar="ARG", help="extra gateway argument")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="output directory (default bench-results/cpu-<time>)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser().parse_args(argv)
    ns.out = ns.out or Path("bench-results") / time.strftime("cpu-%Y%m%d-%H%M%S")
    results = run(ns, argv)
    print(summary_md(results))
    print(f"wrote {ns.out / 'results.json'} and {ns.out / 'summary.md'}", file=sys.stderr)
    return 0

