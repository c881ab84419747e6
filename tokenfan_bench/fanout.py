"""``tokenfan bench fanout``: one answer to thousands of subscribers, beside the raw floor of the same run.

For each level N (``--levels``) and each gateway worker count (``--workers-list``): a fresh synthetic engine
+ gateway (``--workers W``), ``--streams`` listed fan-out streams (``POST /v1/streams``) at
``--tokens-per-s``, and N subscribers of them (``--transport sse|ws|mix``, round-robin over the streams) spread
over ``--clients`` client processes (:mod:`tokenfan_bench.clients.fanout_client`: raw asyncio protocols
that parse every event, each process from its own loopback address). Once every subscriber has its
first event and ``--warmup`` s have passed, a ``--window`` s window is measured:

- **spread** of each event first received in the window: from the first subscriber's receipt to the last's
  (one monotonic clock for every process), p50 / p99 / max over the window's events;
- **CPU per delivery**: the gateway's CPU seconds (every process of its tree; the engine apart) over the
  deliveries received in the window;
- **RSS per subscriber**: the gateway's resident memory (every process) with the N subscribers connected,
  less its RSS before the first one connected, over N;
- the **client** processes' CPU use in the window (the busiest one's share of a core), so a client that was
  the bottleneck shows;
- the **longest stall of the gateway's event loop** (``loop_stall_s``: the lateness of its engine links' heartbeat
  ticks, ``/health``), up to the window's end;
- **garbage collections** of the gateway's and the engine's processes (``gc``, the bench's GC probe:
  :mod:`tokenfan_bench.stats.gc_probe`; ``--no-gc-probe`` turns it off): per phase (``subscribe``: from the
  first subscriber's connect to the last one's first event; ``window``; ``run``: the server's whole life), per
  generation the count and total time, and the largest collection. Its logs: ``DIR/logs/gc-<level>-<server>/``.

Then the streams are ended (``DELETE``) and every subscriber must have had every event from seq 0 to the
last, once and in order, then the end: counted (``delivery``). ``--slow F`` makes that fraction of the
subscribers stop reading (a tiny receive buffer, no reads until the end): they must not slow the others,
and the gateway cuts them after its ``--send-timeout`` (``--gateway-arg=--send-timeout=2``); counted apart.

The **raw floor** (:mod:`tokenfan_bench.servers.raw_floor`: one process writing the same bytes to every
socket in a loop) is measured the same way at every level, with the same client processes and the same
subscribers, in the same run. Output: ``DIR/results.json``, ``DIR/summary.md`` (printed too) and
``DIR/spread_vs_n.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import resource
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from tokenfan_bench.cpu.gateway_cost import ProcCpu
from tokenfan_bench.report import run_outputs
from tokenfan_bench.servers import processes
from tokenfan_bench.stats import gc_probe
from tokenfan_bench.stats.spread import delivery, merge, window_spread

MAX_TOKENS = 4000  # per stream: longer than any level takes (DELETE ends it); the gateway's cap is raised to it
FDS_PER_SUBSCRIBER = 1  # one socket each, in the client and in the server
FD_SLACK = 512  # a server's other descriptors


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan bench fanout", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--levels", type=_ints, default=[1000, 2000, 5000, 10000],
                    help="subscribers per run, e.g. 1000,2000,5000,10000,20000 (default up to 10000)")
    ap.add_argument("--workers-list", type=_ints, default=[1, 2], help="gateway --workers values (default 1,2)")
    ap.add_argument("--streams", type=int, default=1, help="listed streams the subscribers share (default 1)")
    ap.add_argument("--transport", choices=("sse", "ws", "mix"), default="mix",
                    help="what each subscriber uses (mix: every other one WebSocket; default)")
    ap.add_argument("--tokens-per-s", type=float, default=5.0, help="synthetic tokens/s per stream (default 5)")
    ap.add_argument("--token-chars", type=int, default=0,
                    help="synthetic tokens of N characters (default 0: natural words)")
    ap.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    ap.add_argument("--client-nice", type=int, default=0,
                    help="niceness of the client processes (negative, as root: they read before the servers write on)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds between the last first event and the window")
    ap.add_argument("--window", type=float, default=20.0, help="seconds measured (default 20)")
    ap.add_argument("--slow", type=float, default=0.0, help="fraction of subscribers that stop reading (e.g. 0.01)")
    ap.add_argument("--no-raw", action="store_true", help="skip the raw floor")
    ap.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for the spawned gateways, e.g. --gateway-arg=--send-timeout=2")
    ap.add_argument("--no-gc-probe", action="store_true", help="do not time the servers' garbage collections")
    ap.add_argument("--ready-timeout", type=float, default=180.0, help="seconds for every subscriber's first event")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default bench-results/fanout-<time>)")
    return ap


# -- processes ------------------------------------------------------------------------------------------


def raise_nofile(subscribers: int) -> int:
    """Lift this process's RLIMIT_NOFILE (inherited by the servers and clients it starts) to fit
    ``subscribers`` connections; the limit it got (the hard limit if it could not raise that: not root)."""
    need = subscribers * FDS_PER_SUBSCRIBER + FD_SLACK
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return soft
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, max(hard, need)))
        return need
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    root = psutil.Process(pid)
    total = 0
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


@dataclass
class Target:
    kind: str  # "gateway" | "raw"
    workers: int
    url: str
    pid: int  # the server's process (its tree: every worker)

    @property
    def name(self) -> str:
        return "raw floor" if self.kind == "raw" else f"gateway --workers {self.workers}"


@contextlib.contextmanager
def spawned(kind: str, workers: int, ns: argparse.Namespace, out: Path, level: int,
            gc_dir: Path | None = None) -> Iterator[Target]:
    if kind == "raw":
        with processes.spawn_raw(ns.tokens_per_s, 20.0, out / "logs") as raw:
            yield Target("raw", 1, raw.url, raw.server_pid)
        return
    gw_args = ["--max-tokens-cap", str(MAX_TOKENS), "--max-subscribers", str(max(10_000, level + 100)),
               *(["--workers", str(workers)] if workers > 1 else []), *ns.gateway_arg]
    engine_args = ["--max-model-len", "1000000",
                   *(["--synthetic-token-chars", str(ns.token_chars)] if ns.token_chars else [])]
    env = gc_probe.env(gc_dir) if gc_dir is not None else None
    with processes.spawn_synthetic(ns.tokens_per_s, 20.0, out / "logs", gw_args, engine_args=engine_args,
                                   env=env) as s:
        if workers > 1:  # every worker listens once its engine link is up: /health says so
            processes.wait_healthy(s.url, s.procs, 60.0)
        yield Target("gateway", workers, s.url, s.server_pid)


def create_streams(url: str, n: int) -> list[str]:
    body = {"messages": [{"role": "user", "content": "Tell the crowd a long story."}], "max_tokens": MAX_TOKENS}
    ids = []
    for _ in range(n):
        r = httpx.post(url + "/v1/streams", json=body, timeout=10.0, trust_env=False)
        r.raise_for_status()
        ids.append(r.json()["id"])
    return ids


def readers_cut(url: str) -> int | None:
    """The gateway's ``tokenfan_readers_cut_total`` (every worker's: ``/metrics`` merges them); None for the
    raw floor, which cuts nobody."""
    try:
        text = httpx.get(url + "/metrics", timeout=10.0, trust_env=False).text
    except httpx.HTTPError:
        return None
    rows = [ln for ln in text.splitlines() if ln.startswith("tokenfan_readers_cut_total{")]
    return int(sum(float(ln.rsplit(" ", 1)[1]) for ln in rows)) if rows else None


def loop_stall(url: str) -> float | None:
    """The longest stall of the gateway's event loop its engine links saw so far (``/health`` ``engines[]``
    ``longest_loop_stall_s``; with ``--workers``, the worker that answered); None for the raw floor."""
    try:
        engines = httpx.get(url + "/health", timeout=10.0, trust_env=False).json().get("engines") or []
    except (httpx.HTTPError, ValueError):
        return None
    stalls = [e["longest_loop_stall_s"] for e in engines if e.get("longest_loop_stall_s") is not None]
    return max(stalls) if stalls else None


def end_streams(url: str, ids: list[str]) -> None:
    for sid in ids:
        with contextlib.suppress(httpx.HTTPError):
            httpx.delete(f"{url}/v1/streams/{sid}", timeout=10.0, trust_env=False)


def subscriber_plan(n: int, streams: int, transport: str, slow: float) -> list[tuple[int, str, bool]]:
    """``(stream index, transport, slow)`` of each of ``n`` subscribers: round-robin over the streams; with
    ``mix`` every other one of a stream WebSocket; every ``1/slow``-th one of a stream slow, on either
    transport in turn."""
    every = round(1 / slow) if slow > 0 else 0
    plan = []
    for i in range(n):
        j = i // streams  # its place among its stream's subscribers
        kind = transport if transport != "mix" else ("ws" if j % 2 else "sse")
        plan.append((i % streams, kind, bool(every) and j % every == (every // 2 + j // every) % every))
    return plan


class Clients:
    """The client processes of one run (:func:`tokenfan_bench.clients.fanout_client.serve`)."""

    def __init__(self, count: int, nice: int = 0) -> None:
        from tokenfan_bench.clients.fanout_client import serve

        ctx = multiprocessing.get_context("spawn")
        self.pipes = []
        self.procs = []
        for _ in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(child, nice), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def cpu(self) -> list[float]:
        out = []
        for p in self.procs:
            try:
                t = psutil.Process(p.pid).cpu_times()
                out.append(t.user + t.system)
            except psutil.Error:
                out.append(0.0)
        return out

    def open(self, host: str, port: int, ids: list[str], subs: list[tuple[int, str, bool]],
             timeout: float) -> list[dict[str, Any]]:
        for k, pipe in enumerate(self.pipes):
            pipe.send(("open", {"host": host, "port": port, "streams": ids, "source": f"127.0.0.{k + 2}",
                                "subs": subs[k::len(self.pipes)]}))
        return [self._answer(pipe, "ready", timeout) for pipe in self.pipes]

    def end(self, timeout: float) -> list[dict[str, Any]]:
        for pipe in self.pipes:
            pipe.send(("end", timeout))
        return [self._answer(pipe, "result", timeout + 30.0) for pipe in self.pipes]

    @staticmethod
    def _answer(pipe: Any, kind: str, timeout: float) -> dict[str, Any]:
        if not pipe.poll(timeout):
            raise TimeoutError(f"a client process did not answer {kind!r} within {timeout:g}s")
        got, value = pipe.recv()
        assert got == kind, (got, kind)
        return value  # type: ignore[no-any-return]

    def close(self) -> None:
        for p in self.procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()


# -- one run -------------------------------------------------------------------------------------------


def measure(target: Target, ns: argparse.Namespace, n: int) -> dict[str, Any]:
    """One level on one server: subscribe, measure the window, end, check every delivery."""
    host, port = target.url.split("//")[1].rsplit(":", 1)
    rss0 = tree_rss(target.pid)
    subs = subscriber_plan(n, ns.streams, ns.transport, ns.slow)
    clients = Clients(ns.clients, ns.client_nice)
    try:
        cut0 = readers_cut(target.url)
        ids = create_streams(target.url, ns.streams)
        t_open = time.monotonic()
        ready = clients.open(host, int(port), ids, subs, ns.ready_timeout)
        t_ready = time.monotonic()
        opened_s = t_ready - t_open
        failed = sum(r["failed"] for r in ready)
        time.sleep(ns.warmup)
        server, client_cpu = ProcCpu(target.pid), clients.cpu()
        cpu0, t0 = server.seconds(), time.monotonic_ns()
        time.sleep(ns.window)
        cpu1, t1 = server.seconds(), time.monotonic_ns()
        client_cpu = [b - a for a, b in zip(client_cpu, clients.cpu(), strict=True)]
        rss1 = tree_rss(target.pid)
        cut1 = readers_cut(target.url)
        stall = loop_stall(target.url) if target.kind == "gateway" else None
        end_streams(target.url, ids)
        results = clients.end(30.0)
    finally:
        clients.close()
    per_stream = [merge([r["tallies"][k] for r in results]) for k in range(len(ids))]
    events = {k: (max(t) + 1 if t else 0) for k, t in enumerate(per_stream)}
    outcomes = [row for r in results for row in r["outcomes"]]
    fast_per_stream = [sum(1 for s in subs if s[0] == k and not s[2]) for k in range(len(ids))]
    spreads = [window_spread(t, t0, t1, fast_per_stream[k]) for k, t in enumerate(per_stream)]
    deliveries = sum(s["deliveries"] for s in spreads)
    window_s = (t1 - t0) / 1e9
    return {
        "server": target.name, "kind": target.kind, "workers": target.workers, "subscribers": n,
        "streams": len(ids), "transport": ns.transport, "subscribe_s": round(opened_s, 2), "failed_to_subscribe": failed,
        "spread_ms": _pooled(spreads), "spread_per_stream": spreads,
        "window_s": window_s, "deliveries": deliveries,
        "cpu_s": cpu1 - cpu0, "cpu_util": (cpu1 - cpu0) / window_s,
        "cpu_us_per_delivery": (cpu1 - cpu0) / deliveries * 1e6 if deliveries else None,
        "rss_before_mb": rss0 / 2**20, "rss_mb": rss1 / 2**20, "rss_kb_per_subscriber": (rss1 - rss0) / 1024 / n,
        "client_cpu_util_max": max(client_cpu) / window_s if client_cpu else None,
        "delivery": delivery(outcomes, events),
        # readers the gateway cut as too slow before the end (a slow subscriber reads again only after it, by
        # when a cut connection may have been reset: its client then sees no slow_consumer notice)
        "readers_cut": None if cut0 is None or cut1 is None else cut1 - cut0,
        "phases": {"subscribe": (t_open, t_ready), "window": (t0 / 1e9, t1 / 1e9)},
        "loop_stall_s": stall,
    }


def _pooled(spreads: list[dict[str, Any]]) -> dict[str, Any]:
    """The streams' spreads together: the worst stream's percentiles (each stream is its own crowd)."""
    def worst(key: str) -> float | None:
        vals = [s[key] for s in spreads if s[key] is not None]
        return max(vals) if vals else None

    return {"events": sum(s["events"] for s in spreads), "complete": sum(s["complete"] for s in spreads),
            "p50_ms": worst("p50_ms"), "p99_ms": worst("p99_ms"), "max_ms": worst("max_ms")}


# -- the whole bench -----------------------------------------------------------------------------------


def run(ns: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    out: Path = ns.out or Path("bench-results") / time.strftime("fanout-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    nofile = raise_nofile(max(ns.levels))
    results: dict[str, Any] = {"meta": {**run_outputs.meta(["fanout", *argv], 0), "rlimit_nofile": nofile},
                               "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(ns).items()},
                               "runs": []}
    servers = [("gateway", w) for w in ns.workers_list] + ([] if ns.no_raw else [("raw", 1)])
    for n in ns.levels:
        for kind, workers in servers:
            if -(-n // workers) + FD_SLACK > nofile:  # the kernel spreads the connections over the workers
                name = Target(kind, workers, "", 0).name
                print(f"fanout: {name} N={n} skipped: {n} connections need more than RLIMIT_NOFILE {nofile} "
                      f"in one process", file=sys.stderr)
                results["runs"].append({"server": name, "subscribers": n, "skipped": f"RLIMIT_NOFILE {nofile}"})
                continue
            gc_dir = None if ns.no_gc_probe or kind == "raw" else out / "logs" / f"gc-{n}-{kind}-{workers}"
            t_start = time.monotonic()
            with spawned(kind, workers, ns, out, n, gc_dir) as target:
                row = measure(target, ns, n)
            if gc_dir is not None:
                row["gc"] = gc_probe.summary(gc_dir, {**row["phases"], "run": (t_start, time.monotonic())})
            results["runs"].append(row)
            print(f"fanout: {brief(row)}", file=sys.stderr)
            run_outputs.write_json(out / "results.json", results)
    (out / "summary.md").write_text(summary_md(results))
    plot(results, out / "spread_vs_n.png")
    run_outputs.write_json(out / "results.json", results)
    results["out"] = str(out)
    return results


def brief(r: dict[str, Any]) -> str:
    s, d = r["spread_ms"], r["delivery"]
    return (f"{r['server']} N={r['subscribers']}: spread p50/p99/max {_ms(s['p50_ms'])}/{_ms(s['p99_ms'])}/"
            f"{_ms(s['max_ms'])} ms over {s['events']} events; {d['complete']}/{d['subscribers']} complete; "
            f"{_f(r['cpu_us_per_delivery'])} µs CPU/delivery; {r['rss_kb_per_subscriber']:.1f} KB/subscriber"
            + (f"; longest loop stall {r['loop_stall_s']:.2f} s" if r.get("loop_stall_s") is not None else "")
            + "".join(f"; gateway GC {phase}: {gc_brief(r, phase)}" for phase in ("subscribe", "window")
                      if r.get("gc", {}).get("gateway")))


def gc_brief(r: dict[str, Any], phase: str) -> str:
    """The gateway's full collections in ``phase`` and its largest collection there, e.g. ``2 full, 140 ms
    in all, largest 96.0 ms (gen 2)``."""
    ph = r["gc"]["gateway"][phase]
    full, top = ph["generations"][2], ph["largest"]
    return (f"{full['count']} full, {full['total_ms']:.0f} ms in all, largest "
            + ("-" if top is None else f"{top['ms']:.1f} ms (gen {top['gen']})"))


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def summary_md(results: dict[str, Any]) -> str:
    m, st = results["meta"], results["settings"]
    lines = [
        "# tokenfan bench fanout", "",
        (f"`{' '.join(m['command'])}` · {m['time']} · {m['machine']['cpus']} CPUs ({m['machine']['cpu_model']}) · "
        f"load at start {m['load']} · RLIMIT_NOFILE {m['rlimit_nofile']}"), "",
        f"{st['streams']} stream(s) at {st['tokens_per_s']:g} tokens/s, {st['transport']} subscribers over "
        f"{st['clients']} client processes, window {st['window']:g} s"
        + (f", {st['slow'] * 100:g} % slow subscribers" if st["slow"] else "") + ".", "",
        ("| server | N | spread p50 / p99 / max (ms) | events | delivered (complete subscribers) | "
        "CPU µs / delivery | × floor | server CPU | RSS KB / subscriber | busiest client | slow: cut by the gateway / done |"),
        "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    floors = {r["subscribers"]: r for r in results["runs"] if r.get("kind") == "raw"}
    for r in results["runs"]:
        if "skipped" in r:
            lines.append(f"| {r.get('server', '–')} | {r['subscribers']} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        s, d = r["spread_ms"], r["delivery"]
        floor = floors.get(r["subscribers"])
        x = (r["cpu_us_per_delivery"] / floor["cpu_us_per_delivery"]
             if floor and floor["cpu_us_per_delivery"] and r["cpu_us_per_delivery"] else None)
        slow = d["slow"]
        lines.append(
            f"| {r['server']} | {r['subscribers']} | {_ms(s['p50_ms'])} / {_ms(s['p99_ms'])} / {_ms(s['max_ms'])} | "
            f"{s['events']} | {d['delivered_events']:,} of {d['expected_events']:,} ({d['complete']}/{d['subscribers']}) | "
            f"{_f(r['cpu_us_per_delivery'])} | {_f(x)} | {r['cpu_util'] * 100:.0f} % | {r['rss_kb_per_subscriber']:.1f} | "
            f"{_f((r['client_cpu_util_max'] or 0) * 100, 0)} % | "
            + (f"{r['readers_cut'] if r['readers_cut'] is not None else '–'} / {slow['done']} of "
               f"{slow['subscribers']}" if slow["subscribers"] else "–") + " |")
    lines += gc_table(results["runs"])
    bad = [r for r in results["runs"] if "delivery" in r and r["delivery"]["incomplete"]]
    for r in bad:
        lines += ["", (f"**{r['server']} N={r['subscribers']}: {r['delivery']['incomplete']} subscribers incomplete**, "
                  f"e.g. {r['delivery']['incomplete_examples'][:2]}")]
    lines += ["", ("Spread: from the first subscriber's receipt of an event to the last's, over the events first "
              "received in the window (the worst stream's, with several). CPU: every process of the server "
              "(the engine apart), per delivery received in the window. RSS: the server's processes with the "
              "subscribers connected, less before, per subscriber. The raw floor is one process whatever the "
              "gateway's worker count."), ""]
    return "\n".join(lines)


def gc_table(runs: list[dict[str, Any]]) -> list[str]:
    """The GC probe's figures of each run: full collections (count, total) and the largest collection, per
    phase, for the gateway's processes and the engine's."""
    rows = [r for r in runs if r.get("gc")]
    if not rows:
        return []
    out = ["", ("Garbage collections (the bench's GC probe): full collections, their total and the largest "
                "collection of any generation, per phase."), "",
           "| server | N | process | subscribe: full / ms / largest ms | window: full / ms / largest ms |",
           "|---|---:|---|---|---|"]
    for r in rows:
        for who in ("gateway", "engine"):
            if who not in r["gc"]:
                continue
            cells = []
            for phase in ("subscribe", "window"):
                ph = r["gc"][who][phase]
                full, top = ph["generations"][2], ph["largest"]
                cells.append(f"{full['count']} / {full['total_ms']:.0f} / " + ("-" if top is None else
                                                                                 f"{top['ms']:.1f} (gen {top['gen']})"))
            out.append(f"| {r['server']} | {r['subscribers']} | {who} | {cells[0]} | {cells[1]} |")
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[int, float, float]]] = {}
    for r in results["runs"]:
        if "skipped" in r or r["spread_ms"]["p99_ms"] is None:
            continue
        series.setdefault(r["server"], []).append((r["subscribers"], r["spread_ms"]["p99_ms"], r["spread_ms"]["p50_ms"]))
    for name, pts in sorted(series.items()):
        pts.sort()
        line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{name} p99")[0]
        ax.plot([p[0] for p in pts], [p[2] for p in pts], marker=".", linestyle=":", color=line.get_color(),
                label=f"{name} p50")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("subscribers of one stream (N)")
    ax.set_ylabel("spread, first to last receipt (ms)")
    ax.set_title("fan-out spread vs subscribers")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser().parse_args(argv)
    results = run(ns, argv)
    print((Path(results["out"]) / "summary.md").read_text())
    print(f"wrote {results['out']}/results.json, summary.md and spread_vs_n.png", file=sys.stderr)
    incomplete = [r for r in results["runs"] if "delivery" in r and (r["delivery"]["incomplete"] or r["failed_to_subscribe"])]
    return 1 if incomplete else 0
