"""TLS and HTTP/2 on the gateway (``--ssl-certfile``/``--ssl-keyfile``), the certificate from
``tokenfan certs``, and a browser holding many EventSources on one HTTP/2 connection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from tests.e2e.helpers import chunk_text, metric, sse_events
from tests.procs import StartGateway, engine_and_gateway, spawn, start_engine
from tokenfan_bench.servers.processes import Proc, free_port


def start_tls_gateway(engine_address: str, certs: Path, *args: str, command: str = "gateway",
                      name: str = "gateway-tls") -> tuple[Proc, str]:
    port = free_port()
    engine_args = ["--engine", engine_address] if command == "gateway" else []
    proc = spawn(["-m", "tokenfan.cli", command, *engine_args, "--host", "127.0.0.1", "--port", str(port),
                  "--ssl-certfile", str(certs / "cert.pem"), "--ssl-keyfile", str(certs / "key.pem"),
                  "--log-level", "warning", *args], name)
    url = f"https://localhost:{port}"
    wait_https(url, proc, 60.0)
    return proc, url


def tls(certs: Path) -> StartGateway:
    """:func:`start_tls_gateway` with these certificates, as :func:`tests.procs.engine_and_gateway` starts it."""
    def start(engine_address: str, *args: str, name: str = "gateway-tls") -> tuple[Proc, str]:
        return start_tls_gateway(engine_address, certs, *args, name=name)

    return start


def wait_https(url: str, proc: Proc, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.popen.returncode}:\n{proc.log()[-4000:]}")
        try:
            if httpx.get(url + "/health", verify=False, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"gateway not healthy after {timeout} s:\n{proc.log()[-4000:]}")


def make_certs(directory: Path) -> Path:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tokenfan.cli", "certs", str(directory)], capture_output=True,
                         text=True, check=True)
    assert "--ssl-certfile" in out.stdout
    return directory


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs") / "tls")


@pytest.fixture(scope="module")
def tls_gateway(ipc_dir: Path, certs: Path) -> Iterator[str]:
    with engine_and_gateway(f"ipc://{ipc_dir / 'tls.sock'}",
                            ("--engine", "synthetic", "--synthetic-ttft-ms", "5", "--synthetic-tokens-per-s", "200"),
                            name="tls", start=tls(certs)) as url:
        yield url


def alpn(url: str, offered: list[str]) -> str | None:
    host, port = url.removeprefix("https://").split(":")
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(offered)
    with socket.create_connection((host, int(port))) as raw, ctx.wrap_socket(raw, server_hostname=host) as tls:
        return tls.selected_alpn_protocol()


def test_certs_makes_a_self_signed_certificate_for_localhost(tmp_path: Path) -> None:
    d = make_certs(tmp_path / "c")
    cert = x509.load_pem_x509_certificate((d / "cert.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} >= {"127.0.0.1", "::1"}
    assert (d / "key.pem").stat().st_mode & 0o077 == 0


def test_alpn_offers_http2_and_still_http11(tls_gateway: str) -> None:
    assert alpn(tls_gateway, ["h2", "http/1.1"]) == "h2"
    assert alpn(tls_gateway, ["http/1.1"]) == "http/1.1"
    with httpx.Client(http2=True, verify=False) as h2c:
        assert h2c.get(tls_gateway + "/health").http_version == "HTTP/2"
    with httpx.Client(verify=False) as h1c:
        assert h1c.get(tls_gateway + "/health").http_version == "HTTP/1.1"


def test_fan_out_stream_over_http2_and_websocket_on_the_same_port(tls_gateway: str) -> None:
    with httpx.Client(http2=True, verify=False, timeout=30) as client:
        r = client.post(tls_gateway + "/v1/streams", json={"endpoint": "completions", "prompt": "hi",
                                                            "max_tokens": 40})
        assert r.status_code == 201, r.text
        info = r.json()
        assert info["events_url"].startswith("https://") and info["ws_url"].startswith("wss://")
        sse = client.get(info["events_url"])
        assert sse.http_version == "HTTP/2"
        events = sse_events(sse.text)
        assert events[-1]["data"] == "[DONE]"
        text = "".join(chunk_text(json.loads(e["data"])) for e in events if "id" in e)
        resumed = client.get(info["events_url"], headers={"Last-Event-ID": "9"})
        tail = "".join(chunk_text(json.loads(e["data"])) for e in sse_events(resumed.text) if "id" in e)
        assert text.endswith(tail) and 0 < len(tail) < len(text)

    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE

    async def ws_text() -> tuple[str, str]:
        got = []
        async with ws_connect(info["ws_url"] + "?after=-1", ssl=ctx) as ws:
            async for raw in ws:
                msg = json.loads(raw)
                if msg["type"] != "chunk":
                    assert msg["type"] == "done", msg
                    break
                got.append(chunk_text(msg["data"]))
        mux = []
        async with ws_connect(tls_gateway.replace("https", "wss") + "/v1/ws", ssl=ctx) as ws:
            await ws.send(json.dumps({"type": "request", "id": "r1", "endpoint": "completions",
                                      "body": {"prompt": "hi", "max_tokens": 5}}))
            async for raw in ws:
                mux.append(raw)
                if '"done"' in raw or '"error"' in raw:
                    break
        return "".join(got), "".join(mux)

    ws_got, mux = asyncio.run(ws_text())
    assert ws_got == text
    assert '"done"' in mux and '"error"' not in mux


def test_a_websocket_message_above_the_limit_closes_1009_over_tls_too(tls_gateway: str) -> None:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE

    async def run() -> int | None:
        async with ws_connect(tls_gateway.replace("https", "wss") + "/v1/ws", ssl=ctx, max_size=None) as ws:
            await ws.send("x" * ((1 << 20) + 1))  # --ws-max-message-bytes defaults to 1 MiB
            with contextlib.suppress(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)
            return ws.close_code

    assert asyncio.run(run()) == 1009


def test_sigterm_after_a_clean_drain_exits_0_with_tls(ipc_dir: Path, certs: Path) -> None:
    address = f"ipc://{ipc_dir / 'tls-exit.sock'}"
    engine = start_engine(address, "--engine", "synthetic", name="engine-tls-exit")
    try:
        gw, _ = start_tls_gateway(address, certs, "--shutdown-grace", "1", name="gateway-tls-exit")
        assert gw.stop(signal.SIGTERM) == 0, gw.log()[-3000:]
    finally:
        engine.stop()


TEN_EVENTSOURCES_AND_A_FETCH = """async (n) => {
  const urls = [];
  for (let i = 0; i < n; i++) {
    const r = await fetch("/v1/streams", {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({endpoint: "completions", prompt: "hi", max_tokens: 400})});
    urls.push((await r.json()).events_url);
  }
  const sources = urls.map((u) => { const es = new EventSource(u); es.got = 0;
    es.onmessage = (e) => { if (e.data !== "[DONE]") es.got++; }; return es; });
  while (!sources.every((s) => s.got > 0)) await new Promise((r) => setTimeout(r, 20));
  const t0 = performance.now();
  const health = await fetch("/health", {cache: "no-store"});
  const fetchMs = performance.now() - t0;
  const after = sources.map((s) => ({open: s.readyState === EventSource.OPEN, got: s.got}));
  const resources = performance.getEntriesByType("resource").map((e) => [e.name, e.nextHopProtocol]);
  sources.forEach((s) => s.close());
  return {status: health.status, fetchMs, after,
          navigation: performance.getEntriesByType("navigation")[0].nextHopProtocol, resources};
}"""


@pytest.mark.browser
def test_one_https_page_holds_ten_eventsources_and_a_fetch_still_answers_over_h2(
        ipc_dir: Path, certs: Path) -> None:
    from playwright.sync_api import sync_playwright

    from tests.e2e.browser_fixtures import CHROMIUM, CHROMIUM_ARGS
    from tests.system import require

    require(CHROMIUM)
    with engine_and_gateway(f"ipc://{ipc_dir / 'tls-browser.sock'}",
                            ("--engine", "synthetic", "--synthetic-ttft-ms", "5",
                             "--synthetic-tokens-per-s", "20"),  # 400 tokens: 20 s
                            name="tls-browser", start=tls(certs)) as url, \
            sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                     args=[*CHROMIUM_ARGS, "--ignore-certificate-errors"])
        page = browser.new_context(ignore_https_errors=True).new_page()
        page.goto(url + "/")
        # Over HTTP/1.1 the seventh EventSource would wait for one of the first six to end (~20 s):
        # the loop would not finish and the page's sources would no longer all be open.
        result = page.evaluate(TEN_EVENTSOURCES_AND_A_FETCH, 10)
        browser.close()
    print(f"fetch with 10 live EventSources: {result['fetchMs']:.1f} ms")
    assert result["status"] == 200
    assert all(s["open"] for s in result["after"]), result["after"]
    assert all(0 < s["got"] < 400 for s in result["after"]), result["after"]  # still streaming
    assert result["navigation"] == "h2"
    protocols = {proto for name, proto in result["resources"] if "/v1/streams" in name or "/health" in name}
    assert protocols == {"h2"}, result["resources"]


def test_a_stalled_reader_over_tls_is_cut_by_the_send_timeout(ipc_dir: Path, certs: Path) -> None:
    """Granian's ``send`` must block when a client stops reading (HTTP/1.1 over TLS, and one HTTP/2 stream
    whose flow-control window is never reopened), so ``--send-timeout`` cuts it as with uvicorn."""
    import h2.config
    import h2.connection

    from tests.e2e.helpers import wait_until

    with engine_and_gateway(f"ipc://{ipc_dir / 'tls-fat.sock'}",
                            ("--engine", "synthetic", "--synthetic-tokens-per-s", "1000", "--synthetic-token-chars",
                             "2000", "--max-model-len", "20000"), ("--send-timeout", "1", "--max-tokens-cap", "20000"),
                            name="tls-fat", start=tls(certs)) as url:
        def network_errors() -> float:
            return metric(url, "tokenfan_errors_total", {"class": "network"})

        for proto in ("http/1.1", "h2"):
            info = httpx.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "hi",
                                                        "max_tokens": 15000}, verify=False, timeout=10).json()
            before = network_errors()
            host, port = url.removeprefix("https://").split(":")
            raw = socket.socket()
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
            raw.connect(("127.0.0.1", int(port)))
            ctx = ssl.create_default_context()
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            ctx.set_alpn_protocols([proto])
            stalled = ctx.wrap_socket(raw, server_hostname=host)
            path = f"/v1/streams/{info['id']}/events"
            if proto == "h2":
                conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
                conn.initiate_connection()
                conn.send_headers(1, [(":method", "GET"), (":path", path), (":scheme", "https"),
                                      (":authority", host)], end_stream=True)
                stalled.sendall(conn.data_to_send())
            else:
                stalled.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            try:  # never read (and never send a WINDOW_UPDATE)
                wait_until(lambda b=before: network_errors() > b, timeout=60,
                           what=f"the stalled {proto} reader closed as slow")
            finally:
                stalled.close()
