"""``--via nginx``: Debian's nginx in front of the gateway, configured by ``deploy/nginx/tokenfan.conf``.

Two variants (:data:`VARIANTS`):

- ``nginx``: the shipped file as is (TLS + HTTP/2 to the client, unbuffered HTTP/1.1 to the gateway);
  only its listen port, certificate paths and upstream address are replaced, as tests/e2e/test_nginx.py does.
- ``nginx-buffering``: the same file with the mistake people make: ``proxy_buffering on`` (nginx's
  default) and ``proxy_ignore_headers X-Accel-Buffering`` (without that line the gateway's
  ``X-Accel-Buffering: no`` header would switch buffering off again for its SSE responses). It shows what
  a buffering proxy costs each transport (WebSocket is tunnelled after the upgrade and never buffered).

nginx runs in the foreground (``master_process off``, one worker) in a scratch directory with a
self-signed certificate from :func:`gateway.http.certs.generate`; the gateway must speak plain HTTP (nginx
terminates TLS, as in the deploy file).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx

VARIANTS = ("nginx", "nginx-buffering")
CONF = Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "tokenfan.conf"

_MAIN = """daemon off;
master_process off;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log {error_level};
events {{ worker_connections {connections}; }}
http {{
    access_log {access_log};
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    include {dir}/tokenfan.conf;
}}
"""


def main_conf(d: Path, *, logs: bool = False, connections: int = 4096) -> str:
    """The top-level nginx.conf of an unprivileged nginx in ``d`` (its pid, temp paths and the site
    ``d/tokenfan.conf``); ``logs``: an access log and info-level errors (tests), else warnings only."""
    return _MAIN.format(dir=d, error_level="info" if logs else "warn", connections=connections,
                        access_log=f"{d}/access.log" if logs else "off")


_BUFFERING = ("        proxy_buffering         off;\n",
              ("        proxy_buffering         on;      # the mistake (nginx's default)\n"
              "        proxy_ignore_headers    X-Accel-Buffering;  # and the gateway's header ignored\n"))


def site_conf(port: int, upstream: str, certs: Path, variant: str = "nginx") -> str:
    """deploy/nginx/tokenfan.conf with its port, certificate paths and upstream replaced (and, for
    ``nginx-buffering``, buffering turned on)."""
    if variant not in VARIANTS:
        raise ValueError(f"--via wants one of {', '.join(VARIANTS)}; got {variant!r}")
    if not CONF.exists():
        raise RuntimeError(f"--via needs the repository's {CONF.relative_to(CONF.parent.parent.parent)} "
                           "(run the bench from a checkout)")
    text = CONF.read_text()
    swaps = [("listen 443 ssl", f"listen 127.0.0.1:{port} ssl"),
             ("/etc/tokenfan/tls/cert.pem", str(certs / "cert.pem")),
             ("/etc/tokenfan/tls/key.pem", str(certs / "key.pem")),
             ("server 127.0.0.1:8000;", f"server {upstream};")]
    if variant == "nginx-buffering":
        swaps.append(_BUFFERING)
    for old, new in swaps:
        if text.count(old) != 1:
            raise RuntimeError(f"{CONF} changed: expected {old!r} once")
        text = text.replace(old, new)
    return text


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if found is None:
        raise RuntimeError("--via nginx needs nginx (Debian: apt-get install nginx-light)")
    return found


@contextlib.contextmanager
def nginx_in_front(gateway_url: str, variant: str = "nginx", keep_dir: Path | None = None) -> Iterator[str]:
    """nginx on a free port proxying to ``gateway_url`` (http); yields its ``https://127.0.0.1:PORT`` URL."""
    from gateway.http.certs import generate
    from tokenfan_bench.servers.processes import free_port

    u = urlsplit(gateway_url)
    if u.scheme != "http":
        raise ValueError(f"--via {variant}: the gateway must speak plain HTTP behind nginx; got {gateway_url}")
    with tempfile.TemporaryDirectory(prefix=f"tokenfan-{variant}-") as tmp:
        d = Path(tmp)
        generate(d / "tls")
        port = free_port()
        (d / "tokenfan.conf").write_text(site_conf(port, u.netloc, d / "tls", variant))
        (d / "nginx.conf").write_text(main_conf(d))
        nginx = nginx_binary()
        cmd = [nginx, "-p", str(d), "-c", str(d / "nginx.conf"), "-e", str(d / "error.log")]
        check = subprocess.run([*cmd, "-t"], check=False, capture_output=True, text=True)
        if check.returncode:
            raise RuntimeError(f"nginx -t failed: {check.stderr.strip()}")
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"https://127.0.0.1:{port}"
        try:
            _wait(url, proc, d / "error.log")
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            if keep_dir is not None and (d / "error.log").exists():
                keep_dir.mkdir(parents=True, exist_ok=True)
                shutil.copy(d / "error.log", keep_dir / f"{variant}-{port}-error.log")


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", verify=False, timeout=1.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"nginx at {url} not healthy: {log.read_text() if log.exists() else 'no log'}")
        time.sleep(0.05)
