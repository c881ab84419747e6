"""Helpers for the browser tests: Chromium launch settings, a cuttable TCP proxy, page probes."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from playwright.sync_api import Page

from tests.e2e.helpers import sample
from tests.procs import spawn
from tokenfan_bench.servers.processes import Proc, free_port

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


class CuttableProxy:
    """A loopback TCP proxy in front of a gateway; :meth:`cut` drops every open connection.

    Playwright's ``page.route`` cannot interrupt an EventSource stream, so the reconnect test puts
    this between the browser and the gateway and cuts the sockets mid-stream. Everything the
    browser sends is kept in :attr:`sent` so a test can check the request headers it used.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent: list[bytes] = []
        self._lock = threading.Lock()
        self._conns: list[tuple[socket.socket, socket.socket]] = []
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # listener closed
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._conns.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_browser: bool) -> None:
        try:
            while data := src.recv(65536):
                if from_browser:
                    with self._lock:
                        self.sent.append(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _close(s)

    def cut(self) -> int:
        """Close every open connection (both sides); returns how many were open."""
        with self._lock:
            conns, self._conns = self._conns, []
        for client, upstream in conns:
            _close(client)
            _close(upstream)
        return len(conns)

    def requests_sent(self) -> str:
        with self._lock:
            return b"".join(self.sent).decode("latin-1")

    def close(self) -> None:
        self.listener.close()
        self.cut()


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def start_gateway_without_engine(address: str, name: str = "gateway-no-engine") -> tuple[Proc, str]:
    """A gateway whose engine never answers: /health says 503 once it is up."""
    port = free_port()
    proc = spawn(["-m", "tokenfan.cli", "gateway", "--engine", address, "--host", "127.0.0.1",
                  "--port", str(port), "--log-level", "warning"], name)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.popen.returncode}:\n{proc.log()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 503:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.stop()
    raise TimeoutError(f"{url} did not come up:\n{proc.log()[-4000:]}")


def aborted_total(gateway_url: str) -> float:
    """``tokenfan_requests_aborted_total`` from the gateway's /metrics."""
    value = sample(httpx.get(gateway_url + "/metrics", timeout=5).text, "tokenfan_requests_aborted_total")
    assert value is not None, "tokenfan_requests_aborted_total missing from /metrics"
    return value


def full_stream_text(gateway_url: str, stream_id: str) -> str:
    """The whole text of a finished fan-out stream, read independently of the browser."""
    texts: list[str] = []
    with httpx.stream("GET", f"{gateway_url}/v1/streams/{stream_id}/events", timeout=10) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                texts.append(choice.get("delta", {}).get("content") or "")
    return "".join(texts)


@dataclass
class ConsoleLog:
    """Console errors and uncaught page errors of one page."""

    errors: list[str] = field(default_factory=list)

    def attach(self, page: Page) -> None:
        page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
