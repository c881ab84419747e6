"""Helpers to run real tokenfan processes (engine workers, gateways) on loopback for tests.

The process primitives are the bench's (:mod:`tokenfan_bench.servers.processes`); this module adds the tests'
defaults (logs under ``test-artifacts/``), the engine and gateway command lines, and the Node harnesses."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenfan_bench.servers import processes
from tokenfan_bench.servers.processes import Proc, free_port, stop_all, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
# every test client is 127.0.0.1: a test that is itself a crowd turns the per-client limits off
NO_CLIENT_LIMITS = ("--max-generations-per-client", "0", "--max-connections-per-client", "0",
                    "--max-subscriptions-per-client", "0")
ARTIFACTS = ROOT / "test-artifacts"
NODE_DIR = ROOT / "tests" / "node"  # the npm SDKs the Node harnesses import, pinned in its package-lock.json
# vLLM's tool, reasoning and structured-output flags, as the parser-configured servers take them (the
# `parser_gateway` fixture and `vllm serve` in tests/e2e/test_vllm_parity.py): without whitespace, a
# constrained tiny model writes a JSON object or a tool call in a few tokens.
PARSER_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}')


def spawn(args: list[str], name: str, env: dict[str, str] | None = None, nice: int = 0) -> Proc:
    """:func:`tokenfan_bench.servers.processes.spawn` with the tests' defaults: the log in
    ``test-artifacts/<name>-….log``, the repository as the working directory, the model hub offline."""
    log_path = ARTIFACTS / f"{name}-{os.getpid()}-{time.monotonic_ns()}.log"
    return processes.spawn(args, log_path, env={"HF_HUB_OFFLINE": "1", **(env or {})}, nice=nice, cwd=ROOT)


def start_engine(address: str, *args: str, name: str = "engine", nice: int = 0,
                 env: dict[str, str] | None = None) -> Proc:
    return spawn(["-m", "engine_worker", "--address", address, *args], name, nice=nice, env=env)


class StartGateway(Protocol):
    def __call__(self, engine_address: str, *args: str, name: str = ...) -> tuple[Proc, str]: ...


def start_gateway(engine_address: str, *args: str, name: str = "gateway", timeout: float = 30.0,
                  port: int | None = None, env: dict[str, str] | None = None) -> tuple[Proc, str]:
    port = port or free_port()
    proc = spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", engine_address, "--host", "127.0.0.1",
                  "--port", str(port), "--log-level", "warning", *args], name, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout)
    except BaseException:  # a gateway that never became healthy is stopped, not left behind the session
        proc.stop()
        raise
    return proc, url


@contextlib.contextmanager
def engine_and_gateway(address: str, engine_args: Sequence[str] = (), gateway_args: Sequence[str] = (), *,
                       name: str, start: StartGateway = start_gateway) -> Iterator[str]:
    """An engine worker bound to ``address`` and a gateway attached to it (``start``: :func:`start_gateway` or
    another with its signature); yields the gateway's URL and stops both at the end."""
    engine = start_engine(address, *engine_args, name=f"engine-{name}")
    try:
        gateway, url = start(address, *gateway_args, name=f"gateway-{name}")
    except BaseException:
        engine.stop()
        raise
    try:
        yield url
    finally:
        stop_all([gateway, engine])


def node_modules_current(node_dir: Path = NODE_DIR) -> bool:
    """Whether ``node_modules`` holds every package of the lockfile at its locked version (npm's own record
    of what it installed, ``node_modules/.package-lock.json``): a tree installed before a package was added
    to ``package.json`` is not current."""
    installed_record = node_dir / "node_modules" / ".package-lock.json"
    if not installed_record.is_file():
        return False
    locked = json.loads((node_dir / "package-lock.json").read_text())["packages"]
    installed = json.loads(installed_record.read_text())["packages"]
    return all(installed.get(path, {}).get("version") == entry.get("version")
               for path, entry in locked.items() if path and not entry.get("optional"))


def npm_ci(node_dir: Path = NODE_DIR) -> Path:
    """``npm ci`` from the lockfile, unless ``node_modules`` is already current; returns ``node_dir``."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        raise RuntimeError("node and npm are needed for the Node SDK tests")
    if not node_modules_current(node_dir):
        proc = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--prefix", str(node_dir)],
                              timeout=600, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"npm ci failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return node_dir


def run_node(script: Path, url: str, *scenarios: str) -> dict[str, Any]:
    """Run a Node harness (``node SCRIPT URL SCENARIO...``) and return the JSON object it prints; a
    non-zero exit fails with its output."""
    proc = subprocess.run(["node", str(script), url, *scenarios], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NODE_NO_WARNINGS": "1"}, check=False)
    assert proc.returncode == 0, f"node harness failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout)  # type: ignore[no-any-return]
