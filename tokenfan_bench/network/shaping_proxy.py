"""Network profiles for the bench: a userspace shaping TCP proxy (this kernel has no ``netem``).

A profile (:class:`Profile`) is round-trip time, jitter, bandwidth each way and occasional stalls. The
proxy forwards TCP byte for byte (TLS passes through untouched) and delays each read by what the profile
says; every arm of a run goes through the same proxy process, one listener (route) per arm so bytes on
the wire are counted per arm.

The model, per direction of one connection (:class:`Link`, pure, clock passed in):

- **serialization**: a read of ``n`` bytes (cut into :data:`SEGMENT`-byte segments) occupies the link for
  ``8 n / bandwidth`` seconds after the previous one (a FIFO per direction and connection: a user's own
  access link; HTTP/2's K streams on one connection share it);
- **propagation**: ``rtt / 2`` plus the path's jitter ``j(t)`` (:class:`PathJitter`, within ± jitter / 2 each
  way, so the round trip varies by ± jitter): a smooth random
  function of time, the same for every connection of the run (queueing at a shared bottleneck), so two
  subscribers watching one stream see the same path and the paired A/B comparison measures the
  transports, not two independent dice; it changes slowly enough that bytes never overtake each other;
- **stalls** (:class:`Stalls`): the link is frozen a given fraction of the time, in stalls of a given
  length (a Poisson process of stall starts), per connection, both directions at once (a Wi-Fi
  retransmission storm); bytes due inside a stall arrive when it ends;
- **handshake**: a new connection carries no bytes for one RTT (the TCP handshake the kernel already did
  on loopback), so connection set-up costs what it costs on the profile's path. TCP slow start and loss
  recovery are not modelled (a stall stands in for the latter).

The proxy stops reading from a side whose queued bytes pass :data:`WINDOW` (a bounded path buffer), so
a slow link back-pressures the sender as TCP would.

Timer precision: the proxy runs on asyncio's selector loop over ``select(2)`` (:func:`precise_loop`),
whose timeout and clock are sub-millisecond. uvloop (and asyncio's epoll loop) wait in whole
milliseconds, and uvloop's clock is the millisecond of its last wake-up: every read was then delivered
on a millisecond tick, so a difference of 2.1 ms between two arms read as 2 or 3 ms depending on the
phase of the token clock against the tick, a phase that stays put for a whole run (measured: the
browser calibration read +3.2 ms in two profiles of one report and +2.0-2.4 ms in the others, the
probe's 1 ms RTT read 1.9 ms). ``select`` handles file descriptors below 1024 only, so a run is limited
to about 500 proxied connections at once (:data:`MAX_FD`: beyond it new connections are refused). Run as ``python -m tokenfan_bench.network.shaping_proxy``
(:func:`main`), controlled over stdin/stdout by :class:`Shaper` in the bench process; it also serves a
probe target so the bench measures the profile's real RTT and bandwidth through the same code
(:func:`probe`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import random
import re
import selectors
import socket
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Self, cast

SEGMENT = 4096  # bytes scheduled as one unit (a read is cut into these)
WINDOW = 256 * 1024  # bytes queued per direction before the proxy stops reading that side
EARLY_S = 0.00005  # deliver what is due this close to now in the same wake-up
MAX_FD = 1000  # select(2) takes descriptors below FD_SETSIZE (1024); keep a margin for the loop's own


@dataclass(frozen=True)
class Profile:
    """A network path. Bandwidths in bits/s (``None``: unlimited); times in milliseconds."""

    name: str
    rtt_ms: float = 0.0
    jitter_ms: float = 0.0
    down_bps: float | None = None
    up_bps: float | None = None
    stall_fraction: float = 0.0  # of the time the link is frozen
    stall_ms: float = 0.0  # length of one stall

    def describe(self) -> str:
        parts = [f"RTT {self.rtt_ms:g} ms ± {self.jitter_ms:g} ms jitter",
                 f"down {_rate(self.down_bps)}", f"up {_rate(self.up_bps)}"]
        if self.stall_fraction:
            parts.append(f"stalls {100 * self.stall_fraction:g}% of the time, {self.stall_ms:g} ms each")
        return ", ".join(parts)

    def spec(self) -> str:
        """The custom form that parses back to this profile."""
        parts = [f"rtt={self.rtt_ms:g}ms", f"jitter={self.jitter_ms:g}ms"]
        if self.down_bps:
            parts.append(f"down={self.down_bps / 1e6:g}mbit")
        if self.up_bps:
            parts.append(f"up={self.up_bps / 1e6:g}mbit")
        if self.stall_fraction:
            parts.append(f"stall={100 * self.stall_fraction:g}%/{self.stall_ms:g}ms")
        return ",".join(parts)


def _rate(bps: float | None) -> str:
    return "unlimited" if not bps else f"{bps / 1e6:g} Mbit/s"


PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("lan", rtt_ms=1, jitter_ms=0.2, down_bps=1e9, up_bps=1e9),
    Profile("4g", rtt_ms=60, jitter_ms=15, down_bps=20e6, up_bps=5e6, stall_fraction=0.005, stall_ms=200),
    Profile("3g", rtt_ms=200, jitter_ms=40, down_bps=1.6e6, up_bps=0.4e6, stall_fraction=0.01, stall_ms=500),
    Profile("transatlantic", rtt_ms=90, jitter_ms=2, down_bps=100e6, up_bps=100e6),
    Profile("flaky-wifi", rtt_ms=20, jitter_ms=10, down_bps=10e6, up_bps=5e6, stall_fraction=0.03, stall_ms=300),
)}

_UNITS_S = {"ms": 1e-3, "s": 1.0, "us": 1e-6}
_UNITS_BPS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def parse_profile(text: str) -> Profile:
    """A named profile (:data:`PROFILES`) or ``rtt=80ms,jitter=10ms,down=5mbit,up=1mbit,stall=0.5%/300ms``
    (every key optional; ``none`` is no shaping at all)."""
    if text in PROFILES:
        return PROFILES[text]
    if text == "none":
        return Profile("none")
    values: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"--net {text!r}: {part!r} is not key=value; named profiles: {', '.join(PROFILES)}")
        if key in ("rtt", "jitter"):
            values[f"{key}_ms"] = _duration_ms(value)
        elif key in ("down", "up"):
            values[f"{key}_bps"] = _bandwidth(value)
        elif key == "stall":
            m = re.fullmatch(r"([\d.]+)%/(.+)", value)
            if not m:
                raise ValueError(f"--net stall wants PERCENT%/DURATION, e.g. stall=0.5%/300ms; got {value!r}")
            values["stall_fraction"] = float(m.group(1)) / 100
            values["stall_ms"] = _duration_ms(m.group(2))
        else:
            raise ValueError(f"--net: unknown key {key!r} (rtt, jitter, down, up, stall)")
    profile = Profile("custom:" + text, **values)
    if profile.jitter_ms > profile.rtt_ms:
        raise ValueError(f"--net {text!r}: jitter must be at most the RTT (a one-way delay cannot be negative)")
    if not 0 <= profile.stall_fraction < 0.5:
        raise ValueError(f"--net {text!r}: the stall fraction must be below 50%")
    return profile


def _duration_ms(value: str) -> float:
    m = re.fullmatch(r"([\d.]+)(ms|s|us)", value.strip())
    if not m:
        raise ValueError(f"--net: {value!r} is not a duration like 80ms")
    return float(m.group(1)) * _UNITS_S[m.group(2)] * 1e3


def _bandwidth(value: str) -> float:
    m = re.fullmatch(r"([\d.]+)(bit|kbit|mbit|gbit)", value.strip().lower())
    if not m:
        raise ValueError(f"--net: {value!r} is not a bandwidth like 5mbit")
    return float(m.group(1)) * _UNITS_BPS[m.group(2)]


# -- the model (pure) -----------------------------------------------------------------------------


class PathJitter:
    """``j(t)`` in seconds: linear between knots every ``period`` s whose values are uniform in
    ``[-amplitude, amplitude]``, drawn from ``seed`` and the knot's index (a pure function of ``t``).

    The period is at least four amplitudes, so ``|dj/dt| <= 0.5``: later bytes never overtake earlier ones.
    """

    def __init__(self, amplitude_s: float, seed: int, period_s: float | None = None) -> None:
        self.amplitude = amplitude_s
        self.period = max(period_s or 0.0, 4 * amplitude_s, 1e-3)
        self.seed = seed
        self._knots: dict[int, float] = {}

    def knot(self, k: int) -> float:
        v = self._knots.get(k)
        if v is None:
            if len(self._knots) > 100_000:
                self._knots.clear()
            v = self._knots[k] = self.amplitude * (2 * random.Random(self.seed * 1_000_003 + k).random() - 1)
        return v

    def __call__(self, t: float) -> float:
        if not self.amplitude:
            return 0.0
        x = t / self.period
        k = math.floor(x)
        a, b = self.knot(k), self.knot(k + 1)
        return a + (b - a) * (x - k)


def path_jitters(profile: Profile, seed: int) -> tuple[PathJitter, PathJitter]:
    """The run's up and down path jitter: each way within ± jitter / 2, so the round trip varies by ± jitter."""
    half = profile.jitter_ms / 2e3
    return PathJitter(half, seed * 2 + 1), PathJitter(half, seed * 2 + 2)


class Stalls:
    """Stall windows of one connection: starts form a Poisson process of rate ``fraction / length``,
    each stall lasts ``length`` s; drawn lazily from ``rng`` from time ``start`` on."""

    def __init__(self, fraction: float, length_s: float, start: float, rng: random.Random) -> None:
        self.length = length_s
        self.rate = fraction / length_s if fraction and length_s else 0.0
        self.rng = rng
        self.next_start = start + self._gap() if self.rate else math.inf
        self.count = 0  # stalls that delayed something
        self._counted = -1.0

    def _gap(self) -> float:
        return self.rng.expovariate(self.rate)

    def release(self, t: float) -> float:
        """When something due at ``t`` really arrives (``t`` itself, or the end of the stall it falls in)."""
        while self.next_start + self.length <= t:  # stalls wholly before t are past
            self.next_start += self.length + self._gap()
        if self.next_start <= t:
            if self._counted != self.next_start:
                self._counted = self.next_start
                self.count += 1
            return self.next_start + self.length
        return t


class Link:
    """One direction of one connection: when each read arrives on the far side."""

    def __init__(self, base_s: float, bps: float | None, jitter: PathJitter, stalls: Stalls,
                 not_before: float = 0.0) -> None:
        self.base = base_s
        self.bps = bps
        self.jitter = jitter
        self.stalls = stalls
        self.free_at = not_before  # the end of the last serialization
        self.last = 0.0  # the last arrival: arrivals never go backwards (TCP is in order)

    def schedule(self, now: float, nbytes: int) -> float:
        start = max(now, self.free_at)
        self.free_at = start + (8 * nbytes / self.bps if self.bps else 0.0)
        t = self.free_at + max(0.0, self.base + self.jitter(self.free_at))
        t = max(self.stalls.release(t), self.last)
        self.last = t
        return t


def segments(data: bytes) -> list[bytes]:
    return [data[i:i + SEGMENT] for i in range(0, len(data), SEGMENT)] or [data]


# -- the proxy (asyncio) ----------------------------------------------------------------------------

_EOF, _CLOSE = b"", None


@dataclass
class RouteStats:
    """What crossed one route (listener) since the last reset."""

    connections: int = 0
    up_bytes: int = 0
    down_bytes: int = 0
    down_reads: int = 0
    down_deflated: int = 0  # down bytes deflated per read with a sync flush (``compress`` routes only)
    stalls: int = 0


class _Direction:
    """Queued reads of one direction, written to ``dst`` when due (one timer at a time, in order)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, link: Link, on_window: Any) -> None:
        self.loop, self.link, self.on_window = loop, link, on_window
        self.dst: asyncio.Transport | None = None
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.queued = 0
        self.timer: asyncio.TimerHandle | None = None
        self.done = False

    def push(self, data: bytes | None) -> None:
        now = self.loop.time()
        if data:
            for seg in segments(data):
                self.queue.append((self.link.schedule(now, len(seg)), seg))
                self.queued += len(seg)
            if self.queued > WINDOW:
                self.on_window(True)
        else:  # EOF / close markers follow the data through the link
            self.queue.append((self.link.schedule(now, 0), data))
        self._arm()

    def attach(self, dst: asyncio.Transport) -> None:
        self.dst = dst
        self._arm()

    def _arm(self) -> None:
        if self.timer is None and self.queue and self.dst is not None:
            self.timer = self.loop.call_at(self.queue[0][0], self._flush)

    def _flush(self) -> None:
        self.timer = None
        now = self.loop.time() + EARLY_S
        dst = self.dst
        assert dst is not None
        while self.queue and self.queue[0][0] <= now:
            _, data = self.queue.popleft()
            if data is _CLOSE:
                self.done = True
                dst.close()
            elif data == _EOF:
                self.done = True
                if dst.can_write_eof() and not dst.is_closing():
                    try:
                        dst.write_eof()
                    except OSError:  # the peer is already gone (asyncio raises where uvloop did not)
                        dst.close()
            elif not dst.is_closing():
                self.queued -= len(data)
                dst.write(data)
        if self.queued <= WINDOW // 2:
            self.on_window(False)
        self._arm()


class _Pipe:
    """One proxied connection: the client side (accepted), the upstream side, a link each way."""

    def __init__(self, route: Route, client: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        self.route = route
        p = route.profile
        now = loop.time()
        rng = random.Random(route.seed * 7919 + route.opened)
        self.stalls = Stalls(p.stall_fraction, p.stall_ms / 1e3, now, rng)
        half = p.rtt_ms / 2e3
        # The TCP handshake took no time on loopback: the first bytes wait one RTT, as on the real path.
        self.up = _Direction(loop, Link(half, p.up_bps, route.jitter_up, self.stalls, now + 2 * half),
                             lambda full: _pause(client, full))
        self.down = _Direction(loop, Link(half, p.down_bps, route.jitter_down, self.stalls),
                               self._window_upstream)
        self.client = client
        self.upstream: asyncio.Transport | None = None
        self.deflate = zlib.compressobj(6, zlib.DEFLATED, -15) if route.compress else None
        self.down.attach(client)

    def _window_upstream(self, full: bool) -> None:
        if self.upstream is not None:
            _pause(self.upstream, full)

    @property
    def stats(self) -> RouteStats:  # the route's current counters (a reset replaces them)
        return self.route.stats

    def from_client(self, data: bytes | None) -> None:
        if data:
            self.stats.up_bytes += len(data)
        self.up.push(data)

    def from_upstream(self, data: bytes | None) -> None:
        if data:
            self.stats.down_bytes += len(data)
            self.stats.down_reads += 1
            if self.deflate is not None:  # what permessage-deflate / a flushed gzip would send
                out = self.deflate.compress(data) + self.deflate.flush(zlib.Z_SYNC_FLUSH)
                self.stats.down_deflated += len(out) - 4  # the 00 00 ff ff tail is not sent (RFC 7692)
        self.down.push(data)

    def upstream_ready(self, transport: asyncio.Transport) -> None:
        self.upstream = transport
        self.up.attach(transport)

    def closed(self) -> None:
        self.stats.stalls += self.stalls.count
        self.stalls.count = 0


def _pause(transport: asyncio.Transport, full: bool) -> None:
    if transport.is_closing():
        return
    if full:
        transport.pause_reading()
    else:
        transport.resume_reading()


class _ClientSide(asyncio.Protocol):
    def __init__(self, route: Route) -> None:
        self.route = route
        self.pipe: _Pipe | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.fileno() >= MAX_FD:
            print(f"netem: refusing a connection: descriptor {sock.fileno()} >= {MAX_FD} (select(2) limit; "
                  "too many proxied connections at once)", file=sys.stderr, flush=True)
            transport.abort()
            return
        self.route.stats.connections += 1
        self.route.opened += 1
        _nodelay(transport)
        self.pipe = pipe = _Pipe(self.route, transport)
        asyncio.get_running_loop().create_task(self._connect(pipe))

    async def _connect(self, pipe: _Pipe) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_connection(lambda: _UpstreamSide(pipe), *self.route.upstream)
        except OSError:
            pipe.client.close()
            return
        _nodelay(transport)
        pipe.upstream_ready(transport)

    def data_received(self, data: bytes) -> None:
        assert self.pipe is not None
        self.pipe.from_client(data)

    def eof_received(self) -> bool:
        assert self.pipe is not None
        self.pipe.from_client(_EOF)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.pipe is None:  # refused (MAX_FD)
            return
        self.pipe.from_client(_CLOSE)
        self.pipe.closed()


class _UpstreamSide(asyncio.Protocol):
    def __init__(self, pipe: _Pipe) -> None:
        self.pipe = pipe

    def data_received(self, data: bytes) -> None:
        self.pipe.from_upstream(data)

    def eof_received(self) -> bool:
        self.pipe.from_upstream(_EOF)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.pipe.from_upstream(_CLOSE)


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclass
class Route:
    """A listener forwarding to ``upstream`` (host, port) through ``profile``."""

    profile: Profile
    upstream: tuple[str, int]
    seed: int
    jitter_up: PathJitter
    jitter_down: PathJitter
    compress: bool = False
    opened: int = 0  # connections since start (seeds each one's stalls)
    stats: RouteStats = field(default_factory=RouteStats)


# -- the probe target -----------------------------------------------------------------------------


class _ProbeServer(asyncio.Protocol):
    """``p`` echoes one byte; ``d`` + u32 n sends n bytes; ``u`` + u32 n answers one byte after n bytes."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        self.t = transport
        _nodelay(transport)
        self.buf = b""
        self.upload = 0

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.buf:
            if self.upload:
                take = min(self.upload, len(self.buf))
                self.upload -= take
                self.buf = self.buf[take:]
                if not self.upload:
                    self.t.write(b"u")
                continue
            op = self.buf[:1]
            if op == b"p":
                self.buf = self.buf[1:]
                self.t.write(b"p")
            elif len(self.buf) < 5:
                return
            else:
                (n,) = struct.unpack("!I", self.buf[1:5])
                self.buf = self.buf[5:]
                if op == b"d":
                    self.t.write(b"\0" * n)
                else:
                    self.upload = n


def probe(host: str, port: int, profile: Profile, pings: int = 15) -> dict[str, Any]:
    """Measure RTT and bandwidth through a route to the probe target: median and spread of ``pings``
    one-byte round trips on one connection, then a download and an upload of ~0.5 s of the profile's
    bandwidth (at least 64 KiB, at most 8 MiB)."""
    with socket.create_connection((host, port), timeout=60) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall(b"p")
        _recv_exact(s, 1)
        connect_ms = (time.perf_counter() - t0) * 1e3  # includes the modelled handshake
        rtts = []
        for _ in range(pings):
            t0 = time.perf_counter()
            s.sendall(b"p")
            _recv_exact(s, 1)
            rtts.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.01)
        rtts.sort()
        out: dict[str, Any] = {"rtt_ms": rtts[len(rtts) // 2], "rtt_min_ms": rtts[0], "rtt_max_ms": rtts[-1],
                               "first_exchange_ms": connect_ms}
        for key, bps, op in (("down_mbit", profile.down_bps, b"d"), ("up_mbit", profile.up_bps, b"u")):
            n = int(min(8 << 20, max(64 << 10, (bps or 1e9) * 0.5 / 8)))
            t0 = time.perf_counter()
            if op == b"d":
                s.sendall(b"d" + struct.pack("!I", n))
                first = len(s.recv(65536))
                t1 = time.perf_counter()
                _recv_exact(s, n - first)
                secs = time.perf_counter() - t1
                out[key] = 8 * (n - first) / secs / 1e6 if secs > 0 else None
            else:
                s.sendall(b"u" + struct.pack("!I", n) + b"\0" * n)
                _recv_exact(s, 1)
                secs = time.perf_counter() - t0 - out["rtt_ms"] / 1e3
                out[key] = 8 * n / secs / 1e6 if secs > 0 else None
        return out


def _recv_exact(s: socket.socket, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        b = s.recv(min(1 << 20, n - got))
        if not b:
            raise ConnectionError("probe: connection closed")
        parts.append(b)
        got += len(b)
    return b"".join(parts)


# -- the process and its controller -----------------------------------------------------------------


async def serve(profile: Profile, upstreams: list[tuple[str, int]], seed: int, compress: list[bool]) -> None:
    """Listen on one free port per upstream plus one probe route; print the ports as a JSON line; then
    answer ``stats``/``reset`` lines on stdin with JSON lines until stdin closes."""
    loop = asyncio.get_running_loop()
    probe_srv = await loop.create_server(_ProbeServer, "127.0.0.1", 0)
    probe_port = probe_srv.sockets[0].getsockname()[1]
    jitter_up, jitter_down = path_jitters(profile, seed)
    routes = [Route(profile, up, seed + i, jitter_up, jitter_down, c)
              for i, (up, c) in enumerate(zip([*upstreams, ("127.0.0.1", probe_port)], [*compress, False]))]
    servers = [await loop.create_server(_factory(r), "127.0.0.1", 0, backlog=4096) for r in routes]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    print(json.dumps({"ports": ports[:-1], "probe_port": ports[-1]}), flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).strip():
        if line == b"reset":
            for r in routes:
                r.stats = RouteStats()
        print(json.dumps([asdict(r.stats) for r in routes[:-1]]), flush=True)
    for srv in (*servers, probe_srv):
        srv.close()


def _factory(route: Route) -> Callable[[], asyncio.Protocol]:
    return lambda: _ClientSide(route)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tokenfan_bench.network.shaping_proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--net", required=True, help="profile name or custom form (see parse_profile)")
    ap.add_argument("--upstream", action="append", required=True, metavar="HOST:PORT")
    ap.add_argument("--compress", action="append", default=[], metavar="I",
                    help="route index whose down bytes are also deflated per read (counted, not sent)")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    ups = [(h, int(p)) for h, p in (u.rsplit(":", 1) for u in ns.upstream)]
    compress = [str(i) in ns.compress for i in range(len(ups))]
    loop = precise_loop()
    try:
        loop.run_until_complete(serve(parse_profile(ns.net), ups, ns.seed, compress))
    finally:
        loop.close()


def precise_loop() -> asyncio.AbstractEventLoop:
    """An asyncio loop whose timers fire within tens of µs of their time (``select(2)`` takes a
    microsecond timeout; see the module docstring for why not uvloop or epoll)."""
    return asyncio.SelectorEventLoop(selectors.SelectSelector())


class Shaper:
    """The shaping proxy process, seen from the bench: one URL per upstream, stats, probe."""

    def __init__(self, profile: Profile, upstream_urls: list[str], seed: int = 0,
                 compress: tuple[int, ...] | None = None) -> None:
        """``compress``: the routes whose down bytes are also deflated (default: the plain-HTTP ones)."""
        from urllib.parse import urlsplit

        if compress is None:
            compress = tuple(i for i, u in enumerate(upstream_urls) if u.startswith("http:"))

        self.profile = profile
        self.upstream_urls = upstream_urls
        self._down_jitter = path_jitters(profile, seed)[1]
        # The proxy times its links on the monotonic clock (``loop.time()``); the gateway stamps the wall clock.
        self._mono_minus_wall_ns = time.monotonic_ns() - time.time_ns()
        hosts = []
        for u in upstream_urls:
            s = urlsplit(u)
            hosts.append(f"{s.hostname}:{s.port or (443 if s.scheme == 'https' else 80)}")
        args = [sys.executable, "-m", "tokenfan_bench.network.shaping_proxy", "--net", profile.spec() if profile.name.startswith(
            "custom:") else profile.name, "--seed", str(seed)]
        for h in hosts:
            args += ["--upstream", h]
        for i in compress:
            args += ["--compress", str(i)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise RuntimeError(f"the shaping proxy exited with {self.proc.returncode}")
        ports = json.loads(line)
        self.ports: list[int] = ports["ports"]
        self.probe_port: int = ports["probe_port"]
        self.urls = [f"{urlsplit(u).scheme}://{urlsplit(u).hostname}:{p}" for u, p in zip(upstream_urls, self.ports)]

    def _ask(self, command: str) -> list[dict[str, Any]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command.encode() + b"\n")
        self.proc.stdin.flush()
        return list(json.loads(self.proc.stdout.readline()))

    def stats(self) -> list[dict[str, Any]]:
        """Per route: connections, up/down bytes, down reads, deflated down bytes, stalls."""
        return self._ask("stats")

    def reset(self) -> list[dict[str, Any]]:
        return self._ask("reset")

    def down_jitter_ns(self, wall_ns: Sequence[int]) -> list[float]:
        """The path jitter (ns) the proxy adds to bytes it forwards down at these wall-clock times (ns): a
        seeded function of time, the same for every connection of the run (:class:`PathJitter`)."""
        j, shift = self._down_jitter, self._mono_minus_wall_ns
        return [j((t + shift) / 1e9) * 1e9 for t in wall_ns]

    def probe(self) -> dict[str, Any]:
        return probe("127.0.0.1", self.probe_port, self.profile)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    main()
