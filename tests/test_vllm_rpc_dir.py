"""vLLM's own ZeroMQ sockets go to a private directory per engine process (engine_worker.backends.vllm)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from engine_worker.backends.vllm import private_rpc_dir


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_directory_is_private_and_leaves_the_sweep_to_the_engine_start(tmp_path: Path) -> None:
    """``private_rpc_dir`` makes this process's directory and sweeps nothing: the engine worker's start is the
    one sweep of the runtime directory (tests/test_ipc_sweep.py)."""
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    dead = runtime / f"vllm-{_dead_pid()}"
    dead.mkdir()

    path = private_rpc_dir(runtime)

    assert path == runtime / f"vllm-{os.getpid()}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    assert dead.is_dir()
    assert private_rpc_dir(runtime) == path  # a second call (a restart in the same process) keeps it


def test_the_runtime_directory_is_made_when_missing(tmp_path: Path) -> None:
    path = private_rpc_dir(tmp_path / "a" / "b")
    assert path.is_dir() and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
