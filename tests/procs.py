"""Helpers to run real tokenfan processes (engine workers, gateways) on loopback for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
# every test client is 127.0.0.1: a test that is itself a crowd turns the per-client limits off
NO_CLIENT_LIMITS = ("--max-generations-per-client", "0", "--max-connections-per-client", "0",
                    "--max-subscriptions-per-client", "0")
ARTIFACTS = ROOT / "test-artifacts"
# vLLM's tool, reasoning and structured-output flags, as the parser-configured servers take them (the
# `parser_gateway` fixture and `vllm serve` in tests/e2e/test_vllm_parity.py): without whitespace, a
# constrained tiny model writes a JSON object or a tool call in a few tokens.
PARSER_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    log_path: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        return self.popen.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def spawn(args: list[str], name: str, env: dict[str, str] | None = None) -> Proc:
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / f"{name}-{os.getpid()}-{time.monotonic_ns()}.log"
    out = open(log_path, "wb")  # noqa: SIM115 - the process's stdout while it runs
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    popen = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, env=full_env,
                             cwd=ROOT, start_new_session=True)
    return Proc(popen, log_path)


def start_engine(address: str, *args: str, name: str = "engine") -> Proc:
    return spawn(["-m", "engine_worker", "--address", address, *args], name)


def start_gateway(engine_address: str, *args: str, name: str = "gateway", timeout: float = 30.0,
                  port: int | None = None) -> tuple[Proc, str]:
    port = port or free_port()
    proc = spawn(["-m", "gateway.cli", "gateway", "--engine-address", engine_address, "--host", "127.0.0.1",
                  "--port", str(port), "--log-level", "warning", *args], name)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, timeout)
    return proc, url


def wait_healthy(url: str, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"process exited with {proc.popen.returncode}:\n{proc.log()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout}s:\n{proc.log()[-4000:]}")
