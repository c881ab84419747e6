"""``engine_worker.ipc.sweep_stale``: what killed processes leave in the runtime directory goes, nothing live."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from engine_worker.ipc import sweep_stale


def _aged(path: Path, seconds: float) -> Path:
    when = time.time() - seconds
    os.utime(path, (when, when), follow_symlinks=False)
    return path


def _socket(path: Path, *, listening: bool) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if listening:
        sock.listen()
    return sock


def test_dead_sockets_and_expired_claims_go_live_and_young_ones_stay(tmp_path: Path) -> None:
    live = _socket(tmp_path / "engine-8000.sock", listening=True)
    dead = _socket(tmp_path / "engine-8001.sock", listening=False)
    dead.close()  # the file stays, as after a SIGKILL
    young = _socket(tmp_path / "gateway-8002-w1.sock", listening=False)
    young.close()
    _aged(tmp_path / "engine-8000.sock", 3600)
    _aged(tmp_path / "engine-8001.sock", 3600)
    for name, age in (("adopt-8000-chatcmpl-1-a", 3600), ("adopt-8000-chatcmpl-2-a", 30), ("notes.txt", 3600)):
        (tmp_path / name).touch()
        _aged(tmp_path / name, age)
    try:
        assert sweep_stale(tmp_path) == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "adopt-8000-chatcmpl-2-a", "engine-8000.sock", "gateway-8002-w1.sock", "notes.txt"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(tmp_path / "engine-8000.sock"))  # still served
    finally:
        live.close()


def test_a_missing_directory_is_nothing_to_do(tmp_path: Path) -> None:
    assert sweep_stale(tmp_path / "absent") == 0


def test_the_vllm_socket_directories_of_dead_processes_go_and_the_living_ones_stay(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = tmp_path / f"vllm-{child.pid}"
    dead.mkdir()
    (dead / "engine-core-socket").touch()
    alive, other = tmp_path / f"vllm-{os.getpid()}", tmp_path / "vllm-notes"
    alive.mkdir()
    other.mkdir()
    assert sweep_stale(tmp_path) == 1
    assert not dead.exists() and alive.is_dir() and other.is_dir()


def test_an_engine_worker_sweeps_the_runtime_directory_once_at_its_start(tmp_path: Path) -> None:
    """``tokenfan engine`` (and ``tokenfan serve``, through its engine worker) removes a dead engine's vLLM socket
    directory and a socket nobody listens on at its start; its own socket and a live directory stay."""
    runtime = tmp_path / "tokenfan"
    runtime.mkdir(mode=0o700)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = runtime / f"vllm-{child.pid}"
    dead.mkdir()
    alive = runtime / f"vllm-{os.getpid()}"
    alive.mkdir()
    left = runtime / "gateway-1-w0.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(left))  # bound, never listening: what a killed process leaves
    old = time.time() - 3600
    os.utime(left, (old, old))
    address = f"ipc://{runtime / 'engine.sock'}"
    proc = subprocess.Popen([sys.executable, "-m", "engine_worker", "--engine", "synthetic", "--engine-address",
                             address], env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (runtime / "engine.sock").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        assert not dead.exists() and not left.exists()
        assert alive.is_dir()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
