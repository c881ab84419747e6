"""Granian's TLS certificate, replaced on SIGHUP without dropping a connection (``--ssl-certfile``).

Granian reads its certificate when it builds a worker and has no call to swap it. Its embedded server's
``reload()`` builds a new worker in the same process (on the ``asginl`` interface the app and its state
stay: :func:`gateway.http.server.run_granian` runs the app's lifespan itself, once), lets both listen for
``respawn_interval`` seconds, then stops the old one's accepting; the old worker serves its open connections
(SSE, WebSockets, HTTP/2) to their end. So new handshakes get the new certificate once the reload is done,
and nothing open is cut. Measured here with Granian 2.8.9: a stream open across the reload reached
``[DONE]``; every connection made after it got the new certificate.

Granian is pointed at a private copy of the pair (:class:`Snapshot`, in a 0700 directory) that only a
checked pair replaces: the worker it builds never reads a half-written or mismatched file (a worker that
fails to start would stop the server).

This leans on the embedded server's ``reload()``, ``respawn_interval`` and ``wrks`` (its workers, each with
``is_alive()``): :data:`WRITTEN_FOR` names the versions it was checked on, and :func:`check` refuses others.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import ssl
import tempfile
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from gateway.http.reload import ReloadError

WRITTEN_FOR = ("2.8",)
RESPAWN_INTERVAL = 1.0  # seconds both workers listen: the new one is listening before the old one stops
RELOAD_TIMEOUT = 30.0


def check(server: Any) -> None:
    """Refuse a Granian whose embedded server lacks what this module uses."""
    found = version("granian")
    if not found.startswith(WRITTEN_FOR) or not all(hasattr(server, a) for a in ("reload", "wrks",
                                                                                 "respawn_interval")):
        raise SystemExit(f"certificate reload was written for Granian {', '.join(WRITTEN_FOR)}.x; found {found}: "
                         "check gateway/http/granian_tls.py against it")


def describe(cert_pem: bytes) -> str:
    """What the log says of a certificate: its serial and expiry (nothing secret)."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    return f"serial {cert.serial_number:x}, valid until {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"


def load_pair(cert_file: Path, key_file: Path) -> tuple[bytes, bytes]:
    """Both files' bytes, checked: they parse, and the key is the certificate's (else :class:`ReloadError`)."""
    try:
        cert, key = cert_file.read_bytes(), key_file.read_bytes()
    except OSError as exc:
        raise ReloadError(f"{exc.filename}: {exc.strerror}") from exc
    with tempfile.TemporaryDirectory(prefix="tokenfan-tls-check-") as tmp:  # ssl loads only from files
        c, k = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        c.write_bytes(cert)
        k.touch(0o600)
        k.write_bytes(key)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(c, k)
            describe(cert)
        except (ssl.SSLError, ValueError) as exc:
            raise ReloadError(f"{cert_file} / {key_file}: {exc}") from exc
    return cert, key


@dataclass
class Snapshot:
    """The private copy Granian reads: ``cert.pem`` and ``key.pem`` (0600) in a 0700 directory of its own."""

    directory: Path

    @classmethod
    def create(cls, cert: bytes, key: bytes) -> Snapshot:
        snap = cls(Path(tempfile.mkdtemp(prefix="tokenfan-tls-")))
        snap.write(cert, key)
        return snap

    @property
    def cert(self) -> Path:
        return self.directory / "cert.pem"

    @property
    def key(self) -> Path:
        return self.directory / "key.pem"

    def write(self, cert: bytes, key: bytes) -> None:
        for path, data in ((self.cert, cert), (self.key, key)):
            tmp = path.with_suffix(".new")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            tmp.replace(path)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class GranianTls:
    """The ``tls`` part of the :class:`~gateway.http.reload.Reloader` for Granian's certificate."""

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        try:
            cert, key = load_pair(cert_file, key_file)
        except ReloadError as exc:
            raise SystemExit(str(exc)) from exc
        self.current = cert
        self.snapshot = Snapshot.create(cert, key)
        self.server: Any = None

    def attach(self, server: Any) -> None:
        check(server)
        server.respawn_interval = RESPAWN_INTERVAL
        self.server = server

    async def __call__(self) -> str:
        cert, key = load_pair(self.cert_file, self.key_file)
        if cert == self.current:
            return f"certificate unchanged ({describe(cert)})"
        server = self.server
        old = list(server.wrks)
        self.snapshot.write(cert, key)
        server.reload()
        try:
            async with asyncio.timeout(RELOAD_TIMEOUT):
                while any(w.is_alive() or w in server.wrks for w in old):
                    await asyncio.sleep(0.05)
        except TimeoutError as exc:
            raise ReloadError(f"Granian's worker did not restart within {RELOAD_TIMEOUT:g} s") from exc
        self.current = cert
        return f"new certificate for new connections ({describe(cert)}); open ones keep theirs"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.snapshot.remove()
