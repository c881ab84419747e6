"""Session fixtures: real engine processes and real gateways on loopback ports.

One synthetic engine and one vLLM engine (tiny random-weight Llama built locally) are shared by
the whole session: each vLLM start costs ~30 s. A second vLLM engine, configured with vLLM's tool,
reasoning and structured-output flags (``parser_gateway``), starts only when a test asks for it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import (
    PARSER_FLAGS,
    Proc,
    free_port,
    npm_ci,
    spawn,
    start_engine,
    start_gateway,
    wait_healthy,
)


@pytest.fixture(scope="session")
def ipc_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="tokenfan-test-") as d:
        yield Path(d)


@pytest.fixture(scope="session")
def synthetic_engine(ipc_dir: Path) -> Iterator[str]:
    address = f"ipc://{ipc_dir / 'synthetic.sock'}"
    proc = start_engine(address, "--engine", "synthetic", "--synthetic-ttft-ms", "5",
                        "--synthetic-tokens-per-s", "200", name="engine-synthetic")
    yield address
    proc.stop()


@pytest.fixture(scope="session")
def gateway_url(synthetic_engine: str) -> Iterator[str]:
    """A gateway attached to the shared synthetic engine."""
    proc, url = start_gateway(synthetic_engine, name="gateway-synthetic")
    yield url
    proc.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine_worker.models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def vllm_engine(ipc_dir: Path, tiny_model: Path) -> Iterator[tuple[str, Proc]]:
    address = f"ipc://{ipc_dir / 'vllm.sock'}"
    proc = start_engine(address, "--engine", "vllm", "--model", str(tiny_model), "--max-model-len", "512",
                        name="engine-vllm")
    yield address, proc
    proc.stop(timeout=30)


@pytest.fixture(scope="session")
def vllm_gateway_url(vllm_engine: tuple[str, Proc]) -> Iterator[str]:
    """A gateway attached to the shared real vLLM engine (tiny model); waits for the engine start."""
    address, _engine = vllm_engine
    # ~40 s on a quiet box; 244 s was seen at load 17
    proc, url = start_gateway(address, name="gateway-vllm", timeout=480)
    yield url
    proc.stop()


@pytest.fixture(scope="session")
def parser_gateway(tiny_model: Path, ipc_dir: Path) -> Iterator[str]:
    """``tokenfan serve`` on the tiny model with :data:`~tests.procs.PARSER_FLAGS` (float32): the
    differential suite against ``vllm serve`` and the agent SDK tests share this one process."""
    port = free_port()
    proc = spawn(["-m", "gateway.cli", "serve", "--engine", "vllm", "--model", str(tiny_model),
                  "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512",
                  "--kv-cache-gib", "1", "--engine-address", f"ipc://{ipc_dir / 'parser.sock'}",
                  "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *PARSER_FLAGS],
                 "tokenfan-parser", env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=600)
        yield url
    finally:
        proc.stop(timeout=30)


@pytest.fixture(scope="session")
def node_dir() -> Path:
    """``tests/node`` with the npm packages of its lockfile installed (``npm ci`` when they are not)."""
    try:
        return npm_ci()
    except RuntimeError as exc:
        pytest.fail(str(exc))
