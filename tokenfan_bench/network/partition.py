"""Real network partitions, for the suite and ``tokenfan bench partitions``: an *island* is a network namespace
joined to the machine's own by a veth pair; a process started :meth:`Island.inside` it reaches the machine at
:attr:`Island.host_ip` and is reached at :attr:`Island.ip`. :meth:`Island.cut` adds ``iptables -j DROP`` rules
inside the island, both ways, for one TCP port of the machine: packets are held, nothing is refused or reset,
which is what a partition looks like to TCP (the kernel has no ``netem`` here; namespaces, veth and iptables
work). Unix sockets (``ipc://`` engine links) are not partitioned: a namespace does not reach a path socket.

Needs root, ``ip`` (iproute2) and ``iptables``; :func:`available` says why not otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Self

from tokenfan_bench.network.wire import in_namespace


def available() -> str | None:
    """Why islands cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, iptables)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"needs {tool} (Debian: iproute2, iptables)"
    return None


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


class Island:
    """One namespace (``tfi<tag>``) and its veth pair; ``index`` (0..63) keeps several islands of one process
    apart, the process id those of concurrent runs (its /30 network is ``10.204.<pid % 250>.<4 index>``)."""

    def __init__(self, index: int = 0, tag: str | None = None) -> None:
        why = available()
        if why:
            raise RuntimeError(f"network partitions: {why}")
        if not 0 <= index < 64:
            raise ValueError("island index: 0 to 63")
        tag = tag or f"{os.getpid() % 100000}i{index}"
        self.ns = f"tfi{tag}"
        self.host_dev, self.dev = f"tfh{tag}"[:15], f"tfn{tag}"[:15]
        net = f"10.204.{os.getpid() % 250}"
        self.host_ip, self.ip = f"{net}.{4 * index + 1}", f"{net}.{4 * index + 2}"
        self.cuts: set[int] = set()

    def __enter__(self) -> Self:
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("ip", "netns", "del", self.ns)  # a namespace a killed run left behind
        _run("ip", "netns", "add", self.ns)
        try:
            _run("ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", self.dev)
            _run("ip", "link", "set", self.dev, "netns", self.ns)
            _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_dev)
            _run("ip", "link", "set", self.host_dev, "up")
            for cmd in (("ip", "addr", "add", f"{self.ip}/30", "dev", self.dev), ("ip", "link", "set", self.dev, "up"),
                        ("ip", "link", "set", "lo", "up")):
                _run("ip", "netns", "exec", self.ns, *cmd)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove the namespace (its end of the veth pair goes with it, and so does the other)."""
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("ip", "netns", "del", self.ns)
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("ip", "link", "del", self.host_dev)

    def inside(self) -> contextlib.AbstractContextManager[None]:
        """Run the calling thread (and the processes it starts meanwhile) inside the island."""
        return in_namespace(self.ns)

    def _rules(self, port: int) -> list[list[str]]:
        comment = ["-m", "comment", "--comment", f"tokenfan-cut-{port}"]
        return [["OUTPUT", "-p", "tcp", "-d", self.host_ip, "--dport", str(port), *comment, "-j", "DROP"],
                ["INPUT", "-p", "tcp", "-s", self.host_ip, "--sport", str(port), *comment, "-j", "DROP"]]

    def cut(self, port: int) -> None:
        """Drop every packet between the island and ``port`` on the machine, both ways, from now on."""
        for rule in self._rules(port):
            _run("ip", "netns", "exec", self.ns, "iptables", "-w", "-I", *rule)
        self.cuts.add(port)

    def heal(self, port: int) -> None:
        """Let the packets of ``port`` through again (TCP retransmits what was held)."""
        for rule in self._rules(port):
            _run("ip", "netns", "exec", self.ns, "iptables", "-w", "-D", *rule)
        self.cuts.discard(port)
