"""A packet wire between two network namespaces: the shaping proxy's RTT/bandwidth model at the IP level.

This kernel has no ``netem``, and the shaping proxy (:mod:`tokenfan_bench.network.shaping_proxy`) ends
each TCP connection at itself, so packet loss behind it would be recovered over a hop of microseconds, and
it carries no UDP. The wire instead joins a client namespace and a gateway namespace by one TUN device in
each (``tfw0``, ``10.77.0.1`` ↔ ``10.77.0.2``) and moves every IP packet between them after the delay the
profile gives it, so the kernels' TCP and the QUIC stacks at both ends see the whole path: the handshake,
the round trip, the bandwidth, and each loss, recovered at the path's RTT as on a real network.

The model is the proxy's (:class:`~tokenfan_bench.network.shaping_proxy.Link`), per flow (the 5-tuple:
a TCP connection or a QUIC connection's UDP pair) and direction: serialization at the profile's bandwidth,
propagation ``rtt / 2`` plus the run's path jitter (shared by every flow), stalls. A flow holding more
than :data:`QUEUE_LIMIT` bytes in flight on the wire drops what comes next (a router's tail drop; counted).

Loss: random loss is the kernel's, by ``iptables -m statistic`` rules in the client namespace
(:mod:`tokenfan_bench.network.lossy`); *burst* loss is the wire's, a Gilbert-Elliott chain per direction
(:class:`Bursts`: a bad state that drops every packet, entered so that the mean loss and the mean burst
length are as asked).

Run as ``python -m tokenfan_bench.network.wire CLIENT_NS GATEWAY_NS --profile SPEC [--burst P/LEN]``
(root: it opens a TUN device inside each namespace); it prints ``ready``, then answers ``stats`` and
``reset`` on stdin with one JSON line, and exits at the end of its stdin.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import heapq
import json
import os
import random
import struct
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tokenfan_bench.network.shaping_proxy import (
    Link,
    Profile,
    Stalls,
    parse_profile,
    path_jitters,
    precise_loop,
)

CLIENT_IP, GATEWAY_IP = "10.77.0.1", "10.77.0.2"
DEVICE = "tfw0"
QUEUE_LIMIT = 256 * 1024  # bytes one flow may have on the wire in one direction before tail drop
TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
PROTOS = {6: "tcp", 17: "udp"}


def setns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path`` (``/run/netns/NAME``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def in_namespace(name: str) -> Iterator[None]:
    """Run the calling thread (and the processes it starts meanwhile) in the network namespace ``name``."""
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        setns(f"/run/netns/{name}")
        yield
    finally:
        ctypes.CDLL(None, use_errno=True).setns(home, CLONE_NEWNET)
        os.close(home)


def open_tun(name: str = DEVICE) -> int:
    """A TUN device (IP packets, no packet-info header) in the calling thread's namespace, non-blocking."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def flow_key(packet: bytes) -> tuple[int, bytes, bytes]:
    """``(protocol, source, destination)`` of an IPv4 packet, addresses with ports for TCP and UDP; a flow
    and its reverse differ only by the order of the two."""
    if len(packet) < 20 or packet[0] >> 4 != 4:
        return (0, b"", b"")
    proto, ihl = packet[9], (packet[0] & 0x0F) * 4
    src, dst = packet[12:16], packet[16:20]
    if proto in PROTOS and len(packet) >= ihl + 4:
        src += packet[ihl:ihl + 2]
        dst += packet[ihl + 2:ihl + 4]
    return proto, src, dst


@dataclass
class Bursts:
    """Gilbert-Elliott loss for one direction: in the bad state every packet is dropped. ``loss`` is the
    mean fraction lost, ``length`` the mean burst in packets (``p_exit = 1 / length``; ``p_enter`` so the
    chain spends ``loss`` of the packets in the bad state)."""

    loss: float
    length: float
    rng: random.Random
    bad: bool = False

    def drop(self) -> bool:
        if self.loss <= 0:
            return False
        p_exit = 1.0 / max(1.0, self.length)
        p_enter = self.loss * p_exit / max(1e-9, 1.0 - self.loss)
        self.bad = (self.rng.random() >= p_exit) if self.bad else (self.rng.random() < p_enter)
        return self.bad


def parse_burst(text: str | None) -> tuple[float, float]:
    """``2%/8`` -> (0.02, 8.0): mean loss and mean burst length in packets; None -> no bursts."""
    if not text:
        return 0.0, 1.0
    loss, _, length = text.partition("/")
    value = float(loss.rstrip("%")) / 100
    if not 0 <= value < 0.5:
        raise ValueError(f"burst loss must be below 50%, got {text!r}")
    return value, float(length or 8)


class Counters:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        # direction ("down": gateway -> client, "up") -> protocol -> counts
        self.packets: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.burst_drops: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.queue_drops: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.stalls = 0

    def snapshot(self) -> dict[str, Any]:
        return {"packets": self.packets, "bytes": self.bytes, "burst_drops": self.burst_drops,
                "queue_drops": self.queue_drops, "stalls": self.stalls}


class Wire:
    """Moves packets between the two TUN descriptors with the profile's delays (one event loop)."""

    def __init__(self, client_fd: int, gateway_fd: int, profile: Profile, burst: tuple[float, float],
                 seed: int = 0) -> None:
        self.loop = precise_loop()
        self.fds = {"up": (client_fd, gateway_fd), "down": (gateway_fd, client_fd)}
        self.profile = profile
        self.rng = random.Random(seed)
        self.jitter = dict(zip(("up", "down"), path_jitters(profile, seed)))
        self.bursts = {d: Bursts(burst[0], burst[1], random.Random(seed * 7 + i)) for i, d in enumerate(("up", "down"))}
        self.links: dict[tuple[str, tuple[int, bytes, bytes]], tuple[Link, list[int]]] = {}
        self.heap: list[tuple[float, int, str, tuple[Link, list[int]], bytes]] = []
        self.seq = 0
        self.timer: Any = None
        self.counters = Counters()

    def link(self, direction: str, key: tuple[int, bytes, bytes]) -> tuple[Link, list[int]]:
        entry = self.links.get((direction, key))
        if entry is None:
            p = self.profile
            bps = p.down_bps if direction == "down" else p.up_bps
            stalls = Stalls(p.stall_fraction, p.stall_ms / 1e3, self.loop.time(), random.Random(self.rng.random()))
            entry = self.links[direction, key] = (Link(p.rtt_ms / 2e3, bps, self.jitter[direction], stalls), [0])
        return entry

    def read(self, direction: str) -> None:
        src = self.fds[direction][0]
        now = self.loop.time()
        c = self.counters
        while True:
            try:
                packet = os.read(src, 65536)
            except BlockingIOError:
                break
            key = flow_key(packet)
            proto = PROTOS.get(key[0], "other")
            c.packets[direction][proto] += 1
            c.bytes[direction][proto] += len(packet)
            if self.bursts[direction].drop():
                c.burst_drops[direction][proto] += 1
                continue
            link, queued = entry = self.link(direction, key)
            if queued[0] + len(packet) > QUEUE_LIMIT:
                c.queue_drops[direction][proto] += 1
                continue
            queued[0] += len(packet)
            stalls_before = link.stalls.count
            due = link.schedule(now, len(packet))
            c.stalls += link.stalls.count - stalls_before
            self.seq += 1
            heapq.heappush(self.heap, (due, self.seq, direction, entry, packet))
        self.arm()

    def arm(self) -> None:
        if not self.heap:
            return
        due = self.heap[0][0]
        if self.timer is not None:
            if self.timer.when() <= due:
                return
            self.timer.cancel()
        self.timer = self.loop.call_at(due, self.flush)

    def flush(self) -> None:
        self.timer = None
        now = self.loop.time() + 0.00005
        while self.heap and self.heap[0][0] <= now:
            _, _, direction, (_, queued), packet = heapq.heappop(self.heap)
            queued[0] -= len(packet)
            try:
                os.write(self.fds[direction][1], packet)
            except OSError:  # the far device is down or full: the packet is lost there
                pass
        self.arm()

    def command(self, line: str) -> None:
        if line.strip() == "reset":
            self.counters.reset()
        print(json.dumps(self.counters.snapshot()), flush=True)

    def serve(self) -> None:
        self.loop.add_reader(self.fds["up"][0], self.read, "up")
        self.loop.add_reader(self.fds["down"][0], self.read, "down")

        def stdin() -> None:
            for line in sys.stdin:
                self.loop.call_soon_threadsafe(self.command, line)
            self.loop.call_soon_threadsafe(self.loop.stop)

        threading.Thread(target=stdin, daemon=True).start()
        print("ready", flush=True)
        self.loop.run_forever()


def configure(namespace: str, local: str, peer: str) -> None:
    for args in (["addr", "add", local, "peer", peer, "dev", DEVICE], ["link", "set", DEVICE, "mtu", "1500"],
                 ["link", "set", DEVICE, "up"], ["link", "set", "lo", "up"]):
        subprocess.run(["ip", "-n", namespace, *args], check=True, capture_output=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tokenfan_bench.network.wire")
    ap.add_argument("client_ns")
    ap.add_argument("gateway_ns")
    ap.add_argument("--profile", default="none")
    ap.add_argument("--burst", default=None, help="burst loss LOSS%%/LENGTH (mean loss, mean packets per burst)")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        setns(f"/run/netns/{ns.client_ns}")
        client_fd = open_tun()
        setns(f"/run/netns/{ns.gateway_ns}")
        gateway_fd = open_tun()
    finally:
        ctypes.CDLL(None, use_errno=True).setns(home, CLONE_NEWNET)
        os.close(home)
    configure(ns.client_ns, CLIENT_IP, GATEWAY_IP)
    configure(ns.gateway_ns, GATEWAY_IP, CLIENT_IP)
    Wire(client_fd, gateway_fd, parse_profile(ns.profile), parse_burst(ns.burst), ns.seed).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
