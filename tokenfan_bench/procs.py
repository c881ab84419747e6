"""Processes the bench starts itself: a synthetic engine + gateway per token rate (``--spawn``) and
the raw floor server (``--baseline raw``). Each runs in its own session, logs to ``DIR/logs``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Spawned:
    """A group of processes behind one base URL; ``stop()`` ends them in reverse order."""

    url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    tmpdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def server_pid(self) -> int:
        """The process serving ``url`` (the one to profile)."""
        return self.procs[-1].pid

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        if self.tmpdir is not None:
            self.tmpdir.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _popen(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


def wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args!r} exited with {p.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=1.0, trust_env=False, verify=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout:g}s; see {log}")


def spawn_synthetic(tokens_per_s: float, ttft_ms: float, log_dir: Path, gateway_args: list[str] = (),  # type: ignore[assignment]
                    engine_args: list[str] = ()) -> Spawned:  # type: ignore[assignment]
    """``python -m engine_worker --engine synthetic`` + ``python -m tokenfan.cli gateway`` on a free port."""
    tmp = tempfile.TemporaryDirectory(prefix="tokenfan-bench-")
    address = f"ipc://{tmp.name}/engine.sock"
    port = free_port()
    tag = f"{tokens_per_s:g}tps-{port}"
    scheme = "https" if any(a.split("=")[0] == "--ssl-certfile" for a in gateway_args) else "http"
    spawned = Spawned(f"{scheme}://127.0.0.1:{port}", tmpdir=tmp)
    try:
        spawned.procs.append(_popen(["-m", "engine_worker", "--engine", "synthetic", "--address", address,
                                     "--synthetic-tokens-per-s", str(tokens_per_s),
                                     "--synthetic-ttft-ms", str(ttft_ms), "--log-level", "WARNING", *engine_args],
                                    log_dir / f"engine-{tag}.log"))
        glog = log_dir / f"gateway-{tag}.log"
        spawned.procs.append(_popen(["-m", "tokenfan.cli", "gateway", "--engine", address, "--host", "127.0.0.1",
                                     "--port", str(port), "--log-level", "warning", *SPAWN_GATEWAY_ARGS,
                                     *gateway_args], glog))
        wait_healthy(spawned.url, spawned.procs, 60.0, glog)
    except BaseException:
        spawned.stop()
        raise
    return spawned


def spawn_raw(tokens_per_s: float, ttft_ms: float, log_dir: Path, steps: str = "per-stream") -> Spawned:
    port = free_port()
    log = log_dir / f"raw-{tokens_per_s:g}tps-{port}.log"
    spawned = Spawned(f"http://127.0.0.1:{port}")
    try:
        spawned.procs.append(_popen(["-m", "tokenfan_bench.raw_server", "--port", str(port),
                                     "--tokens-per-s", str(tokens_per_s), "--ttft-ms", str(ttft_ms),
                                     "--steps", steps], log))
        wait_healthy(spawned.url, spawned.procs, 30.0, log)
    except BaseException:
        spawned.stop()
        raise
    return spawned
