"""Processes the bench and the test suite start: each in its own session (so a stop reaches its children),
its output in a log file, and a wait for its ``/health``.

The primitives (:func:`spawn`, :class:`Proc`, :func:`wait_healthy`, :func:`stop_all`, :func:`free_port`) are
shared with ``tests/procs.py``, which adds the tests' defaults (logs under ``test-artifacts/``). On top of
them, the bench's own servers: a synthetic engine + gateway per token rate (``--spawn``,
:func:`spawn_synthetic`) and the raw floor server (``--baseline raw``, :func:`spawn_raw`), logging to
``DIR/logs``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import httpx

# A spawned gateway keeps finished streams briefly: a long closed-loop run creates many streams and
# the default retention (300 s, 10k streams) would answer 429 long before the run ends.
# the bench is one client (one address) that is a crowd: no per-client limits
SPAWN_GATEWAY_ARGS = ["--stream-ttl", "5", "--max-streams", "200000", "--max-generations-per-client", "0",
                      "--max-connections-per-client", "0", "--max-subscriptions-per-client", "0"]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    """A process started by :func:`spawn` (the leader of its own session) and its log."""

    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the process group (the process and its children), if the process still runs."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> int:
        """Wait for the exit; after ``timeout`` s, SIGKILL the group."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            self.popen.wait(5)
        return self.popen.returncode

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        self.signal_group(sig)
        return self.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def spawn(args: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None, nice: int = 0,
          cwd: Path | None = None) -> Proc:
    """``python <args>`` in its own session, stdout and stderr appended to ``log_path``; ``nice`` > 0 runs it
    (and its children) at that lower CPU priority."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        popen = subprocess.Popen([*(["nice", "-n", str(nice)] if nice else []), sys.executable, *args],
                                 stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return Proc(popen, log_path)


@dataclass(frozen=True)
class Child:
    """A live child process (Linux ``/proc``): its pid, argv and environment."""

    pid: int
    argv: list[bytes]
    environ: list[bytes]

    def has_env(self, name: str, value: str) -> bool:
        return f"{name}={value}".encode() in self.environ


def children(parent: int) -> list[Child]:
    """The live child processes of ``parent``, in pid order (what ``tokenfan serve`` runs: its engine, its workers)."""
    out = []
    for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != parent:
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        out.append(Child(pid, argv, environ))
    return out


def engine_child(parent: int) -> int:
    """The pid of the one engine worker ``parent`` (``tokenfan serve``) runs."""
    (pid,) = [c.pid for c in children(parent) if b"engine_worker" in c.argv]
    return pid


def stop_all(procs: Iterable[Proc], timeout: float = 20.0) -> None:
    """SIGTERM every process at once, then wait for each: they shut down side by side, not one after another."""
    procs = list(procs)
    for proc in procs:
        proc.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.wait(max(0.0, deadline - time.monotonic()))


def wait_healthy(url: str, procs: Proc | Sequence[Proc], timeout: float) -> None:
    """Until ``url``'s ``/health`` answers 200; a process of ``procs`` that exits first, or the timeout,
    raises with the end of its log."""
    watched = [procs] if isinstance(procs, Proc) else list(procs)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in watched:
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.popen.args!r} exited with {p.popen.returncode} ({p.log_path}):\n"
                                   f"{p.log()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=1.0, trust_env=False, verify=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.03)
    raise TimeoutError(f"{url} not healthy after {timeout:g}s ({watched[-1].log_path}):\n{watched[-1].log()[-4000:]}")


@dataclass
class Spawned:
    """A group of processes behind one base URL; ``stop()`` ends them together."""

    url: str
    procs: list[Proc] = field(default_factory=list)
    tmpdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def server_pid(self) -> int:
        """The process serving ``url`` (the one to profile)."""
        return self.procs[-1].pid

    def stop(self) -> None:
        stop_all(reversed(self.procs), timeout=15.0)
        if self.tmpdir is not None:
            self.tmpdir.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def spawn_synthetic(tokens_per_s: float, ttft_ms: float, log_dir: Path, gateway_args: Sequence[str] = (),
                    engine_args: Sequence[str] = (), env: dict[str, str] | None = None) -> Spawned:
    """``python -m engine_worker --engine synthetic`` + ``python -m tokenfan.cli gateway`` on a free port
    (``env``: added to both processes' environment)."""
    tmp = tempfile.TemporaryDirectory(prefix="tokenfan-bench-")
    address = f"ipc://{tmp.name}/engine.sock"
    port = free_port()
    tag = f"{tokens_per_s:g}tps-{port}"
    scheme = "https" if any(a.split("=")[0] == "--ssl-certfile" for a in gateway_args) else "http"
    spawned = Spawned(f"{scheme}://127.0.0.1:{port}", tmpdir=tmp)
    try:
        spawned.procs.append(spawn(["-m", "engine_worker", "--engine", "synthetic", "--address", address,
                                    "--synthetic-tokens-per-s", str(tokens_per_s),
                                    "--synthetic-ttft-ms", str(ttft_ms), "--log-level", "WARNING", *engine_args],
                                   log_dir / f"engine-{tag}.log", env=env))
        spawned.procs.append(spawn(["-m", "tokenfan.cli", "gateway", "--engine", address, "--host", "127.0.0.1",
                                    "--port", str(port), "--log-level", "warning", *SPAWN_GATEWAY_ARGS,
                                    *gateway_args], log_dir / f"gateway-{tag}.log", env=env))
        wait_healthy(spawned.url, spawned.procs, 60.0)
    except BaseException:
        spawned.stop()
        raise
    return spawned


def spawn_raw(tokens_per_s: float, ttft_ms: float, log_dir: Path, steps: str = "per-stream",
              stream_interval: int = 1) -> Spawned:
    """The raw floor server (:mod:`tokenfan_bench.servers.raw_floor`) on a free port."""
    port = free_port()
    spawned = Spawned(f"http://127.0.0.1:{port}")
    try:
        spawned.procs.append(spawn(["-m", "tokenfan_bench.servers.raw_floor", "--port", str(port),
                                    "--tokens-per-s", str(tokens_per_s), "--ttft-ms", str(ttft_ms),
                                    "--steps", steps, "--stream-interval", str(stream_interval)], log_dir / f"raw-{tokens_per_s:g}tps-{port}.log"))
        wait_healthy(spawned.url, spawned.procs, 30.0)
    except BaseException:
        spawned.stop()
        raise
    return spawned
