"""CURVE (encryption + client authentication) for ``tcp://`` engine links, via ZeroMQ's own ZAP.

Key layout, made by ``tokenfan keys DIR``:

    DIR/engine.key            engine public key      (gateways need it)
    DIR/engine.key_secret     engine key pair        (engine only)
    DIR/gateway.key           a gateway public key
    DIR/gateway.key_secret    that gateway's key pair (gateways only)
    DIR/authorized/*.key      public keys the engine accepts (a copy of gateway.key to start with)

The engine (``--curve-dir``) accepts only clients whose public key is in ``authorized/``; a gateway
(``--curve-dir``) proves its key and checks the engine's. Secret files are 0600.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator


def generate(directory: Path) -> Path:
    """Create engine and gateway key pairs in ``directory`` (refuses to overwrite)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    if (directory / "engine.key_secret").exists():
        raise FileExistsError(f"{directory} already holds keys")
    zmq.auth.create_certificates(str(directory), "engine")
    zmq.auth.create_certificates(str(directory), "gateway")
    authorized = directory / "authorized"
    authorized.mkdir(exist_ok=True, mode=0o700)
    shutil.copy(directory / "gateway.key", authorized / "gateway.key")
    for secret in directory.glob("*.key_secret"):
        os.chmod(secret, 0o600)
    return directory


def serve_curve(ctx: zmq.asyncio.Context, sock: zmq.Socket, directory: Path) -> AsyncioAuthenticator:
    """Make ``sock`` a CURVE server that admits only the keys in ``directory/authorized``."""
    authorized = directory / "authorized"
    if not authorized.is_dir():
        raise FileNotFoundError(f"{authorized} is missing: put the gateways' public keys there")
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(authorized))
    public, secret = zmq.auth.load_certificate(str(directory / "engine.key_secret"))
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True
    return auth


def connect_curve(sock: zmq.Socket, directory: Path) -> None:
    """Make ``sock`` a CURVE client with the gateway key pair, expecting the engine's public key."""
    public, secret = zmq.auth.load_certificate(str(directory / "gateway.key_secret"))
    server_public, _ = zmq.auth.load_certificate(str(directory / "engine.key"))
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = server_public
