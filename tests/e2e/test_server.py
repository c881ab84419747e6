"""The ASGI server edge (``gateway/http/server.py``): slowloris read deadlines and the exit code of a drain."""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
from pathlib import Path

import pytest

from tests.procs import spawn, start_gateway
from tokenfan_bench.servers.processes import free_port, wait_healthy

HEAD_TIMEOUT, BODY_TIMEOUT = 2.0, 3.0


@pytest.fixture(scope="module")
def strict_gateway(synthetic_engine: str) -> str:
    proc, url = start_gateway(synthetic_engine, "--http-header-timeout", str(HEAD_TIMEOUT),
                              "--http-body-timeout", str(BODY_TIMEOUT), name="gateway-slowloris")
    yield url  # type: ignore[misc]
    proc.stop()


async def _trickle(port: int, first: bytes, then: bytes, limit: float, tls: bool,
                   connecting: asyncio.Semaphore) -> tuple[bytes, bool]:
    """Send ``first``, then ``then`` one byte per second; return (what the server wrote, whether it closed
    the connection before ``limit`` seconds)."""
    ctx = None
    if tls:
        ctx = ssl.create_default_context()
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        ctx.set_alpn_protocols(["http/1.1"])
    async with connecting:  # a few handshakes at a time: the server's deadline counts from accept
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
        except (ConnectionResetError, ssl.SSLError):
            return b"", True  # closed during the TLS handshake: closed all the same
        writer.write(first)
    got = b""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    i = 0
    try:
        while loop.time() < deadline:
            try:
                data = await asyncio.wait_for(reader.read(65536), 1.0)
            except TimeoutError:
                writer.write(then[i % len(then):i % len(then) + 1])
                i += 1
                continue
            if not data:
                return got, True
            got += data
    except (ConnectionResetError, BrokenPipeError, ssl.SSLError):
        return got, True
    finally:
        writer.close()
    return got, False


async def _slowloris(port: int, heads: int, bodies: int, limit: float, tls: bool = False) -> list[tuple[bytes, bool]]:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\n"
    body = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{")
    connecting = asyncio.Semaphore(20)
    tasks = [_trickle(port, head, b"X-Slow: abcdefghij\r\n", limit, tls, connecting) for _ in range(heads)]
    tasks += [_trickle(port, body, b'"a": 1, ', limit, tls, connecting) for _ in range(bodies)]
    return list(await asyncio.gather(*tasks))


@pytest.fixture(scope="module")
def strict_tls_gateway(synthetic_engine: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    from gateway.http.certs import generate
    from tests.e2e.test_tls_h2 import start_tls_gateway

    certs = tmp_path_factory.mktemp("slowloris") / "tls"
    generate(certs)
    proc, url = start_tls_gateway(synthetic_engine, certs, "--http-header-timeout", str(HEAD_TIMEOUT),
                                  "--http-body-timeout", str(BODY_TIMEOUT), name="gateway-slowloris-tls")
    yield url  # type: ignore[misc]
    proc.stop()


def test_slowloris_heads_and_bodies_are_closed_and_a_slow_body_gets_408(strict_gateway: str) -> None:
    _check_slowloris(strict_gateway, heads=500, bodies=200, tls=False)


def test_slowloris_over_tls_is_closed_too(strict_tls_gateway: str) -> None:
    _check_slowloris(strict_tls_gateway, heads=100, bodies=50, tls=True)


def _check_slowloris(url: str, heads: int, bodies: int, tls: bool) -> None:
    port = int(url.rsplit(":", 1)[1])
    results = asyncio.run(_slowloris(port, heads, bodies, limit=BODY_TIMEOUT + 20, tls=tls))
    head_results, body_results = results[:heads], results[heads:]
    assert all(closed for _, closed in head_results), sum(not c for _, c in head_results)
    assert all(got == b"" for got, _ in head_results)  # a head that never completed gets no response
    assert all(closed for _, closed in body_results), sum(not c for _, c in body_results)
    for got, _ in body_results:
        status, _, rest = got.partition(b"\r\n")
        assert status == b"HTTP/1.1 408 Request Timeout", got[:200]
        error = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"

def test_a_normal_request_still_works_after_the_slowloris(strict_gateway: str) -> None:
    import httpx

    assert httpx.get(strict_gateway + "/health", timeout=5).status_code == 200
    r = httpx.post(strict_gateway + "/v1/completions", json={"model": "synthetic", "prompt": "hi", "max_tokens": 3},
                   timeout=10)
    assert r.status_code == 200, r.text


def test_gateway_exits_0_after_a_clean_sigterm_drain(synthetic_engine: str) -> None:
    proc, _ = start_gateway(synthetic_engine, "--shutdown-grace", "1", name="gateway-exit")
    assert proc.stop(signal.SIGTERM) == 0, proc.log()[-3000:]


def test_serve_exits_0_after_a_clean_sigterm_drain(ipc_dir: Path) -> None:
    port = free_port()
    proc = spawn(["-m", "tokenfan.cli", "serve", "--engine", "synthetic", "--host", "127.0.0.1", "--port", str(port),
                  "--engine-address", f"ipc://{ipc_dir / 'serve-exit.sock'}", "--shutdown-grace", "1",
                  "--log-level", "warning"], "serve-exit")
    wait_healthy(f"http://127.0.0.1:{port}", proc, 60.0)
    assert proc.stop(signal.SIGTERM) == 0, proc.log()[-3000:]

