"""Real packet loss for the bench: a client and a gateway namespace, the wire between them, the kernel's drops.

:class:`LossyNet` creates two network namespaces of its own (``tfc<pid>`` for the bench's clients,
``tfg<pid>`` for the gateways), joins them with the packet wire (:mod:`tokenfan_bench.network.wire`: the
profile's RTT, jitter and bandwidth on every IP packet) and adds random loss with the kernel's
``iptables -m statistic --mode random --probability P -j DROP`` on arrival in each namespace (each way) and
for TCP and UDP alike, so the kernels' TCP (fast retransmit, tail-loss probes, retransmission timeouts)
and QUIC's own recovery repair it at the path's RTT. A burst variant drops in bursts at the wire instead
(Gilbert-Elliott). Nothing else on the machine sees this traffic; the namespaces go when it ends.

What was really lost and repaired is read beside each run (:meth:`LossyNet.counters`): the packets each
iptables rule saw and dropped, the wire's packets and burst drops, and the kernel's TCP counters in both
namespaces (``/proc/net/snmp`` and ``/proc/net/netstat`` read inside each: ``RetransSegs``, ``OutSegs``,
``TCPLossProbes``, ``TCPTimeouts``). QUIC's retransmissions are userspace (aioquic) and not counted here.

Processes join a namespace through :meth:`LossyNet.inside` (the calling thread's namespace; children
started meanwhile inherit it). Needs root, ``ip`` and ``iptables``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Self

from tokenfan_bench.network.wire import CLIENT_IP, DEVICE, GATEWAY_IP, in_namespace

SNMP_FIELDS = {("Tcp", "RetransSegs"), ("Tcp", "OutSegs"), ("Tcp", "InSegs"), ("Udp", "InDatagrams"),
               ("Udp", "OutDatagrams"), ("TcpExt", "TCPLossProbes"), ("TcpExt", "TCPTimeouts"),
               ("TcpExt", "TCPFastRetrans"), ("TcpExt", "TCPSpuriousRTOs")}


@dataclass(frozen=True)
class Loss:
    """A loss level: ``random`` fraction dropped by iptables, or ``burst`` fraction dropped by the wire in
    bursts of ``burst_len`` packets on average."""

    name: str
    random: float = 0.0
    burst: float = 0.0
    burst_len: float = 8.0

    def describe(self) -> str:
        if self.burst:
            return f"{100 * self.burst:g}% in bursts of {self.burst_len:g} packets (mean)"
        return f"{100 * self.random:g}% random" if self.random else "no added loss"


def parse_loss(text: str) -> Loss:
    """``0.5%`` (random), ``2%-burst`` or ``2%-burst/8`` (bursts, mean length 8 packets), ``0%``."""
    m = re.fullmatch(r"([\d.]+)%(?:-burst(?:/([\d.]+))?)?", text.strip())
    if not m:
        raise ValueError(f"loss level {text!r}: want PERCENT%, e.g. 2%, or PERCENT%-burst[/PACKETS]")
    value = float(m.group(1)) / 100
    if not 0 <= value < 0.5:
        raise ValueError(f"loss level {text!r}: below 50% please")
    if "-burst" in text:
        return Loss(text.strip(), burst=value, burst_len=float(m.group(2) or 8))
    return Loss(text.strip(), random=value)


def parse_snmp(text: str) -> dict[str, int]:
    """``Section.Field -> value`` from ``/proc/net/snmp`` or ``/proc/net/netstat`` text (pairs of lines: a
    header of names, then the values), only the :data:`SNMP_FIELDS`."""
    out: dict[str, int] = {}
    lines = text.splitlines()
    for head, values in zip(lines[::2], lines[1::2]):
        section, _, names = head.partition(":")
        section2, _, nums = values.partition(":")
        if section != section2:
            continue
        for name, num in zip(names.split(), nums.split()):
            if (section, name) in SNMP_FIELDS:
                out[f"{section}.{name}"] = int(num)
    return out


def parse_iptables(text: str) -> dict[str, int]:
    """Packet counts of the rules this module adds (``iptables -L -v -x -n`` text), by their comment."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = re.search(r"/\* (tokenfan-[\w-]+) \*/", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0) + int(line.split()[0])
    return out


def available() -> str | None:
    """Why loss profiles cannot run here (None when they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, iptables, TUN devices)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"needs {tool} (Debian: iproute2, iptables)"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun"
    return None


class LossyNet:
    """Two namespaces, the wire, the loss rules; :meth:`close` (or the context) removes them."""

    def __init__(self, profile_spec: str, loss: Loss, seed: int = 0, tag: str = "") -> None:
        why = available()
        if why:
            raise RuntimeError(f"loss profiles: {why}")
        suffix = tag or str(os.getpid())
        self.client_ns, self.gateway_ns = f"tfc{suffix}", f"tfg{suffix}"
        self.profile_spec, self.loss, self.seed = profile_spec, loss, seed
        self.wire: subprocess.Popen[str] | None = None
        self.gateway_ip, self.client_ip = GATEWAY_IP, CLIENT_IP

    def __enter__(self) -> Self:
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> None:
        for ns in (self.client_ns, self.gateway_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)  # a leftover
            subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        args = [sys.executable, "-m", "tokenfan_bench.network.wire", self.client_ns, self.gateway_ns,
                "--profile", self.profile_spec, "--seed", str(self.seed)]
        if self.loss.burst:
            args += ["--burst", f"{100 * self.loss.burst:g}%/{self.loss.burst_len:g}"]
        self.wire = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.wire.stdout is not None
        line = self.wire.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the packet wire did not start (exit {self.wire.poll()}): {line!r}")
        if self.loss.random:
            self._iptables_rules(self.loss.random)

    def _iptables_rules(self, p: float) -> None:
        """Random drops on arrival, each way: the up packets in the gateway namespace's INPUT, the down ones in
        the client's. Not in OUTPUT: a packet dropped there fails the sender's own ``sendmsg`` (EPERM), which
        a UDP sender sees as an error (Chromium closes its QUIC connection: ERR_QUIC_PROTOCOL_ERROR), where
        loss on a network is silent."""
        for ns, way in ((self.gateway_ns, "up"), (self.client_ns, "down")):
            for proto in ("tcp", "udp"):
                base = ["ip", "netns", "exec", ns, "iptables", "-w", "-A", "INPUT", "-i", DEVICE, "-p", proto]
                subprocess.run([*base, "-m", "comment", "--comment", f"tokenfan-seen-{way}-{proto}"],
                               check=True, capture_output=True)
                subprocess.run([*base, "-m", "statistic", "--mode", "random", "--probability", f"{p:.6f}",
                                "-m", "comment", "--comment", f"tokenfan-drop-{way}-{proto}", "-j", "DROP"],
                               check=True, capture_output=True)

    def _in(self, ns: str, *cmd: str) -> str:
        return subprocess.run(["ip", "netns", "exec", ns, *cmd], check=True, capture_output=True,
                              text=True).stdout

    def _wire(self, command: str) -> dict[str, Any]:
        assert self.wire is not None and self.wire.stdin is not None and self.wire.stdout is not None
        self.wire.stdin.write(command + "\n")
        self.wire.stdin.flush()
        return json.loads(self.wire.stdout.readline())  # type: ignore[no-any-return]

    def counters(self) -> dict[str, Any]:
        """Everything counted so far: iptables rules, the wire, TCP in each namespace (absolute values)."""
        tcp = {side: parse_snmp(self._in(ns, "cat", "/proc/net/snmp") + self._in(ns, "cat", "/proc/net/netstat"))
               for side, ns in (("client", self.client_ns), ("gateway", self.gateway_ns))}
        rules: dict[str, int] = {}
        if self.loss.random:
            for ns in (self.client_ns, self.gateway_ns):
                rules.update(parse_iptables(self._in(ns, "iptables", "-w", "-L", "INPUT", "-v", "-x", "-n")))
        return {"iptables": rules, "wire": self._wire("stats"), "tcp": tcp}

    def reset(self) -> None:
        """Zero the wire's and the rules' counters (the kernel's TCP counters are read as differences)."""
        self._wire("reset")
        if self.loss.random:
            for ns in (self.client_ns, self.gateway_ns):
                self._in(ns, "iptables", "-w", "-Z", "INPUT")

    @contextlib.contextmanager
    def inside(self, side: str) -> Iterator[None]:
        """Run the calling thread (and the processes it starts meanwhile) in the ``client`` or ``gateway``
        namespace."""
        with in_namespace(self.client_ns if side == "client" else self.gateway_ns):
            yield

    def close(self) -> None:
        if self.wire is not None:
            with contextlib.suppress(OSError):
                assert self.wire.stdin is not None
                self.wire.stdin.close()
            try:
                self.wire.wait(5)
            except subprocess.TimeoutExpired:
                self.wire.kill()
                self.wire.wait(5)
            self.wire = None
        for ns in (self.client_ns, self.gateway_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def measured(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What one run saw (``after`` minus ``before`` where counters are absolute): per protocol, the packets
    that crossed the lossy hop and those dropped (iptables and the wire's bursts), the measured loss, and the
    kernel's TCP retransmissions per segment sent, each namespace."""
    out: dict[str, Any] = {"protocols": {}, "tcp": {}}
    rules, wire = after["iptables"], after["wire"]
    for proto in ("tcp", "udp"):
        ways = ("up", "down")
        if rules:  # random loss: the rules see every packet that crossed the wire, on arrival
            sent = sum(rules.get(f"tokenfan-seen-{w}-{proto}", 0) for w in ways)
            dropped = sum(rules.get(f"tokenfan-drop-{w}-{proto}", 0) for w in ways)
        else:  # bursts (or none): the wire sees every packet and drops the bursts
            sent = sum(wire["packets"].get(w, {}).get(proto, 0) for w in ways)
            dropped = sum(wire["burst_drops"].get(w, {}).get(proto, 0) for w in ways)
        out["protocols"][proto] = {"packets": sent, "dropped": dropped, "loss": dropped / sent if sent else None,
                                   "queue_drops": sum(wire["queue_drops"].get(w, {}).get(proto, 0) for w in ways)}
    for side in ("client", "gateway"):
        a, b = after["tcp"][side], before["tcp"][side]
        d = {k: a.get(k, 0) - b.get(k, 0) for k in a}
        out_segs = d.get("Tcp.OutSegs", 0)
        out["tcp"][side] = {**d, "retrans_per_segment": d.get("Tcp.RetransSegs", 0) / out_segs if out_segs else None}
    return out
