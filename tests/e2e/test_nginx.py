"""The gateway behind Debian's nginx, configured by ``deploy/nginx/tokenfan.conf`` itself.

The file is used as shipped; only the listen port, the certificate paths and the upstream address are
replaced. Through the proxy (HTTPS, HTTP/2 to the client): SSE is delivered unbuffered and resumes with
``Last-Event-ID``; WebSockets upgrade (``/v1/streams/{id}/ws`` and ``/v1/ws``); a client that stops
reading is cut by the gateway's ``--send-timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect

from tests.e2e.helpers import chunk_text, fat_gateway, metric, sse_events, wait_until
from tests.procs import ARTIFACTS, start_engine, start_gateway
from tests.system import require
from tokenfan_bench.network.nginx import main_conf, site_conf
from tokenfan_bench.servers.processes import free_port

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"


@pytest.fixture(autouse=True, scope="module")
def _nginx_installed() -> None:
    require(NGINX)

@contextlib.contextmanager
def nginx_in_front(gateway_url: str, certs: Path, name: str) -> Iterator[str]:
    """nginx on a free port proxying to ``gateway_url``; yields its https URL."""
    d = ARTIFACTS / f"nginx-{name}-{time.monotonic_ns()}"
    d.mkdir(parents=True)
    port = free_port()
    (d / "tokenfan.conf").write_text(site_conf(port, gateway_url.removeprefix("http://"), certs))
    (d / "nginx.conf").write_text(main_conf(d, logs=True, connections=1024))
    subprocess.run([NGINX, "-t", "-p", str(d), "-c", str(d / "nginx.conf"), "-e", str(d / "error.log")],
                   check=True, capture_output=True)
    proc = subprocess.Popen([NGINX, "-p", str(d), "-c", str(d / "nginx.conf"), "-e", str(d / "error.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"https://localhost:{port}"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if httpx.get(url + "/health", verify=False, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (d / "error.log").read_text()
            time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gateway.http.certs import generate

    d = tmp_path_factory.mktemp("nginx-certs")
    generate(d / "tls")
    return d / "tls"


@pytest.fixture(scope="module")
def proxied(ipc_dir: Path, certs: Path) -> Iterator[str]:
    """nginx in front of a gateway on a 50 tokens/s engine (a 40-token stream lasts ~0.8 s)."""
    address = f"ipc://{ipc_dir / 'nginx.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-ttft-ms", "5",
                          "--synthetic-tokens-per-s", "50", name="engine-nginx")
    try:
        gw, gw_url = start_gateway(address, "--keepalive-interval", "0.5", name="gateway-nginx")
        try:
            with nginx_in_front(gw_url, certs, "main") as url:
                yield url
        finally:
            gw.stop()
    finally:
        engine.stop()


def _ctx() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    return ctx


def _text(events: list[dict[str, str]]) -> str:
    return "".join(chunk_text(json.loads(e["data"])) for e in events if "id" in e)


def test_sse_through_nginx_is_unbuffered_over_http2_and_resumes_with_last_event_id(proxied: str) -> None:
    with httpx.Client(http2=True, verify=False, timeout=30) as client:
        r = client.post(proxied + "/v1/streams", json={"endpoint": "completions", "prompt": "hi", "max_tokens": 40})
        assert r.status_code == 201 and r.http_version == "HTTP/2", r.text
        info = r.json()
        assert info["events_url"].startswith(proxied + "/v1/streams/")  # Host and X-Forwarded-Proto kept
        assert info["ws_url"].startswith(proxied.replace("https", "wss"))
        with client.stream("GET", info["events_url"]) as sse:
            assert sse.headers["content-type"].startswith("text/event-stream")
            pieces = sse.iter_text()
            body = ""
            for piece in pieces:
                body += piece
                if "\nid: 0\n" in "\n" + body:
                    break
            # The first event came through while the generation was still running: nginx did not buffer.
            assert client.get(proxied + f"/v1/streams/{info['id']}").json()["state"] == "running"
            body += "".join(pieces)
        events = sse_events(body)
        assert events[-1]["data"] == "[DONE]"
        text = _text(events)
        resumed = client.get(info["events_url"], headers={"Last-Event-ID": "19"})
        tail = sse_events(resumed.text)
        assert next(int(e["id"]) for e in tail if "id" in e) == 20
        assert text == _text([e for e in events if "id" in e and int(e["id"]) <= 19]) + _text(tail)


def test_websockets_upgrade_through_nginx(proxied: str) -> None:
    info = httpx.post(proxied + "/v1/streams", json={"endpoint": "completions", "prompt": "hi", "max_tokens": 40},
                      verify=False, timeout=10).json()

    async def run() -> tuple[str, list[dict]]:
        got = []
        async with ws_connect(info["ws_url"] + "?after=-1", ssl=_ctx()) as ws:
            async for raw in ws:
                msg = json.loads(raw)
                if msg["type"] != "chunk":
                    assert msg["type"] == "done", msg
                    break
                got.append(chunk_text(msg["data"]))
        mux = []
        async with ws_connect(proxied.replace("https", "wss") + "/v1/ws", ssl=_ctx()) as ws:
            await ws.send(json.dumps({"type": "request", "id": "q1", "endpoint": "completions",
                                      "body": {"prompt": "hi", "max_tokens": 5}}))
            async for raw in ws:
                mux.append(json.loads(raw))
                if mux[-1]["type"] in ("done", "error"):
                    break
        return "".join(got), mux

    ws_text, mux = asyncio.run(run())
    sse_text = _text(sse_events(httpx.get(info["events_url"], verify=False, timeout=30).text))
    assert ws_text == sse_text and ws_text
    assert mux[-1]["type"] == "done" and mux[-1]["id"] == "q1"
    assert sum(m["type"] == "chunk" for m in mux) >= 5


def test_a_stalled_client_behind_nginx_is_cut_by_the_gateway(ipc_dir: Path, certs: Path) -> None:
    with fat_gateway(ipc_dir, "nginx-fat") as gw_url, nginx_in_front(gw_url, certs, "fat") as url:
        info = httpx.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "hi", "max_tokens": 15000},
                          verify=False, timeout=10).json()
        errors_before = metric(gw_url, "tokenfan_errors_total", {"class": "network"})
        port = int(url.rsplit(":", 1)[1])
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        raw.connect(("127.0.0.1", port))
        ctx = _ctx()
        ctx.set_alpn_protocols(["http/1.1"])
        stalled = ctx.wrap_socket(raw, server_hostname="localhost")
        try:
            stalled.sendall(f"GET /v1/streams/{info['id']}/events HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
            # Never read: nginx stops reading from the gateway, whose write blocks and is cut.
            wait_until(lambda: metric(gw_url, "tokenfan_errors_total", {"class": "network"}) > errors_before,
                       timeout=60, what="the stalled subscriber behind nginx closed as slow")
        finally:
            stalled.close()
        # The stream stays readable through nginx from its start.
        with httpx.Client(verify=False, timeout=30) as client, \
                client.stream("GET", info["events_url"]) as sse:
            first = next(sse.iter_text())
            assert first
