"""``tokenfan probe``: is the engine worker at an address alive? The engine container's probe (deploy/k8s).

It pings the engine over its own socket, as a gateway does (a ``Ping``; the engine answers with a
``Heartbeat`` from the loop that serves the gateways), and exits 0 when the answer arrives within
``--timeout``, 1 otherwise. It asks nothing of a gateway or of Redis, so a gateway that is down, restarting
or waiting for Redis never restarts the engine. An engine still loading its model has not bound its
socket yet: no answer (the startup probe allows for that). The engine keeps a probe's identity as it keeps
a gateway's and forgets it after ``--gateway-grace``; a probe submits nothing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import zmq

from engine_worker import protocol as p
from engine_worker.curve import connect_curve


def ping(address: str, timeout: float, curve_dir: Path | None = None) -> p.Heartbeat | None:
    """The engine's heartbeat in answer to one ping, or None if none came within ``timeout`` seconds."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if curve_dir is not None:
            connect_curve(sock, curve_dir)
        sock.connect(address)
        sock.send_multipart(p.encode(p.Ping(sent_ns=p.now_ns())))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                return None
            try:
                msg = p.decode(sock.recv_multipart())
            except p.WireError:  # another protocol version: not an answer this probe can read
                continue
            if isinstance(msg, p.Heartbeat):
                return msg
        return None
    finally:
        sock.close(linger=0)
        ctx.term()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan probe", description=(
        "Ping the engine worker at ADDRESS over its socket; exit 0 if it answers within --timeout, else 1. "
        "The engine container's startup and liveness probe: it asks no gateway and no Redis."))
    ap.add_argument("address", help="the engine's address, as its --address (ipc://… or tcp://…)")
    ap.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer (default 2)")
    ap.add_argument("--curve-dir", type=Path, default=None,
                    help="the CURVE key directory of a tcp:// engine (as the gateway's --curve-dir)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    hb = ping(ns.address, ns.timeout, ns.curve_dir)
    if hb is None:
        print(f"tokenfan probe: no answer from the engine at {ns.address} within {ns.timeout:g} s", file=sys.stderr)
        return 1
    print(f"engine {hb.engine_id} ({hb.backend}, {hb.model}): running {hb.running}, waiting {hb.waiting}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
