"""``tokenfan bench failover``: the gap a client sees when an engine or a gateway dies mid-stream.

Three scenarios, real processes, one run each (or all):

- ``engine``: two engines behind one gateway (synthetic, or vLLM with ``--model``); N chat completions as
  listed streams (``POST /v1/streams``, each read over SSE); the engine serving about half of them is killed
  with SIGKILL. Every stream continues on the other engine (docs/failures.md, migration). The gap of a
  migrated stream, at the client: its event before the first that says ``"migrated": true`` (in its
  ``tokenfan`` object) to that one; the streams of the engine that lived have none.
- ``gateway``: two gateway replicas sharing a ``redis-server`` (``--broker``), one synthetic engine; N fan-out
  streams created on replica A, one SSE reader each on B; A is killed with SIGKILL. B adopts them. The gap:
  each reader's last event before the kill to its first after.
- ``workers``: ``tokenfan serve --workers 2`` on a synthetic engine, no broker; N fan-out streams created on
  worker 0, one SSE reader each on worker 1 (its private socket); worker 0 is killed with SIGKILL. Worker 1
  adopts them from its standby mirrors. The gap as for ``gateway``.

``--kind`` picks the requests (comma-separated; the streams are shared out among them): ``plain`` (text),
``tools`` (tool calls: a script with Hermes ``<tool_call>`` blocks on synthetic engines, ``tool_choice:
"required"`` on vLLM), ``reasoning`` (a ``<think>`` section, then the answer), ``json`` (a JSON schema),
``logprobs`` (logprobs with presence and frequency penalties) and ``n2`` (two sampled choices). ``tools`` and
``reasoning`` alone run on scripted synthetic engines (vLLM's OpenAI layer and its ``hermes`` and ``qwen3``
parsers over the tiny model's tokenizer); ``json``, ``logprobs`` and ``n2`` need a model: vLLM on ``--model``
(default: the tiny random-weight Llama, built locally), with the same parsers.

Every stream must end normally (``[DONE]``, no error event); the JSON holds each gap and the summary their
median, p90 and max per scenario and kind, with the hardware and the exact command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tokenfan_bench.servers.processes import Proc, children, free_port, spawn, stop_all, wait_healthy

KINDS = ("plain", "tools", "reasoning", "json", "logprobs", "n2")
MODEL_KINDS = {"json", "logprobs", "n2"}  # what only a model writes
PARSERS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TOOL_CALLS = "".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "city number {k}", "note": '
                     f'"a long argument that arrives in pieces"}}}}\n</tool_call>' for k in range(6))
THOUGHT = "<think>" + "".join(f"step {k} of the thought. " for k in range(60)) + "</think>The answer."
SCRIPT = [  # the scripted engine's replies, a few characters per engine step (the first match answers)
    {"match": "weather", "reply": [TOOL_CALLS[k:k + 4] for k in range(0, len(TOOL_CALLS), 4)]},
    {"match": "think", "reply": [THOUGHT[k:k + 4] for k in range(0, len(THOUGHT), 4)]},
    {"match": "river", "reply": [f" word {k}" for k in range(400)]},
]


def body(kind: str, i: int, tokens: int, vllm: bool) -> dict[str, Any]:
    """The chat request of stream ``i`` of ``kind``."""
    base: dict[str, Any] = {"messages": [{"role": "user", "content": f"river {i}"}], "max_tokens": tokens,
                            "temperature": 0, "stream": True}
    if kind == "tools":
        base["messages"][0]["content"] = f"What is the weather, {i}?"
        base["tools"] = TOOLS
        if vllm:
            # `required`, not a named call: the tiny random model ends a named call within ~50 tokens (its
            # arguments may be null under vLLM's hermes structural tag), before the kill; `required` writes calls
            # until max_tokens
            base.update(tool_choice="required", **NO_THINKING)
    elif kind == "reasoning":
        base["messages"][0]["content"] = f"think about river {i}"
    elif kind == "json":
        base.update(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {
            "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"]}}}, **NO_THINKING)
    elif kind == "logprobs":
        base.update(logprobs=True, top_logprobs=2, presence_penalty=0.5, frequency_penalty=0.5, **NO_THINKING)
    elif kind == "n2":
        base.update(n=2, temperature=1.0, seed=i, **NO_THINKING)
    return base


def engine_backend(args: argparse.Namespace, tmp: Path) -> tuple[list[str], bool]:
    """The engine flags for the kinds asked for, and whether they run vLLM."""
    kinds = set(args.kinds)
    if args.model is None and not kinds & MODEL_KINDS and kinds <= {"plain"}:
        return ["--engine", "synthetic", "--synthetic-tokens-per-s", str(args.tokens_per_s)], False
    from engine_worker.models import build_tiny_llama

    model = args.model or build_tiny_llama(tmp / "tiny-llama")
    if args.model is None and not kinds & MODEL_KINDS:
        script = tmp / "script.json"
        script.write_text(json.dumps(SCRIPT))
        return ["--engine", "synthetic", "--synthetic-tokens-per-s", str(args.tokens_per_s), "--synthetic-script",
                str(script), "--model", str(model), *PARSERS], False
    return ["--engine", "vllm", "--model", str(model), "--max-model-len", "1024", *PARSERS,
            "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'], True


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan bench failover", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=("engine", "gateway", "workers", "all"), default="all")
    ap.add_argument("--streams", type=int, default=16, help="concurrent streams")
    ap.add_argument("--tokens", type=int, default=120, help="max_tokens of each stream")
    ap.add_argument("--tokens-per-s", type=float, default=20.0, help="synthetic engine pace per stream")
    ap.add_argument("--model", type=Path, default=None,
                    help="engines on vLLM with this model directory (default: synthetic engines; the tiny model "
                         "for the kinds that need one)")
    ap.add_argument("--kind", default="plain",
                    help=f"request kinds, comma-separated, or all: {', '.join(KINDS)} (default: plain)")
    ap.add_argument("--out", type=Path, default=Path("bench-results/failover"))
    return ap


@dataclass
class Stream:
    """What the client saw of one stream: when each output event arrived, and which of them (an index into
    ``arrivals``) was the first after its generation moved to another engine (``tokenfan.migrated``)."""

    arrivals: list[float] = field(default_factory=list)
    migrated_at: int | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)


async def _read(c: httpx.AsyncClient, url: str, s: Stream) -> bool:
    """Read one listed stream's SSE events, stamping each content event; True if it ended normally
    (``[DONE]``)."""
    async with c.stream("GET", url) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return True
            if line.startswith("event: error"):
                return False
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            moved = bool((chunk.get("tokenfan") or {}).get("migrated"))
            if moved or _carries_output(chunk):
                if moved and s.migrated_at is None:
                    s.migrated_at = len(s.arrivals)
                s.arrivals.append(time.monotonic())
                if len(s.arrivals) == 3:
                    s.started.set()
    return False


def _carries_output(chunk: dict[str, Any]) -> bool:
    """A chunk with content, reasoning or a tool call's part (not the role chunk, not the usage chunk)."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning") or delta.get("tool_calls"):
            return True
    return False


def _listed(args: argparse.Namespace, vllm: bool, create: str, read: str) -> Any:
    """``make`` for :func:`_drive`: stream ``i`` created on the gateway at ``create``, read at ``read``."""
    async def make(c: httpx.AsyncClient, i: int, s: Stream) -> Any:
        r = await c.post(create + "/v1/streams", json=body(kind_of(args, i), i, args.tokens, vllm))
        r.raise_for_status()
        return _read(c, f"{read}/v1/streams/{r.json()['id']}/events", s)

    return make


def _gap(s: Stream, killed: float, migrated_only: bool) -> float | None:
    """The stream's gap: ``migrated_only``, the event before its first after a migration to that event
    (None if it never moved: its engine lived); else the last arrival before the kill to the first after
    (None if it ended before the kill)."""
    if migrated_only:
        k = s.migrated_at
        return s.arrivals[k] - s.arrivals[k - 1] if k else None
    before = [t for t in s.arrivals if t <= killed]
    after = [t for t in s.arrivals if t > killed]
    return after[0] - before[-1] if before and after else None


async def _drive(streams: int, make: Any, victim: int, transport: httpx.AsyncBaseTransport | None = None
                 ) -> tuple[list[bool], list[Stream], float]:
    """Open the streams (``make(client, i, stream)``), SIGKILL the process group ``victim`` once each has
    tokens."""
    seen = [Stream() for _ in range(streams)]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams + 4),
                                 transport=transport) as c:
        jobs = asyncio.gather(*[await make(c, i, seen[i]) for i in range(streams)])
        for s in seen:
            await s.started.wait()
        killed = time.monotonic()
        os.killpg(victim, signal.SIGKILL)  # its process group (vLLM's EngineCore too), as a container dies
        ended = await jobs
    return list(ended), seen, killed


def _engine(args: argparse.Namespace, tmp: Path, logs: Path) -> dict[str, Any]:
    addresses = [f"ipc://{tmp / f'e{k}.sock'}" for k in range(2)]
    backend, vllm = engine_backend(args, tmp)
    engines = [spawn(["-m", "engine_worker", "--engine-address", a, *backend, "--log-level", "warning"],
                     logs / f"engine-{k}.log") for k, a in enumerate(addresses)]
    port = free_port()
    gateway = spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", ",".join(addresses), "--port", str(port),
                     "--heartbeat-timeout", "30", "--max-generations-per-client", "0", "--log-level", "warning"],
                    logs / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [gateway, *engines], 600)
        while not all(e["healthy"] for e in httpx.get(url + "/health").json()["engines"]):
            time.sleep(0.2)

        ended, seen, killed = asyncio.run(_drive(args.streams, _listed(args, vllm, url, url), engines[0].pid))
        metrics = httpx.get(url + "/metrics").text
    finally:
        stop_all([gateway, *engines])
    return _result(args, "engine", "vllm" if vllm else "synthetic", ended, seen, killed,
                   migrations=[line for line in metrics.splitlines() if line.startswith("tokenfan_migrations_total")])


def _gateway(args: argparse.Namespace, tmp: Path, logs: Path) -> dict[str, Any]:
    redis_port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(tmp)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    address = f"ipc://{tmp / 'g.sock'}"
    backend, vllm = engine_backend(args, tmp)
    engine = spawn(["-m", "engine_worker", "--engine-address", address, *backend, "--log-level", "warning"],
                   logs / "engine.log")
    gateways: list[Proc] = []
    urls = []
    try:
        for k in "ab":
            port = free_port()
            gateways.append(spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", address, "--port", str(port),
                                   "--broker", f"redis://127.0.0.1:{redis_port}/0", "--max-generations-per-client",
                                   "0", "--max-subscriptions-per-client", "0", "--log-level", "warning"],
                                  logs / f"gateway-{k}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        for u, g in zip(urls, gateways, strict=True):
            wait_healthy(u, [g, engine], 600)

        ended, seen, killed = asyncio.run(_drive(args.streams, _listed(args, vllm, *urls), gateways[0].pid))
        metrics = httpx.get(urls[1] + "/metrics").text
    finally:
        stop_all([*gateways, engine])
        redis.terminate()
        redis.wait(10)
    return _result(args, "gateway", "vllm" if vllm else "synthetic", ended, seen, killed,
                   adoptions=[line for line in metrics.splitlines() if line.startswith("tokenfan_adoptions_total")])


def _workers(args: argparse.Namespace, tmp: Path, logs: Path) -> dict[str, Any]:
    from gateway.scaleout.workers import WORKER_INDEX_ENV, worker_socket

    port = free_port()
    backend, vllm = engine_backend(args, tmp)
    server = spawn(["-m", "tokenfan.cli", "serve", *backend, "--workers", "2", "--port", str(port), "--max-generations-per-client",
                    "0", "--max-subscriptions-per-client", "0", "--log-level", "warning"], logs / "serve-workers.log")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [server], 600)
        while httpx.get(f"http://127.0.0.1:{port}/health").json()["workers"]["ready"] < 2:  # both, not the first
            time.sleep(0.05)
        worker0 = next(c.pid for c in children(server.pid) if c.has_env(WORKER_INDEX_ENV, "0"))
        owner, reader = (httpx.AsyncHTTPTransport(uds=str(worker_socket(port, k))) for k in (0, 1))

        async def make(c: httpx.AsyncClient, i: int, s: Stream) -> Any:
            async with httpx.AsyncClient(transport=owner) as w0:
                r = await w0.post("http://worker/v1/streams", json=body(kind_of(args, i), i, args.tokens, vllm))
                r.raise_for_status()
            return _read(c, f"http://worker/v1/streams/{r.json()['id']}/events", s)

        ended, seen, killed = asyncio.run(_drive(args.streams, make, worker0, reader))
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(worker_socket(port, 1)))) as c:
            metrics = c.get("http://worker/metrics").text
    finally:
        stop_all([server])
    return _result(args, "workers", "vllm" if vllm else "synthetic", ended, seen, killed,
                   adoptions=[line for line in metrics.splitlines() if line.startswith("tokenfan_adoptions_total")])


def kind_of(args: argparse.Namespace, i: int) -> str:
    """The kind of stream ``i``: the kinds take turns by pairs of streams, since the gateway places
    consecutive streams on alternate engines (turns of one put every other kind on the killed engine
    alone, and no stream of the rest there)."""
    return str(args.kinds[(i // 2) % len(args.kinds)])


def _result(args: argparse.Namespace, scenario: str, backend: str, ended: list[bool], seen: list[Stream],
            killed: float, **counters: list[str]) -> dict[str, Any]:
    kinds = {}
    for kind in args.kinds:
        mine = [i for i in range(args.streams) if kind_of(args, i) == kind]
        kinds[kind] = {"streams": len(mine), "ended_normally": sum(ended[i] for i in mine),
                       "gaps_s": [g for i in mine if (g := _gap(seen[i], killed, scenario == "engine")) is not None]}
    return {"scenario": scenario, "backend": backend, "streams": args.streams, "ended_normally": sum(ended),
            "kinds": kinds, **counters}


def _summary(results: list[dict[str, Any]], command: str) -> str:
    lines = ["# tokenfan bench failover", "", f"`{command}`", "",
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             "", "| scenario | kind | backend | streams | ended normally | gaps measured | gap median | p90 | max |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for kind, k in r["kinds"].items():
            g = np.array(k["gaps_s"]) * 1000
            stats = (f"{np.median(g):.0f} ms | {np.percentile(g, 90):.0f} ms | {g.max():.0f} ms" if len(g)
                     else "- | - | -")
            lines.append(f"| {r['scenario']} | {kind} | {r['backend']} | {k['streams']} | {k['ended_normally']} | "
                         f"{len(g)} | {stats} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    args.kinds = list(KINDS) if args.kind == "all" else [k.strip() for k in args.kind.split(",") if k.strip()]
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown or not args.kinds:
        print(f"--kind: unknown {', '.join(unknown) or '(none)'}; choose from {', '.join(KINDS)} or all",
              file=sys.stderr)
        return 2
    if args.scenario in ("gateway", "all") and shutil.which("redis-server") is None:
        print("the gateway scenario needs redis-server (make test-deps installs it)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="tokenfan-failover-") as d:
        tmp = Path(d)
        if args.scenario in ("engine", "all"):
            results.append(_engine(args, tmp, args.out / "logs"))
        if args.scenario in ("gateway", "all"):
            results.append(_gateway(args, tmp, args.out / "logs"))
        if args.scenario in ("workers", "all"):
            results.append(_workers(args, tmp, args.out / "logs"))
    command = "tokenfan bench failover " + " ".join(argv)
    (args.out / "results.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    summary = _summary(results, command)
    (args.out / "summary.md").write_text(summary)
    print(summary)
    return 0 if all(r["ended_normally"] == r["streams"] for r in results) else 1
