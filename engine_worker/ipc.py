"""ZeroMQ endpoint helpers shared by engine and gateway: private IPC paths, loopback checks."""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import socket
import stat
import time
from pathlib import Path

log = logging.getLogger(__name__)


def ipc_path(address: str) -> Path | None:
    return Path(address[len("ipc://"):]) if address.startswith("ipc://") else None


def prepare_ipc_dir(address: str) -> None:
    """Create the socket's directory private to this user (0700) and remove a stale socket."""
    path = ipc_path(address)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.parent.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"IPC directory {path.parent} belongs to uid {st.st_uid}, not to us")
    os.chmod(path.parent, 0o700)
    if path.exists() and stat.S_ISSOCK(path.stat().st_mode):
        path.unlink()


def secure_ipc_socket(address: str) -> None:
    """After bind: make the socket file 0600."""
    path = ipc_path(address)
    if path is not None and path.exists():
        os.chmod(path, 0o600)


def check_tcp_bind(address: str, allow_remote: bool) -> None:
    """Refuse a non-loopback ``tcp://`` bind unless explicitly allowed (then warn)."""
    if not address.startswith("tcp://"):
        return
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return
    if not allow_remote:
        raise ValueError(
            f"refusing to bind the engine socket to non-loopback {address}: the engine link is "
            "unauthenticated; use --curve-dir (CURVE keys from `tokenfan keys DIR`), or pass "
            "--allow-remote-engine to do it anyway on a private network"
        )
    log.warning("engine socket bound to non-loopback %s (authenticated only with --curve-dir)", address)


def sweep_stale(directory: Path, *, min_age_s: float = 60.0, claim_life_s: float = 600.0) -> int:
    """Remove what killed processes left in a private runtime directory; returns how many entries went.

    A socket goes when nothing listens on it (a connect is refused) and it is older than ``min_age_s`` (a
    process between its bind and its listen is never mistaken for a dead one); an adoption claim
    (``adopt-*``, see ``gateway.scaleout.peers``) when older than its ``claim_life_s``; a ``vllm-<pid>``
    directory (vLLM's own sockets, ``engine_worker.backends.vllm.private_rpc_dir``) when its process is gone.
    """
    if not directory.is_dir() or directory.stat().st_uid != os.getuid():
        return 0
    now, removed = time.time(), 0
    for entry in directory.iterdir():
        try:
            st = entry.lstat()
        except FileNotFoundError:
            continue
        age = now - st.st_mtime
        stale = False
        if stat.S_ISSOCK(st.st_mode) and age > min_age_s:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                try:
                    probe.connect(str(entry))
                except ConnectionRefusedError:
                    stale = True
                except OSError:
                    pass  # listening but busy, or not ours to judge
        elif stat.S_ISREG(st.st_mode) and entry.name.startswith("adopt-") and age > claim_life_s:
            stale = True
        elif stat.S_ISDIR(st.st_mode) and entry.name.startswith("vllm-"):
            owner = entry.name.removeprefix("vllm-")
            if owner.isdigit() and not _running(int(owner)):
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
            continue
        if stale:
            entry.unlink(missing_ok=True)
            removed += 1
    if removed:
        log.info("removed %d stale entries (sockets nobody listens on, expired claims, dead processes' vLLM "
                 "socket directories) from %s", removed, directory)
    return removed


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
