"""SIGHUP reloads, under live traffic: TLS certificates (Granian's HTTP/2 + HTTP/1.1, the QUIC listener's),
API keys (``--api-key-file``) and stream-token secrets (``--token-secret-file``); and ``--workers``: one
stream-token secret per server, every worker accepting every stream URL.

The certificates come from two test CAs, the old leaf signed by one and the new by the other, so a client
that trusts only one CA proves which certificate a new connection got (httpx and aioquic with ``verify``,
Chromium with ``--ignore-certificate-errors-spki-list``)."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import json
import os
import signal
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gateway.scaleout.workers import worker_socket
from tests.e2e.browser_fixtures import CHROMIUM, CHROMIUM_ARGS
from tests.e2e.helpers import chunk_text, sample, sse_events, wait_until
from tests.e2e.test_tls_h2 import wait_https
from tests.procs import spawn, start_engine, start_gateway
from tokenfan_bench.servers.processes import Proc, free_port, stop_all

pytestmark = pytest.mark.timeout(180)


# ------------------------------------------------------------------------------------------ certificates

@dataclass
class Leaf:
    cert: bytes
    key: bytes
    ca_file: Path  # the CA that signed it (what a client that trusts only it verifies against)
    serial: int
    spki: str  # base64 SHA-256 of the leaf's SubjectPublicKeyInfo (Chromium's SPKI allow-list)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_leaf(directory: Path, label: str, serial: int) -> Leaf:
    """A CA of its own (``ca-<label>.pem``) and a leaf for localhost/127.0.0.1 it signed."""
    import ipaddress

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name(f"test CA {label}")).issuer_name(_name(f"test CA {label}"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (x509.CertificateBuilder().subject_name(_name("localhost")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(serial)
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))
    ca_file = directory / f"ca-{label}.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    spki = key.public_key().public_bytes(serialization.Encoding.DER,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)
    return Leaf(leaf.public_bytes(serialization.Encoding.PEM),
                key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()),
                ca_file, serial, base64.b64encode(hashlib.sha256(spki).digest()).decode())


def install(leaf: Leaf, directory: Path) -> None:
    """Put ``leaf`` where the gateway's --ssl-certfile/--ssl-keyfile point (as a renewal tool would)."""
    (directory / "cert.pem").write_bytes(leaf.cert)
    (directory / "key.pem").write_bytes(leaf.key)


def served_serial(port: int) -> int:
    """The serial of the certificate a new TLS handshake on ``port`` gets (no verification)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, ctx.wrap_socket(raw) as s:
        der = s.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def trusting(leaf: Leaf) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(leaf.ca_file))


def handshake_ok(port: int, leaf: Leaf) -> bool:
    """Does a new HTTPS connection verify against ``leaf``'s CA (and only that CA)?"""
    try:
        with httpx.Client(verify=trusting(leaf), http2=True, timeout=10) as c:
            r = c.get(f"https://localhost:{port}/v1/time")
            return r.status_code == 200 and r.http_version == "HTTP/2"
    except httpx.ConnectError as exc:
        assert "CERTIFICATE_VERIFY_FAILED" in str(exc), exc
        return False


def quic_handshake_ok(port: int, leaf: Leaf) -> bool:
    """Does a new QUIC connection verify against ``leaf``'s CA?"""
    from aioquic.asyncio import connect

    from tokenfan_bench.clients.quic import client_configuration

    async def main() -> bool:
        qc = client_configuration(str(leaf.ca_file))
        qc.server_name = "localhost"
        try:
            async with asyncio.timeout(10), connect("127.0.0.1", port, configuration=qc, wait_connected=True):
                return True
        except ConnectionError:  # aioquic: the handshake failed (bad certificate)
            return False

    return asyncio.run(main())


def reloads(url: str, part: str, result: str, verify: ssl.SSLContext | bool = True) -> float:
    """The reload counter; -1 when the scrape's new connection was dropped unanswered (Granian's old worker
    stopping in that moment: docs/tls.md), so a poll asks again."""
    try:
        text = httpx.get(url + "/metrics", verify=verify, timeout=10).text
    except httpx.RemoteProtocolError:
        return -1.0
    return sample(text, "tokenfan_reloads_total", {"part": part, "result": result}) or 0.0


# ------------------------------------------------------------------------------------------ TLS gateway

@dataclass
class TlsGateway:
    proc: Proc
    url: str
    port: int
    h3_port: int
    certs: Path
    old: Leaf
    new: Leaf


@pytest.fixture
def tls_gateway(tmp_path: Path) -> Iterator[TlsGateway]:
    """A TLS gateway (Granian; HTTP/3 beside it, same certificate) serving ``old``; ``new`` waits beside it.
    The engine writes 10 tokens/s, so a 100-token stream is open for seconds around a reload."""
    certs = tmp_path / "certs"
    certs.mkdir()
    old, new = make_leaf(tmp_path, "old", 0xA11), make_leaf(tmp_path, "new", 0xB22)
    install(old, certs)
    address = f"ipc://{tmp_path / 'engine.sock'}"
    engine = start_engine(address, "--engine", "synthetic", "--synthetic-ttft-ms", "5",
                          "--synthetic-tokens-per-s", "10", name="engine-reload")
    port, h3_port = free_port(), free_port()
    gateway = spawn(["-m", "tokenfan.cli", "gateway", "--engine-address", address, "--host", "127.0.0.1",
                     "--port", str(port), "--ssl-certfile", str(certs / "cert.pem"),
                     "--ssl-keyfile", str(certs / "key.pem"), "--http3-port", str(h3_port),
                     "--log-level", "info"], "gateway-reload-tls")
    url = f"https://localhost:{port}"
    try:
        wait_https(url, gateway, 60.0)
        yield TlsGateway(gateway, url, port, h3_port, certs, old, new)
    finally:
        stop_all([gateway, engine])


def create_stream(url: str, max_tokens: int, **kw: object) -> dict:
    r = httpx.post(url + "/v1/streams", json={"endpoint": "completions", "prompt": "x", "max_tokens": max_tokens,
                                              "ignore_eos": True}, timeout=10, **kw)  # type: ignore[arg-type]
    assert r.status_code == 201, r.text
    return r.json()


class TlsReader(threading.Thread):
    """One SSE stream over HTTP/1.1 on a client that trusts only ``leaf``'s CA, read to its end; notes the
    serial of its connection's certificate and whether it had events after :attr:`mark` was set.

    HTTP/1.1: Granian's old worker ends its HTTP/2 connections gracefully (GOAWAY, then a PING), which the
    python h2 state machine under httpx refuses (python-hyper/h2#1199: "RECV_PING in state CLOSED"), though
    the stream may go on; the browser test below holds an HTTP/2 stream across the reload."""

    def __init__(self, events_url: str, leaf: Leaf) -> None:
        super().__init__(daemon=True)
        self.events_url, self.leaf = events_url, leaf
        self.first = threading.Event()
        self.mark = threading.Event()
        self.after_mark = 0
        self.text = ""
        self.serial: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(verify=trusting(self.leaf), timeout=60) as c, c.stream("GET", self.events_url) as r:
                ssl_object = r.extensions["network_stream"].get_extra_info("ssl_object")
                self.serial = x509.load_der_x509_certificate(ssl_object.getpeercert(True)).serial_number
                for line in r.iter_lines():
                    self.text += line + "\n"
                    self.first.set()
                    if self.mark.is_set() and line.startswith("data:"):
                        self.after_mark += 1
        except (httpx.HTTPError, AssertionError, ssl.SSLError) as exc:
            self.error = exc
            self.first.set()


def test_certificate_reload_new_connections_get_the_new_one_open_streams_go_on(tls_gateway: TlsGateway) -> None:
    g = tls_gateway
    assert served_serial(g.port) == g.old.serial
    assert handshake_ok(g.port, g.old) and not handshake_ok(g.port, g.new)
    assert quic_handshake_ok(g.h3_port, g.old) and not quic_handshake_ok(g.h3_port, g.new)
    info = create_stream(g.url, 100, verify=trusting(g.old))
    reader = TlsReader(info["events_url"], g.old)
    reader.start()
    assert reader.first.wait(30) and reader.error is None

    install(g.new, g.certs)
    g.proc.popen.send_signal(signal.SIGHUP)
    wait_until(lambda: reloads(g.url, "tls", "ok", False) == 1 and reloads(g.url, "http3_tls", "ok", False) == 1,
               timeout=60, what="both certificates reloaded")
    reader.mark.set()

    # every new connection gets the new certificate: TCP (HTTP/2 and HTTP/1.1 by ALPN) and QUIC
    assert {served_serial(g.port) for _ in range(20)} == {g.new.serial}
    assert handshake_ok(g.port, g.new) and not handshake_ok(g.port, g.old)
    assert quic_handshake_ok(g.h3_port, g.new) and not quic_handshake_ok(g.h3_port, g.old)
    # the stream open across the reload keeps its connection (and its certificate) to [DONE]
    reader.join(60)
    assert not reader.is_alive() and reader.error is None, reader.error
    assert reader.serial == g.old.serial
    assert reader.after_mark > 0, "the stream ended before the reload: nothing was open across it"
    events = sse_events(reader.text)
    assert events[-1]["data"] == "[DONE]"
    assert sum(len(json.loads(e["data"])["choices"][0]["text"]) > 0 for e in events[:-1]) == 100
    log = g.proc.log()
    assert "reload: tls: new certificate for new connections (serial b22" in log
    assert g.new.key.decode().splitlines()[1] not in log


def test_a_bad_certificate_keeps_the_old_one_and_counts_an_error(tls_gateway: TlsGateway) -> None:
    g = tls_gateway
    (g.certs / "cert.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\nnot a certificate\n")
    g.proc.popen.send_signal(signal.SIGHUP)
    wait_until(lambda: reloads(g.url, "tls", "error", False) == 1 and reloads(g.url, "http3_tls", "error", False) == 1,
               timeout=60, what="both reloads refused")
    (g.certs / "cert.pem").write_bytes(g.new.cert)  # a certificate whose key is not key.pem
    g.proc.popen.send_signal(signal.SIGHUP)
    wait_until(lambda: reloads(g.url, "tls", "error", False) == 2 and reloads(g.url, "http3_tls", "error", False) == 2,
               timeout=60, what="both mismatched pairs refused")
    assert served_serial(g.port) == g.old.serial
    assert handshake_ok(g.port, g.old) and quic_handshake_ok(g.h3_port, g.old)
    assert reloads(g.url, "tls", "ok", False) == 0
    assert "reload: tls: kept the old material" in g.proc.log()


# ---------------------------------------------------------------------------------------------- browser

EVENTSOURCE = """url => new Promise((resolve, reject) => {
  const es = new EventSource(url); window.got = [];
  es.onmessage = e => { window.got.push(e.data); if (e.data === '[DONE]') { es.close(); resolve(true); } };
  es.onerror = () => { es.close(); reject(new Error('EventSource error after ' + window.got.length)); };
  window.done = null;
})"""


def test_a_browser_sees_the_new_certificate_after_the_reload(tls_gateway: TlsGateway) -> None:
    """Chromium trusting only the new certificate's key cannot open the page before the reload and can after;
    one trusting only the old key holds an EventSource open across the reload to [DONE] (its HTTP/2
    connection keeps the old certificate)."""
    from playwright.sync_api import Error, sync_playwright

    g = tls_gateway
    with sync_playwright() as p:
        def launch(leaf: Leaf):  # type: ignore[no-untyped-def]
            return p.chromium.launch(executable_path=str(CHROMIUM), args=[
                *CHROMIUM_ARGS, f"--ignore-certificate-errors-spki-list={leaf.spki}"])

        old_browser, new_browser = launch(g.old), launch(g.new)
        try:
            old_page, new_page = old_browser.new_page(), new_browser.new_page()
            old_page.goto(g.url + "/v1/time")
            assert old_page.evaluate("performance.getEntriesByType('navigation')[0].nextHopProtocol") == "h2"
            with pytest.raises(Error, match="ERR_CERT"):
                new_page.goto(g.url + "/v1/time")
            info = create_stream(g.url, 100, verify=trusting(g.old))
            old_page.evaluate("url => { window.ev = (" + EVENTSOURCE + ")(url).then(() => window.done = true, "
                              "e => window.done = String(e)); }", info["events_url"])
            old_page.wait_for_function("window.got && window.got.length > 0", timeout=30_000)

            install(g.new, g.certs)
            g.proc.popen.send_signal(signal.SIGHUP)
            wait_until(lambda: reloads(g.url, "tls", "ok", False) == 1, timeout=60, what="certificate reloaded")
            seen = old_page.evaluate("window.got.length")

            response = new_page.goto(g.url + "/v1/time")
            assert response is not None and response.ok
            assert new_page.evaluate("performance.getEntriesByType('navigation')[0].nextHopProtocol") == "h2"
            old_page.wait_for_function("window.done !== null", timeout=60_000)
            assert old_page.evaluate("window.done") is True
            got = old_page.evaluate("window.got")
            assert got[-1] == "[DONE]" and len(got) > seen, "the EventSource ended before the reload"
            assert "".join(chunk_text(json.loads(d)) for d in got[:-1])
        finally:
            old_browser.close()
            new_browser.close()


# ---------------------------------------------------------------------- API keys and token secrets

def auth_get(url: str, path: str, key: str | None = None, transport: str | None = None) -> int:
    """GET with ``key``; on the shared port, or on the worker whose private socket is ``transport``."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(transport=httpx.HTTPTransport(uds=transport) if transport else None, timeout=10) as c:
        return c.get(url + path, headers=headers).status_code


def workers_up(each: list[str]) -> bool:
    try:
        return all(auth_get("http://w", "/health", transport=t) == 200 for t in each)
    except httpx.TransportError:  # a worker's socket not listening yet
        return False


def on_each_worker(port: int, workers: int) -> list[str]:
    """Each worker's private socket (the same app, every route), not the shared port."""
    return [str(worker_socket(port, k)) for k in range(workers)]


def test_workers_share_one_token_secret_every_stream_url_opens_on_every_worker(synthetic_engine: str) -> None:
    proc, url = start_gateway(synthetic_engine, "--workers", "2", "--api-key", "K", name="gateway-workers-secret")
    try:
        port = int(url.rsplit(":", 1)[1])
        each = on_each_worker(port, 2)
        wait_until(lambda: workers_up(each), timeout=60, what="both workers up")
        headers = {"Authorization": "Bearer K"}
        # each on a connection of its own: minted on whichever worker the kernel gave it
        streams = [create_stream(url, 2, headers=headers) for _ in range(30)]
        refused = tried = 0
        for info in streams:
            for t in each:
                with httpx.Client(transport=httpx.HTTPTransport(uds=t), timeout=30) as c:
                    r = c.get(info["events_url"].replace(url, "http://w"))
                tried += 1
                refused += r.status_code == 401
            refused += asyncio.run(ws_refused(info["ws_url"]))
            tried += 1
        assert tried >= 60 and refused == 0, f"{refused} of {tried} stream URLs refused"
        # the secret and the keys reached the workers by their environment, not on a command line
        for pid in children_of(proc.popen.pid):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert b"--token-secret" not in argv and b"--api-key" not in argv, argv
    finally:
        proc.stop()


async def ws_refused(ws_url: str) -> bool:
    import websockets

    async with websockets.connect(ws_url + "&after=-1") as sock:
        async for raw in sock:
            if json.loads(raw).get("type") == "error":
                break
    return sock.close_code == 4401


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def test_keys_and_secrets_reload_on_every_worker_an_open_stream_goes_on(synthetic_engine: str,
                                                                         tmp_path: Path) -> None:
    keys, secrets_file = tmp_path / "keys", tmp_path / "secrets"
    keys.write_text("# the clients' keys\nK1\n\n")
    secrets_file.write_text("secret-one\n")
    proc, url = start_gateway(synthetic_engine, "--workers", "2", "--api-key-file", str(keys),
                              "--token-secret-file", str(secrets_file), name="gateway-workers-reload")
    try:
        port = int(url.rsplit(":", 1)[1])
        each = on_each_worker(port, 2)
        wait_until(lambda: workers_up(each), timeout=60, what="both workers up")
        assert all(auth_get("http://w", "/v1/models", "K1", t) == 200 for t in each)
        assert all(auth_get("http://w", "/v1/models", "K2", t) == 401 for t in each)
        old = create_stream(url, 2, headers={"Authorization": "Bearer K1"})
        path = old["events_url"].replace(url, "")

        # a stream read over K1 stays open while K1 is removed
        with httpx.Client(transport=httpx.HTTPTransport(uds=each[0]), timeout=60) as c, c.stream(
                "POST", "http://w/v1/completions", headers={"Authorization": "Bearer K1"},
                json={"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            keys.write_text("K2\n")
            secrets_file.write_text("secret-two\nsecret-one\n")  # rotated: the old one still verifies
            proc.popen.send_signal(signal.SIGHUP)
            wait_until(lambda: all(auth_get("http://w", "/v1/models", "K2", t) == 200 for t in each), timeout=30,
                       what="K2 accepted on both workers")
            assert all(auth_get("http://w", "/v1/models", "K1", t) == 401 for t in each)
            assert all(auth_get("http://w", path, transport=t) == 200 for t in each)  # signed by secret-one
            rest = list(lines)
        assert rest[-1] == "data: [DONE]" or [x for x in rest if x][-1] == "data: [DONE]"
        new = create_stream(url, 2, headers={"Authorization": "Bearer K2"})
        new_path = new["events_url"].replace(url, "")

        secrets_file.write_text("secret-two\n")  # secret-one dropped: what it signed is refused
        proc.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: all(auth_get("http://w", path, transport=t) == 401 for t in each), timeout=30,
                   what="secret-one dropped on both workers")
        assert all(auth_get("http://w", new_path, transport=t) == 200 for t in each)

        keys.write_text("")  # no key left: everything refused, not opened to all
        proc.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: all(auth_get("http://w", "/v1/models", "K2", t) == 401 for t in each), timeout=30,
                   what="K2 removed on both workers")
        assert all(auth_get("http://w", "/v1/models", None, t) == 401 for t in each)
        secrets_file.write_text("# nothing\n")  # a file without a secret: refused, the old ones kept
        proc.popen.send_signal(signal.SIGHUP)
        wait_until(lambda: "token secrets: kept the old material" in proc.log(), timeout=30, what="refusal logged")
        assert all(auth_get("http://w", new_path, transport=t) == 200 for t in each)
        log = proc.log()
        assert "secret-two" not in log and "secret-one" not in log
    finally:
        proc.stop()


def test_gateway_refuses_both_token_secret_flags(tmp_path: Path) -> None:
    (tmp_path / "s").write_text("x\n")
    proc = spawn(["-m", "tokenfan.cli", "gateway", "--port", str(free_port()), "--token-secret", "a",
                  "--token-secret-file", str(tmp_path / "s")], "gateway-two-secrets")
    try:
        assert proc.popen.wait(60) != 0
        assert "--token-secret and --token-secret-file" in proc.log()
    finally:
        proc.stop()
