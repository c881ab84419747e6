"""``tokenfan certs DIR``: a self-signed TLS certificate for local https (HTTP/2 in browsers).

Writes ``DIR/cert.pem`` and ``DIR/key.pem`` (0600): an EC P-256 key and a certificate valid for
``localhost``, ``127.0.0.1`` and ``::1`` (plus any extra names given), for ``--ssl-certfile`` /
``--ssl-keyfile``. Browsers still warn about a self-signed certificate: trust ``cert.pem`` or start
Chromium with ``--ignore-certificate-errors`` for local tests.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import sys
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


def main(argv: list[str]) -> int:
    days = 365
    if len(argv) >= 2 and argv[0] == "--days":
        try:
            days = int(argv[1])
        except ValueError:
            days = 0
        argv = argv[2:]
    if not argv or argv[0].startswith("-") or days < 1:
        print("usage: tokenfan certs [--days N] DIR [NAME ...]   (self-signed cert.pem + key.pem for localhost, "
              "127.0.0.1, ::1 and NAMEs, valid N days, default 365; N <= 13 for WebTransport by hash)",
              file=sys.stderr)
        return 2
    cert, key = generate(Path(argv[0]), tuple(argv[1:]), days=days)
    print(f"--ssl-certfile {cert} --ssl-keyfile {key}")
    print(f"sha256 {sha256_of(cert)}")
    return 0
