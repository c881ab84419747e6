"""Chaos under load: an engine kill while the gateway is saturated, and slow-but-steady readers.

Readers are raw non-blocking sockets served by one ``selectors`` loop (a Python HTTP client per stream
could not keep up and would measure itself). Figures are written to ``test-artifacts/chaos-*.json``; the
docs/failures.md quotes them. The assertions are the contract, not speed: every client gets an explicit notice,
and gateway memory stays bounded by the logs plus small per-reader buffers.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import statistics
import time
from pathlib import Path

import httpx

from tests.e2e.helpers import metric
from tests.procs import ARTIFACTS, NO_CLIENT_LIMITS, start_engine, start_gateway


def _open(url: str, request: bytes, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    s.sendall(request)
    s.setblocking(False)
    return s


def _post(body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(raw), raw))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def test_an_engine_kill_under_overload_reaches_every_client_explicitly(ipc_dir: Path) -> None:
    # 400 x 50 = 20,000 events/s: more than this 2-core box delivers (CHAOS_N / CHAOS_RATE for other points)
    n, rate = int(os.environ.get("CHAOS_N", "400")), int(os.environ.get("CHAOS_RATE", "50"))
    address = f"ipc://{ipc_dir / 'overload.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-tokens-per-s", str(rate),
                          "--synthetic-ttft-ms", "5", "--max-queue", "5000", "--max-model-len", "20000",
                          name="engine-overload")
    gw, url = start_gateway(address, "--migration-limit", "0", "--max-loop-lag", "0", "--max-tokens-cap", "20000", *NO_CLIENT_LIMITS,
                            name="gateway-overload")
    sel = selectors.DefaultSelector()
    try:
        body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        socks = [_open(url, _post(body)) for _ in range(n)]
        tails = {s: b"" for s in socks}
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        noticed: dict[socket.socket, float] = {}
        ended_ok: set[socket.socket] = set()

        def pump(until: float) -> None:
            while time.monotonic() < until and len(noticed) + len(ended_ok) < n:
                for key, _ in sel.select(0.05):
                    s = key.fileobj
                    try:
                        data = s.recv(1 << 16)  # type: ignore[union-attr]
                    except BlockingIOError:
                        continue
                    tail = tails[s] + data  # type: ignore[index]
                    if b"engine_unavailable" in tail and s not in noticed:
                        noticed[s] = time.monotonic()  # type: ignore[index]
                    elif b"data: [DONE]" in tail:
                        ended_ok.add(s)  # type: ignore[arg-type]
                    tails[s] = tail[-64:]  # type: ignore[index]
                    if not data:
                        sel.unregister(s)

        pump(time.monotonic() + 5)  # saturated for 5 s
        premature = len(noticed)  # told the engine failed while it was alive: a false alarm
        killed = time.monotonic()
        engine.popen.send_signal(signal.SIGKILL)
        pump(killed + 30)
        delays = [t - killed for t in noticed.values()]
        figures = {"streams": n, "tokens_per_s": rate, "noticed": len(noticed), "completed": len(ended_ok),
                   "premature": premature,
                   "notice_p50_s": statistics.median(delays) if delays else None,
                   "notice_p99_s": _pct(delays, 0.99) if delays else None,
                   "rss_mb": metric(url, "process_resident_memory_bytes") / 1e6}
        figures["sample_tail"] = repr(next(iter(tails.values()))) if tails else ""
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "chaos-overload.json").write_text(json.dumps(figures, indent=2))
        # Every client is told: none hangs, none gets a normal end after its engine died.
        assert len(noticed) == n, figures
        assert not ended_ok, figures
        assert premature == 0, figures  # overload alone never looks like an engine failure
    finally:
        sel.close()
        gw.stop()
        engine.stop()


def test_slow_steady_readers_cost_their_log_and_a_small_buffer(ipc_dir: Path) -> None:
    readers, rate_bps, tokens, chars = 20, 20_000, 300, 2000
    address = f"ipc://{ipc_dir / 'slowreaders.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-tokens-per-s", "100",
                          "--synthetic-token-chars", str(chars), "--max-model-len", "20000", name="engine-slowread")
    gw, url = start_gateway(address, "--send-timeout", "60", name="gateway-slowread")
    try:
        httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 5})  # warm up
        rss0 = metric(url, "process_resident_memory_bytes")
        body = {"prompt": "x", "max_tokens": tokens, "ignore_eos": True, "stream": True}
        socks = [_open(url, _post(body), rcvbuf=16384) for _ in range(readers)]
        t0 = time.monotonic()
        got = [0] * readers
        peak = rss0
        while time.monotonic() - t0 < 8:
            budget = int((time.monotonic() - t0) * rate_bps)
            for i, s in enumerate(socks):
                want = budget - got[i]
                if want > 0:
                    try:
                        got[i] += len(s.recv(min(want, 65536)))
                    except BlockingIOError:
                        pass
            time.sleep(0.05)
            peak = max(peak, metric(url, "process_resident_memory_bytes"))
        growth_mb = (peak - rss0) / 1e6
        log_mb = readers * tokens * chars / 1e6  # every generation's own output, as text
        figures = {"readers": readers, "read_rate_bps": rate_bps, "generation_chars": tokens * chars,
                   "rss_growth_mb": round(growth_mb, 1), "rss_growth_per_reader_mb": round(growth_mb / readers, 2),
                   "logs_text_mb": log_mb}
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "chaos-slow-readers.json").write_text(json.dumps(figures, indent=2))
        # Bounded by the logs (text, the chunk objects around it) plus small per-reader buffers: no queue
        # that grows with the backlog per reader beyond the log itself.
        assert growth_mb < 3 * log_mb + readers * 1.0, figures
        for s in socks:
            s.close()
    finally:
        gw.stop()
        engine.stop()
