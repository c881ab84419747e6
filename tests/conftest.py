"""Session fixtures: real engine processes and real gateways on loopback ports.

One synthetic engine and one vLLM engine (tiny random-weight Llama built locally) are shared by
the whole session: each vLLM start costs ~30 s.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Proc, start_engine, start_gateway


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
