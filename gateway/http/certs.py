"""``tokenfan certs DIR``: a self-signed TLS certificate for local https (HTTP/2 in browsers).

Writes ``DIR/cert.pem`` and ``DIR/key.pem`` (0600): an EC P-256 key and a certificate valid for
``localhost``, ``127.0.0.1`` and ``::1`` (plus any extra names given), for ``--ssl-certfile`` /
``--ssl-keyfile``. Browsers still warn about a self-signed certificate: trust ``cert.pem`` or start
Chromium with ``--ignore-certificate-errors`` for local tests.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_NAMES = ("localhost", "127.0.0.1", "::1")


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def generate(directory: Path, names: tuple[str, ...] = (), days: int = 365) -> tuple[Path, Path]:
    """Create ``cert.pem`` and ``key.pem`` in ``directory`` (refuses to overwrite); return their paths."""
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    if cert_path.exists() or key_path.exists():
        raise FileExistsError(f"{directory} already holds cert.pem/key.pem")
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tokenfan local")])
    now = dt.datetime.now(dt.UTC)
    alt = [_san(n) for n in dict.fromkeys(DEFAULT_NAMES + names)]
    cert = (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(key, hashes.SHA256()))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def sha256_of(cert_path: Path) -> str:
    """The SHA-256 of a PEM certificate's DER bytes, hex: what WebTransport's ``serverCertificateHashes``
    takes (browsers accept such a certificate without a CA if it is valid for at most 14 days)."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    return cert.fingerprint(hashes.SHA256()).hex()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tokenfan certs", description="A self-signed cert.pem + key.pem for localhost, "
                                 "127.0.0.1, ::1 and the NAMEs given, for --ssl-certfile/--http3-certfile.")
    ap.add_argument("dir", type=Path, help="where to write cert.pem and key.pem (refuses to overwrite)")
    ap.add_argument("names", nargs="*", help="more host names or addresses the certificate is valid for")
    ap.add_argument("--days", type=int, default=365, help="validity in days (default 365; at most 13 for "
                    "WebTransport by certificate hash, which browsers accept only for certificates valid ≤ 14 days)")
    return ap


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    if ns.days < 1:
        parser().error("--days must be at least 1")
    try:
        cert, key = generate(ns.dir, tuple(ns.names), days=ns.days)
    except FileExistsError as exc:
        parser().error(str(exc))
    print(f"--ssl-certfile {cert} --ssl-keyfile {key}")
    print(f"sha256 {sha256_of(cert)}")
    return 0
