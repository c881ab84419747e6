"""``tokenfan bench partitions``: real network partitions (:mod:`tokenfan_bench.network.partition`) against
sampled listed streams, and a checker that reads every reader's history (the suite runs the same scenarios:
tests/e2e/test_partitions.py).

Scenarios (each with its own processes; the engine is shared):

- ``redis-cut``: gateways A (in an island) and B on one engine and one ``redis-server``; N fan-out streams
  and a background response (Responses API) created on A, sampled (temperature 1, no seed: two
  continuations differ), each read by one reader starting on A and one starting on B. A's link to Redis is cut for ``--cut`` × the lease TTL (A keeps its engine and
  its readers), then healed.
- ``redis-restart``: the same without the island; Redis is killed and started again, empty, on its port, after
  ``--cut`` × the lease TTL.
- ``redis-failover``: a Redis primary with one replica (replicating through a link the bench can hold) and
  gateways A and B reaching Redis through one switchable endpoint (:mod:`tokenfan_bench.network.endpoint`,
  a managed Redis endpoint); N fan-out streams created on A, each read by two readers starting on A. The
  replication link is held for ``--lag`` seconds (the replica falls that far behind, its connection open),
  then the primary and gateway A are SIGKILLed together, the replica is promoted (``REPLICAOF NO ONE``) and
  the endpoint leads to it; A's readers resume on B, and one more reader per stream starts on B after the
  failover from the first event.
- ``sentinel-failover``: the same, with three sentinels in the endpoint's place: the gateways find the primary
  through them (``redis+sentinel://``) and the sentinels, not the bench, promote the replica once the primary
  is down (``down-after-milliseconds`` 1000).
- ``engine-cut``: gateway A (in an island) on two engines: one over ``tcp://`` with CURVE, whose link is cut for
  longer than ``--heartbeat-timeout`` (A migrates its requests to the other) and than the engine's
  ``--gateway-grace`` (the engine aborts them), then healed. Synthetic engines: their text is a function of
  the position, so a delta of the old run that reached a client shows as text that is not the control's.

Each reader resumes with ``Last-Event-ID`` at its next gateway whenever its response ends without ``[DONE]``
or fails, as behind a load balancer. The checker (:func:`check`): every reader reads each event once and in
order, ends with ``[DONE]`` or an explicit error event, within the deadline (nothing hangs); every two readers
of a stream read one answer (one history a prefix of the other; equal when both ended); the engines end with
nothing running. Reported: each scenario's recovery time (the fault's end to the moment every reader had an
event after it) and the largest gap any reader saw.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenfan_bench.network.endpoint import Endpoint
from tokenfan_bench.network.partition import Island, available
from tokenfan_bench.servers.processes import Proc, free_port, spawn, stop_all, wait_healthy

SCENARIOS = ("redis-cut", "redis-restart", "redis-failover", "sentinel-failover", "engine-cut")
NEEDS_ISLANDS = ("redis-cut", "engine-cut")
LEASE = ["--broker-lease-interval", "0.2", "--broker-lease-ttl", "0.8"]
OPEN = ["--max-generations-per-client", "0", "--max-subscriptions-per-client", "0", "--max-connections-per-client",
        "0", "--log-level", "warning"]


@dataclass
class History:
    """What one reader of one stream saw: each event's ``seq``, text and arrival; how each connection ended."""

    urls: list[str]
    seqs: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    ends: list[str] = field(default_factory=list)  # done | eof | error:<code> | http <status> | net <error>
    outcome: str = "hung"  # done | error:<code> | hung

    def largest_gap(self) -> float:
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:])), default=0.0)


def chunk_text(chunk: dict[str, Any]) -> str:
    out = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        out.append(str(delta.get("content") or "") + str(delta.get("reasoning") or "") + str(choice.get("text") or ""))
    return "".join(out)


async def read(client: httpx.AsyncClient, sid: str, h: History, stop: asyncio.Event) -> None:
    """Follow one stream, resuming with ``Last-Event-ID`` at the next URL whenever a response ends without an end."""
    k = 0
    while not stop.is_set():
        url = f"{h.urls[k % len(h.urls)]}/v1/streams/{sid}/events"
        headers = {"Last-Event-ID": str(h.seqs[-1])} if h.seqs else {}
        ended = "eof"
        try:
            async with client.stream("GET", url, headers=headers) as r:
                if r.status_code == 204:  # nothing after Last-Event-ID, and the stream is done
                    h.ends.append("done")
                    h.outcome = "done"
                    return
                if r.status_code != 200:
                    ended = f"http {r.status_code}"
                else:
                    seq, event = None, "message"
                    async for line in r.aiter_lines():
                        if line.startswith("id: "):
                            seq = int(line[4:])
                        elif line.startswith("event: "):
                            event = line[7:]
                        elif line == "data: [DONE]":
                            h.ends.append("done")
                            h.outcome = "done"
                            return
                        elif line.startswith("data: ") and event == "error":
                            code = json.loads(line[6:]).get("error", {}).get("code")
                            h.ends.append(f"error:{code}")
                            h.outcome = f"error:{code}"
                            return
                        elif line.startswith("data: {") and seq is not None:
                            h.seqs.append(seq)
                            h.texts.append(chunk_text(json.loads(line[6:])))
                            h.arrivals.append(time.monotonic())
                        elif not line:
                            seq, event = None, "message"
        except httpx.HTTPError as exc:
            ended = f"net {type(exc).__name__}"
        k = await _again(h, ended, k, stop)


async def _again(h: History, ended: str, k: int, stop: asyncio.Event) -> int:
    """A connection ended without the stream's end: note how, wait a moment, and go on at the next URL."""
    h.ends.append(ended)
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(0.1 if ended == "eof" else 0.3):
            await stop.wait()
    return k + 1


async def read_response(client: httpx.AsyncClient, rid: str, h: History, stop: asyncio.Event) -> None:
    """Follow a background response (``GET /v1/responses/{id}?stream=true``), resuming with ``starting_after``
    at the next URL whenever a response ends before its terminal event; its events are the log's, numbered by
    ``sequence_number`` (text: an output text delta's)."""
    k = 0
    while not stop.is_set():
        after = f"&starting_after={h.seqs[-1]}" if h.seqs else ""
        ended = "eof"
        try:
            async with client.stream("GET", f"{h.urls[k % len(h.urls)]}/v1/responses/{rid}?stream=true{after}") as r:
                if r.status_code != 200:
                    ended = f"http {r.status_code}"
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        ev = json.loads(line[6:])
                        kind = ev.get("type", "")
                        if kind == "error":
                            h.outcome = f"error:{(ev.get('error') or ev).get('code')}"
                            h.ends.append(h.outcome)
                            return
                        h.seqs.append(int(ev["sequence_number"]))
                        h.texts.append(str(ev.get("delta") or "") if kind == "response.output_text.delta" else "")
                        h.arrivals.append(time.monotonic())
                        if kind in ("response.completed", "response.incomplete", "response.failed"):
                            h.outcome = "done" if kind != "response.failed" else "error:failed"
                            h.ends.append(h.outcome)
                            return
        except httpx.HTTPError as exc:
            ended = f"net {type(exc).__name__}"
        k = await _again(h, ended, k, stop)


def check(streams: dict[str, list[History]]) -> list[str]:
    """Every problem the histories show (none: one answer per stream, each event once, every reader ended)."""
    problems = []
    for sid, readers in streams.items():
        for n, h in enumerate(readers):
            if h.seqs != list(range(len(h.seqs))):
                problems.append(f"{sid} reader {n}: events out of order, repeated or missing: {h.seqs[:50]}")
            if h.outcome == "hung":
                problems.append(f"{sid} reader {n}: never ended (ends {h.ends})")
        for a in range(len(readers)):
            for b in range(a + 1, len(readers)):
                x, y = readers[a].texts, readers[b].texts
                short, long_ = (x, y) if len(x) <= len(y) else (y, x)
                if long_[:len(short)] != short:
                    at = next(i for i, (p, q) in enumerate(zip(short, long_, strict=False)) if p != q)
                    problems.append(f"{sid}: readers {a} and {b} read two answers, parting at event {at} "
                                    f"({len(''.join(short[:at]))} characters in)")
                elif readers[a].outcome == readers[b].outcome == "done" and len(x) != len(y):
                    problems.append(f"{sid}: readers {a} and {b} both got [DONE] after {len(x)} and {len(y)} events")
    return problems


def body(i: int, tokens: int) -> dict[str, Any]:
    """A sampled chat stream: temperature 1 and no seed, so two continuations of it differ; ``ignore_eos``, so
    it runs its ``tokens`` (a sampled end of sequence ended one before the fault now and then)."""
    return {"messages": [{"role": "user", "content": f"Tell a long story about river {i}."}], "max_tokens": tokens,
            "temperature": 1.0, "stream": True, "ignore_eos": True}


@dataclass
class Driven:
    """What :func:`_drive` saw: each stream's readers, the fault's start and end (monotonic), and how many of the
    generations still ran when the fault began."""

    streams: dict[str, list[History]]
    t0: float
    t1: float
    running: int


@dataclass
class Run:
    """One scenario's outcome: the histories, the problems, and the times the checker reports."""

    scenario: str
    streams: dict[str, list[History]]
    problems: list[str]
    fault_s: float  # how long the fault lasted
    recovery_s: float | None  # the fault's end to the first event after it (None: none came)
    engine_idle: bool
    notes: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        gaps = sorted(h.largest_gap() for rs in self.streams.values() for h in rs)
        ends: dict[str, int] = {}
        for rs in self.streams.values():
            for h in rs:
                ends[h.outcome] = ends.get(h.outcome, 0) + 1
        return {"scenario": self.scenario, "streams": len(self.streams),
                "readers": sum(len(r) for r in self.streams.values()), "outcomes": ends, "problems": self.problems,
                "fault_s": round(self.fault_s, 3),
                "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 3),
                "largest_gap_s": round(gaps[-1], 3) if gaps else None, "engine_idle": self.engine_idle,
                "resumes": sum(len(h.ends) - 1 for rs in self.streams.values() for h in rs), **self.notes}


class RedisProc:
    """A ``redis-server`` without persistence on ``port``, on loopback and the given extra addresses (``extra``:
    more arguments, e.g. ``--replicaof``)."""

    def __init__(self, workdir: Path, binds: list[str], extra: list[str] | None = None) -> None:
        self.port, self.workdir, self.binds, self.extra = free_port(), workdir, binds, extra or []
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        # (protected mode off: the extra address is an island's private veth, see tokenfan_bench.network.partition)
        return ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", *self.binds, "--protected-mode",
                "no" if self.binds else "yes", "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                *self.extra]

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        command = self.command()
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(self.port), "ping"], check=False,
                             capture_output=True).stdout.strip() != b"PONG":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def cli(self, *args: str) -> str:
        return subprocess.run(["redis-cli", "-p", str(self.port), *args], check=True, capture_output=True,
                              text=True, timeout=10).stdout.strip()

    def replicas_online(self) -> int:
        return self.cli("info", "replication").count("state=online")


class SentinelProc(RedisProc):
    """A ``redis-sentinel`` on ``port`` watching the primary on ``primary`` as ``service`` (quorum 2: one of
    three; down after 1 s unanswered; a failover that stalls is given up, and tried again, after 3 s)."""

    def __init__(self, workdir: Path, service: str, primary: int) -> None:
        super().__init__(workdir, [])
        self.service, self.primary = service, primary

    def command(self) -> list[str]:
        conf = self.workdir / "sentinel.conf"  # (the sentinel writes what it learns into it)
        conf.write_text("\n".join([
            f"port {self.port}", "bind 127.0.0.1", f"dir {self.workdir}",
            f"sentinel monitor {self.service} 127.0.0.1 {self.primary} 2",
            f"sentinel down-after-milliseconds {self.service} 1000",
            f"sentinel failover-timeout {self.service} 3000"]) + "\n")
        return ["redis-sentinel", str(conf)]

    def master(self) -> int:
        """The port of the primary this sentinel names."""
        return int(self.cli("sentinel", "get-master-addr-by-name", self.service).split()[1])

    def replicas(self) -> list[str]:
        """The replicas this sentinel knows, by name (``ip:port``, as it reaches them)."""
        fields = self.cli("sentinel", "replicas", self.service).splitlines()  # (flat: field, value, ...)
        return [value for key, value in zip(fields[::2], fields[1::2], strict=True) if key == "name"]


def engine_running(url: str) -> int:
    """Requests running and waiting on the engines a gateway sees (their heartbeats)."""
    return sum(int(e.get("running") or 0) + int(e.get("waiting") or 0)
               for e in httpx.get(url + "/health", timeout=5).json().get("engines", []))


async def _drive(create: str, urls: list[list[str]], n: int, tokens: int, warm: int, fault: Any,
                 deadline_s: float, responses: int = 0, late: list[list[str]] | None = None) -> Driven:
    """Create ``n`` fan-out streams (and ``responses`` background responses) on ``create``, one reader per URL
    list each; once every stream has ``warm`` events on its owner, ``await fault()`` (returns when the fault
    ends); then start one reader per ``late`` URL list on each fan-out stream (from its first event), and wait
    for the readers."""
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=5), limits=httpx.Limits(max_connections=4 * n + 8)) \
            as c:
        ids, rids = [], []
        for i in range(n):
            r = await c.post(create + "/v1/streams", json=body(i, tokens))
            r.raise_for_status()
            ids.append(r.json()["id"])
        for i in range(responses):
            r = await c.post(create + "/v1/responses", json={
                "input": f"Tell a long story about lake {i}.", "background": True, "temperature": 1.0,
                "max_output_tokens": tokens, "ignore_eos": True})
            r.raise_for_status()
            rids.append(r.json()["id"])
        streams = {sid: [History(list(u)) for u in urls] for sid in [*ids, *rids]}
        jobs = [asyncio.create_task(read(c, sid, h, stop)) for sid in ids for h in streams[sid]]
        jobs += [asyncio.create_task(read_response(c, rid, h, stop)) for rid in rids for h in streams[rid]]
        # The fault strikes once every stream has ``warm`` events on its owner: the server's count, not the
        # readers' (the tiny model writes 480 tokens in about 2 s, and a client process starved of CPU attached its
        # readers and read their first events later than that: "only 0 of 7 generations still ran"). A reader
        # that attaches during the fault is checked like any other.
        t_warm = time.monotonic() + 120
        while not all([(await c.get(f"{create}/v1/streams/{sid}")).json().get("events", 0) >= warm for sid in ids]):
            if time.monotonic() > t_warm:
                raise RuntimeError("the streams did not start")
            await asyncio.sleep(0.02)
        # the fault must strike generations that still run (else a scenario proves nothing): counted here
        running = 0
        for sid in ids:
            running += (await c.get(f"{create}/v1/streams/{sid}")).json().get("state") == "running"
        for rid in rids:
            running += (await c.get(f"{create}/v1/responses/{rid}")).json().get("status") == "in_progress"
        t0 = time.monotonic()
        await fault()
        t1 = time.monotonic()
        for sid in ids:
            for u in late or ():
                h = History(list(u))
                streams[sid].append(h)
                jobs.append(asyncio.create_task(read(c, sid, h, stop)))
        _, pending = await asyncio.wait(jobs, timeout=deadline_s)
        stop.set()
        if pending:
            await asyncio.wait(pending, timeout=10)
    return Driven(streams, t0, t1, running)


def _still_ran(driven: Driven, when: str) -> list[str]:
    """The scenario proves nothing about a generation that had ended before its fault: that is a problem too."""
    n = len(driven.streams)
    return [] if driven.running >= n else \
        [f"only {driven.running} of {n} generations still ran when {when} (more --tokens)"]


def _recovery(streams: dict[str, list[History]], t1: float) -> float | None:
    """The fault's end to the moment every reader still reading then had an event after it (None: one never did)."""
    firsts = []
    for rs in streams.values():
        for h in rs:
            after = [t for t in h.arrivals if t > t1]
            if after:
                firsts.append(after[0])
            elif h.outcome == "done" and h.arrivals and h.arrivals[-1] <= t1:
                continue  # it had everything before the fault ended
            else:
                return None
    return max(firsts) - t1 if firsts else None


def _sample(url: str, name: str, **labels: str) -> float:
    """One sample of a gateway's ``/metrics`` (0 if absent), read with ``prometheus_client``'s parser."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


def _wait_idle(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if engine_running(url) == 0:
                return True
        time.sleep(0.2)
    return False


@contextlib.contextmanager
def _procs() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        stop_all(procs)


def redis_scenario(kind: str, engine: str, tmp: Path, logs: Path, *, streams: int, tokens: int, cut: float,
                   lease: list[str], responses: int = 1, env: dict[str, str] | None = None) -> Run:
    """``redis-cut`` or ``redis-restart`` on the engine at ``engine`` (see the module docstring), with
    ``streams`` fan-out streams and ``responses`` background responses (Responses API, sampled too)."""
    ttl = float(lease[lease.index("--broker-lease-ttl") + 1])
    island = Island(0) if kind == "redis-cut" else None
    with contextlib.ExitStack() as stack:
        if island is not None:
            stack.enter_context(island)
        redis = RedisProc(tmp, [island.host_ip] if island else [])
        redis.start()
        stack.callback(redis.stop)
        procs = stack.enter_context(_procs())
        port_a, port_b = free_port(), free_port()
        host_a = island.ip if island else "127.0.0.1"
        broker_a = f"redis://{island.host_ip if island else '127.0.0.1'}:{redis.port}/0"
        args = ["-m", "tokenfan.cli", "gateway", "--engine-address", engine, *lease, *OPEN]
        with island.inside() if island else contextlib.nullcontext():
            procs.append(spawn([*args, "--broker", broker_a, "--host", "0.0.0.0", "--port", str(port_a)],
                               logs / f"{kind}-gateway-a.log", env=env))
        procs.append(spawn([*args, "--broker", f"redis://127.0.0.1:{redis.port}/0", "--host", "127.0.0.1", "--port",
                            str(port_b)], logs / f"{kind}-gateway-b.log", env=env))
        url_a, url_b = f"http://{host_a}:{port_a}", f"http://127.0.0.1:{port_b}"
        wait_healthy(url_a, procs[:1], 120)
        wait_healthy(url_b, procs[1:], 120)
        notes: dict[str, Any] = {}

        async def fault() -> None:
            if island is not None:
                island.cut(redis.port)
                await asyncio.sleep(ttl)
                async with httpx.AsyncClient() as c:  # the cut gateway says it is not ready
                    notes["health_during_cut"] = (await c.get(url_a + "/health", timeout=5)).status_code
                await asyncio.sleep(cut * ttl - ttl)
                island.heal(redis.port)
            else:
                redis.stop()
                await asyncio.sleep(cut * ttl)
                redis.start()

        driven = asyncio.run(_drive(url_a, [[url_a, url_b], [url_b, url_a]], streams, tokens, 3, fault, 120,
                                    responses))
        histories, t0, t1 = driven.streams, driven.t0, driven.t1
        notes["running_at_fault"] = driven.running
        idle = _wait_idle(url_b, 30)
        notes["adopted_b"] = _sample(url_b, "tokenfan_adoptions_total", outcome="adopted")
        # A finds out at its first write after the heal (its publisher reconnects with backoff, and a connect
        # that was cut waits for TCP's retransmission): wait for it, at most 20 s
        deadline = time.monotonic() + 20
        while (fenced := _sample(url_a, "tokenfan_streams_fenced_total", reason="fenced")) < notes["adopted_b"] \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        notes["fenced_a"] = fenced
        notes["paused_a"] = _sample(url_a, "tokenfan_streams_fenced_total", reason="lease")
    problems = check(histories) + _still_ran(driven, "the fault began")
    return Run(kind, histories, problems, t1 - t0, _recovery(histories, t1), idle, notes)


class EndpointPromotion:
    """``redis-failover``: both gateways reach Redis at one switchable endpoint (a managed Redis endpoint); the
    failover is the bench's: ``REPLICAOF NO ONE`` on the replica, then the endpoint leads to it."""

    def __init__(self, primary: RedisProc, replica: RedisProc, stack: contextlib.ExitStack) -> None:
        self.replica = replica
        self.endpoint = Endpoint(primary.port)
        stack.callback(self.endpoint.close)
        self.broker = self.endpoint.url
        self.notes: dict[str, Any] = {}

    def promote(self) -> None:
        self.replica.cli("replicaof", "no", "one")
        self.endpoint.switch(self.replica.port)


class SentinelPromotion:
    """``sentinel-failover``: three sentinels watch the primary (:class:`SentinelProc`) and the gateways ask them
    (``redis+sentinel://``); the failover is theirs: the bench only waits until each names the replica, and it
    says it is the primary. The replica's link to the primary goes through the held endpoint, so the primary's
    ``INFO`` shows it at the endpoint's address (loopback) and its own listening port: what the sentinels
    connect to (checked: each must list the replica at its real port)."""

    SERVICE = "tokenfan"

    def __init__(self, primary: RedisProc, replica: RedisProc, stack: contextlib.ExitStack, tmp: Path) -> None:
        self.replica = replica
        self.sentinels = [SentinelProc(tmp / f"sentinel-{i}", self.SERVICE, primary.port) for i in range(3)]
        for s in self.sentinels:
            s.start()
            stack.callback(s.stop)
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        self.broker = f"redis+sentinel://{hosts}/{self.SERVICE}"
        want = f"127.0.0.1:{replica.port}"
        _until(lambda: all(want in s.replicas() for s in self.sentinels), 30, f"every sentinel listing {want}")
        self.notes: dict[str, Any] = {"sentinels_saw_replica_as": self.sentinels[0].replicas()}

    def promote(self) -> None:
        t = time.monotonic()

        def promoted() -> bool:
            with contextlib.suppress(subprocess.SubprocessError, IndexError, ValueError):
                return all(s.master() == self.replica.port for s in self.sentinels) and \
                    self.replica.cli("role").split()[0] == "master"
            return False

        _until(promoted, 60, f"the sentinels promoting the replica on {self.replica.port}")
        self.notes["promotion_s"] = round(time.monotonic() - t, 3)


def _until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


FAILOVERS = ("redis-failover", "sentinel-failover")


def failover_scenario(kind: str, engine: str, tmp: Path, logs: Path, *, streams: int, tokens: int, lag: float,
                      lease: list[str], replicas: str | None = None, env: dict[str, str] | None = None) -> Run:
    """``redis-failover`` or ``sentinel-failover`` on the engine at ``engine`` (see the module docstring);
    ``replicas``: the gateways' ``--broker-replicas`` (None: their default, ``auto``)."""
    primary = RedisProc(tmp / "primary", [], ["--repl-diskless-sync-delay", "0"])
    with contextlib.ExitStack() as stack:
        primary.start()
        stack.callback(primary.stop)
        link = Endpoint(primary.port)  # the replication link, which the fault holds
        stack.callback(link.close)
        replica = RedisProc(tmp / "replica", [], ["--replicaof", "127.0.0.1", str(link.port)])
        replica.start()
        stack.callback(replica.stop)
        _until(lambda: primary.replicas_online() >= 1, 30, "the replica online")
        promotion = EndpointPromotion(primary, replica, stack) if kind == "redis-failover" else \
            SentinelPromotion(primary, replica, stack, tmp)
        procs = stack.enter_context(_procs())
        port_a, port_b = free_port(), free_port()
        args = ["-m", "tokenfan.cli", "gateway", "--engine-address", engine, "--broker", promotion.broker, *lease,
                *OPEN, *(["--broker-replicas", replicas] if replicas is not None else [])]
        procs.append(spawn([*args, "--port", str(port_a)], logs / f"{kind}-gateway-a.log", env=env))
        procs.append(spawn([*args, "--port", str(port_b)], logs / f"{kind}-gateway-b.log", env=env))
        url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
        wait_healthy(url_a, procs[:1], 480)  # (healthy once the engine is: a vLLM boot took 244 s at load 17)
        wait_healthy(url_b, procs[1:], 480)
        notes: dict[str, Any] = {"lag_s": lag, "broker_replicas": replicas or "auto"}

        async def fault() -> None:
            link.hold()
            await asyncio.sleep(lag)
            primary.stop()  # SIGKILL, and gateway A with it
            procs[0].signal_group(signal.SIGKILL)
            link.close()  # what it held dies with the primary
            await asyncio.to_thread(promotion.promote)  # (the readers read on meanwhile)
            notes["replica_role"] = replica.cli("role").split()[0]

        driven = asyncio.run(_drive(url_a, [[url_a, url_b], [url_a, url_b]], streams, tokens, 3, fault, 120,
                                    late=[[url_b]]))
        histories, t0, t1 = driven.streams, driven.t0, driven.t1
        notes["running_at_fault"] = driven.running
        idle = _wait_idle(url_b, 30)
        notes["adopted_b"] = _sample(url_b, "tokenfan_adoptions_total", outcome="adopted")
        notes.update(promotion.notes)
    problems = check(histories) + _still_ran(driven, "the replica fell behind")
    return Run(kind, histories, problems, t1 - t0, _recovery(histories, t1), idle, notes)


def engine_scenario(tmp: Path, logs: Path, *, streams: int, tokens: int, cut: float, env: dict[str, str] | None = None
                    ) -> Run:
    """``engine-cut`` (see the module docstring): synthetic engines, one over tcp:// with CURVE."""
    keys = tmp / "keys"
    subprocess.run([sys.executable, "-m", "tokenfan.cli", "keys", str(keys)], check=True, capture_output=True)
    hb_timeout, grace = 1.0, 2.0
    with Island(1) as island, _procs() as procs:
        tcp = f"tcp://{island.host_ip}:{free_port()}"
        ipc = f"ipc://{tmp / 'engine-b.sock'}"
        synth = ["--engine", "synthetic", "--synthetic-tokens-per-s", "40", "--gateway-grace", str(grace),
                 "--log-level", "warning"]
        procs.append(spawn(["-m", "engine_worker", "--engine-address", tcp, "--curve-dir", str(keys),
                            "--allow-remote-engine", *synth], logs / "engine-cut-engine-tcp.log", env=env))
        # (the gateway's --curve-dir applies to each of its links: this one too)
        procs.append(spawn(["-m", "engine_worker", "--engine-address", ipc, "--curve-dir", str(keys), *synth],
                           logs / "engine-cut-engine-ipc.log", env=env))
        port = free_port()
        with island.inside():
            procs.append(spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", f"{tcp},{ipc}", "--curve-dir",
                                str(keys), "--heartbeat-timeout", str(hb_timeout), "--host", "0.0.0.0", "--port",
                                str(port), *OPEN], logs / "engine-cut-gateway.log", env=env))
        url = f"http://{island.ip}:{port}"
        wait_healthy(url, procs, 120)
        deadline = time.monotonic() + 60
        while not all(e["healthy"] for e in httpx.get(url + "/health").json()["engines"]):
            if time.monotonic() > deadline:
                raise RuntimeError("both engines never became healthy")
            time.sleep(0.1)
        tcp_port = int(tcp.rsplit(":", 1)[1])

        notes: dict[str, Any] = {}

        async def fault() -> None:
            island.cut(tcp_port)
            await asyncio.sleep(cut * max(hb_timeout, grace))
            island.heal(tcp_port)
            # healed, while the streams still run (on the other engine): the engine that was cut off runs nothing
            # of this gateway's (it aborted them after --gateway-grace), as its first heartbeats say
            async with httpx.AsyncClient() as c:
                for _ in range(100):
                    e = next(e for e in (await c.get(url + "/health", timeout=5)).json()["engines"]
                             if e["address"] == tcp)
                    if e["healthy"]:
                        notes["tcp_engine_after_heal"] = {"running": e["running"], "waiting": e["waiting"]}
                        break
                    await asyncio.sleep(0.05)

        driven = asyncio.run(_drive(url, [[url], [url]], streams, tokens, 3, fault, 120))
        histories, t0, t1 = driven.streams, driven.t0, driven.t1
        notes["running_at_fault"] = driven.running
        # the control: the same requests where nothing was cut (the synthetic text is a function of the position)
        controls = {}
        for i, sid in enumerate(histories):
            r = httpx.post(url + "/v1/chat/completions", json={**body(i, tokens), "stream": False}, timeout=120)
            controls[sid] = r.json()["choices"][0]["message"]["content"]
        problems = check(histories) + _still_ran(driven, "the link was cut")
        after = notes.get("tcp_engine_after_heal")
        if after is None or after["running"] or after["waiting"]:
            problems.append(f"the engine that was cut off, healed: {after or 'never healthy again'} (want nothing "
                            "running)")
        for sid, readers in histories.items():
            for n, h in enumerate(readers):
                if h.outcome == "done" and "".join(h.texts) != controls[sid]:
                    problems.append(f"{sid} reader {n}: its text is not the control's (a delta of the old run?)")
        idle = _wait_idle(url, grace + 10)
        notes["migrated"] = _sample(url, "tokenfan_migrations_total", outcome="continued")
        if not notes["migrated"]:
            problems.append("no request was migrated off the engine that was cut off")
    return Run("engine-cut", histories, problems, t1 - t0, _recovery(histories, t1), idle, notes)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan bench partitions", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=(*SCENARIOS, "all"), default="all")
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=600, help="max_tokens of each stream")
    ap.add_argument("--cut", type=float, default=3.0, help="the fault lasts this many lease TTLs (engine: "
                    "heartbeat timeouts or gateway graces, the longer)")
    ap.add_argument("--lag", type=float, default=2.0, help="redis-failover, sentinel-failover: seconds the "
                    "replica falls behind before the primary dies")
    ap.add_argument("--broker-replicas", default=None, help="redis-failover, sentinel-failover: the "
                    "gateways' --broker-replicas (default: theirs, auto; 0 shows what a failover does without "
                    "replicated delivery)")
    ap.add_argument("--lease-ttl", type=float, default=0.8, help="--broker-lease-ttl of the gateways "
                    "(--broker-lease-interval is a quarter of it)")
    ap.add_argument("--model", type=Path, default=None, help="the engine's model for the Redis scenarios "
                    "(default: the tiny random-weight Llama, built locally)")
    ap.add_argument("--out", type=Path, default=Path("bench-results/partitions"))
    return ap


def _vllm_engine(args: argparse.Namespace, tmp: Path, logs: Path) -> tuple[Proc, str]:
    from engine_worker.models import build_tiny_llama

    model = args.model or build_tiny_llama(tmp / "tiny-llama")
    address = f"ipc://{tmp / 'engine.sock'}"
    proc = spawn(["-m", "engine_worker", "--engine-address", address, "--engine", "vllm", "--model", str(model),
                  "--max-model-len", "1024", "--log-level", "warning"], logs / "engine-vllm.log")
    return proc, address


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    why = available()
    if why and any(s in NEEDS_ISLANDS for s in scenarios):
        print(f"tokenfan bench partitions: {why}", file=sys.stderr)
        return 2
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    lease = ["--broker-lease-interval", f"{args.lease_ttl / 4:g}", "--broker-lease-ttl", f"{args.lease_ttl:g}"]
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="tokenfan-partitions-") as d:
        tmp = Path(d)
        engine: Proc | None = None
        try:
            for s in scenarios:
                if s != "engine-cut":
                    if engine is None:
                        engine, address = _vllm_engine(args, tmp, logs)
                    if s in FAILOVERS:
                        runs.append(failover_scenario(s, address, tmp, logs, streams=args.streams, tokens=args.tokens,
                                                      lag=args.lag, lease=lease, replicas=args.broker_replicas))
                    else:
                        runs.append(redis_scenario(s, address, tmp, logs, streams=args.streams, tokens=args.tokens,
                                                   cut=args.cut, lease=lease))
                else:
                    runs.append(engine_scenario(tmp, logs, streams=args.streams, tokens=args.tokens, cut=args.cut))
        finally:
            if engine is not None:
                stop_all([engine])
    command = "tokenfan bench partitions " + " ".join(argv)
    results = [r.summary() for r in runs]
    (args.out / "results.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    lines = ["# tokenfan bench partitions", "", f"`{command}`", "",
             (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"), "",
             ("| scenario | streams | readers | outcomes | one answer each | fault | recovery | largest gap | "
              "engine idle after |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rec = "-" if r["recovery_s"] is None else f"{r['recovery_s'] * 1000:.0f} ms"
        gap = "-" if r["largest_gap_s"] is None else f"{r['largest_gap_s'] * 1000:.0f} ms"
        lines.append(f"| {r['scenario']} | {r['streams']} | {r['readers']} | {r['outcomes']} | "
                     f"{'yes' if not r['problems'] else 'NO: ' + '; '.join(r['problems'][:3])} | {r['fault_s']:.1f} s | "
                     f"{rec} | {gap} | {'yes' if r['engine_idle'] else 'no'} |")
    summary = "\n".join(lines) + "\n"
    (args.out / "summary.md").write_text(summary)
    print(summary)
    return 0 if all(not r["problems"] and r["engine_idle"] for r in results) else 1
